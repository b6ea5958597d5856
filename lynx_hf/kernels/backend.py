"""Kernel backend selection: the torch routing ops, their numba CPU twins or their Triton twins
(``docs/design.md`` "Kernels").

Cheap to import: Triton is imported only when the Triton backend is resolved, numba only when the CPU
twins are asked for.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import typing

import torch

#: ``LynxConfig.routing_backend`` values: which routing ops run
ROUTING_BACKENDS = ("auto", "torch", "triton")
#: ``LynxConfig.expert_path`` values: what computes the routed experts in decode
EXPERT_PATHS = ("auto", "model", "triton")
#: the modules whose ``@triton.jit`` kernels are defined at import (each records ``_INTERPRET`` then)
_KERNEL_MODULES = ("lynx_hf.kernels.routing", "lynx_hf.kernels.moe", "lynx_hf.kernels.fused_step")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Return ``"torch"`` or ``"triton"`` for routing ops on tensors on ``device``.

    - ``"auto"``: Triton on CUDA tensors, torch otherwise (on CPU the interpreter is a test tool,
      not a speed path);
    - ``"torch"``: always torch;
    - ``"triton"``: Triton; on a non-CUDA device only when ``os.environ["TRITON_INTERPRET"] == "1"``
      (the Triton interpreter) and lynx_hf's kernel modules were not imported before it was set, else
      ``RuntimeError``.

    Raises ``ValueError`` for an unknown backend name.
    """
    if backend not in ROUTING_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {ROUTING_BACKENDS}")
    dev = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if dev.type == "cuda" else "torch"
    if dev.type == "cuda":
        return "triton"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"'triton' needs CUDA tensors, got device {dev}; on CPU set the environment variable "
            "TRITON_INTERPRET=1 before triton is first imported (interpreter, for tests only)")
    compiled = [name for name in _KERNEL_MODULES
                if name in sys.modules and not getattr(sys.modules[name], "_INTERPRET", False)]
    if compiled:
        # @triton.jit picks the interpreter when a kernel is defined: kernels imported before the variable was set
        # are GPU kernels, and calling them on CPU fails deep inside Triton (found by a fresh-user trial)
        raise RuntimeError(
            f"'triton' on device {dev}: TRITON_INTERPRET=1 was set after lynx_hf's Triton kernels were imported "
            f"({', '.join(compiled)}), so they are not interpreted; set it before importing lynx_hf (a notebook: "
            "restart the kernel, set os.environ['TRITON_INTERPRET'] = '1' first)")
    return "triton"


#: the routing ops every backend provides, named once (:class:`RoutingOps` gives their signatures). Each backend
#: module (``routing_torch`` the reference, ``routing_cpu`` its numba twins, ``routing`` its Triton twins) defines a
#: function of each name, except those it lists in :data:`TORCH_FALLBACK`, which run the torch reference. A new op:
#: its name here, its signature in :class:`RoutingOps`, one function in each module (or a fallback line), and the
#: twin tests (``tests/kernels``: ``test_kernels_routing.py``, ``test_routing_cpu.py``, ``test_backend_ops.py``).
CRITICAL_SET_OPS = ("lynx_critical_set", "oea_critical_set", "mass_greedy_grow", "xshare_critical_set")
#: per backend module, the ops it does not implement itself (the torch reference runs): XShare is a baseline
TORCH_FALLBACK = {"routing": ("xshare_critical_set",), "routing_cpu": ()}


@typing.runtime_checkable
class RoutingOps(typing.Protocol):
    """The op set of a routing backend (what :func:`routing_ops` returns): the critical-set ops (:data:`CRITICAL_SET_OPS`,
    signatures of :mod:`.routing_torch`), ``remap`` (top-k restricted to the critical set, then the weight rule) and
    ``lynx_mass_decode`` (the default policy's whole decode step in one call, or ``None`` where the backend has none).
    ``topk_idx [T, k]``: the model's own top-k ids; where one token's ranking is taken (OEA's top-k0, XShare's
    warm-up, the remap) equal scores prefer them, then the lower id (``None``: the lower id). Every implementation
    returns the same integers for the same inputs."""

    name: str
    lynx_mass_decode: typing.Callable | None

    def lynx_critical_set(self, scores, topk_idx, top_k, alpha, beta, tau, batch_base=None, vote=None,
                          seed=None): ...

    def oea_critical_set(self, scores, top_k0, vote=None, seed=None, topk_idx=None): ...

    def mass_greedy_grow(self, scores, topk_idx, critical, top_k, price, vote=None, seed=None, unit="token"): ...

    def xshare_critical_set(self, scores, topk_idx, top_k, budget, warmup, vote=None, seed=None): ...

    def remap(self, scores, critical, top_k, logits, rule, renormalize=False, scale=1.0, eps=0.0, topk_idx=None): ...


def _remap_with(remap_topk):
    """The ops' ``remap``: ``remap_topk`` (the torch op or its numba twin) picks the ids (ties -> the token's own
    experts ``topk_idx``, then lower id), the torch weight rule (``routing_torch.routing_weights``) weights them."""
    from . import routing_torch as rt

    def remap(scores, critical, top_k, logits, rule, renormalize=False, scale=1.0, eps=0.0, topk_idx=None):
        idx = remap_topk(scores, critical, top_k, check=False, topk_idx=topk_idx)
        return idx, rt.routing_weights(logits, idx, rule, renormalize, scale, eps)

    return remap


def _namespace(name: str, module, remap, **extra) -> types.SimpleNamespace:
    """A backend's :class:`RoutingOps`: :data:`CRITICAL_SET_OPS` from ``module`` (the torch reference for its
    :data:`TORCH_FALLBACK` entries), ``remap`` and ``extra``."""
    from . import routing_torch as rt

    short = module.__name__.rsplit(".", 1)[-1]
    fallback = TORCH_FALLBACK.get(short, ())
    ops = {op: getattr(rt if op in fallback else module, op) for op in CRITICAL_SET_OPS}
    return types.SimpleNamespace(**{"name": name, "remap": remap, "lynx_mass_decode": None, **ops, **extra})


@functools.lru_cache(maxsize=None)
def routing_ops(backend: str, host: bool = False) -> RoutingOps:
    """The routing ops of ``backend`` (``"torch"`` or ``"triton"``): a :class:`RoutingOps`. Every namespace returns
    the same integers.

    ``host``: the caller's tensors are CPU tensors in eager mode (``routing_torch.host_reads_allowed``, asked
    once per call by the caller): the torch backend then returns the numba twins of :mod:`.routing_cpu`
    (torch's per-op overhead dominates at decode sizes there) and ``lynx_mass_decode``, the default policy's
    whole decode step in one numba call; without numba, or with ``host`` False, the torch ops
    (``lynx_mass_decode`` is then ``None``). The Triton namespace ignores ``host`` and also carries
    ``sparse_moe`` (:mod:`.moe`), ``fused_step`` (:class:`.fused_step.FusedStep`, the whole decode step in one
    launch) and ``pinning`` (:func:`.fused_step.pinning`: launches made inside it kept for good); resolving it imports every Triton module the decode path launches, so the
    choice is made once (at plan time), not at the first decode step.
    """
    from . import routing_torch as rt

    if backend == "torch":
        if host:
            from . import routing_cpu as rc

            if rc.AVAILABLE:
                return _namespace("torch", rc, _remap_with(rc.remap_topk), lynx_mass_decode=rc.lynx_mass_decode)
            return routing_ops("torch", False)
        return _namespace("torch", rt, _remap_with(rt.remap_topk))
    if backend != "triton":
        raise ValueError(f"unknown kernel backend {backend!r}")
    from . import fused_step as tf
    from . import moe as tm
    from . import routing as tr

    def remap_triton(scores, critical, top_k, logits, rule, renormalize=False, scale=1.0, eps=0.0, topk_idx=None):
        return tr.remap_topk(scores, critical, top_k, logits=logits, rule=rule, renormalize=renormalize, scale=scale,
                             eps=eps, check=False, topk_idx=topk_idx)

    return _namespace("triton", tr, remap_triton, sparse_moe=tm.sparse_moe, fused_step=tf.FusedStep,
                      pinning=tf.pinning)
