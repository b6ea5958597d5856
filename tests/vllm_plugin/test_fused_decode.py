"""The op's one-call CPU decode step (issue 25 item 5): on the host (CPU eager), a step whose every row is a live
decode token is a plain ``Step("decode")`` without masks (``lynx_hf.vllm.rows.DECODE_STEP``), so
``lynx_hf.core.fused_step`` runs the policy's fused path (``plan.fused``) and records the telemetry in that call; mixed
steps (prefill or padding rows) keep the masks. The masked path is the reference: the same rows described with masks
(``rows.masked_step``) passed to ``lynx_hf.vllm.op.remap_step``: same ids, weights, telemetry and loaded-experts
counts. Unit level (no engine); vLLM environment only, like the rest of tests/vllm_plugin."""

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf import core  # noqa: E402
from lynx_hf.vllm import op, plans, rows, state, steps, telemetry  # noqa: E402
from lynx_hf.vllm.state import DECODE, PADDING, PREFILL  # noqa: E402
from plugin_steps import set_kinds  # noqa: E402

_MASKED_STEP = rows.masked_step  # the reference builds its masked steps with this one, never a spy


def _routing(rows, num_experts, top_k, dtype, seed, nonfinite_row=None):
    """vLLM's CPU router (softmax, renormalized) on ``dtype`` logits: fp32 weights, int32 ids."""
    logits = (torch.randn(rows, num_experts, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    if nonfinite_row is not None:
        logits[nonfinite_row, 1] = float("-inf")
    vals, ids = torch.topk(logits.float(), top_k, dim=-1)
    return logits, torch.softmax(vals, dim=-1), ids.to(torch.int32)


def _spy(layer, monkeypatch):
    """Counts of the fused one-call path's calls and of the masked steps the op builds."""
    calls = {"fused": 0, "masked": 0}
    plan = layer.plan
    if plan.fused is not None:
        fused = plan.fused

        def counted(*args, **kwargs):
            calls["fused"] += 1
            return fused(*args, **kwargs)

        layer.plan = dataclasses.replace(plan, fused=counted)

    def counted_masked(kinds, decode_rows=None):
        calls["masked"] += 1
        return _MASKED_STEP(kinds, decode_rows)

    monkeypatch.setattr(rows, "masked_step", counted_masked)
    return calls


def _run(one_layer, monkeypatch, options, step_kinds, num_experts, top_k, dtype, fused, inference=True):
    """Run ``step_kinds`` (a list of ``(kinds, seed, nonfinite_row)``) through the op (``fused``: the product) or
    through the masked reference (each call's rows described by masks, ``op.remap_step``); return the routing of
    every step, the layer's snapshot entry and the spy counts."""
    layer = one_layer(options, num_experts, top_k, capacity=64)
    layer.gathered = False
    plans.plan_for(layer, torch.device("cpu"), dtype, state.STATE.config.lynx)
    calls = _spy(layer, monkeypatch)
    outs = []
    for kinds, seed, bad in step_kinds:
        logits, weights, ids = _routing(len(kinds), num_experts, top_k, dtype, seed, bad)
        set_kinds(kinds)
        with torch.inference_mode(inference):  # vLLM's worker runs the forward under inference_mode
            if fused:
                outs.append(torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0))
            else:
                masked = _MASKED_STEP(steps.buffer(torch.device("cpu"), len(kinds))[:len(kinds)])
                outs.append(op.remap_step(layer, masked, logits, weights, ids, True))
        steps.end_step()
    return outs, telemetry.snapshot()["layers"][0], calls


SHAPES = {"fixture_a": (32, 4, torch.float32), "qwen2_57b": (64, 8, torch.bfloat16), "tiny": (8, 2, torch.float32)}
COUNTS = ("decode_steps", "unique_experts_before", "unique_experts_after", "remapped_fraction", "fallbacks",
          "decode_tokens", "verify_tokens", "prefill_tokens_in_mixed_steps", "finished_row_tokens", "skipped_calls",
          "loaded_experts_before", "loaded_experts_after")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("options", [{"policy": "lynx"}, {"policy": "none"}, {"policy": "oea", "oea_k0": 1}],
                         ids=["lynx", "none", "oea"])
def test_all_decode_step_is_fused_and_equals_the_masked_path(one_layer, monkeypatch, shape, options):
    """16 live decode rows per step, several steps (one with a non-finite row: the fused path hands it to the general
    path, a fallback): the plain decode step gives vLLM's experts the same ids and weights, and the snapshot the same
    counts, as the masked path; the lynx policy's fused path runs once per step and the op builds no masked step."""
    num_experts, top_k, dtype = SHAPES[shape]
    decode_steps = [([DECODE] * 16, seed, 3 if seed == 2 else None) for seed in range(4)]
    fast, fast_snap, fast_calls = _run(one_layer, monkeypatch, options, decode_steps, num_experts, top_k, dtype, True)
    ref, ref_snap, ref_calls = _run(one_layer, monkeypatch, options, decode_steps, num_experts, top_k, dtype, False)
    for (w, i), (rw, ri) in zip(fast, ref):
        assert i.dtype == ri.dtype == torch.int32 and w.dtype == rw.dtype == torch.float32
        assert torch.equal(i, ri)
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert {key: fast_snap[key] for key in COUNTS} == {key: ref_snap[key] for key in COUNTS}
    assert fast_snap["routing_mass_kept"] == pytest.approx(ref_snap["routing_mass_kept"], rel=1e-6)
    assert fast_snap["decode_steps"] == 4
    assert fast_snap["fallbacks"] == (0 if options["policy"] == "none" else 1)  # none keeps every row anyway
    assert fast_snap["loaded_experts_before"] == fast_snap["unique_experts_before"]
    assert fast_snap["loaded_experts_after"] == fast_snap["unique_experts_after"]
    assert fast_calls["masked"] == 0  # every step the plain decode step
    if options["policy"] == "lynx":
        assert fast_calls["fused"] == 4 and ref_calls["fused"] == 0  # one per step (the non-finite one returns None)
        assert fast_snap["unique_experts_after"] < fast_snap["unique_experts_before"]


@pytest.mark.parametrize("kinds", [[PREFILL, DECODE, DECODE, PREFILL] + [DECODE] * 12,
                                   [DECODE] * 14 + [PADDING, PADDING]], ids=["prefill", "padding"])
def test_mixed_steps_keep_the_masks(one_layer, monkeypatch, kinds):
    """A step with prefill rows or padding rows is described with masks (the fused path never sees it); its result
    and counts equal the masked reference's."""
    layer = one_layer({"policy": "lynx"}, 64, 8, capacity=64)
    logits, weights, ids = _routing(len(kinds), 64, 8, torch.bfloat16, 7)
    set_kinds(kinds)
    step = op.step_for(layer, logits, True)
    assert step.kind == core.MIXED and step.decode is not None and step.live is not None
    assert torch.equal(step.decode, torch.tensor(kinds) == DECODE)
    assert torch.equal(step.live, torch.tensor(kinds) != PADDING)
    steps.end_step()
    two = [(kinds, 7, None), ([DECODE] * 16, 8, None)]
    fast, fast_snap, fast_calls = _run(one_layer, monkeypatch, {"policy": "lynx"}, two, 64, 8, torch.bfloat16, True)
    ref, ref_snap, _ = _run(one_layer, monkeypatch, {"policy": "lynx"}, two, 64, 8, torch.bfloat16, False)
    assert fast_calls == {"fused": 1, "masked": 1}  # the mixed step masked, the all-decode step fused
    for (w, i), (rw, ri) in zip(fast, ref):
        assert torch.equal(i, ri)
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert {key: fast_snap[key] for key in COUNTS} == {key: ref_snap[key] for key in COUNTS}
    if PADDING in kinds:  # padding rows: not loaded, not counted
        assert fast_snap["decode_tokens"] == 14 + 16
    else:
        assert fast_snap["prefill_tokens_in_mixed_steps"] == 2
        assert fast_snap["loaded_experts_before"] >= fast_snap["unique_experts_before"]


def test_all_decode_step_outside_inference_mode_and_forced_decode(one_layer, monkeypatch):
    """The loaded counts accumulate in place on the host whether the accumulators were made under inference_mode
    or not, and the forced decode phase (every row decodes) takes the same plain decode step."""
    three = [([DECODE] * 16, seed, None) for seed in range(3)]
    a, snap_a, _ = _run(one_layer, monkeypatch, {"policy": "lynx"}, three, 32, 4, torch.float32, True, inference=False)
    b, snap_b, calls = _run(one_layer, monkeypatch, {"policy": "lynx", "phase": "decode"}, three, 32, 4,
                            torch.float32, True)
    assert calls == {"fused": 3, "masked": 0}
    for (w, i), (rw, ri) in zip(a, b):
        assert torch.equal(i, ri) and torch.equal(w, rw)
    assert snap_a["decode_steps"] == 3
    assert {key: snap_a[key] for key in COUNTS} == {key: snap_b[key] for key in COUNTS}

