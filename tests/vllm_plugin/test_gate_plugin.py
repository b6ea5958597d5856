"""The cost gate in the vLLM plugin (``LynxConfig.gate``, ``lynx_hf.gate``): the op asks the same ``PlanGate`` as the
HF path; gated off it returns vLLM's routing unchanged and the snapshot says so per layer; a layer gated off at every
step size the engine can run is bypassed (no op call, no op in the compiled graph) and a compiled engine refuses a
configuration that would need the op back. No engine: the op is called on a fake layer (or a vLLM ``CPURouter`` hooked
by ``lynx_hf.vllm.layers.attach``), the measurement replaced by fixed decisions (no timed assertion). vLLM
environment only."""

import time

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf import gate  # noqa: E402
from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.vllm import layers, op, plans, state, steps, telemetry  # noqa: E402
from lynx_hf.vllm.state import STATE  # noqa: E402


def _decide(on):
    """A fake ``gate.measure``: on (saving 4 x 1 ms > 1.25 x cost 1 ms) at the buckets ``on`` says (a bool: all or
    none; else a set of buckets), off elsewhere."""
    def measure(plan, shape, num_tokens, telemetry=True, extra_expert_ms=0.0, expert_fn=None):
        yes = on if isinstance(on, bool) else gate.bucket_of(num_tokens) in on
        return gate.decide(1.0, 4.0 if yes else 0.0, 1.0)
    return measure


@pytest.fixture
def layer(monkeypatch, plugin_state):
    """``layer(options, on)``: a fresh process state (capacity 16) with one fake layer (k 2 of 8) whose gate decides
    as ``on`` says."""

    def make(options, on):
        monkeypatch.setattr(gate, "measure", _decide(on))
        st = plugin_state({"phase": "decode", **options}, capacity=16)
        one = state.Layer(index=0, name="fake", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True),
                          gathered=False, gate_shape=gate.LayerShape(8, 2, 32, 16))  # what attach reads of the runner
        st.layers = [one]
        return one

    return make


def _routing(t=8, n=8, k=2):
    logits = torch.randn(t, n, generator=torch.Generator().manual_seed(0)) * 3
    vals, ids = torch.topk(logits, k, dim=-1)
    return logits, torch.softmax(vals, -1), ids.to(torch.int32)


def test_gated_off_op_keeps_vllm_routing_and_reports_it(layer):
    one = layer({"policy": "lynx", "gate": "auto"}, on=False)
    logits, weights, ids = _routing()
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(new_ids, ids) and torch.equal(new_w, weights)
    snap = telemetry.snapshot()
    entry = snap["layers"][0]["gate"]
    assert entry["by_tokens"][8]["on"] is False and entry["steps_skipped"] == 1
    assert snap["summary"]["gate_steps_skipped"] == 1 and snap["layers"][0]["decode_steps"] == 0
    assert gate.of(one.plan) is not None
    telemetry.reset()
    assert telemetry.snapshot()["layers"][0]["gate"]["steps_skipped"] == 0


def test_gate_on_equals_always(layer):
    logits, weights, ids = _routing()
    layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "always"}, on=True)
    ref = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert telemetry.snapshot()["layers"][0]["gate"]["gate"] == "always"
    layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on=True)
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(out[1], ref[1]) and torch.equal(out[0], ref[0])
    assert not torch.equal(out[1], ids)  # the policy ran
    assert telemetry.snapshot()["layers"][0]["gate"]["by_tokens"][8]["on"] is True


def test_op_times_its_body_and_the_gate_switches_off_when_it_costs_more_than_measured(layer, monkeypatch):
    """The patch-time decision is on at 8 tokens only (cost 1 ms, saving 4 x 1 ms). On CPU the op body's wall time is the served
    cost: with a clock that advances 5 ms per reading, two served steps cost 5 ms each, 4 <= 1.25 x 5: off, and the
    next step keeps vLLM's routing."""
    monkeypatch.setattr(gate, "OBSERVE_STEPS", 2)
    one = layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on={8})
    logits, weights, ids = _routing()
    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock) / 1e3)
    for _ in range(2):
        out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        assert not torch.equal(out[1], ids)  # on while observed
    d = gate.of(one.plan).decision(8)
    assert not d.on and d.cost_ms == 5.0 and "2 served steps" in d.reason
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(out[1], ids) and torch.equal(out[0], weights)
    # that was the last step size it was on at (off at 1-4 and 16 from the start): an eager engine now bypasses the op
    assert one.bypass and STATE.bypassed == (one,)


# ------------------------------------------------------------------ layers off at every step size: no op at all


class _ModelRunner:
    """What ``plans.before_forward`` / ``plans.frozen`` read of a vLLM model runner."""

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
    """``attached(options, on)``: a vLLM ``CPURouter`` (k 2 of 8, softmax, renormalized) hooked by ``layers.attach``
    in a fake engine whose gate decides as ``on`` says; returns ``(router, layer)``."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    held = []

    def make(options, on):
        layer({**options, "phase": "auto"}, on)
        STATE.layers = []
        router = CPURouter(top_k=2, global_num_experts=8)
        held.append(_MoERunner(router))  # the layer keeps a weak reference (the model owns the runner)
        layers.attach(held[-1])
        one = STATE.layers[-1]
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
    steps.write_kinds(steps.token_kinds([1] * rows, [40] * rows, [32] * rows, 1), "cpu")


@pytest.mark.vllm_code  # vLLM's own CPURouter traced with the hook (also on vLLM 0.33 / 0.34)
@pytest.mark.parametrize("on", [set(), {32}], ids=["off_everywhere", "on_above_capacity"])
def test_layer_off_at_every_step_size_is_traced_without_the_op(attached, monkeypatch, on):
    """Off at every bucket this engine can run (capacity 16: buckets 1-16; on at 32 cannot happen): the plans are
    made before the first forward, the layer is bypassed, its routing is vLLM's own without calling the op (the op
    body would raise), the compiled graph has no plugin op, and each decode step is counted as skipped by the gate."""
    router, one = attached({"policy": "lynx", "gate": "auto"}, on)
    plans.before_forward(_ModelRunner(mode=3))
    assert one.plan is not None and one.bypass and STATE.start.frozen and STATE.bypassed == (one,)
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    want = layers.original_routing(router)(None, logits, None)

    def refuse(*args):
        raise AssertionError("the op was called")

    monkeypatch.setattr(op, "remap_layer", refuse)
    _decode_step()
    got = router._compute_routing(None, logits, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not [t for t in _graph_targets(lambda x: router._compute_routing(None, x, None), logits) if "lynx" in t]
    steps.end_step()
    snap = telemetry.snapshot()
    entry = snap["layers"][0]["gate"]
    assert entry["bypassed"] is True and entry["steps_skipped"] == 1 and entry["by_tokens"][8]["on"] is False
    assert snap["summary"]["gate_bypassed_layers"] == 1


@pytest.mark.vllm_code
def test_layer_on_at_some_step_size_keeps_the_op(attached):
    """On at one bucket the engine can run (8): not bypassed, the compiled graph calls the op once, and the policy
    remaps a decode step of 8 tokens (``tau`` 1000: every decode token may move)."""
    router, one = attached({"policy": "lynx", "gate": "auto", "mass_price": "None", "tau": "1000"}, {8})
    plans.before_forward(_ModelRunner(mode=3))
    assert not one.bypass and STATE.bypassed == ()
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    targets = _graph_targets(lambda x: router._compute_routing(None, x, None), logits)
    assert sum("lynx_vllm.remap_routing" in t for t in targets) == 1
    _decode_step()
    want = layers.original_routing(router)(None, logits, None)
    got = router._compute_routing(None, logits, None)
    steps.end_step()
    assert not torch.equal(got[1], want[1].to(got[1].dtype))


def test_configure_a_frozen_engine_cannot_bring_the_op_back(attached):
    """Compiled engine, the layer bypassed at start: a configuration under which it would be on needs the op the
    graph was traced without: ``LynxConfigError``, nothing changed; one under which it is still off everywhere is
    taken. An eager engine takes either and bypasses or calls the op accordingly."""
    from lynx_hf import LynxConfigError

    router, one = attached({"policy": "lynx", "gate": "auto"}, set())
    plans.before_forward(_ModelRunner(mode=3))
    before = STATE.config
    with pytest.raises(LynxConfigError, match="compiled .* without the plugin's op"):
        layers.configure({"policy": "lynx", "gate": "always"})
    assert STATE.config is before and one.bypass
    assert layers.configure({"policy": "oea", "oea_k0": 1, "gate": "auto"}) is True
    assert STATE.config.lynx.policy == "oea" and one.bypass and gate.of(one.plan) is not None

    router, one = attached({"policy": "lynx", "gate": "auto"}, set())
    plans.before_forward(_ModelRunner(mode=3, eager=True))
    assert one.bypass and not STATE.start.frozen
    assert layers.configure({"policy": "lynx", "gate": "always"}) is True
    assert not one.bypass and one.plan is not None and gate.of(one.plan) is None and STATE.bypassed == ()


def test_frozen_reads_the_compilation_config():
    """Compiled (any torch.compile mode) or CUDA graphs: frozen; enforce_eager, or neither: not."""
    assert plans.frozen(_ModelRunner(mode=3))
    assert plans.frozen(_ModelRunner(mode=0, cudagraphs="FULL_AND_PIECEWISE"))
    assert not plans.frozen(_ModelRunner(mode=0))
    assert not plans.frozen(_ModelRunner(mode=3, eager=True))
