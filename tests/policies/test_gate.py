"""The cost gate (``LynxConfig.gate``, ``lynx_hf.gate``): the decision is a pure function of its measurements
(hand-worked cases); a gated-off layer is bit-identical to policy none; a gate that is on changes nothing against
``gate="always"``; the gate adds no host sync; accuracy entry points force the gate on. No timed assertion: the
measurements are replaced by fixed decisions wherever an outcome is asserted (``_fixed_gate``)."""

import math

import pytest
import torch
from transformers import StaticCache

import lynx_hf
from helpers import families as fam
from helpers.sync_detector import SyncDetector
from lynx_hf import gate
from lynx_hf.kernels.routing_torch import strict_sync_free


# -- decide: hand-worked -------------------------------------------------------------------------------------
def test_decide_off_when_saving_is_below_cost():
    d = gate.decide(cost_ms=0.05, experts_saved=2.0, expert_ms=0.01)  # saving 2 x 0.01 = 0.02 ms < 0.05 ms
    assert not d.on and d.saving_ms == pytest.approx(0.02) and d.cost_ms == 0.05 and d.experts_saved == 2.0
    assert "0.02 ms <= cost 0.05 ms" in d.reason


def test_decide_on_when_saving_beats_cost():
    d = gate.decide(0.05, 10.0, 0.01)  # 0.1 ms > 0.05 ms
    assert d.on and d.saving_ms == pytest.approx(0.1)


def test_decide_tie_is_off_and_extra_expert_cost_counts():
    assert not gate.decide(0.5, 2.0, 0.25).on  # saving 0.5 == cost 0.5 (exact in binary): strict, off
    d = gate.decide(0.5, 2.0, 0.25, extra_expert_ms=0.25)  # an offloaded expert's transfer: 2 x 0.5 = 1.0 > 0.5
    assert d.on and d.saving_ms == 1.0 and d.extra_expert_ms == 0.25


def test_decide_margin_clamps_and_nothing_saved():
    assert gate.decide(0.5, 2.0, 0.5).on and not gate.decide(0.5, 2.0, 0.5, margin=2.0).on  # 1.0 vs 2 x 0.5
    d = gate.decide(-0.01, 3.0, 0.1)  # a negative cost is timing noise: 0
    assert d.on and d.cost_ms == 0.0
    assert not gate.decide(0.0, 0.0, 1.0).on  # nothing saved: never on, even at zero cost
    assert not gate.decide(0.0, -1.0, 1.0).on and gate.decide(0.0, -1.0, 1.0).experts_saved == 0.0


@pytest.mark.parametrize("args", [(math.nan, 1.0, 1.0), (1.0, math.inf, 1.0), (1.0, 1.0, -0.1), (1.0, 1.0, True)])
def test_decide_rejects_bad_measurements(args):
    with pytest.raises(ValueError):
        gate.decide(*args)
    with pytest.raises(ValueError, match="margin"):
        gate.decide(1.0, 1.0, 1.0, margin=0.0)


def test_bucket_of():
    assert [gate.bucket_of(t) for t in (1, 2, 3, 16, 17, 512, 4096)] == [1, 2, 4, 16, 32, 512, 512]


# -- PlanGate: host-side lookups, counters, summary -------------------------------------------------------------
def _decision(on: bool) -> gate.GateDecision:
    d = gate.decide(1.0, 10.0 if on else 0.0, 0.5)
    return gate.GateDecision(d.on, d.cost_ms, d.saving_ms, d.experts_saved, d.expert_ms, experts_before=20.0,
                             experts_after=10.0 if on else 20.0, reason=d.reason)


def test_plan_gate_lookup_counts_and_summary():
    g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), decisions={b: _decision(b >= 16) for b in gate.BUCKETS})
    assert not g.on(8) and g.on(16) and g.on(9) and g.on(2000)  # 9 -> bucket 16; 2000 -> the largest, 512
    g.skip(8)
    g.skip(8)
    s = g.summary()
    assert s["steps_skipped"] == 2 and set(s["by_tokens"]) == {8, 9, 16, 2000}
    assert s["by_tokens"][8]["on"] is False and s["by_tokens"][8]["steps_skipped"] == 2
    assert s["by_tokens"][16]["saving_ms"] == 5.0 and s["by_tokens"][16]["cost_ms"] == 1.0
    g.reset()
    assert g.summary() == {"gate": "auto", "by_tokens": {}, "steps_skipped": 0}


def test_observe_decides_again_from_the_median_served_cost(monkeypatch):
    """Patch time: cost 0.1 ms, 4 experts saved x 0.1 ms = 0.4 > 1.25 x 0.1: on. Served steps then cost 1.0 ms
    (median of 1.0, 1.0, 0.2; the 0.2 is an outlier the median drops): 0.4 <= 1.25 x 1.0, off from then on."""
    monkeypatch.setattr(gate, "OBSERVE_STEPS", 3)
    g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), decisions={16: gate.decide(0.1, 4.0, 0.1, margin=gate.MARGIN)})
    assert g.on(16) and g.observing(16) and g.observing(9)  # 9 tokens: bucket 16
    g.observe(16, 1.0)
    g.observe(9, 0.2)
    assert g.on(16) and g.observing(16)  # 2 of 3 served steps: the patch-time decision stands
    g.observe(16, 1.0)
    d = g.decision(16)
    assert not d.on and d.cost_ms == 1.0 and d.saving_ms == pytest.approx(0.4) and "3 served steps" in d.reason
    assert not g.observing(16) and 16 in g.checked
    g.observe(16, 0.0)  # decided: no more samples taken
    assert not g.on(16) and g.observed == {}


def test_observe_keeps_on_when_served_cost_is_low_and_never_checks_off(monkeypatch):
    monkeypatch.setattr(gate, "OBSERVE_STEPS", 2)
    g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), decisions={4: gate.decide(1.0, 0.0, 1.0),
                                                               16: gate.decide(0.1, 4.0, 0.1, margin=gate.MARGIN)})
    assert not g.observing(4)  # off: the work does not run, nothing to time, it stays off
    g.observe(16, 0.2)
    g.observe(16, 0.3)  # median 0.25: 0.4 > 1.25 x 0.25 = 0.3125, still on
    d = g.decision(16)
    assert d.on and d.cost_ms == pytest.approx(0.25) and not g.observing(16)


def test_off_line():
    entry = {"on": False, "cost_ms": 0.05, "saving_ms": 0.02, "steps_skipped": 3}
    layers = [{"gate": {"by_tokens": {16: entry}}}, {"gate": {"by_tokens": {16: {**entry, "on": True}}}}]
    assert gate.off_line(layers) == ("LYNX off on 1/2 layers at 16 tokens per step: expected saving 0.02 ms <= cost "
                                     "0.05 ms per layer-step (gate='always' or LYNX_HF_GATE=always forces it on)")
    assert gate.off_line([{"gate": {"by_tokens": {16: {**entry, "on": True}}}}]) is None
    assert gate.off_line([{"gate": {"gate": "always", "by_tokens": {}}}]) is None


# -- LynxConfig.gate ----------------------------------------------------------------------------------------------
def test_config_gate_default_from_environment(monkeypatch):
    monkeypatch.delenv(gate.ENV, raising=False)
    assert lynx_hf.LynxConfig().gate == "auto"
    monkeypatch.setenv(gate.ENV, "always")
    assert lynx_hf.LynxConfig().gate == "always" and lynx_hf.LynxConfig(gate="auto").gate == "auto"  # explicit wins
    monkeypatch.setenv(gate.ENV, "sometimes")
    with pytest.raises(lynx_hf.LynxConfigError, match="gate"):
        lynx_hf.LynxConfig()
    with pytest.raises(lynx_hf.LynxConfigError, match="gate"):
        lynx_hf.LynxConfig(gate="never", policy="lynx")


def test_patch_rejects_a_bad_gate():
    model = fam.build("qwen2_moe")
    with pytest.raises(lynx_hf.LynxConfigError, match="gate"):
        lynx_hf.patch(model, gate="off")
    assert not lynx_hf.is_patched(model)


# -- the gate in a model ------------------------------------------------------------------------------------------
@pytest.fixture
def fixed_gate(monkeypatch):
    """Replace the measurement by fixed decisions: ``fixed_gate(on)`` with ``on`` a bool or a callable of the bucket."""
    calls = []

    def install(on):
        def measure(plan, shape, num_tokens, telemetry=True, extra_expert_ms=0.0, expert_fn=None, route_fn=None,
                    cost_key=()):
            calls.append((shape, num_tokens))
            return _decision(on(num_tokens) if callable(on) else on)

        monkeypatch.setattr(gate, "measure", measure)
        return calls

    return install


def _generate(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "llama4"])
def test_gated_off_layers_are_bit_identical_to_policy_none(family, fixed_gate):
    calls = fixed_gate(False)
    model = fam.build(family)
    ids, mask = fam.prompts(8, 6)
    with lynx_hf.patched(model, policy="none"):
        ref = _generate(model, ids, mask)
    with lynx_hf.patched(model, policy="lynx", gate="auto"):
        block = lynx_hf.patcher._state(model).blocks[0]
        assert gate.of(block.plan) is not None and block.layer_shape().hidden is not None
        out = _generate(model, ids, mask)
        summary = lynx_hf.stats(model).summary()
    assert calls  # measured (here: the fixed decisions) at patch time, per shape
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))
    assert summary["gate_steps_skipped"] == 4 * summary["num_moe_layers"] and summary["decode_steps"] == 0
    layer = summary["per_layer"][0]["gate"]
    assert layer["by_tokens"][8]["on"] is False and layer["by_tokens"][8]["steps_skipped"] == 4


def test_gate_on_changes_nothing_against_always(fixed_gate):
    fixed_gate(True)
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 6)
    with lynx_hf.patched(model, policy="lynx", gate="always"):
        assert gate.of(lynx_hf.patcher._state(model).blocks[0].plan) is None
        ref = _generate(model, ids, mask)
        ref_stats = lynx_hf.stats(model).summary()
    with lynx_hf.patched(model, policy="lynx", gate="auto"):
        out = _generate(model, ids, mask)
        stats = lynx_hf.stats(model).summary()
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))
    assert stats["unique_experts_after"] == ref_stats["unique_experts_after"] < ref_stats["unique_experts_before"]
    assert stats["gate_steps_skipped"] == 0 and stats["per_layer"][0]["gate"]["by_tokens"][8]["on"] is True
    assert ref_stats["per_layer"][0]["gate"]["gate"] == "always"


def test_gate_per_step_size(fixed_gate):
    """On from 8 tokens: a batch of 4 keeps the model's routing, a batch of 8 is remapped."""
    fixed_gate(lambda bucket: bucket >= 8)
    model = fam.build("qwen2_moe")
    with lynx_hf.patched(model, policy="lynx", gate="auto"):
        for batch in (4, 8):
            ids, mask = fam.prompts(batch, 6)
            lynx_hf.reset_stats(model)
            _generate(model, ids, mask)
            s = lynx_hf.stats(model).summary()
            assert (s["gate_steps_skipped"] > 0) == (batch == 4) and (s["decode_steps"] > 0) == (batch == 8)


@pytest.mark.parametrize("on", [True, False])
def test_gate_adds_no_host_sync(on, fixed_gate):
    fixed_gate(on)
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    ids, mask = fam.prompts(8, 5)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **fam.cache_kw(model, cache), use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        detector = SyncDetector()
        with strict_sync_free(), detector:
            for _ in range(2):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(input_ids=nxt, attention_mask=mask, **fam.cache_kw(model, fam.cache_of(out)),
                            use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    summary = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    detector.check()
    assert (summary["decode_steps"] == 2) == on and (summary["gate_steps_skipped"] > 0) != on


def test_measurement_runs_on_a_real_shape():
    """The real measurement once, on the CPU: finite, non-negative numbers, and the estimate from synthetic logits
    (no assertion on which way it decides: that depends on this machine)."""
    model = fam.build("qwen2_moe")
    with lynx_hf.patched(model, policy="lynx", gate="auto"):
        block = lynx_hf.patcher._state(model).blocks[0]
        d = gate.of(block.plan).decision(8)
    assert d.cost_ms >= 0 and d.expert_ms >= 0 and math.isfinite(d.saving_ms)
    assert block.top_k <= d.experts_after <= d.experts_before <= block.num_experts
    assert d.on == (d.saving_ms > gate.MARGIN * d.cost_ms)  # decided with the measured margin
    assert gate.of(block.plan).route_fn is not None  # the HF path times the router hook's whole work


# -- accuracy entry points force the gate on --------------------------------------------------------------------
def test_accuracy_entry_points_force_always(monkeypatch):
    from lynx_hf.eval import evaluation

    monkeypatch.setenv(gate.ENV, "auto")
    assert evaluation.ACCURACY_GATE == "always"
    seen = []
    real = lynx_hf.patcher.patched

    def spy(model, config=None, **overrides):
        seen.append(lynx_hf.patcher._as_config(config, overrides).gate)
        return real(model, config, **overrides)

    monkeypatch.setattr(evaluation.patcher, "patched", spy)
    model = fam.build("qwen2_moe")
    tok = fam.tokenizer()
    evaluation.generation_agreement(model, tok, ["w5 w6 w7", "w9 w3"], [("lynx", lynx_hf.LynxConfig())],
                                    max_new_tokens=3)
    assert seen == ["always"]


def test_lm_eval_model_forces_always(monkeypatch, tmp_path):
    pytest.importorskip("lm_eval")
    import lynx_hf.lm_eval as lynx_lm_eval

    monkeypatch.setenv(gate.ENV, "auto")  # the default a user without the test suite's setting gets
    fam.save_checkpoint("qwen2_moe", tmp_path)
    lm = lynx_lm_eval.LynxLM(pretrained=str(tmp_path), batch_size=2)
    assert lm.lynx_config.gate == "always" and lynx_hf.config_of(lm.model).gate == "always"
    asked = lynx_lm_eval.LynxLM(pretrained=str(tmp_path), batch_size=2, gate="auto")  # asked for: kept
    assert asked.lynx_config.gate == "auto"


@pytest.mark.parametrize("on", [True, False])
def test_gated_decode_forward_has_no_graph_break(on, fixed_gate):
    """The gate's branch is a host-side lookup on the static T: dynamo traces it in one graph (on and off)."""
    fixed_gate(on)
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    ids, mask = fam.prompts(4, 5)
    cache = StaticCache(config=model.config, max_cache_len=12)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **fam.cache_kw(model, cache), use_cache=True)
        inputs = dict(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), **fam.cache_kw(model, fam.cache_of(out)),
                      use_cache=True,
                      attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(**inputs)
    lynx_hf.unpatch(model)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_generate_prints_the_gate_line(fixed_gate, tmp_path, capsys):
    from lynx_hf import cli

    fixed_gate(False)
    fam.save_checkpoint("qwen2_moe", tmp_path / "ckpt")
    (tmp_path / "prompts.txt").write_text("w5 w6 w7\nw9 w3 w4\n")
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--prompts", str(tmp_path / "prompts.txt"), "--batch-size",
            "4", "--max-new-tokens", "3", "--quiet"]
    assert cli.main(argv + ["--gate", "auto"]) == 0
    out = capsys.readouterr().out
    assert "LYNX off on 2/2 layers at 4 tokens per step: expected saving 0 ms <= cost 1 ms per layer-step" in out
    assert cli.main(argv + ["--gate", "always"]) == 0
    assert "LYNX off" not in capsys.readouterr().out


def test_patch_note_names_only_step_sizes_where_something_is_lost():
    """The patch-time warning lists the buckets where the gate is off although the policy would save experts; a bucket
    with nothing to save (one token; every expert used either way) is not listed; no gate off: no note."""
    def d(on, saved):
        return gate.GateDecision(on, 1.0, 0.5, saved, 0.1)

    def planned(decisions):
        return gate.PlanGate(gate.LayerShape(8, 2, 16, 8), decisions=decisions)

    gates = [planned({1: d(False, 0.0), 4: d(False, 2.0), 16: d(True, 5.0)}), planned({1: d(False, 0.0), 16: d(True, 5.0)})]
    note = gate.patch_note(gates)
    assert "on 1/2 MoE layers" in note and "sizes (tokens, rounded up to these) 4 on this device" in note
    assert gate.patch_note(gates[1:]) is None and gate.patch_note([planned({}), None]) is None


def test_patch_note_warns_once_across_a_reconfiguration_and_back(monkeypatch):
    """``lynx-hf generate`` decodes its reference under ``patched(model, policy="none")`` and returns to the user's
    configuration: the gate's patch-time note is warned at patch only, not again on the way back."""
    import warnings

    off = gate.GateDecision(False, 1.0, 0.5, 2.0, 0.1, reason="off")  # 2 experts saved, below the cost: a loss
    monkeypatch.setattr(gate, "measure", lambda *args, **kwargs: off)
    model = fam.build("qwen2_moe")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lynx_hf.patch(model, policy="lynx", gate="auto")
        with lynx_hf.patched(model, policy="none"):
            pass
    lynx_hf.unpatch(model)
    notes = [w for w in seen if "the cost gate" in str(w.message)]
    assert len(notes) == 1


def test_module_expert_timing_falls_back_when_it_cannot_measure():
    """measure_module_expert_ms gives None (the caller uses the batched-MLP model) when fewer than one expert lies
    between before and after, or when the implementation rejects the synthetic routing."""
    calls = []

    def fn(h, i, w):
        calls.append(int(torch.unique(i).numel()))
        return h

    assert gate.measure_module_expert_ms(fn, 16, 8, 2, 4, before=2.4, after=2.0, dtype=torch.float32,
                                         device="cpu") is None and not calls
    gate.measure_module_expert_ms(fn, 16, 8, 2, 4, before=8.0, after=2.0, dtype=torch.float32, device="cpu")
    assert set(calls) == {8, 2}  # the synthetic routing touches exactly E experts

    def bad(h, i, w):
        raise RuntimeError("meta weights")

    assert gate.measure_module_expert_ms(bad, 16, 8, 2, 4, before=8.0, after=2.0, dtype=torch.float32,
                                         device="cpu") is None


def test_module_expert_timing_is_the_median_difference_and_none_when_not_positive(monkeypatch):
    """Hand-worked with a fake timer (ms per call by the number of distinct experts the call touches): 8 experts
    1.0 / 1.3 / 1.6 ms, 2 experts 0.4 ms: differences 0.6, 0.9, 1.2, median 0.9 over 6 experts -> 0.15 ms per expert.
    A burst that makes the larger call faster in 2 of 3 pairs (median difference -0.1): None (the caller's fallback),
    not "an expert costs 0 ms"."""
    def fake(times):
        calls = iter(times)
        return lambda fn, device, reps=25, budget_s=None: next(calls)

    fn = lambda h, i, w: h  # noqa: E731
    monkeypatch.setattr(gate, "_time_ms", fake([1.0, 0.4, 1.3, 0.4, 1.6, 0.4]))
    got = gate.measure_module_expert_ms(fn, 16, 8, 2, 4, before=8.0, after=2.0, dtype=torch.float32, device="cpu")
    assert got == pytest.approx(0.9 / 6)
    monkeypatch.setattr(gate, "_time_ms", fake([1.0, 1.1, 1.0, 1.1, 1.5, 0.4]))
    assert gate.measure_module_expert_ms(fn, 16, 8, 2, 4, before=8.0, after=2.0, dtype=torch.float32,
                                         device="cpu") is None


def _timed_measure(monkeypatch, costs, experts, saved=(13.0, 6.0)):
    """``gate.measure`` on a real plan (fixture-like shape N 32, k 4) with the timings replaced by sequences: routing
    costs (ms) and the layer's own saving per expert (ms), one value per timing; the experts before / after fixed.
    Returns ``(decision, costs timed, expert figures timed)``."""
    from lynx_hf.config import LynxConfig
    from lynx_hf.core import MoELayer, make_plan

    gate._CACHE.clear()
    cost_seq, expert_seq, seen = iter(costs), iter(experts), {"cost": 0, "expert": 0}

    def routing(plan, num_tokens, dtype=torch.float32, telemetry=True, draws=gate.DRAWS, mixed=False, route_fn=None):
        seen["cost"] += 1
        return next(cost_seq), saved[0], saved[1]

    def own(*args):
        seen["expert"] += 1
        return next(expert_seq)

    monkeypatch.setattr(gate, "measure_routing", routing)
    monkeypatch.setattr(gate, "measure_module_expert_ms", own)
    plan = make_plan(LynxConfig(policy="lynx", gate="always"), MoELayer(32, 4, torch.device("cpu")))
    shape = gate.LayerShape(32, 4, 64, 32)
    d = gate.measure(plan, shape, 16, expert_fn=lambda h, i, w: h)
    gate._CACHE.clear()
    return d, seen["cost"], seen["expert"]


def test_measure_confirms_the_figure_that_decided_and_keeps_the_smallest(monkeypatch):
    """Hand-worked, 7 experts saved, margin 1.25:
    - an expert timing spike (0.4 ms, then 0.004): on (2.8 > 1.25 x 0.087) -> the saving is timed again: 0.028 <=
      0.109 -> off (flipped) -> the cost is timed again (0.08): still off, stop. Off, 2 costs and 2 expert timings;
    - a cost spike (23.9 ms, then 0.07) with 0.2 ms per expert (saving 1.4): off -> cost again -> on (flipped) ->
      saving again (0.25: the smaller 0.2 is kept) -> still on, stop;
    - a clear decision is confirmed once: on at 0.2 ms per expert and cost 0.07 -> one more expert timing, same."""
    d, costs, experts = _timed_measure(monkeypatch, [0.087, 0.08], [0.4, 0.004])
    assert not d.on and (costs, experts) == (2, 2)
    assert d.expert_ms == 0.004 and d.cost_ms == 0.08
    d, costs, experts = _timed_measure(monkeypatch, [23.9, 0.07], [0.2, 0.25])
    assert d.on and (costs, experts) == (2, 2) and d.cost_ms == 0.07 and d.expert_ms == 0.2
    d, costs, experts = _timed_measure(monkeypatch, [0.07], [0.2, 0.2])
    assert d.on and (costs, experts) == (1, 2)
    d, costs, experts = _timed_measure(monkeypatch, [0.07], [], saved=(4.0, 4.0))  # nothing saved: no timing
    assert not d.on and (costs, experts) == (1, 0)


def test_thread_count_settable_sees_vllms_replacement(monkeypatch):
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a warning-only function: the gate then times on the
    worker's threads instead of calling it (it would log twice per measured shape and change nothing)."""
    assert gate.thread_count_settable()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert not gate.thread_count_settable()


def test_measure_does_not_time_a_long_figure_again(monkeypatch):
    """A figure whose timing took ``CONFIRM_MAX_S`` or more (large experts) is kept as measured: the expert spike
    case above stays on, timed once."""
    monkeypatch.setattr(gate, "CONFIRM_MAX_S", 0.0)
    d, costs, experts = _timed_measure(monkeypatch, [0.087], [0.4])
    assert d.on and (costs, experts) == (1, 1)


# -- the measurement leaves no trace (docs/cases.md C38) ---------------------------------------------------------
def _user_state(model):
    return (torch.get_rng_state(), torch.get_num_threads(), torch.is_grad_enabled(), model.training,
            [m.training for m in model.modules()])


def test_C38_patch_time_measurement_leaves_rng_threads_grad_and_training_alone():
    """CASES C38: the gate's patch-time measurement (gate="auto": routing cost, experts' own timing, the batched-MLP
    fallback) consumes no global RNG draw and leaves the thread count, grad mode and training flags as they were;
    so a sampled generate seeded before patch(gate="auto") (then policy none) gives the unpatched model's tokens.
    Before, gate.measure_expert_ms drew its weights from the global generator."""
    model = fam.build("llama4")  # experts outside transformers' interface: the batched-MLP timing always runs
    ids, mask = fam.prompts(4, 5)

    def sample():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0,
                              temperature=1.5, pad_token_id=0)

    torch.manual_seed(1234)
    want = sample()
    gate._CACHE.clear()
    gate._EXPERT_CACHE.clear()
    torch.manual_seed(1234)
    torch.set_grad_enabled(True)  # not the measurement's no_grad
    before = _user_state(model)
    lynx_hf.patch(model, policy="lynx", gate="auto")
    after = _user_state(model)
    assert any(g.decisions for g in (gate.of(b.plan) for b in lynx_hf.patcher._state(model).blocks))  # it measured
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    lynx_hf.patch(model, policy="none")  # the model's own routing: only the RNG stream could make a difference
    got = sample()
    lynx_hf.unpatch(model)
    assert torch.equal(got, want)
    # each measurement on its own, the fallback expert timing included
    state = torch.get_rng_state()
    gate.measure_expert_ms(16, 32, torch.float32, "cpu", 1, 8)
    with gate.untouched("cpu"):
        torch.randn(3)
        torch.set_grad_enabled(False)
    assert torch.equal(torch.get_rng_state(), state) and torch.is_grad_enabled()


def test_C41_models_of_one_shape_with_different_experts_implementations_do_not_share_figures(monkeypatch):
    """CASES C41: the gate's decision cache key holds what changes the cost (lynx_hf.block.BlockRouting.gate_key:
    the experts implementation, module class, weight storage, offload; the thread count), so a same-shape model on
    the ``eager`` experts gets figures measured on its own experts; an identical model reuses them. Before, the
    second model reused the first's figures bit for bit (decisions flipped at T = 2, 4 on a real pair)."""
    monkeypatch.setattr(gate, "TIME_BUDGET_S", 0.002)  # short timings: only which figures are measured is asserted
    timed = []
    real = gate.measure_routing

    def spy(plan, num_tokens, *args, **kwargs):
        timed.append(num_tokens)
        return real(plan, num_tokens, *args, **kwargs)

    monkeypatch.setattr(gate, "measure_routing", spy)
    gate._CACHE.clear()
    models = {impl: fam.build("qwen2_moe") for impl in ("grouped_mm", "eager", "grouped_mm again")}
    models["eager"].set_experts_implementation("eager")
    counts, keys = {}, {}
    for impl, model in models.items():
        before = len(timed)
        lynx_hf.patch(model, policy="lynx", gate="auto")
        counts[impl] = len(timed) - before
    assert counts["grouped_mm"] > 0 and counts["eager"] > 0  # measured again
    assert counts["grouped_mm again"] == 0  # all equal: shared
    for impl, model in models.items():
        blocks = lynx_hf.patcher._state(model).blocks
        keys[impl] = blocks[0].gate_key()
        assert gate.of(blocks[0].plan).cost_key == keys[impl]
    assert keys["grouped_mm"][1] == "grouped_mm" and keys["eager"][1] == "eager"
    assert keys["grouped_mm again"] == keys["grouped_mm"]
    before, threads = len(timed), torch.get_num_threads()
    planned = gate.of(lynx_hf.patcher._state(models["grouped_mm"]).blocks[0].plan)
    planned.decisions.clear()
    torch.set_num_threads(threads + 1)
    try:  # another thread count: measured again
        planned.decision(8)
    finally:
        torch.set_num_threads(threads)
    assert len(timed) > before
    for model in models.values():
        lynx_hf.unpatch(model)
    gate._CACHE.clear()



# -- issue 38: the margin, the buckets, the confirm loop's guards, decisions asked while measuring is impossible ----
def test_measure_decides_with_the_margin_hand_worked(monkeypatch):
    """7 experts saved (13 -> 6), cost 0.1 ms: at 0.017 ms per expert the saving is 0.119 ms, above the cost but below
    MARGIN (1.25) x 0.1 = 0.125: off; at 0.019 ms (0.133 ms) on. A gate deciding at 1x would run the policy at
    0.017."""
    assert gate.MARGIN == 1.25
    d, _, _ = _timed_measure(monkeypatch, [0.1, 0.1], [0.017, 0.017])
    assert not d.on and d.saving_ms == pytest.approx(0.119) and d.saving_ms > d.cost_ms
    d, _, _ = _timed_measure(monkeypatch, [0.1, 0.1], [0.019, 0.019])
    assert d.on and d.saving_ms == pytest.approx(0.133)


def test_buckets_are_measured_and_kept_apart(monkeypatch):
    """Each bucket is measured on its own and cached under its own key: fake timings per step size (cost 1 ms at T =
    2, 0.01 ms at T = 16; 0.1 ms per expert, 7 saved) give off at 2 and on at 16, also when asked again (cached),
    and a step of 9 tokens uses bucket 16."""
    from lynx_hf.config import LynxConfig
    from lynx_hf.core import MoELayer, make_plan

    gate._CACHE.clear()
    timed = []

    def routing(plan, num_tokens, dtype=torch.float32, telemetry=True, draws=gate.DRAWS, mixed=False, route_fn=None):
        timed.append(num_tokens)
        return (1.0 if num_tokens <= 2 else 0.01), 13.0, 6.0

    monkeypatch.setattr(gate, "measure_routing", routing)
    monkeypatch.setattr(gate, "measure_module_expert_ms", lambda *a: 0.1)
    plan = make_plan(LynxConfig(policy="lynx", gate="always"), MoELayer(32, 4, torch.device("cpu")))
    shape = gate.LayerShape(32, 4, 64, 32)
    g = gate.PlanGate(shape, plan=plan, expert_fn=lambda h, i, w: h)
    assert not g.decision(2).on and g.decision(16).on
    assert not g.decision(2).on and g.decision(9).on  # from the gate's decisions: nothing timed again
    assert gate.measure(plan, shape, 2, expert_fn=lambda h, i, w: h).cost_ms == 1.0  # the shared cache, per bucket
    assert gate.measure(plan, shape, 16, expert_fn=lambda h, i, w: h).cost_ms == 0.01
    assert sorted(set(timed)) == [2, 16]
    gate._CACHE.clear()


def test_off_decision_with_a_long_cost_timing_is_not_timed_again(monkeypatch):
    """The confirm loop's guard on the off branch: a cost whose timing took CONFIRM_MAX_S or more is kept as measured
    (0.5 ms cost, 7 x 0.01 saved: off, one cost timing), where a short one is timed again (two)."""
    monkeypatch.setattr(gate, "CONFIRM_MAX_S", 0.0)
    d, costs, experts = _timed_measure(monkeypatch, [0.5], [0.01])
    assert not d.on and (costs, experts) == (1, 1)
    monkeypatch.setattr(gate, "CONFIRM_MAX_S", 1e9)
    d, costs, experts = _timed_measure(monkeypatch, [0.5, 0.5], [0.01])
    assert not d.on and (costs, experts) == (2, 1)


def test_a_decision_asked_while_measuring_is_impossible_is_not_kept(monkeypatch):
    """Asked under tracing (torch.compile) or CUDA-graph capture, the gate answers on without measuring; that answer
    is not kept: the next eager ask measures the bucket (here: off)."""
    from lynx_hf.config import LynxConfig
    from lynx_hf.core import MoELayer, make_plan

    gate._CACHE.clear()
    monkeypatch.setattr(gate, "measure_routing", lambda *a, **k: (1.0, 13.0, 6.0))
    monkeypatch.setattr(gate, "measure_module_expert_ms", lambda *a: 0.001)
    plan = make_plan(LynxConfig(policy="lynx", gate="always"), MoELayer(32, 4, torch.device("cpu")))
    g = gate.PlanGate(gate.LayerShape(32, 4, 64, 32), plan=plan, expert_fn=lambda h, i, w: h)
    monkeypatch.setattr(gate, "cannot_measure", lambda device: "torch.compile tracing")
    d = g.decision(8)
    assert d.on and d.reason.startswith("not measured") and 8 not in g.decisions
    monkeypatch.undo()  # measuring is possible again (the fakes go too: set them again)
    monkeypatch.setattr(gate, "measure_routing", lambda *a, **k: (1.0, 13.0, 6.0))
    monkeypatch.setattr(gate, "measure_module_expert_ms", lambda *a: 0.001)
    assert not g.decision(8).on and not g.decisions[8].on
    gate._CACHE.clear()


def test_generate_runs_the_real_measurement_end_to_end(tmp_path, capsys):
    """Issue 38: the CLI entry point with the real measurement (no fixed decisions): `lynx-hf generate --gate auto
    --stats-json` measures every layer at the step size it decodes and reports finite figures, decided with the
    margin."""
    import json

    from lynx_hf import cli

    fam.save_checkpoint("qwen2_moe", tmp_path / "ckpt")
    (tmp_path / "prompts.txt").write_text("w5 w6 w7\nw9 w3 w4\n")
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--prompts", str(tmp_path / "prompts.txt"), "--batch-size",
            "4", "--max-new-tokens", "3", "--quiet", "--gate", "auto", "--stats-json", str(tmp_path / "stats.json")]
    assert cli.main(argv) == 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    layers = stats.get("per_layer") or stats["lynx"]["per_layer"]
    figures = [layer["gate"]["by_tokens"]["4"] for layer in layers]
    assert figures and all(f["cost_ms"] is not None and f["cost_ms"] >= 0 and f["expert_ms"] is not None
                           for f in figures)
    assert all(f["on"] == (f["saving_ms"] > gate.MARGIN * f["cost_ms"]) for f in figures)
