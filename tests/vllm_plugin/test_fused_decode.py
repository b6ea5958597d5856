"""The op's one-call CPU decode step (issue 25 item 5): on the host (CPU eager), a step whose every row is a live
decode token is a plain ``Step("decode")`` without masks, so ``lynx_hf.core.fused_step`` runs the policy's fused
path (``plan.fused``) and records the telemetry in that call; mixed steps (prefill or padding rows) keep the masks.
The masked path (``_hooks.FUSED_DECODE = False``, what every step took before) is the reference: same ids, weights,
telemetry and loaded-experts counts. Unit level (no engine); vLLM environment only, like the rest of
tests/vllm_plugin."""

import dataclasses
import weakref

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf import core  # noqa: E402
from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.vllm import _config, _hooks  # noqa: E402
from lynx_hf.vllm._hooks import DECODE, PADDING, PREFILL  # noqa: E402
from plugin_steps import set_kinds  # noqa: E402

_RECORD = _hooks._record  # the masked path's recorder (each spy wraps this one, not an earlier spy)


class _Runner:  # a MoERunner stand-in (the layer keeps a weak reference)
    do_naive_dispatch_combine = False


@pytest.fixture
def plugin(monkeypatch):
    """``plugin(options, num_experts, top_k)`` -> the one fake layer; the process state restored afterwards."""
    state = _hooks.STATE
    saved = (state.config, state.layers, state.step, state.capacity, state.resolved)
    runner = _Runner()

    def make(options, num_experts=8, top_k=2, fused=True):
        monkeypatch.setattr(_hooks, "FUSED_DECODE", fused)
        state.config = _config.parse(options)
        state.resolved = True
        state.step = _hooks._StepBuffer()
        state.capacity = 64
        layer = _hooks._Layer(index=0, name="fake", top_k=top_k, num_experts=num_experts,
                              rule=WeightRule("softmax_all", renormalize=True), runner=weakref.ref(runner))
        layer.gathered = False
        state.layers = [layer]
        return layer

    yield make
    state.config, state.layers, state.step, state.capacity, state.resolved = saved


def _routing(rows, num_experts, top_k, dtype, seed, nonfinite_row=None):
    """vLLM's CPU router (softmax, renormalized) on ``dtype`` logits: fp32 weights, int32 ids."""
    logits = (torch.randn(rows, num_experts, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    if nonfinite_row is not None:
        logits[nonfinite_row, 1] = float("-inf")
    vals, ids = torch.topk(logits.float(), top_k, dim=-1)
    return logits, torch.softmax(vals, dim=-1), ids.to(torch.int32)


def _spy(layer, monkeypatch):
    """Counts of the fused one-call path's calls and of the masked path's ``_record`` calls."""
    calls = {"fused": 0, "record": 0}
    plan = layer.plan
    if plan.fused is not None:
        fused = plan.fused

        def counted(*args, **kwargs):
            calls["fused"] += 1
            return fused(*args, **kwargs)

        layer.plan = dataclasses.replace(plan, fused=counted)
    record = _RECORD

    def counted_record(*args, **kwargs):
        calls["record"] += 1
        return record(*args, **kwargs)

    monkeypatch.setattr(_hooks, "_record", counted_record)
    return calls


def _run(plugin, monkeypatch, options, steps, num_experts, top_k, dtype, fused, inference=True):
    """Run the op over ``steps`` (a list of ``(kinds, seed, nonfinite_row)``) and return the routing of every step,
    the layer's snapshot entry and the spy counts."""
    layer = plugin(options, num_experts, top_k, fused=fused)
    layer.plan = core.make_plan(_hooks.STATE.config.lynx, num_experts, top_k, torch.device("cpu"))
    calls = _spy(layer, monkeypatch)
    outs = []
    for kinds, seed, bad in steps:
        logits, weights, ids = _routing(len(kinds), num_experts, top_k, dtype, seed, bad)
        set_kinds(kinds)
        with torch.inference_mode(inference):  # vLLM's worker runs the forward under inference_mode
            outs.append(torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0))
        _hooks._end_step()
    return outs, _hooks.snapshot()["layers"][0], calls


SHAPES = {"fixture_a": (32, 4, torch.float32), "qwen2_57b": (64, 8, torch.bfloat16), "tiny": (8, 2, torch.float32)}
COUNTS = ("decode_steps", "unique_experts_before", "unique_experts_after", "remapped_fraction", "fallbacks",
          "decode_tokens", "verify_tokens", "prefill_tokens_in_mixed_steps", "finished_row_tokens", "skipped_calls",
          "loaded_experts_before", "loaded_experts_after")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("options", [{"policy": "lynx"}, {"policy": "none"}, {"policy": "oea", "oea_k0": 1}],
                         ids=["lynx", "none", "oea"])
def test_all_decode_step_is_fused_and_equals_the_masked_path(plugin, monkeypatch, shape, options):
    """16 live decode rows per step, several steps (one with a non-finite row: the fused path hands it to the general
    path, a fallback): the plain decode step gives vLLM's experts the same ids and weights, and the snapshot the same
    counts, as the masked path; the lynx policy's fused path runs once per step and ``_record`` never."""
    num_experts, top_k, dtype = SHAPES[shape]
    steps = [([DECODE] * 16, seed, 3 if seed == 2 else None) for seed in range(4)]
    fast, fast_snap, fast_calls = _run(plugin, monkeypatch, options, steps, num_experts, top_k, dtype, fused=True)
    ref, ref_snap, ref_calls = _run(plugin, monkeypatch, options, steps, num_experts, top_k, dtype, fused=False)
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
    assert fast_calls["record"] == 0 and ref_calls["record"] == 4  # the masked path's own record, never both
    if options["policy"] == "lynx":
        assert fast_calls["fused"] == 4 and ref_calls["fused"] == 0  # one per step (the non-finite one returns None)
        assert fast_snap["unique_experts_after"] < fast_snap["unique_experts_before"]


@pytest.mark.parametrize("kinds", [[PREFILL, DECODE, DECODE, PREFILL] + [DECODE] * 12,
                                   [DECODE] * 14 + [PADDING, PADDING]], ids=["prefill", "padding"])
def test_mixed_steps_keep_the_masks(plugin, monkeypatch, kinds):
    """A step with prefill rows or padding rows is described with masks (the fused path never sees it) and records
    through ``_record``; its result does not depend on ``FUSED_DECODE``."""
    layer = plugin({"policy": "lynx"}, 64, 8)
    logits, weights, ids = _routing(len(kinds), 64, 8, torch.bfloat16, 7)
    set_kinds(kinds)
    step = _hooks._step_for(layer, logits, True)
    assert step.kind == core.MIXED and step.decode is not None and step.live is not None
    assert torch.equal(step.decode, torch.tensor(kinds) == DECODE)
    _hooks._end_step()
    steps = [(kinds, 7, None), ([DECODE] * 16, 8, None)]
    fast, fast_snap, fast_calls = _run(plugin, monkeypatch, {"policy": "lynx"}, steps, 64, 8, torch.bfloat16, True)
    ref, ref_snap, _ = _run(plugin, monkeypatch, {"policy": "lynx"}, steps, 64, 8, torch.bfloat16, False)
    assert fast_calls == {"fused": 1, "record": 1}  # the mixed step masked, the all-decode step fused
    for (w, i), (rw, ri) in zip(fast, ref):
        assert torch.equal(i, ri)
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert {key: fast_snap[key] for key in COUNTS} == {key: ref_snap[key] for key in COUNTS}
    if PADDING in kinds:  # padding rows: not loaded, not counted
        assert fast_snap["decode_tokens"] == 14 + 16
    else:
        assert fast_snap["prefill_tokens_in_mixed_steps"] == 2
        assert fast_snap["loaded_experts_before"] >= fast_snap["unique_experts_before"]


def test_all_decode_step_outside_inference_mode_and_forced_decode(plugin, monkeypatch):
    """The loaded counts accumulate in place on the host whether the accumulators were made under inference_mode
    or not, and the forced decode phase (every row decodes) takes the same plain decode step."""
    steps = [([DECODE] * 16, seed, None) for seed in range(3)]
    a, snap_a, _ = _run(plugin, monkeypatch, {"policy": "lynx"}, steps, 32, 4, torch.float32, True, inference=False)
    b, snap_b, calls = _run(plugin, monkeypatch, {"policy": "lynx", "phase": "decode"}, steps, 32, 4, torch.float32,
                            True)
    assert calls == {"fused": 3, "record": 0}
    for (w, i), (rw, ri) in zip(a, b):
        assert torch.equal(i, ri) and torch.equal(w, rw)
    assert snap_a["decode_steps"] == 3
    assert {key: snap_a[key] for key in COUNTS} == {key: snap_b[key] for key in COUNTS}


def test_host_op_body_runs_on_one_thread_and_restores(plugin, monkeypatch):
    """On the host the op body's tiny [T, N] ops run on one torch thread (an OpenMP fork-join per op costs more than
    the op on a busy host); the worker's thread count is restored after the call, also when it raises. Opt-in
    (``_hooks.SINGLE_THREAD``): off by default."""
    assert _hooks.SINGLE_THREAD is False
    monkeypatch.setattr(_hooks, "SINGLE_THREAD", True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = plugin({"policy": "lynx"}, 32, 4)
        layer.plan = core.make_plan(_hooks.STATE.config.lynx, 32, 4, torch.device("cpu"))
        seen = []
        fused = layer.plan.fused

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return fused(*args, **kwargs)

        layer.plan = dataclasses.replace(layer.plan, fused=spy)
        logits, weights, ids = _routing(16, 32, 4, torch.bfloat16, 0)
        set_kinds([DECODE] * 16)
        torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        assert seen == [1] and torch.get_num_threads() == 2

        def boom(*args, **kwargs):
            raise RuntimeError("boom")

        layer.plan = dataclasses.replace(layer.plan, fused=boom)
        with pytest.raises(RuntimeError, match="boom"):
            torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        assert torch.get_num_threads() == 2
        _hooks._end_step()
    finally:
        torch.set_num_threads(threads)
