"""A dispatch-mode detector of host syncs and data-dependent shapes in lynx_hf's own code.

While :class:`SyncDetector` is active, every aten op is inspected; an op that reads a device value on
the host (``_local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)``), tests a tensor's truth
(``is_nonzero``, ``equal``), copies host data in (``torch.tensor(x)``: ``lift_fresh``, a host-to-device copy
on an accelerator), or produces a data-dependent shape (``nonzero``, ``masked_select``,
``unique``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``, ``bincount``) is a
violation when the innermost Python frame outside torch belongs to lynx_hf (the package's files:
``lynx_hf/`` (``lynx_hf/kernels/`` included), ``patches/``). Ops issued by transformers' or Triton's own code (the
model's experts, the interpreter) are not ours and are not counted. Use with
``kernels.routing_torch.strict_sync_free()`` so the CPU-only early exits are off and the code path is
the accelerator one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lynx_hf

aten = torch.ops.aten
_ROOT = Path(lynx_hf.__file__).resolve().parent.parent
OURS = tuple(str(_ROOT / name) for name in ("lynx_hf", "patches"))
_TORCH = str(Path(torch.__file__).resolve().parent)

_ALWAYS = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
    aten.masked_select.default, aten.unique_consecutive.default, aten.unique_dim.default, aten._unique2.default,
    aten._unique.default, aten.bincount.default, aten.argwhere.default,
    # torch.tensor(<host data>) inside a step: a host-to-device copy from pageable memory on an accelerator
    # (a sync under set_sync_debug_mode, and an error under CUDA-graph capture): found by lab.gpu_check on an H200
    aten.lift_fresh.default, aten.lift_fresh_copy.default,
}
for _name in ("item",):
    if hasattr(aten, _name):
        _ALWAYS.add(getattr(aten, _name).default)


def _data_dependent(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    if func is aten.index.Tensor:  # x[mask] with a bool mask is a nonzero in disguise
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return (kwargs or {}).get("output_size") is None
    return False


def _caller() -> str | None:
    """Filename of the innermost frame outside torch (and outside this module)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
            return name
        frame = frame.f_back
    return None


class SyncDetector(TorchDispatchMode):
    """Records ``(op, file:line)`` for each violation in lynx_hf's code; :meth:`check` raises on any."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[tuple[str, str]] = []
        self.ops_seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops_seen += 1
        if _data_dependent(func, args, kwargs):
            caller = _caller()
            if caller is not None and caller.startswith(OURS):
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename != caller:
                    frame = frame.f_back
                where = f"{caller}:{frame.f_lineno if frame else '?'}"
                self.violations.append((str(func), where))
        return func(*args, **(kwargs or {}))

    def check(self) -> None:
        if self.violations:
            raise AssertionError(f"host syncs / data-dependent ops in lynx_hf's decode step: {self.violations}")
