"""Kernel backend selection: the torch routing ops or their Triton twins (DESIGN.md "Kernels").

Cheap to import: Triton is imported only when the Triton backend is resolved.
"""

from __future__ import annotations

import functools
import os
import types

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


@functools.lru_cache(maxsize=None)
def routing_ops(backend: str) -> types.SimpleNamespace:
    """The routing ops of ``backend`` (``"torch"`` or ``"triton"``) under one set of names:

    ``lynx_critical_set``, ``oea_critical_set``, ``mass_greedy_grow``, ``xshare_critical_set``,
    ``mass_floor_set`` (signatures of :mod:`.routing_torch`) and ``remap(scores, critical, top_k, logits, rule, renormalize, scale) ->
    (idx [T, k] int64, weights [T, k] fp32)``. Both return the same integers. The torch namespace runs
    the numba twins of :mod:`.routing_cpu` on CPU tensors in eager mode (torch's per-op overhead
    dominates at decode sizes there) and the torch ops everywhere else. The Triton namespace also
    carries ``sparse_moe`` (:mod:`.moe`); resolving it imports every Triton module the decode path
    launches, so the choice is made once (at patch time), not at the first decode step.
    """
    from . import routing_torch as rt

    if backend == "torch":
        from . import routing_cpu as rc

        def fast(t: torch.Tensor) -> bool:  # CPU, eager, not strict: the numba twins (same integers)
            return rc.AVAILABLE and rt.host_reads_allowed(t)

        def pick(name):
            torch_fn, cpu_fn = getattr(rt, name), getattr(rc, name)
            return lambda scores, *args, **kwargs: (cpu_fn if fast(scores) else torch_fn)(scores, *args, **kwargs)

        def remap(scores, critical, top_k, logits, rule, renormalize=False, scale=1.0):
            idx = (rc.remap_topk if fast(scores) else rt.remap_topk)(scores, critical, top_k, check=False)
            return idx, rt.routing_weights(logits, idx, rule, renormalize, scale)

        return types.SimpleNamespace(
            name="torch", lynx_critical_set=pick("lynx_critical_set"), oea_critical_set=pick("oea_critical_set"),
            mass_greedy_grow=pick("mass_greedy_grow"), mass_floor_set=rt.mass_floor_set, remap=remap,
            xshare_critical_set=pick("xshare_critical_set"),
            # the default policy's whole decode step in one numba call (CPU eager only: callers check
            # routing_torch.host_reads_allowed); None without numba
            lynx_mass_decode=rc.lynx_mass_decode if rc.AVAILABLE else None,
        )
    if backend != "triton":
        raise ValueError(f"unknown kernel backend {backend!r}")
    from . import moe as tm
    from . import routing as tr

    def remap(scores, critical, top_k, logits, rule, renormalize=False, scale=1.0):
        return tr.remap_topk(scores, critical, top_k, logits=logits, rule=rule, renormalize=renormalize, scale=scale,
                             check=False)

    return types.SimpleNamespace(
        name="triton", lynx_critical_set=tr.lynx_critical_set, oea_critical_set=tr.oea_critical_set,
        mass_greedy_grow=tr.mass_greedy_grow, mass_floor_set=rt.mass_floor_set, remap=remap,
        sparse_moe=tm.sparse_moe, xshare_critical_set=rt.xshare_critical_set,  # XShare: torch ops (a baseline)
    )
