"""The cost gate in the vLLM plugin (``LynxConfig.gate``, ``lynx_hf.gate``): a stage of each layer's plan, which the op
runs (``plan.run``) as the HF path does; its decisions are got once, when the plan is made, and never change while
the engine serves (no served step decides again); gated off it returns vLLM's routing unchanged and the snapshot says
so per layer; a mixed step is decided on its decode rows (the host's count, ``Step.decode_rows``); a step the host
knows has no decode row returns at once on every path outside a CUDA-graph capture; a layer gated off at every step
size the engine can run is bypassed (no op call, no op in the compiled graph) and a compiled engine refuses a
configuration that would need the op back. No engine: the op is called on a fake layer (or a vLLM ``CPURouter``
hooked by ``lynx_hf.vllm.layers.attach``), the measurement replaced by fixed decisions (``fixed_gate``, no timed
assertion). vLLM environment only."""

import json
import time
import types

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf import gate  # noqa: E402
from lynx_hf.core import RoutePlan, WeightRule  # noqa: E402
from lynx_hf.kernels.routing_torch import strict_sync_free  # noqa: E402
from lynx_hf.vllm import bypass, layers, op, plans, rows, state, steps, telemetry  # noqa: E402
from lynx_hf.vllm.state import DECODE, PREFILL, STATE  # noqa: E402
from plugin_steps import moe_config, set_kinds  # noqa: E402


@pytest.fixture
def layer(fixed_gate, plugin_state):
    """``layer(options, on)``: a fresh process state (capacity 16) with one fake layer (k 2 of 8) whose gate decides
    as ``on`` says (``fixed_gate``; ``layer.measured``: the gates measured since); ``phase="decode"`` unless
    ``options`` says otherwise."""

    def make(options, on):
        make.measured = fixed_gate(on)
        st = plugin_state({"phase": "decode", **options}, capacity=16)
        one = state.Layer(index=0, name="fake", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True),
                          gathered=False, gate_shape=gate.LayerShape(8, 2, 32, 16))  # what attach reads of the runner
        st.layers = [one]
        return one

    return make


def _routing(t=8, n=8, k=2, seed=0):
    logits = torch.randn(t, n, generator=torch.Generator().manual_seed(seed)) * 3
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


def test_the_op_runs_the_plan_and_decisions_never_change_while_serving(layer, monkeypatch):
    """One step protocol: the op runs ``plan.run`` (the gate, then the padding rows, then the decode-step function),
    never the plan's kernel around it. The decisions are got once, when the plan is made (one measurement), and
    served steps never decide again, however long they take (a clock advancing 5 ms per reading: the cost the
    removed "observe served steps" rule switched a layer off on); the gate counts each step itself."""
    one = layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on={8})
    runs = []
    real_run = RoutePlan.run

    def counted_run(self, inputs):
        runs.append(inputs.step)
        return real_run(self, inputs)

    monkeypatch.setattr(RoutePlan, "run", counted_run)
    clock = iter(range(0, 100_000, 5))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock) / 1e3)
    logits, weights, ids = _routing()
    for _ in range(12):
        out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        assert not torch.equal(out[1], ids)  # on at 8 tokens, every step
    planned = gate.of(one.plan)
    assert [stage.name for stage in one.plan.stages] == ["gate", "padding"]
    assert len(runs) == 12 and planned.seen[8] == 12 and planned.skipped[8] == 0 and len(layer.measured) == 1
    assert planned.decision(8).on and planned.decision(8).cost_ms == 1.0 and not one.bypass
    assert not hasattr(planned, "observe") and not hasattr(gate, "OBSERVE_STEPS")


def test_the_gate_decides_a_mixed_step_on_its_decode_rows(layer):
    """A continuous-batching step of 16 rows of which the host counts 2 decode rows (14 prefill): the policy would
    run over all 16 rows (the cost at 16 tokens) to save experts of 2 decode rows (the saving at 2, nothing here: the
    gate is on at bucket 16 only), so it keeps vLLM's routing and counts one skip at 16 tokens. With 14 decode rows
    (saving at bucket 16) the decode rows are remapped. Without the host's count (``Step.decode_rows``) the gate would
    decide both at 16 tokens: on."""
    one = layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto", "phase": "auto"}, on={16})
    logits, weights, ids = _routing(t=16, seed=3)
    set_kinds([DECODE] * 2 + [PREFILL] * 14)
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    steps.end_step()
    assert torch.equal(out[1], ids) and torch.equal(out[0], weights)
    planned = gate.of(one.plan)
    assert planned.skipped[16] == 1 and not planned.decision(16, decode_rows=2).on
    set_kinds([DECODE] * 14 + [PREFILL] * 2)
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    steps.end_step()
    assert not torch.equal(out[1][:14], ids[:14]) and torch.equal(out[1][14:], ids[14:])
    assert planned.skipped[16] == 1 and planned.seen[16] == 2
    assert telemetry.snapshot()["layers"][0]["decode_tokens"] == 14


@pytest.mark.vllm_code
def test_a_step_without_decode_rows_returns_at_once_outside_a_capture(plugin_state, monkeypatch):
    """Where the host knows a call has no decode row (no step prepared: a dummy / profiling run; or a step of prefill
    tokens only), the op returns vLLM's routing at once, on CPU and on a device alike, as long as the op body is not
    being captured into a CUDA graph: no plan is made or run, vLLM's own tensors come back. Under a capture the body
    describes the rows by the step buffer (the remap is recorded for every replay) without a decode-row count. A mixed
    step on a device passes the host's count of decode rows on (``Step.decode_rows``). The device is a stand-in
    (``torch.cuda.is_current_stream_capturing`` and the buffer faked): this CPU has none."""
    st = plugin_state({"policy": "lynx", "gate": "always"}, capacity=16)
    one = state.Layer(index=0, name="fake", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True),
                      gathered=False)
    st.layers = [one]
    logits, weights, ids = _routing(t=8)
    # the accelerator path on CPU tensors (no host shortcut, strict sync-free): prefill only -> vLLM's tensors
    set_kinds([PREFILL] * 8)
    with strict_sync_free():
        got = op.remap_layer(logits, weights, ids, 0)
    steps.end_step()
    assert got[0] is weights and got[1] is ids and one.plan is None
    with strict_sync_free():  # no step prepared (a dummy run)
        got = op.remap_layer(logits, weights, ids, 0)
    assert got[0] is weights and got[1] is ids and one.plan is None

    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    cpu_buffer = steps.buffer
    monkeypatch.setattr(rows, "buffer", lambda device, n: cpu_buffer(torch.device("cpu"), n))
    on_device = types.SimpleNamespace(shape=(8, 8), device=torch.device("cuda"))  # what step_for reads of the logits
    assert op.host_counts(torch.device("cuda"), False) and op.host_counts(torch.device("cpu"), False)
    assert op.step_for(one, on_device, False) is None  # eager, no step prepared
    set_kinds([PREFILL] * 8)
    assert op.step_for(one, on_device, False) is None  # eager, no decode row
    capturing["now"] = True
    assert not op.host_counts(torch.device("cuda"), False)
    captured = op.step_for(one, on_device, False)  # a capture: the remap is recorded against the buffer
    assert captured is not None and captured.decode_rows is None and captured.decode is not None
    steps.end_step()
    set_kinds([DECODE] * 3 + [PREFILL] * 5)
    capturing["now"] = False
    mixed = op.step_for(one, on_device, False)
    steps.end_step()
    assert mixed.decode_rows == 3 and int(mixed.decode.sum()) == 3
    assert not op.host_counts(torch.device("xpu"), False)  # a device whose capture cannot be asked about


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
            False, moe_config()


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
    remaps a decode step of 8 tokens (``tau`` 1000: every decode token may move). The gate's decision key holds the
    layer's step description (router class and rules, weight rule, experts' classes)."""
    router, one = attached({"policy": "lynx", "gate": "auto", "mass_price": "None", "tau": "1000"}, {8})
    plans.before_forward(_ModelRunner(mode=3))
    assert not one.bypass and STATE.bypassed == ()
    # the decision key names what the step runs besides the plan: vLLM's router class and its rules (issue 43)
    step = json.loads(gate.of(one.plan).key.engine)
    assert step["router"]["router"] == "CPURouter" and step["weight"]["kind"] == "softmax_all"
    # a function is no measured fact (None): the router's rule beside it says what the selection scores compute
    assert set(step) == {"router", "scores", "weight", "experts", "quant_method", "expert_map"}
    assert step["scores"] is None and "lynx_hf" not in json.dumps(step)
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


@pytest.mark.vllm_code
def test_n11_gate_caches_stay_bounded_over_many_step_shapes(attached):
    """Issue 54 N11 (cases C64): a long-running server's steps take many distinct (tokens, decode rows). 10^4 distinct
    mixed steps through the step mask (``steps.write_kinds``, as the model runners' input preparation calls it) on a
    layer the gate bypasses (off everywhere: the pending skips), and 10^4 distinct mixed shapes asked of a gate that is
    on somewhere, half of them above the largest bucket: the pending skips and the derived decisions stay bounded,
    every step is still counted, and a decision within the buckets is the buckets' (no per-(T, rows) entry)."""
    router, one = attached({"policy": "lynx", "gate": "auto"}, set())
    STATE.capacity = 200
    plans.before_forward(_ModelRunner(mode=3))
    assert one.bypass
    shapes = [(t, r) for t in range(2, 200) for r in range(1, t)][:10_000]
    assert len(shapes) == 10_000
    for t, r in shapes:
        steps.write_kinds([DECODE] * r + [PREFILL] * (t - r), "cpu")
        steps.end_step()
        assert len(STATE.pending_skips) <= 256  # bypass.PENDING_MAX: 64
    entry = telemetry.snapshot()["layers"][0]["gate"]
    assert entry["steps_skipped"] == 10_000

    router, one = attached({"policy": "lynx", "gate": "auto"}, {8})
    planned = gate.of(plans.plan_for(one, torch.device("cpu"), torch.float32, STATE.config.lynx))
    top = planned.tuning.buckets[-1]
    within = [(t, r) for t in range(2, top + 1) for r in range(1, t)][:5_000]
    above = [(top + 1 + i, 1 + i % 7) for i in range(5_000)]
    for t, r in within + above:
        planned.decision(t, r)
        assert len(planned._derived) <= 512  # gate.stage.DERIVED_MAX: 256
    # within the buckets a mixed step's decision is its two buckets' (the same object for every (T, rows) in them)
    assert planned.decision(9, 3) is planned.decision(15, 4)



@pytest.mark.vllm_code
def test_n12_under_expert_parallelism_the_gate_weighs_this_ranks_experts(plugin_state, fresh_store, monkeypatch):
    """Issue 54 N12: under expert parallelism (vLLM's ``FusedMoEParallelConfig`` with ``use_ep`` and ``ep_size`` 4) each
    rank runs N / 4 of the layer's experts, so it saves a quarter of the experts the policy avoids. The layer hooked
    on a vLLM ``CPURouter`` carries the EP size into the gate's shape (and its key); the measured decision counts
    (before - after) / 4 experts saved, as the rule above the largest bucket does. With a routing cost of 1 ms, 8
    experts avoided per step and 0.25 ms per expert: on without EP (2 ms > 1 ms), off under EP = 4 (0.5 ms)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from lynx_hf.gate import decision as gate_decision
    from lynx_hf.gate import measure as gate_measure

    monkeypatch.setattr(gate_measure, "measure_routing", lambda *a, **k: (1.0, 12.0, 4.0))
    monkeypatch.setattr(gate_measure, "measure_expert_ms", lambda *a, **k: 0.25)
    held, got = [], {}
    for ep in (1, 4):
        parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=ep, ep_size=ep, tp_rank=0, pcp_rank=0,
                                          dp_rank=0, ep_rank=0, sp_size=1, use_ep=ep > 1, all2all_backend="naive",
                                          enable_eplb=False)
        plugin_state({"policy": "lynx", "gate": "auto", "phase": "auto"}, capacity=16)
        gate.STORE.reset()
        runner = _MoERunner(CPURouter(top_k=2, global_num_experts=64))
        runner.moe_config = moe_config(moe_parallel_config=parallel, hidden_dim=64, intermediate_size_per_partition=32)
        held.append(runner)
        layers.attach(runner)
        one = STATE.layers[-1]
        planned = gate.of(plans.plan_for(one, torch.device("cpu"), torch.float32, STATE.config.lynx))
        got[ep] = planned
        assert planned.decision(8).experts_saved == pytest.approx(8.0 / ep)
        ruled = gate_measure.rule_at(planned, 1000, "", planned.tuning)
        plain = gate_decision.by_rule(64, 2, 64, 32, 4, 1000, "cpu", 0.0, "", planned.tuning)
        assert ruled.experts_saved == pytest.approx(plain.experts_saved / ep)
    assert got[1].decision(8).on and not got[4].decision(8).on
    assert got[1].key != got[4].key  # a rank under EP never reads a decision measured without it


@pytest.mark.vllm_code
def test_n10_a_size_the_gate_keeps_off_adds_no_op_to_its_graph_or_step(attached, monkeypatch):
    """Issue 54 N10: a layer on at some sizes (8) and off at others (4) is not bypassed, but where its gate is off the
    hooked vLLM ``CPURouter`` returns vLLM's routing without calling the op: under a CUDA-graph capture at 4 (the
    capture stood in by ``bypass.capturing``) the graph gets no op (no masks, no copies: the decision at the static T,
    frozen per graph size), and an eager decode step of 4 tokens runs none either; the gate counts that step as
    skipped, and the layer still counts as routed through the plugin (liveness). At 8 the op runs in both."""
    router, one = attached({"policy": "lynx", "gate": "auto", "mass_price": "None", "tau": "1000"}, {8})
    plans.before_forward(_ModelRunner(mode=3))
    assert not one.bypass
    called = []
    real = op.remap_layer
    monkeypatch.setattr(op, "remap_layer", lambda *args: called.append(args[0].shape[0]) or real(*args))
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    monkeypatch.setattr(bypass, "capturing", lambda device: True, raising=False)
    for t in (8, 4):  # the captures, largest first
        got = router._compute_routing(None, logits[:t], None)
    want = layers.original_routing(router)(None, logits[:4], None)
    assert called == [8] and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    monkeypatch.setattr(bypass, "capturing", lambda device: False, raising=False)
    calls = one.calls
    _decode_step(4)
    got = router._compute_routing(None, logits[:4], None)
    steps.end_step()
    assert called == [8] and torch.equal(got[1], want[1]) and one.calls == calls + 1
    planned = gate.of(one.plan)
    assert planned.skipped[4] == 1 and planned.seen[4] == 1
    _decode_step(8)
    router._compute_routing(None, logits, None)
    steps.end_step()
    assert called == [8, 8] and planned.seen[8] == 1 and planned.skipped[8] == 0  # counted once, by the op's gate


@pytest.mark.vllm_code
def test_n10_eager_steps_of_a_captured_engine_take_eager_prices(attached, monkeypatch):
    """Issue 54 N10 (cases C66): an engine captured in CUDA graphs replays its captured sizes' steps but steps eagerly
    at the others (a size above the largest graph, a mixed step outside the graphs), where each of the routing's
    kernels is launched from the host: the replay's price is ~7x too cheap there. The layer's gate holds both
    (``PlanGate.replayed``: the decisions timed as a replay, keyed apart; its own: timed eagerly). The measurement
    answers by the shape's ``captured`` field: a replay is worth it at 4 and 8 tokens, an eager step at 8 only. So the
    captures at 4 and 8 (stood in by ``bypass.capturing``) both hold the op and remap there (the replay's decision),
    an eager decode step of 4 tokens keeps vLLM's routing without the op (the eager decision, counted skipped), one of
    8 runs it, and the replays are counted with the replay's decision (seen, not skipped). Before, every decision of a
    captured engine was the replay's."""
    from lynx_hf.gate import stage as gate_stage

    router, one = attached({"policy": "lynx", "gate": "auto", "mass_price": "None", "tau": "1000"}, {8})
    measured = []

    def measure_layer(planned, expert_times, tuning=gate.TUNING):
        measured.append(planned.shape.captured)
        on = {4, 8} if planned.shape.captured else {8}
        return {b: gate.decide(1.0, 4.0 if b in on else 0.0, 1.0, margin=tuning.margin) for b in tuning.buckets}

    monkeypatch.setattr(gate_stage, "measure_layer", measure_layer)
    monkeypatch.setattr(plans, "captured", lambda model_runner, device: True)  # a CUDA-graph engine
    plans.before_forward(_ModelRunner(mode=3))
    planned = gate.of(one.plan)
    assert STATE.start.captured and not one.bypass and sorted(measured) == [False, True]
    assert not planned.shape.captured and planned.replayed is not None and planned.replayed.shape.captured
    assert planned.key != planned.replayed.key
    assert not planned.decision(4).on and planned.replay_decision(4).on and planned.decision(8).on
    called = []
    real = op.remap_layer
    monkeypatch.setattr(op, "remap_layer", lambda *args: called.append(args[0].shape[0]) or real(*args))
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    want = {t: layers.original_routing(router)(None, logits[:t], None) for t in (4, 8)}
    monkeypatch.setattr(bypass, "capturing", lambda device: True, raising=False)
    for t in (8, 4):  # the captures, largest first: both graphs hold the op, which remaps (the replay's decision)
        _decode_step(t)
        got = router._compute_routing(None, logits[:t], None)
        steps.end_step()
        assert not torch.equal(got[1], want[t][1])
    assert called == [8, 4] and not planned.seen  # captures are no steps
    monkeypatch.setattr(bypass, "capturing", lambda device: False, raising=False)
    _decode_step(4)  # eager at 4: the eager price, off: no op
    got = router._compute_routing(None, logits[:4], None)
    steps.end_step()
    assert called == [8, 4] and torch.equal(got[1], want[4][1]) and torch.equal(got[0], want[4][0])
    _decode_step(8)  # eager at 8: on
    got = router._compute_routing(None, logits, None)
    steps.end_step()
    assert called == [8, 4, 8] and not torch.equal(got[1], want[8][1])
    for t in (4, 8):  # replays: no op body runs; counted with the replay's decision
        _decode_step(t)
        steps.end_step()
    assert dict(planned.seen) == {4: 2, 8: 2} and dict(planned.skipped) == {4: 1}
    entry = bypass.gate_summary(one)["by_tokens"]
    assert entry[4]["on"] is False and entry[4]["replayed_on"] is True and entry[8]["replayed_on"] is True


@pytest.mark.vllm_code
def test_every_gate_count_goes_through_one_accounting_path_and_the_op_asks_plans_once(attached, monkeypatch):
    """Issue 55 item 3: the gate's own stage (an op step), a step the router wrapper keeps off before the op
    (``bypass.gated_off_call``), a replayed step (``bypass.count_replays``) and a bypassed layer's pending skips
    (``bypass.flush_skips``) all count through ``PlanGate.account``; the op's body makes one call into the plans per
    layer-step (``plans.remap``), and the bypass reads ``GateDecision.measured``, not the reason's wording."""
    from lynx_hf.gate.stage import PlanGate

    router, one = attached({"policy": "lynx", "gate": "auto", "mass_price": "None", "tau": "1000"}, {8})
    plans.before_forward(_ModelRunner(mode=3))
    accounted, asked = [], []
    real_account, real_remap = PlanGate.account, plans.remap
    monkeypatch.setattr(PlanGate, "account", lambda self, t, on, steps=1: accounted.append((t, on, steps)) or
                        real_account(self, t, on, steps))
    monkeypatch.setattr(plans, "remap", lambda *args: asked.append(args[1].shape[0]) or real_remap(*args))
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    for t in (8, 4):  # the op's gate (on at 8), then the router wrapper before the op (off at 4)
        _decode_step(t)
        router._compute_routing(None, logits[:t], None)
        steps.end_step()
    assert accounted == [(8, True, 1), (4, False, 1)] and asked == [8]
    STATE.start.captured = True  # a replay of 8: no op body ran
    _decode_step(8)
    steps.end_step()
    assert accounted[-1] == (8, True, 1) and asked == [8]
    STATE.start.captured = False
    bypass.set_bypass(one, True)
    _decode_step(4)
    steps.end_step()
    bypass.flush_skips()
    assert accounted[-1] == (4, False, 1) and len(accounted) == 4
    unmeasured = gate.GateDecision(False, float("nan"), float("nan"), float("nan"), float("nan"), reason="why not")
    assert not unmeasured.measured and gate.decide(1.0, 0.0, 1.0).measured
    planned = gate.of(one.plan)
    monkeypatch.setattr(planned, "decisions", {b: unmeasured for b in planned.decisions})
    assert not bypass.gated_off_everywhere(one.plan)  # off, but on no figure: the gate keeps the op


@pytest.mark.vllm_code
def test_item7_an_all_bypassed_engine_does_only_the_step_count_on_the_host(attached, monkeypatch):
    """Issue 54 item 7 (cases C69): where the gate keeps vLLM's routing on every layer at every step size (all
    bypassed: no op in any forward), a step's host work is its count: the input preparation's hooks (V1 and V2)
    count the step from its requests (no per-token kinds, no mask buffer), and neither the replay bookkeeping of a
    captured engine nor the liveness rule loops over the layers. The bypassed gates still count every skipped step."""
    import numpy as np

    router, one = attached({"policy": "lynx", "gate": "auto"}, set())  # off everywhere: bypassed
    plans.before_forward(_ModelRunner(mode=3))
    assert STATE.all_bypassed and one.bypass
    STATE.start.captured = True  # a CUDA-graph engine: the replay bookkeeping would loop over the layers

    def refuse(*args, **kwargs):
        raise AssertionError("per-token or per-layer host work in an all-bypassed step")

    for module, name in ((steps, "token_kinds"), (steps, "v2_token_kinds"), (steps, "write_kinds"),
                         (steps, "buffer"), (bypass, "target_layers"), (checks_module(), "target_layers")):
        monkeypatch.setattr(module, name, refuse)
    # V1: 3 requests (a 5-token prompt chunk, two decodes) of the persistent batch
    batch = types.SimpleNamespace(num_reqs=3, req_id_to_index={}, num_computed_tokens_cpu=np.array([0, 9, 7]),
                                  num_prompt_tokens=np.array([5, 4, 6]))
    runner = types.SimpleNamespace(input_batch=batch, device=torch.device("cpu"))
    # V2: the same requests as the InputBatch its prepare_inputs returns
    v2 = types.SimpleNamespace(num_reqs=3, num_scheduled_tokens=np.array([5, 1, 1]),
                               is_prefilling_np=np.array([True, False, False]), num_tokens=7)
    v2_runner = types.SimpleNamespace(pcp_manager=None, device=torch.device("cpu"))
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(7))
    worker = types.SimpleNamespace(model_runner=runner)
    for version in ("v1", "v2") * 3:
        seen = STATE.counts.seen_decode
        if version == "v1":
            steps.set_step_v1(runner, types.SimpleNamespace(scheduled_spec_decode_tokens=None), np.array([5, 1, 1]))
        else:
            steps.set_step_v2(v2_runner, v2)
        assert (STATE.step.num_tokens, STATE.step.num_decode, STATE.step.active) == (7, 2, True)
        router._compute_routing(None, logits, None)  # vLLM's routing, no op
        steps.end_step()
        checks_module().after_worker_step(worker, None, seen)
    monkeypatch.undo()
    assert STATE.counts.decode_steps == 6 and STATE.counts.mixed_steps == 6 and STATE.step.kind is None
    assert plans.stage_summaries(one)["gate"]["steps_skipped"] == 6


def checks_module():
    from lynx_hf.vllm import checks

    return checks


# ------------------------------------------------------------------ item 7: a bypassed layer is vLLM's own


class _ForwardRunner(_MoERunner):
    """A runner stand-in with vLLM's ``MoERunner._forward_impl`` signature (what ``moe_forward`` calls): it routes
    through its router's ``select_experts`` (vLLM's own entry: ``BaseRouter._select_experts`` calls
    ``_compute_routing``) and returns the weights times the ids, so a trace holds every routing op."""

    def __init__(self, router, name="layers.0.experts"):
        super().__init__(router)
        self.layer_name = name

    def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
        weights, ids = self.router.select_experts(hidden_states, router_logits)
        return weights * ids


def _cpu_router():
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    return CPURouter(top_k=2, global_num_experts=8)


def _hooked_runners(fixed_gate, plugin_state, num_layers, on, eager=True, capacity=64):
    """``num_layers`` runners on vLLM ``CPURouter`` s (k 2 of 8), attached by ``layers.attach`` in a fresh engine
    state whose gate decides as ``on`` says, the plans made as before the first forward (``eager``: an engine
    ``configure`` may un-bypass). Returns the runners."""
    fixed_gate(on)
    plugin_state({"policy": "lynx", "gate": "auto", "phase": "auto"}, capacity=capacity)
    runners = [_ForwardRunner(_cpu_router(), f"layers.{i}.experts") for i in range(num_layers)]
    for runner in runners:
        layers.attach(runner)
        STATE.layers[-1].gate_shape = gate.LayerShape(8, 2, 32, 16)
    plans.before_forward(_ModelRunner(mode=0 if eager else 3, eager=eager))
    return runners


def _plugin_frames(fn) -> list[str]:
    """The ``lynx_hf`` functions Python enters while ``fn()`` runs (``sys.setprofile``), as ``file:function``."""
    import sys
    from pathlib import Path

    import lynx_hf

    root = str(Path(lynx_hf.__file__).parent)
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def _trace(fn, *args) -> tuple[list[str], set[str]]:
    """``(call targets of the FX graph, files of every function Dynamo inlined)`` of ``torch.compile(fn, fullgraph)``:
    the files as vLLM's compiled mode collects them for its cache key
    (``InliningInstructionTranslator.inline_call_``)."""
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    targets, files = [], set()
    inline_call = InliningInstructionTranslator.inline_call_

    def collecting(self_):
        files.add(self_.f_code.co_filename)
        return inline_call(self_)

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    InliningInstructionTranslator.inline_call_ = collecting
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    finally:
        InliningInstructionTranslator.inline_call_ = inline_call
        torch._dynamo.reset()
    return targets, files


@pytest.mark.vllm_code
def test_item7_a_bypassed_layer_runs_and_traces_vllms_own_router_and_runner(fixed_gate, plugin_state, monkeypatch):
    """Issue 54 item 7 (cases C69): a layer the cost gate bypasses keeps none of the plugin's wrappers on its vLLM
    objects: its router's ``_compute_routing`` and its runner's ``_forward_impl`` are the classes' own methods again,
    so an eager forward through it enters no ``lynx_hf`` function (before: two wrapper frames per layer per step), and
    ``torch.compile`` traces vLLM's code alone: the same FX ops as an unhooked twin (vLLM without the plugin) and no
    ``lynx_hf`` file among the inlined functions (before: ``layers.py``'s wrappers were traced, so part of vLLM's
    compile-cache key). An eager engine's ``configure`` that needs the op puts the wrappers back (the op is called,
    the runner's runs counted again) and one that bypasses takes them off again."""
    import lynx_hf

    (runner,) = _hooked_runners(fixed_gate, plugin_state, 1, set())
    one, router = STATE.layers[0], runner.router
    assert one.bypass and STATE.all_bypassed
    assert "_compute_routing" not in vars(router) and "_forward_impl" not in vars(runner)
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 3
    twin = _ForwardRunner(_cpu_router())  # vLLM without the plugin
    assert torch.equal(runner._forward_impl(None, logits, None), twin._forward_impl(None, logits, None))
    assert _plugin_frames(lambda: runner._forward_impl(None, logits, None)) == []
    targets, files = _trace(runner._forward_impl, None, logits, None)
    twin_targets, _ = _trace(twin._forward_impl, None, logits, None)
    assert targets == twin_targets and targets
    root = str(__import__("pathlib").Path(lynx_hf.__file__).parent)
    assert not [f for f in files if f.startswith(root)], files

    called = []
    real = op.remap_layer
    monkeypatch.setattr(op, "remap_layer", lambda *args: called.append(args[0].shape[0]) or real(*args))
    runs = one.runs
    assert layers.configure({"policy": "lynx", "gate": "always", "phase": "auto"}) is True
    assert not one.bypass and "_compute_routing" in vars(router) and "_forward_impl" in vars(runner)
    _decode_step(8)
    runner._forward_impl(None, logits, None)
    steps.end_step()
    assert called == [8] and one.runs == runs + 1
    assert layers.configure({"policy": "lynx", "gate": "auto", "phase": "auto"}) is True
    assert one.bypass and "_compute_routing" not in vars(router) and "_forward_impl" not in vars(runner)
    assert _plugin_frames(lambda: runner._forward_impl(None, logits, None)) == []


def _worker_step_events(version, runners, num_reqs):
    """Every Python call and builtin call (``sys.setprofile`` events ``call`` / ``c_call``) of one worker step of
    ``num_reqs`` requests of one token each (all past their prompts but the first, whose last prompt token this is: a
    mixed step of ``num_reqs - 1`` decode tokens) through the plugin's own hooks as vLLM's
    classes call them: the worker's ``execute_model`` hook, the runner's ``execute_model`` hook, its input preparation
    hook (``version`` ``"v1"``: before V1's ``_prepare_inputs``, from the persistent batch and vLLM's
    ``SchedulerOutput``; ``"v2"``: after V2's ``prepare_inputs``, from its ``InputBatch``), the forward through every
    runner (vLLM ``CPURouter.select_experts``), the end of the step and the liveness rule. Counted on the second of two
    identical steps (the first warms the gate's step counts)."""
    import dataclasses
    import sys

    import numpy as np
    from vllm.v1.core.sched.output import SchedulerOutput

    from lynx_hf.vllm import install

    ids = [f"r{i}" for i in range(num_reqs)]
    scheduler_output = dataclasses.replace(SchedulerOutput.make_empty(), num_scheduled_tokens=dict.fromkeys(ids, 1),
                                           total_num_scheduled_tokens=num_reqs)
    num_scheduled = np.ones(num_reqs, dtype=np.int32)
    computed = np.full(256, 40, np.int32)  # vLLM's int32 arrays; request 0 has the last token of its prompt left
    computed[0] = 31
    batch = types.SimpleNamespace(num_reqs=num_reqs, req_id_to_index={r: i for i, r in enumerate(ids)},
                                  num_computed_tokens_cpu=computed, num_prompt_tokens=np.full(256, 32, np.int32))
    input_batch = types.SimpleNamespace(num_reqs=num_reqs, num_tokens=num_reqs, num_scheduled_tokens=num_scheduled,
                                        is_prefilling_np=computed < 32)
    model_runner = types.SimpleNamespace(input_batch=batch, device=torch.device("cpu"), pcp_manager=None)
    wrapper = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=model_runner))
    logits = torch.randn(num_reqs, 8, generator=torch.Generator().manual_seed(2))

    def prepare_v1(self, so, num_scheduled_tokens):
        return None

    def prepare_v2(self, so):
        return input_batch

    def runner_execute(self, so):
        if version == "v1":
            install._prepare_v1(prepare_v1, self, so, num_scheduled)
        else:
            install._prepare_v2(prepare_v2, self, so)
        for runner in runners:
            runner._forward_impl(None, logits, None)

    def worker_execute(self, so):
        return install._runner_execute(runner_execute, model_runner, so)

    counts = []
    for _ in range(2):
        events = []
        sys.setprofile(lambda frame, event, arg: events.append(event) if event in ("call", "c_call") else None)
        try:
            install._worker_execute(worker_execute, wrapper, scheduler_output)
        finally:
            sys.setprofile(None)
        counts.append(len(events))
    return counts[-1]


#: what an all-bypassed step may do on the host beyond the plugin-off engine's: its count (calls and builtin calls)
ALL_BYPASSED_EXTRA_CALLS = 12


@pytest.mark.vllm_code
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_item7_an_all_bypassed_step_does_vllms_work_plus_a_fixed_few_calls(fixed_gate, plugin_state, version):
    """Issue 54 item 7 (cases C69): a worker step of one token per request in an engine whose every layer is
    bypassed, through the plugin's hooks and vLLM's own ``CPURouter`` s, makes the plugin-off engine's calls (the same
    hooks, the same vLLM work: the plugin installed but not configured) plus a fixed few (the step's count): the same
    number with 1 layer and 4 requests as with 6 layers and 64 (no work per layer or per request), and at most
    :data:`ALL_BYPASSED_EXTRA_CALLS`; the step is counted as the requests' rule says. Before: two wrapper frames per
    layer (the router's ``_compute_routing``, the runner's ``_forward_impl`` and its ``torch.compiler.is_compiling``),
    and the requests' classification through ``decoding_requests`` / ``step_counts`` (~a dozen numpy calls) where one
    count of the requests past their prompts does."""
    extra = {}
    for num_layers, num_reqs in ((1, 4), (6, 64)):
        plugin_state(None, capacity=64)  # the plugin installed, not configured: vLLM's own MoE layers
        off = _worker_step_events(version, [_ForwardRunner(_cpu_router()) for _ in range(num_layers)], num_reqs)
        runners = _hooked_runners(fixed_gate, plugin_state, num_layers, set(), capacity=64)
        assert STATE.all_bypassed
        on = _worker_step_events(version, runners, num_reqs)
        assert STATE.counts.decode_steps == STATE.counts.mixed_steps == 2 and STATE.step.kind is None
        assert dict(STATE.pending_skips) == {(num_reqs, num_reqs - 1): 2}  # counted as the requests' rule says
        assert plans.stage_summaries(STATE.layers[0])["gate"]["steps_skipped"] == 2
        extra[num_layers, num_reqs] = on - off
    assert extra[1, 4] == extra[6, 64] <= ALL_BYPASSED_EXTRA_CALLS, extra
