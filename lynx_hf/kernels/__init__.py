"""Routing and sparse-expert kernels: Triton (``routing.py``, ``moe.py``), the canonical torch references (``routing_torch.py``, ``moe_naive.py``) and numba CPU twins (``routing_cpu.py``).

Tier rule (``docs/design.md``): nothing here imports transformers or ``lynx_hf`` internals. Importing this
package is cheap: Triton is imported only by the kernel modules themselves.
"""
