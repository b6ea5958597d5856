"""The cost gate (``LynxConfig.gate``, ``lynx_hf.gate``): the decision is a pure function of its figures (hand-worked
cases); decisions are data (keyed by what the step runs, stored, read by every later process); a gated-off layer is
bit-identical to policy none; a gate that is on changes nothing against ``gate="always"``; the gate adds no host sync;
measuring touches no global state. No timed assertion: where an outcome is asserted the measurement is replaced by
fixed decisions (``fixed_gate``) or a decision table."""

import dataclasses
import json
import math
import subprocess
import sys
import threading

import pytest
import torch
from transformers import StaticCache

import lynx_hf
import lynx_hf.gate.stage as gs
from helpers import families as fam
from helpers.sync_detector import SyncDetector
from lynx_hf import gate
from lynx_hf.gate import measure as gm
from lynx_hf.kernels.routing_torch import strict_sync_free

MARGIN = gate.TUNING.margin


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


def test_tuning_is_one_frozen_value_and_its_digest_moves_with_any_constant():
    with pytest.raises(AttributeError):
        gate.TUNING.margin = 2.0  # frozen
    assert gate.TUNING.margin == 1.25 and gate.BUCKETS == gate.TUNING.buckets
    other = gate.Tuning(margin=1.5)
    assert other.digest() != gate.TUNING.digest() and gate.Tuning().digest() == gate.TUNING.digest()


def test_rule_hand_worked():
    """The closed-form rule (docs/policies.md): N 8, k 2, T 4 on CPU: before = 8 (1 - (6/8)^4) = 5.46875; after =
    max(2, 8 (1 - (7/8)^4)) = 3.3105...; saved 2.1582; one expert 3 x 64 x 32 x 4 bytes / 20 GB/s = 0.0012288 ms;
    saving 0.002652 ms; cost 0.05 + 4 x 8 x 2e-6 = 0.050064 ms: off. 4096 tokens of N 8: every expert either way."""
    d = gate.by_rule(8, 2, 64, 32, 4, 4, "cpu")
    assert d.experts_before == pytest.approx(5.46875) and d.experts_after == pytest.approx(8 * (1 - (7 / 8) ** 4))
    assert d.expert_ms == pytest.approx(3 * 64 * 32 * 4 / 20e9 * 1e3) and d.cost_ms == pytest.approx(0.050064)
    assert not d.on and d.reason.startswith("rule")
    big = gate.by_rule(64, 8, 3584, 2560, 2, 16, "cuda")  # Qwen2-57B, 16 tokens on a GPU: MBs per expert saved
    assert big.on and big.experts_before > big.experts_after
    assert gate.by_rule(8, 2, 64, 32, 4, 4096, "cpu").experts_saved == pytest.approx(0.0, abs=1e-9)


# -- PlanGate: host-side lookups, counters, summary -------------------------------------------------------------
def _decision(on: bool) -> gate.GateDecision:
    d = gate.decide(1.0, 10.0 if on else 0.0, 0.5)
    return gate.GateDecision(d.on, d.cost_ms, d.saving_ms, d.experts_saved, d.expert_ms, experts_before=20.0,
                             experts_after=10.0 if on else 20.0, reason=d.reason)


def _plan(num_experts=32, top_k=4):
    from lynx_hf.core import MoELayer, make_plan

    return make_plan(lynx_hf.LynxConfig(policy="lynx", gate="always"), MoELayer(num_experts, top_k, "cpu"))


def test_plan_gate_lookup_counts_and_summary():
    g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), plan=_plan(8, 2),
                      decisions={b: _decision(b >= 16) for b in gate.BUCKETS})
    assert not g.on(8) and g.on(16) and g.on(9)  # 9 -> bucket 16
    g.skip(8)
    g.skip(8)
    s = g.summary()
    assert s["steps_skipped"] == 2 and set(s["by_tokens"]) == {8, 9, 16}
    assert s["by_tokens"][8]["on"] is False and s["by_tokens"][8]["steps_skipped"] == 2
    assert s["by_tokens"][16]["saving_ms"] == 5.0 and s["by_tokens"][16]["cost_ms"] == 1.0
    g.reset()
    assert g.summary() == {"gate": "auto", "source": "", "by_tokens": {}, "steps_skipped": 0}


def test_a_step_above_the_largest_bucket_is_decided_by_the_rule_not_the_largest_bucket():
    """Before, an 8k-token step used the 512-token decision. Here 512 is on, but 4096 tokens of N 8 touch every
    expert with or without the policy (the rule: nothing saved): off, the reason says why."""
    g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), plan=_plan(8, 2), decisions={b: _decision(True) for b in
                                                                                  gate.BUCKETS})
    assert g.on(512)
    d = g.decision(4096)
    assert not d.on and "above the largest measured step, 512 tokens" in d.reason and d.experts_saved < 1e-6


def test_a_mixed_step_is_decided_on_its_decode_rows():
    """Cost at the step's 256 tokens (the policy runs over every row), saving at its 4 decode rows. Hand-worked:
    bucket 256 costs 1.0 ms (saves 50 x 0.1 = 5 ms: on), bucket 4 saves 2 experts x 0.1 ms = 0.2 ms: 0.2 <= 1.25 x
    1.0: off. All 256 decoding: on."""
    d256 = gate.decide(1.0, 50.0, 0.1, margin=MARGIN)
    d4 = gate.decide(0.01, 2.0, 0.1, margin=MARGIN)
    g = gate.PlanGate(gate.LayerShape(64, 4, 16, 8), plan=_plan(64, 4),
                      decisions={**{b: d256 for b in gate.BUCKETS}, 4: d4})
    assert g.on(256) and g.on(4)
    mixed = g.decision(256, decode_rows=4)
    assert not mixed.on and mixed.cost_ms == 1.0 and mixed.saving_ms == pytest.approx(0.2)
    assert "mixed step" in mixed.reason and not g.on(256, 4) and g.on(256, 256)


def test_a_step_the_host_knows_has_no_decode_rows_returns_at_once():
    """``Step.decode_rows == 0`` (a continuous-batching step of prefill chunks only, known from the scheduler): the
    plan returns the model's own routing objects and records nothing, where before it built masks and ran the policy
    (telemetry counted the prefill rows)."""
    from lynx_hf.core import MIXED, Step, StepInputs, WeightRule
    from lynx_hf.telemetry import BlockTelemetry

    plan = _plan(8, 2)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    weights, idx = logits.softmax(-1).topk(2, dim=-1)
    none = torch.zeros(6, dtype=torch.bool)
    telemetry = BlockTelemetry()
    inputs = StepInputs(Step(MIXED, decode=none, live=~none, decode_rows=0), logits, weights, idx,
                        WeightRule("softmax_all"), True, None, telemetry)
    out = plan.run(inputs)
    assert out.idx is idx and out.weights is weights and telemetry.acc is None
    plan.run(inputs._replace(step=Step(MIXED, decode=none, live=~none)))  # unknown to the host: the masked path
    assert telemetry.acc is not None


def test_continuous_batching_steps_carry_the_hosts_decode_row_count():
    from lynx_hf.detection import _continuous_batching

    class State:
        def __init__(self, offset, prompt):
            self.position_offset, self.initial_tokens = offset, [0] * prompt

    class Future:
        def __init__(self, q, offset, prompt):
            self.query_length, self.state = q, State(offset, prompt)

    # a 3-token prefill chunk of a 5-token prompt, then two decoding requests (1 token each), 1 padding token
    requests = [Future(3, 3, 5), Future(1, 8, 5), Future(1, 9, 6)]
    cu_q = torch.tensor([0, 3, 4, 5])
    step = _continuous_batching({"cu_seq_lens_q": cu_q}, 6, torch.device("cpu"), 1, requests)
    assert step.kind == "mixed" and step.decode_rows == 2 and step.decode.tolist() == [False] * 3 + [True] * 2 + [False]


def test_off_line():
    entry = {"on": False, "cost_ms": 0.05, "saving_ms": 0.02, "steps_skipped": 3}
    layers = [{"gate": {"by_tokens": {16: entry}}}, {"gate": {"by_tokens": {16: {**entry, "on": True}}}}]
    assert gate.off_line(layers) == ("LYNX off on 1/2 layers at 16 tokens per step: expected saving 0.02 ms <= cost "
                                     "0.05 ms per layer-step (gate='always' or LYNX_HF_GATE=always forces it on)")
    assert gate.off_line([{"gate": {"by_tokens": {16: {**entry, "on": True}}}}]) is None
    assert gate.off_line([{"gate": {"gate": "always", "by_tokens": {}}}]) is None


# -- LynxConfig.gate / gate_table ---------------------------------------------------------------------------------
def test_config_gate_default_from_environment(monkeypatch, tmp_path):
    """The default of LynxConfig.gate is a plain value ("auto"); LYNX_HF_GATE is read by the entry points that build a
    config from options not naming ``gate`` (LynxConfig.from_environment): patch without a LynxConfig, from_options
    (the CLI, lm-eval's model_args, the vLLM plugin), from_file. A LynxConfig value and an explicit gate win; a bad
    value is refused naming the variable, by those entry points only."""
    monkeypatch.delenv(gate.ENV, raising=False)
    assert lynx_hf.LynxConfig().gate == "auto" and lynx_hf.LynxConfig.from_environment() == lynx_hf.LynxConfig()
    monkeypatch.setenv(gate.ENV, "always")
    assert lynx_hf.LynxConfig().gate == "auto"  # a plain value: constructing a config reads no environment
    assert dataclasses.replace(lynx_hf.LynxConfig(), policy="oea").gate == "auto"
    assert lynx_hf.LynxConfig.from_environment() == lynx_hf.LynxConfig(gate="always")
    assert lynx_hf.LynxConfig.from_options({"policy": "oea"}).gate == "always"
    assert lynx_hf.LynxConfig.from_options({"gate": "auto"}).gate == "auto"  # explicit wins
    (tmp_path / "c.json").write_text('{"policy": "oea"}')
    assert lynx_hf.LynxConfig.from_file(tmp_path / "c.json").gate == "always"
    assert lynx_hf.LynxConfig.from_dict({"policy": "oea"}).gate == "auto"  # from_dict: the defaults, no environment
    model = fam.build("qwen2_moe")
    for config, overrides, want in ((None, {}, "always"), (None, {"policy": "oea"}, "always"),
                                    ({"policy": "oea"}, {}, "always"), (None, {"gate": "auto"}, "auto"),
                                    (lynx_hf.LynxConfig(), {}, "auto"), (tmp_path / "c.json", {}, "always")):
        lynx_hf.patch(model, config, **overrides)
        assert lynx_hf.config_of(model).gate == want, (config, overrides)
        lynx_hf.unpatch(model)
    monkeypatch.setenv(gate.ENV, "sometimes")
    lynx_hf.LynxConfig()  # nothing reads it here
    for make in (lynx_hf.LynxConfig.from_environment, lambda: lynx_hf.LynxConfig.from_options({}),
                 lambda: lynx_hf.patch(model)):
        with pytest.raises(lynx_hf.LynxConfigError, match=f"gate.*{gate.ENV}"):
            make()
    assert not lynx_hf.is_patched(model)
    with pytest.raises(lynx_hf.LynxConfigError, match="gate"):
        lynx_hf.LynxConfig(gate="never", policy="lynx")


def test_patch_rejects_a_bad_gate_and_a_bad_table_before_changing_anything(tmp_path):
    model = fam.build("qwen2_moe")
    with pytest.raises(lynx_hf.LynxConfigError, match="gate"):
        lynx_hf.patch(model, gate="off")
    with pytest.raises(lynx_hf.LynxConfigError, match="gate_table"):
        lynx_hf.LynxConfig(gate_table=3)
    with pytest.raises(lynx_hf.LynxConfigError, match="gate_table.*No such file"):
        lynx_hf.patch(model, gate_table=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(lynx_hf.LynxConfigError, match="not a lynx_hf gate decision table"):
        lynx_hf.patch(model, gate_table=tmp_path / "bad.json")
    assert not lynx_hf.is_patched(model)


# -- the gate in a model ------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_store(fresh_gate_store):
    return fresh_gate_store


@pytest.fixture
def fixed_gate(monkeypatch, fresh_store):
    """Replace the measurement by fixed decisions: ``fixed_gate(on)`` with ``on`` a bool or a callable of the bucket.
    Returns the list of gates measured."""
    calls = []

    def install(on):
        def measure_layer(planned, expert_times, tuning=gate.TUNING):
            calls.append(planned)
            return {b: _decision(on(b) if callable(on) else on) for b in tuning.buckets}

        monkeypatch.setattr(gs, "measure_layer", measure_layer)
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
        assert gate.of(block.plan) is not None and lynx_hf.facts.layer_shape(block).hidden is not None
        out = _generate(model, ids, mask)
        summary = lynx_hf.stats(model).summary()
        report = str(lynx_hf.stats(model))   # print(lynx_hf.stats(model)): the short report
    assert len(calls) == 1  # measured once (here: the fixed decisions) for every layer of the one key
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))
    assert summary["gate_steps_skipped"] == 4 * summary["num_moe_layers"] and summary["decode_steps"] == 0
    layer = summary["per_layer"][0]["gate"]
    assert layer["by_tokens"][8]["on"] is False and layer["by_tokens"][8]["steps_skipped"] == 4
    assert layer["source"].startswith("measured")
    lines = report.splitlines()
    assert f"kept the model's own routing on {4 * summary['num_moe_layers']} layer-steps" in lines[0]
    assert len(lines) == 2 + 1 + summary["num_moe_layers"]   # head, column names, one per layer, mean
    assert all("gate off (4 steps" in line for line in lines[2:-1]) and lines[-1].split() == ["mean", "-", "-", "-", "-"]


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
        report = str(lynx_hf.stats(model))
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))
    assert stats["unique_experts_after"] == ref_stats["unique_experts_after"] < ref_stats["unique_experts_before"]
    assert stats["gate_steps_skipped"] == 0 and stats["per_layer"][0]["gate"]["by_tokens"][8]["on"] is True
    assert ref_stats["per_layer"][0]["gate"]["gate"] == "always"
    mean = report.splitlines()[-1].split()   # the report's means are the summary's, to the printed digits
    assert mean[:3] == ["mean", f"{stats['unique_experts_before']:.2f}", f"{stats['unique_experts_after']:.2f}"]
    assert "layer-steps" not in report.splitlines()[0] and f"{stats['decode_steps']} decode steps" in report


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
    assert "runs the policy at decode step sizes 16 and keeps the model's own routing" in note   # where it runs, first
    assert "runs the policy at decode step sizes" not in gate.patch_note([planned({4: d(False, 2.0)})])   # on nowhere
    assert gate.patch_note(gates[1:]) is None and gate.patch_note([planned({}), None]) is None


def test_patch_note_warns_once_across_a_reconfiguration_and_back(monkeypatch, fresh_store):
    """``lynx-hf generate`` decodes its reference under ``patched(model, policy="none")`` and returns to the user's
    configuration: the gate's patch-time note is warned at patch only, not again on the way back."""
    import warnings

    off = gate.GateDecision(False, 1.0, 0.5, 2.0, 0.1, reason="off")  # 2 experts saved, below the cost: a loss
    monkeypatch.setattr(gs, "measure_layer", lambda planned, expert_times, tuning=gate.TUNING:
                        {b: off for b in tuning.buckets})
    model = fam.build("qwen2_moe")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lynx_hf.patch(model, policy="lynx", gate="auto")
        with lynx_hf.patched(model, policy="none"):
            pass
    lynx_hf.unpatch(model)
    notes = [w for w in seen if "the cost gate" in str(w.message)]
    assert len(notes) == 1


# -- measurement ---------------------------------------------------------------------------------------------------
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
        return lambda fn, device, budget_s, reps=25, flush_l2=False: next(calls)

    fn = lambda h, i, w: h  # noqa: E731
    monkeypatch.setattr(gm, "_time_ms", fake([1.0, 0.4, 1.3, 0.4, 1.6, 0.4]))
    got = gate.measure_module_expert_ms(fn, 16, 8, 2, 4, before=8.0, after=2.0, dtype=torch.float32, device="cpu")
    assert got == pytest.approx(0.9 / 6)
    monkeypatch.setattr(gm, "_time_ms", fake([1.0, 1.1, 1.0, 1.1, 1.5, 0.4]))
    assert gate.measure_module_expert_ms(fn, 16, 8, 2, 4, before=8.0, after=2.0, dtype=torch.float32,
                                         device="cpu") is None


def _timed_measure(monkeypatch, costs, experts, saved=(13.0, 6.0), tuning=gate.TUNING, expert_fn=True):
    """``measure_bucket`` of a real plan (fixture-like shape N 32, k 4, H 64, I 32) at 16 tokens with the timings
    replaced by sequences: routing costs (ms) and the saving per expert (ms), one value per timing; the experts before
    / after fixed. Returns ``(decision, costs timed, expert figures timed)``."""
    cost_seq, expert_seq, seen = iter(costs), iter(experts), {"cost": 0, "expert": 0}

    def routing(*args, **kwargs):
        seen["cost"] += 1
        return next(cost_seq), saved[0], saved[1]

    def own(*args, **kwargs):
        seen["expert"] += 1
        return next(expert_seq)

    monkeypatch.setattr(gm, "measure_routing", routing)
    monkeypatch.setattr(gm, "measure_module_expert_ms", own)
    monkeypatch.setattr(gm, "measure_expert_ms", own)
    planned = gate.PlanGate(gate.LayerShape(32, 4, 64, 32), plan=_plan(), expert_fn=(lambda h, i, w: h)
                            if expert_fn else None)
    d = gm.measure_bucket(planned, 16, {}, tuning)
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


def test_measure_decides_with_the_margin_hand_worked(monkeypatch):
    """7 experts saved (13 -> 6), cost 0.1 ms: at 0.017 ms per expert the saving is 0.119 ms, above the cost but below
    the margin (1.25) x 0.1 = 0.125: off; at 0.019 ms (0.133 ms) on. A gate deciding at 1x would run the policy at
    0.017."""
    d, _, _ = _timed_measure(monkeypatch, [0.1, 0.1], [0.017, 0.017])
    assert not d.on and d.saving_ms == pytest.approx(0.119) and d.saving_ms > d.cost_ms
    d, _, _ = _timed_measure(monkeypatch, [0.1, 0.1], [0.019, 0.019])
    assert d.on and d.saving_ms == pytest.approx(0.133)


def test_long_figures_are_not_timed_again(monkeypatch):
    """A figure whose timing took ``confirm_max_s`` or more is kept as measured (the expert spike case above stays on,
    timed once; an off decision keeps its one cost timing), where a short one is timed again."""
    quick = gate.Tuning(confirm_max_s=0.0)
    d, costs, experts = _timed_measure(monkeypatch, [0.087], [0.4], tuning=quick)
    assert d.on and (costs, experts) == (1, 1)
    d, costs, experts = _timed_measure(monkeypatch, [0.5], [0.01], tuning=quick)
    assert not d.on and (costs, experts) == (1, 1)
    d, costs, experts = _timed_measure(monkeypatch, [0.5, 0.5], [0.01], tuning=gate.Tuning(confirm_max_s=1e9))
    assert not d.on and (costs, experts) == (2, 1)


def test_the_batched_mlp_expert_timing_is_kept_per_thread_count(monkeypatch):
    """Issue 47: the batched-MLP expert timing (a layer whose experts do not use transformers' interface, e.g.
    Llama-4's, ``expert_fn`` None) is reused from the owner's cache at the same thread count and timed again at
    another: a figure timed on 1 thread is not what 2 threads cost. Before, dropping the thread count from that key
    passed every test."""
    timings = []

    def fake_mlp(hidden, intermediate, dtype, device, tokens, num_experts, tuning=gate.TUNING):
        timings.append(torch.get_num_threads())
        return 0.5

    monkeypatch.setattr(gm, "measure_expert_ms", fake_mlp)
    # off (7 x 0.5 ms <= 1.25 x 10 ms): the confirm loop times the cost again, never the expert figure
    monkeypatch.setattr(gm, "measure_routing", lambda *a, **k: (10.0, 13.0, 6.0))
    planned = gate.PlanGate(gate.LayerShape(32, 4, 64, 32), plan=_plan())
    owned, threads = {}, torch.get_num_threads()
    try:
        for n in (1, 1, 2, 2):
            torch.set_num_threads(n)
            gm.measure_bucket(planned, 16, owned)
    finally:
        torch.set_num_threads(threads)
    assert timings == [1, 2] and sorted(key[-1] for key in owned) == [1, 2]


def test_measurement_runs_on_a_real_shape(fresh_store):
    """The real measurement once, on the CPU: finite, non-negative numbers, and the estimate from synthetic logits
    (no assertion on which way it decides: that depends on this machine)."""
    model = fam.build("qwen2_moe")
    with lynx_hf.patched(model, policy="lynx", gate="auto"):
        block = lynx_hf.patcher._state(model).blocks[0]
        planned = gate.of(block.plan)
        d = planned.decision(8)
    assert d.cost_ms >= 0 and d.expert_ms >= 0 and math.isfinite(d.saving_ms)
    assert block.top_k <= d.experts_after <= d.experts_before <= block.num_experts
    assert d.on == (d.saving_ms > MARGIN * d.cost_ms)  # decided with the margin
    assert planned.route_fn is not None  # the HF path times the router hook's whole work
    assert planned.source.startswith("measured") and sorted(planned.decisions) == list(gate.BUCKETS)


def test_where_measuring_is_impossible_the_rule_decides_and_nothing_is_stored(monkeypatch, fresh_store):
    monkeypatch.setattr(gs, "cannot_measure", lambda device: "torch.compile tracing")
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    planned = gate.of(lynx_hf.patcher._state(model).blocks[0].plan)
    shape = planned.shape
    want = gate.by_rule(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, 4, 16, "cpu",
                        why="torch.compile tracing")
    assert planned.source == "rule (torch.compile tracing)" and planned.decision(16) == want
    assert not (fresh_store / "gate").exists()  # a rule is not a measurement: nothing cached
    lynx_hf.unpatch(model)


# -- the measurement leaves no trace (docs/cases.md C38; issue 43: threads) --------------------------------------
def _user_state(model):
    return (torch.get_rng_state(), torch.get_num_threads(), torch.is_grad_enabled(), model.training,
            [m.training for m in model.modules()])


def test_C38_patch_time_measurement_leaves_rng_threads_grad_and_training_alone(fresh_store):
    """CASES C38: the gate's measurement (gate="auto": routing cost, experts' own timing, the batched-MLP fallback)
    consumes no global RNG draw and leaves the thread count, grad mode and training flags as they were; so a sampled
    generate seeded before patch(gate="auto") (then policy none) gives the unpatched model's tokens."""
    model = fam.build("llama4")  # experts outside transformers' interface: the batched-MLP timing always runs
    ids, mask = fam.prompts(4, 5)

    def sample():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0,
                              temperature=1.5, pad_token_id=0)

    torch.manual_seed(1234)
    want = sample()
    torch.manual_seed(1234)
    torch.set_grad_enabled(True)  # not the measurement's no_grad
    before = _user_state(model)
    lynx_hf.patch(model, policy="lynx", gate="auto")
    after = _user_state(model)
    assert all(gate.of(b.plan).source.startswith("measured") for b in lynx_hf.patcher._state(model).blocks)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    lynx_hf.patch(model, policy="none")  # the model's own routing: only the RNG stream could make a difference
    got = sample()
    lynx_hf.unpatch(model)
    assert torch.equal(got, want)
    state = torch.get_rng_state()
    gate.measure_expert_ms(16, 32, torch.float32, "cpu", 1, 8)  # the fallback expert timing on its own
    assert torch.equal(torch.get_rng_state(), state)


def test_patching_in_one_thread_leaves_another_threads_random_stream_and_generate_alone(fresh_store):
    """Issue 43: thread A draws seeded random numbers and runs a seeded sampled ``generate`` in a loop while thread B
    patches another model with ``gate="auto"`` (measuring: an empty cache). A's draws and tokens equal a run without
    B. Before, the measurement saved and restored the process's global RNG state around itself, rewinding A's stream
    (2,954 of 4,610 values drawn twice), and set the process's thread count to 1."""
    sampler = fam.build("mixtral")
    measured = fam.build("qwen2_moe")  # built (its random init) before the threads start
    ids, mask = fam.prompts(4, 5)

    def run_a(out, stop=None):
        torch.manual_seed(7)
        rounds = 0
        while rounds < 3 or (stop is not None and not stop.is_set() and rounds < 60):
            draws = torch.rand(64)
            tokens = sampler.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=0,
                                      pad_token_id=0)
            out.append((draws, tokens))
            rounds += 1

    alone = []
    run_a(alone)
    threads = torch.get_num_threads()
    together, done = [], threading.Event()
    a = threading.Thread(target=run_a, args=(together, done))
    a.start()
    try:
        lynx_hf.patch(measured, policy="lynx", gate="auto")
        thread_count_during = torch.get_num_threads()
    finally:
        done.set()
        a.join()
    assert gate.of(lynx_hf.patcher._state(measured).blocks[0].plan).source.startswith("measured")
    lynx_hf.unpatch(measured)
    assert len(together) >= 3 and thread_count_during == threads
    for (d1, t1), (d2, t2) in zip(alone, together):
        assert torch.equal(d1, d2) and torch.equal(t1, t2)
    # the rounds beyond the solo run's 3 continue one seeded stream: replay it alone
    replay = []
    torch.manual_seed(7)
    for _ in range(len(together)):
        draws = torch.rand(64)
        replay.append((draws, sampler.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                                               top_k=0, pad_token_id=0)))
    assert all(torch.equal(d1, d2) and torch.equal(t1, t2) for (d1, t1), (d2, t2) in zip(replay, together))


def test_concurrent_patches_of_one_key_measure_once(fixed_gate):
    """Two threads patch two models of one key at once: one measurement, both models get the same decisions."""
    calls = fixed_gate(lambda b: b >= 4)
    models = [fam.build("qwen2_moe") for _ in range(2)]
    errors = []

    def patch(model):
        try:
            lynx_hf.patch(model, policy="lynx", gate="auto")
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=patch, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    a, b = (gate.of(lynx_hf.patcher._state(m).blocks[0].plan) for m in models)
    assert a.decisions == b.decisions and a.key == b.key


# -- decisions are data: the key, the tables, the cache --------------------------------------------------------
def test_C41_the_key_holds_what_the_step_runs(fixed_gate):
    """CASES C41 and issue 43: two layers share decisions only where everything the timed step depends on is equal.
    Models of one shape with the ``eager`` experts implementation, another thread count, or (DeepSeek-V3) group-limited
    instead of plain selection get keys of their own and are measured; an identical model reuses the decisions.
    Before, the group-limited DeepSeek-V3 reused the plain one's figures bit for bit (its routing costs 1.5-2x)."""
    calls = fixed_gate(True)

    def key_of(model, policy="lynx", **config):
        lynx_hf.patch(model, policy=policy, gate="auto", **config)
        planned = gate.of(lynx_hf.patcher._state(model).blocks[0].plan)
        lynx_hf.unpatch(model)
        return planned.key

    base = key_of(fam.build("qwen2_moe"))
    assert key_of(fam.build("qwen2_moe")) == base and len(calls) == 1  # identical: read, not measured
    eager = fam.build("qwen2_moe")
    eager.set_experts_implementation("eager")
    assert key_of(eager) != base
    assert key_of(fam.build("qwen2_moe"), telemetry="counts") != base
    assert key_of(fam.build("qwen2_moe"), oea_k0=2, policy="oea") != base
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert key_of(fam.build("qwen2_moe")).threads == threads + 1
    finally:
        torch.set_num_threads(threads)
    plain = key_of(fam.build("deepseek_v3", n_group=1, topk_group=1))
    grouped = key_of(fam.build("deepseek_v3"))  # 4 groups, top-2
    shape = ("num_experts", "top_k", "hidden", "intermediate", "dtype", "expert_dtype")
    assert plain != grouped and [getattr(plain, f) for f in shape] == [getattr(grouped, f) for f in shape]
    assert '"n_group": 4' in grouped.engine and '"topk_group": 2' in grouped.engine
    assert len(calls) == 7


def test_a_second_process_reads_the_first_ones_decisions(tmp_path):
    """Two processes with one per-user cache, started together, patch the same model with the default gate (real
    measurement): one measures (the other waits for the cache's lock) and both take identical decisions; a third,
    later, reads them without measuring."""
    script = tmp_path / "patch.py"
    script.write_text(
        "import json, sys, torch, lynx_hf\n"
        "sys.path.insert(0, 'tests')\n"
        "from helpers import families as fam\n"
        "from lynx_hf import gate\n"
        "torch.set_num_threads(1)\n"
        "model = fam.build('qwen2_moe')\n"
        "lynx_hf.patch(model, policy='lynx')\n"  # the default gate: auto
        "planned = gate.of(lynx_hf.patcher._state(model).blocks[0].plan)\n"
        "print(json.dumps({'source': planned.source, 'digest': planned.key.digest(),\n"
        "                  'decisions': {b: d.to_dict() for b, d in planned.decisions.items()}}))\n")
    import os

    env = {**os.environ, gate.CACHE_ENV: str(tmp_path / "cache")}
    env.pop(gate.ENV, None)
    cwd = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              cwd=cwd, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    later = subprocess.run([sys.executable, str(script)], capture_output=True, env=env, cwd=cwd, text=True,
                           timeout=600)
    assert later.returncode == 0, later.stderr
    outs.append(json.loads(later.stdout.strip().splitlines()[-1]))
    assert outs[0]["decisions"] == outs[1]["decisions"] == outs[2]["decisions"]
    assert outs[0]["digest"] == outs[1]["digest"] == outs[2]["digest"]
    sources = sorted(o["source"].split()[0] for o in outs)
    assert sources == ["cache", "cache", "measured"], sources


def test_a_user_table_is_read_first_and_is_the_decision(tmp_path, fresh_store, capsys):
    """``lynx-hf tune`` writes a checkpoint's table; ``gate_table`` makes it the decision: edited to 'off' at every
    step size, the model decodes bit-identical to policy none, without measuring (the per-user cache holds nothing
    else of it); to 'on', as ``gate="always"``."""
    from lynx_hf import cli

    fam.save_checkpoint("qwen2_moe", tmp_path / "ckpt")
    table_path = tmp_path / "table.json"
    assert cli.main(["tune", "--model", str(tmp_path / "ckpt"), "--out", str(table_path)]) == 0
    table = json.loads(table_path.read_text())
    (digest, entry), = table["entries"].items()
    assert sorted(int(b) for b in entry["decisions"]) == list(gate.BUCKETS)
    on_at = sorted(int(b) for b, d in entry["decisions"].items() if d["on"])  # what tune printed, in words
    said = f"on at {', '.join(map(str, on_at))} tokens" if on_at else "off at every step size"
    assert said in capsys.readouterr().out
    # the process's memory still holds what tune measured for this key: the table must win over it (issue 56)
    assert gate.STORE.lookup(gate.GateKey.from_dict(entry["key"])) is not None
    model = fam.build("qwen2_moe")  # the checkpoint's weights
    ids, mask = fam.prompts(8, 6)
    with lynx_hf.patched(model, policy="none"):
        ref = _generate(model, ids, mask)
    with lynx_hf.patched(model, policy="lynx", gate="always"):
        on = _generate(model, ids, mask)
    for value, want in ((False, ref), (True, on)):
        for d in entry["decisions"].values():
            d["on"] = value
        table_path.write_text(json.dumps(table))
        with lynx_hf.patched(model, policy="lynx", gate_table=str(table_path)):
            planned = gate.of(lynx_hf.patcher._state(model).blocks[0].plan)
            assert planned.source == f"table {table_path}" and planned.key.digest() == digest
            got = _generate(model, ids, mask)
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))


def test_generate_runs_the_real_measurement_end_to_end(tmp_path, capsys, fresh_store):
    """The CLI entry point with the real measurement (no fixed decisions): `lynx-hf generate --gate auto
    --stats-json` measures every layer and reports finite figures at the step size it decodes, decided with the
    margin."""
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
    assert all(f["on"] == (f["saving_ms"] > MARGIN * f["cost_ms"]) for f in figures)


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


def test_the_saving_is_timed_on_the_experts_path_the_step_size_runs(monkeypatch):
    """``expert_path="auto"`` on CUDA runs the sparse kernel from ``AUTO_KERNEL_MIN_TOKENS`` decode tokens
    (``RoutePlan.uses_kernel``): there the saving per avoided expert is timed on the kernel (``PlanGate.kernel_fn``),
    below it on the model's own experts implementation (``expert_fn``); on the H200 the two differ several-fold.
    Driven with a plan whose threshold is set by hand (the CPU plan has no kernel) and the timing stubbed."""
    from lynx_hf.core import AUTO_KERNEL_MIN_TOKENS

    timed = []
    monkeypatch.setattr(gm, "measure_routing", lambda *a, **k: (0.01, 13.0, 6.0))
    monkeypatch.setattr(gm, "measure_module_expert_ms", lambda fn, *a, **k: timed.append(fn) or 0.05)
    own, kernel = (lambda h, i, w: h), (lambda h, i, w: h)
    plan = dataclasses.replace(_plan(), expert_ops=object(), kernel_min_tokens=AUTO_KERNEL_MIN_TOKENS)
    planned = gate.PlanGate(gate.LayerShape(32, 4, 64, 32), plan=plan, expert_fn=own, kernel_fn=kernel)
    for bucket in (AUTO_KERNEL_MIN_TOKENS // 2, AUTO_KERNEL_MIN_TOKENS, 4 * AUTO_KERNEL_MIN_TOKENS):
        timed.clear()
        gm.measure_bucket(planned, bucket, {}, gate.Tuning(confirm=0))
        assert timed and all(fn is (kernel if bucket >= AUTO_KERNEL_MIN_TOKENS else own) for fn in timed), bucket
    no_kernel = gate.PlanGate(gate.LayerShape(32, 4, 64, 32), plan=_plan(), expert_fn=own, kernel_fn=kernel)
    timed.clear()
    gm.measure_bucket(no_kernel, 16, {}, gate.Tuning(confirm=0))  # the plan runs no kernel: the own path, always
    assert timed and all(fn is own for fn in timed)


# -- issue 56: behaviours new since 2026-12-04 that could break with every test green ------------------------------
def test_the_rule_keeps_k_experts_per_step_hand_worked():
    """The closed-form rule's floor: every token still uses k experts, so a step loads at least k. N 64, k 8, one
    expert 3 x 3584 x 2560 x 2 bytes at 20 GB/s on a CPU (2.75 ms: saving anything beats the 0.05 ms cost).
    T = 1: before = 64 (1 - 56/64) = 8, after = max(8, 1) = 8: nothing saved, off (without the floor a lone token
    "saves" 7 experts and turns the policy on). T = 2: before = 64 (1 - (56/64)^2) = 15, after = max(8, 64 (1 -
    (63/64)^2) = 1.98) = 8: 7 saved (not 13.02)."""
    one = gate.by_rule(64, 8, 3584, 2560, 2, 1, "cpu")
    assert one.experts_before == pytest.approx(8.0) and one.experts_after == pytest.approx(8.0)
    assert one.experts_saved == pytest.approx(0.0, abs=1e-9) and not one.on
    two = gate.by_rule(64, 8, 3584, 2560, 2, 2, "cpu")
    assert two.experts_before == pytest.approx(15.0) and two.experts_after == pytest.approx(8.0)
    assert two.experts_saved == pytest.approx(7.0) and two.on
    assert two.saving_ms == pytest.approx(7 * 3 * 3584 * 2560 * 2 / 20e9 * 1e3)


def test_two_mixed_steps_of_one_size_with_different_decode_rows_get_their_own_decisions():
    """A mixed step's decision is derived once per (T, decode rows), not per T. Hand-worked as in
    ``test_a_mixed_step_is_decided_on_its_decode_rows``: cost 1.0 ms at bucket 256; 4 decode rows (bucket 4) save
    0.2 ms <= 1.25 x 1.0: off; 200 decode rows (bucket 256) save 50 x 0.1 = 5 ms > 1.25: on. Asked in both orders."""
    d256 = gate.decide(1.0, 50.0, 0.1, margin=MARGIN)
    d4 = gate.decide(0.01, 2.0, 0.1, margin=MARGIN)
    for order in ((4, 200), (200, 4)):
        g = gate.PlanGate(gate.LayerShape(64, 4, 16, 8), plan=_plan(64, 4),
                          decisions={**{b: d256 for b in gate.BUCKETS}, 4: d4})
        got = {rows: g.decision(256, decode_rows=rows) for rows in order}
        assert not got[4].on and got[4].saving_ms == pytest.approx(0.2)
        assert got[200].on and got[200].saving_ms == pytest.approx(5.0) and got[200].cost_ms == 1.0
        assert [g.on(256, rows) for rows in (4, 200, 4)] == [False, True, False]


def test_the_key_holds_the_tuning_in_use_not_the_default(fixed_gate):
    """``PlanGate.tuning`` (a lab script's or a test's own constants) is what the key's ``tuning`` digest describes:
    two gates of one layer under two tunings have two keys, each measured, each with its own tuning's digest (the
    default's digest for a tuning that differs would reuse decisions measured with other constants)."""
    calls = fixed_gate(True)
    other = gate.Tuning(margin=1.5)
    assert other.digest() != gate.TUNING.digest()
    keys = []
    for tuning in (gate.TUNING, other):
        g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), tuning=tuning)
        g.plan = _plan(8, 2)
        g.resolve()
        assert g.key.tuning == tuning.digest() and g.source.startswith("measured")
        keys.append(g.key.digest())
    assert keys[0] != keys[1] and len(calls) == 2


def test_a_user_table_wins_over_what_this_process_measured_before(fixed_gate, tmp_path):
    """``gate_table`` is read before the process's memory: a process that measured a layer (on at every step size)
    and is then patched with a user table holding that key (off everywhere) runs the table's decisions. The user
    table test above starts from an empty memory; this one does not."""
    calls = fixed_gate(True)
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    measured = gate.of(lynx_hf.patcher._state(model).blocks[0].plan)
    assert measured.source.startswith("measured") and all(d.on for d in measured.decisions.values())
    lynx_hf.unpatch(model)
    off = gate.decide(1.0, 0.0, 0.5, margin=MARGIN)
    table = gate.DecisionTable()
    table.put(measured.key, {b: off for b in gate.BUCKETS}, "a user's table")
    path = table.save(tmp_path / "table.json")
    lynx_hf.patch(model, policy="lynx", gate="auto", gate_table=str(path))
    planned = gate.of(lynx_hf.patcher._state(model).blocks[0].plan)
    lynx_hf.unpatch(model)
    assert planned.key == measured.key and planned.source == f"table {path}"
    assert not any(d.on for d in planned.decisions.values()) and len(calls) == 1


def test_layer_facts_are_the_gates_one_input_and_plan_stage_its_one_constructor():
    """The HF adapter (``lynx_hf.facts.layer_facts``) builds one frozen ``LayerFacts`` of a block, its shape read from
    the model's config here (the oracle); ``gate.plan_stage`` reads ``config.gate`` and builds the gate from the facts
    (made only where the gate is on: a function of them is never called under ``gate="always"``)."""
    import dataclasses

    from lynx_hf import LynxConfig

    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="always")
    block = lynx_hf.patcher._state(model).blocks[0]
    facts = lynx_hf.facts.layer_facts(block)
    cfg = model.config
    dtype = block.router.weight.dtype
    assert facts.shape == gate.LayerShape(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                          cfg.moe_intermediate_size, dtype, dtype)
    assert facts.step["family"] == "qwen2_moe" and facts.extra_expert_ms == 0.0 and facts.carried is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.shape = None
    made = []

    def lazy():
        made.append(True)
        return facts

    assert gate.plan_stage(lazy, LynxConfig(gate="always")) is None and not made
    planned = gate.plan_stage(lazy, LynxConfig(gate="auto", telemetry="counts"))
    assert made and isinstance(planned, gate.PlanGate) and planned.decisions == {}
    assert (planned.shape, planned.step_key, planned.telemetry, planned.table) == (facts.shape, facts.step, "counts",
                                                                                   None)
    assert planned.route_fn is facts.route_fn and planned.expert_fn is facts.expert_fn
    lynx_hf.unpatch(model)
