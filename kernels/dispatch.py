"""Backend choice for the kernels: torch reference or Triton (DESIGN.md "Kernels").

Cheap to import: it does not import Triton.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Return ``"torch"`` or ``"triton"`` for tensors on ``device``.

    - ``"auto"``: Triton on CUDA tensors, torch otherwise (on CPU the interpreter is a test tool,
      not a speed path);
    - ``"torch"``: always torch;
    - ``"triton"``: Triton; on a non-CUDA device only when ``os.environ["TRITON_INTERPRET"] == "1"``
      (the Triton interpreter), else ``RuntimeError``.

    Raises ``ValueError`` for an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    dev = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if dev.type == "cuda" else "torch"
    if dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    raise RuntimeError(
        f"backend='triton' needs CUDA tensors, got device {dev}; on CPU set the environment variable "
        "TRITON_INTERPRET=1 before triton is first imported (interpreter, for tests only), "
        "or use backend='torch' / 'auto'"
    )
