"""The routing op set is named once (``lynx_hf.kernels.backend``: ``CRITICAL_SET_OPS`` and the ``RoutingOps``
protocol) and every backend implements it: the torch reference, its numba twins and the Triton twins each define a
function of every op with the reference's parameters, or name it as a torch fallback; every namespace
``routing_ops`` returns is a ``RoutingOps``."""

import inspect

import pytest

from lynx_hf.kernels import backend
from lynx_hf.kernels import routing as tr
from lynx_hf.kernels import routing_cpu as rc
from lynx_hf.kernels import routing_torch as rt


def _params(fn):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.KEYWORD_ONLY]


def test_the_protocol_names_the_op_set_once():
    methods = {name for name, _ in inspect.getmembers(backend.RoutingOps, inspect.isfunction) if not name.startswith("_")}
    assert methods == {*backend.CRITICAL_SET_OPS, "remap"}
    for op in backend.CRITICAL_SET_OPS:  # the protocol's signature is the torch reference's
        assert _params(getattr(backend.RoutingOps, op))[1:] == _params(getattr(rt, op)), op


@pytest.mark.parametrize("module", [rc, tr], ids=["routing_cpu", "routing"])
def test_every_twin_module_implements_every_op_or_names_its_fallback(module):
    short = module.__name__.rsplit(".", 1)[-1]
    fallback = backend.TORCH_FALLBACK[short]
    for op in backend.CRITICAL_SET_OPS:
        if op in fallback:
            continue
        fn = getattr(module, op, None)
        assert callable(fn), f"{short} lacks {op} (implement it, or list it in backend.TORCH_FALLBACK)"
        assert _params(fn)[:len(_params(getattr(rt, op)))] == _params(getattr(rt, op)), (short, op)
    for op in fallback:
        assert op in backend.CRITICAL_SET_OPS


@pytest.mark.parametrize("backend_name,host", [("torch", False), ("torch", True), ("triton", False)])
def test_every_namespace_is_a_routing_ops(backend_name, host):
    ops = backend.routing_ops(backend_name, host)
    assert isinstance(ops, backend.RoutingOps)
    assert ops.name == backend_name
    for op in backend.CRITICAL_SET_OPS:
        fn = getattr(ops, op)
        assert fn is getattr(rt, op) or fn.__module__.rsplit(".", 1)[-1] in ("routing_cpu", "routing"), op
    if backend_name == "triton":
        assert ops.xshare_critical_set is rt.xshare_critical_set and callable(ops.sparse_moe)
    assert (ops.lynx_mass_decode is not None) == (host and rc.AVAILABLE)
