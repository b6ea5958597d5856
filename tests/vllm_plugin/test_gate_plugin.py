"""The cost gate in the vLLM plugin (``LynxConfig.gate``, ``lynx_hf.gate``): the op asks the same ``PlanGate`` as the
HF path; gated off it returns vLLM's routing unchanged and the snapshot says so per layer; a layer gated off at every
step size the engine can run is bypassed (no op call, no op in the compiled graph) and a compiled engine refuses a
configuration that would need the op back. No engine: the op is called on a fake layer (or a vLLM ``CPURouter`` hooked
by ``_attach``), the measurement replaced by fixed decisions (no timed assertion). vLLM environment only."""

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf import gate  # noqa: E402
from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.vllm import _config, _hooks  # noqa: E402

_STATE_FIELDS = ("config", "layers", "step", "capacity", "resolved", "started", "frozen", "device", "dtype", "bypassed")


def _decide(on):
    """A fake ``gate.measure``: on (saving 4 x 1 ms > 1.25 x cost 1 ms) at the buckets ``on`` says (a bool: all or
    none; else a set of buckets), off elsewhere."""
    def measure(plan, shape, num_tokens, telemetry=True, extra_expert_ms=0.0, expert_fn=None):
        yes = on if isinstance(on, bool) else gate.bucket_of(num_tokens) in on
        return gate.decide(1.0, 4.0 if yes else 0.0, 1.0)
    return measure


@pytest.fixture
def layer(monkeypatch):
    state = _hooks.STATE
    saved = tuple(getattr(state, name) for name in _STATE_FIELDS)

    def make(options, on):
        monkeypatch.setattr(gate, "measure", _decide(on))
        state.config = _config.parse({"phase": "decode", **options})
        state.resolved = True
        state.step = _hooks._StepBuffer()
        state.capacity = 16
        state.started, state.frozen, state.device, state.dtype, state.bypassed = False, False, None, None, ()
        one = _hooks._Layer(index=0, name="fake", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True))
        one.gathered = False
        one.gate_shape = gate.LayerShape(8, 2, 32, 16)  # what _attach reads from the runner's FusedMoEConfig
        state.layers = [one]
        return one

    yield make
    for name, value in zip(_STATE_FIELDS, saved):
        setattr(state, name, value)


def _routing(t=8, n=8, k=2):
    logits = torch.randn(t, n, generator=torch.Generator().manual_seed(0)) * 3
    vals, ids = torch.topk(logits, k, dim=-1)
    return logits, torch.softmax(vals, -1), ids.to(torch.int32)


def test_gated_off_op_keeps_vllm_routing_and_reports_it(layer):
    one = layer({"policy": "lynx", "gate": "auto"}, on=False)
    logits, weights, ids = _routing()
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(new_ids, ids) and torch.equal(new_w, weights)
    snap = _hooks.snapshot()
    entry = snap["layers"][0]["gate"]
    assert entry["by_tokens"][8]["on"] is False and entry["steps_skipped"] == 1
    assert snap["summary"]["gate_steps_skipped"] == 1 and snap["layers"][0]["decode_steps"] == 0
    assert one.plan.gate is not None
    _hooks.reset()
    assert _hooks.snapshot()["layers"][0]["gate"]["steps_skipped"] == 0


def test_gate_on_equals_always(layer):
    logits, weights, ids = _routing()
    layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "always"}, on=True)
    ref = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert _hooks.snapshot()["layers"][0]["gate"]["gate"] == "always"
    layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on=True)
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(out[1], ref[1]) and torch.equal(out[0], ref[0])
    assert not torch.equal(out[1], ids)  # the policy ran
    assert _hooks.snapshot()["layers"][0]["gate"]["by_tokens"][8]["on"] is True


def test_op_times_its_body_and_the_gate_switches_off_when_it_costs_more_than_measured(layer, monkeypatch):
    """The patch-time decision is on at 8 tokens only (cost 1 ms, saving 4 x 1 ms). On CPU the op body's wall time is the served
    cost: with a clock that advances 5 ms per reading, two served steps cost 5 ms each, 4 <= 1.25 x 5: off, and the
    next step keeps vLLM's routing."""
    monkeypatch.setattr(gate, "OBSERVE_STEPS", 2)
    one = layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on={8})
    logits, weights, ids = _routing()
    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(_hooks.time, "perf_counter", lambda: next(clock) / 1e3)
    for _ in range(2):
        out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        assert not torch.equal(out[1], ids)  # on while observed
    d = one.plan.gate.decision(8)
    assert not d.on and d.cost_ms == 5.0 and "2 served steps" in d.reason
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(out[1], ids) and torch.equal(out[0], weights)
    # that was the last step size it was on at (off at 1-4 and 16 from the start): an eager engine now bypasses the op
    assert one.bypass and _hooks.STATE.bypassed == (one,)


# ------------------------------------------------------------------ layers off at every step size: no op at all


class _ModelRunner:
    """What ``_hooks._before_forward`` / ``_frozen`` read of a vLLM model runner."""

    def __init__(self, mode=3, eager=False, cudagraphs="NONE"):
        from types import SimpleNamespace

        self.device = torch.device("cpu")
        self.model_config = SimpleNamespace(dtype=torch.float32, enforce_eager=eager)
        self.compilation_config = SimpleNamespace(mode=mode, cudagraph_mode=SimpleNamespace(name=cudagraphs))


class _MoERunner:
    def __init__(self, router):
        self.router, self.layer_name, self.do_naive_dispatch_combine, self.moe_config = router, "layers.0.experts", \
            False, None


@pytest.fixture
def attached(layer):
    """``attached(options, on)``: a vLLM ``CPURouter`` (k 2 of 8, softmax, renormalized) hooked by ``_hooks._attach``
    in a fake engine whose gate decides as ``on`` says; returns ``(router, layer)``."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    held = []

    def make(options, on):
        layer({**options, "phase": "auto"}, on)
        _hooks.STATE.layers = []
        router = CPURouter(top_k=2, global_num_experts=8)
        held.append(_MoERunner(router))  # the layer keeps a weak reference (the model owns the runner)
        _hooks._attach(held[-1])
        one = _hooks.STATE.layers[-1]
        one.gate_shape = gate.LayerShape(8, 2, 32, 16)
        return router, one

    return make


def _graph_targets(fn, *args) -> list[str]:
    """The call targets of the FX graph ``torch.compile`` (fullgraph) traces for ``fn(*args)``."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return targets


def _decode_step(rows=8):
    _hooks._write_kinds(_hooks.token_kinds([1] * rows, [40] * rows, [32] * rows, 1), "cpu")


@pytest.mark.vllm_code  # vLLM's own CPURouter traced with the hook (also on vLLM 0.33 / 0.34)
@pytest.mark.parametrize("on", [set(), {32}], ids=["off_everywhere", "on_above_capacity"])
def test_layer_off_at_every_step_size_is_traced_without_the_op(attached, monkeypatch, on):
    """Off at every bucket this engine can run (capacity 16: buckets 1-16; on at 32 cannot happen): the plans are
    made before the first forward, the layer is bypassed, its routing is vLLM's own without calling the op (the op
    body would raise), the compiled graph has no plugin op, and each decode step is counted as skipped by the gate."""
    router, one = attached({"policy": "lynx", "gate": "auto"}, on)
    _hooks._before_forward(_ModelRunner(mode=3))
    assert one.plan is not None and one.bypass and _hooks.STATE.frozen and _hooks.STATE.bypassed == (one,)
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    want = router._lynx_original_compute_routing(None, logits, None)

    def refuse(*args):
        raise AssertionError("the op was called")

    monkeypatch.setattr(_hooks, "_remap_layer", refuse)
    _decode_step()
    got = router._compute_routing(None, logits, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not [t for t in _graph_targets(lambda x: router._compute_routing(None, x, None), logits) if "lynx" in t]
    _hooks._end_step()
    snap = _hooks.snapshot()
    entry = snap["layers"][0]["gate"]
    assert entry["bypassed"] is True and entry["steps_skipped"] == 1 and entry["by_tokens"][8]["on"] is False
    assert snap["summary"]["gate_bypassed_layers"] == 1


@pytest.mark.vllm_code
def test_layer_on_at_some_step_size_keeps_the_op(attached):
    """On at one bucket the engine can run (8): not bypassed, the compiled graph calls the op once, and the policy
    remaps a decode step of 8 tokens (``tau`` 1000: every decode token may move)."""
    router, one = attached({"policy": "lynx", "gate": "auto", "mass_price": "None", "tau": "1000"}, {8})
    _hooks._before_forward(_ModelRunner(mode=3))
    assert not one.bypass and _hooks.STATE.bypassed == ()
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    targets = _graph_targets(lambda x: router._compute_routing(None, x, None), logits)
    assert sum("lynx_vllm.remap_routing" in t for t in targets) == 1
    _decode_step()
    want = router._lynx_original_compute_routing(None, logits, None)
    got = router._compute_routing(None, logits, None)
    _hooks._end_step()
    assert not torch.equal(got[1], want[1].to(got[1].dtype))


def test_configure_a_frozen_engine_cannot_bring_the_op_back(attached):
    """Compiled engine, the layer bypassed at start: a configuration under which it would be on needs the op the
    graph was traced without: ``LynxConfigError``, nothing changed; one under which it is still off everywhere is
    taken. An eager engine takes either and bypasses or calls the op accordingly."""
    from lynx_hf import LynxConfigError

    router, one = attached({"policy": "lynx", "gate": "auto"}, set())
    _hooks._before_forward(_ModelRunner(mode=3))
    before = _hooks.STATE.config
    with pytest.raises(LynxConfigError, match="compiled .* without the plugin's op"):
        _hooks.configure({"policy": "lynx", "gate": "always"})
    assert _hooks.STATE.config is before and one.bypass
    assert _hooks.configure({"policy": "oea", "oea_k0": 1, "gate": "auto"}) is True
    assert _hooks.STATE.config.lynx.policy == "oea" and one.bypass and one.plan.gate is not None

    router, one = attached({"policy": "lynx", "gate": "auto"}, set())
    _hooks._before_forward(_ModelRunner(mode=3, eager=True))
    assert one.bypass and not _hooks.STATE.frozen
    assert _hooks.configure({"policy": "lynx", "gate": "always"}) is True
    assert not one.bypass and one.plan is not None and one.plan.gate is None and _hooks.STATE.bypassed == ()


def test_frozen_reads_the_compilation_config():
    """Compiled (any torch.compile mode) or CUDA graphs: frozen; enforce_eager, or neither: not."""
    assert _hooks._frozen(_ModelRunner(mode=3))
    assert _hooks._frozen(_ModelRunner(mode=0, cudagraphs="FULL_AND_PIECEWISE"))
    assert not _hooks._frozen(_ModelRunner(mode=0))
    assert not _hooks._frozen(_ModelRunner(mode=3, eager=True))
