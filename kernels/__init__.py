"""Routing and sparse-expert kernels (Triton) beside their torch references (``naive_*``).

Tier rule (DESIGN.md): nothing here imports transformers or ``lynx_hf`` internals. Importing this
package is cheap: Triton is imported only by the kernel modules themselves.
"""
