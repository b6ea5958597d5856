"""The default policy's one-call CPU decode step (kernels/routing_cpu.lynx_mass_decode, used by
BlockRouting.route on CPU in eager mode) returns exactly what the step-by-step torch ops return:
LYNX cover (k 1, no consensus) -> routing-mass growth -> remap -> weight rule, and the telemetry row of
BlockTelemetry.record. The reference runs inside strict_sync_free() (the accelerator code path, torch ops
only), on hypothesis-drawn values (ties, forbidden experts, every price unit and weight rule). Then, on
tiny models of three families, generation with the fused path equals generation without it, token for
token and statistic for statistic, and the fused path is shown to have run."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import lynx_hf
from helpers import families as fam
from helpers.strategies import fuzz, routing_scores, tied_topk
from lynx_hf import core, patcher
from lynx_hf.kernels import routing_cpu as rc
from lynx_hf.kernels import routing_torch as rt
from lynx_hf.telemetry import BlockTelemetry

# policy_on_every_step (tests/conftest.py): the one-call CPU decode step is compared with the step-by-step path while
# generating, which needs the policy on every decode step of these tiny models
pytestmark = pytest.mark.usefixtures("policy_on_every_step")



@st.composite
def steps(draw):
    scores, idx, k = draw(routing_scores(tokens=(2, 16), experts=(3, 40), max_k=6, k_below_n=True))
    t = scores.shape[0]
    if draw(st.booleans()):  # the model's own top-k with its tied experts in a drawn order (torch.topk has its own)
        idx = tied_topk(scores, k, torch.tensor(draw(st.permutations(range(scores.shape[1])))))
    # router logits: the scores where allowed, any finite value where the model forbids the expert
    logits = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, -3.0))
    weights = torch.softmax(logits, dim=-1).gather(1, idx).to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    live = draw(st.one_of(st.none(), arrays(np.bool_, (t,)).filter(lambda a: a.any()).map(torch.from_numpy)))
    return scores, logits, weights, idx, k, live


def reference(scores, logits, weights, idx, k, live, rule, alpha, beta, price, unit):
    with rt.strict_sync_free():
        critical = rt.lynx_critical_set(scores, idx, 1, alpha, beta, math.inf, vote=live)
        critical = rt.mass_greedy_grow(scores, idx, critical, k, price, vote=live, unit=unit)
        new_idx = rt.remap_topk(scores, critical, k, check=False, topk_idx=idx)
        new_weights = rt.routing_weights(logits.float(), new_idx, rule.kind, rule.renormalize, rule.scale,
                                         rule.renorm_eps)
        tel = BlockTelemetry()
        counted = torch.ones(idx.shape[0], dtype=torch.bool) if live is None else live
        tel.record(scores.shape[1], idx, weights, new_idx, counted, finished_rows=None if live is None else ~live,
                   fallback=torch.zeros((), dtype=torch.bool))
    return new_weights.to(weights.dtype), new_idx, tel.acc


@fuzz(1.2)
@given(steps(), st.sampled_from([0.02, 0.125, 0.5, 2.0]), st.sampled_from(rt.PRICE_UNITS),
       st.sampled_from([("softmax_all", False, 1.0), ("softmax_all", True, 1.0), ("softmax_chosen", False, 1.0),
                        ("sigmoid", True, 2.5), ("sigmoid", True, 1.0, 1e-6)]))  # last: LFM2-MoE's sum + 1e-6
def test_fused_step_equals_the_ops_one_by_one(step, price, unit, rule):
    scores, logits, weights, idx, k, live = step
    rule = SimpleNamespace(kind=rule[0], renormalize=rule[1], scale=rule[2], renorm_eps=(*rule, 0.0)[3])
    alpha, beta = rt.default_lynx_bins(scores.shape[1], k)
    want_w, want_idx, want_row = reference(scores, logits, weights, idx, k, live, rule, alpha, beta, price, unit)
    got = rc.lynx_mass_decode(scores, logits, weights, idx, rule, live, alpha=alpha, beta=beta, price=price,
                              unit=unit, telemetry=True)
    assert got is not None
    got_w, got_idx, row = got
    assert got_idx.dtype == idx.dtype and torch.equal(got_idx, want_idx)
    assert got_w.dtype == weights.dtype and torch.equal(got_w, want_w)
    # every slot is an exact count except the routing mass kept (fp64 here, fp32 in the torch twin)
    exact = [i for i in range(11) if i != 5]
    assert torch.equal(row[exact], want_row[exact])
    assert row[5].item() == pytest.approx(want_row[5].item(), rel=1e-5)
    # telemetry off: the same routing, no row
    w2, i2, none = rc.lynx_mass_decode(scores, logits, weights, idx, rule, live, alpha=alpha, beta=beta,
                                       price=price, unit=unit)
    assert none is None and torch.equal(i2, got_idx) and torch.equal(w2, got_w)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_leave_the_step_to_the_general_path(bad):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, generator=gen)
    logits[2, 5] = bad
    weights, idx = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    rule = SimpleNamespace(kind="softmax_all", renormalize=False, scale=1.0, renorm_eps=0.0)
    alpha, beta = rt.default_lynx_bins(8, 2)
    assert rc.lynx_mass_decode(logits, logits, weights, idx, rule, alpha=alpha, beta=beta, price=0.1,
                               unit="token") is None


def test_no_live_row_leaves_the_step_to_the_general_path():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    weights, idx = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    rule = SimpleNamespace(kind="softmax_all", renormalize=False, scale=1.0, renorm_eps=0.0)
    alpha, beta = rt.default_lynx_bins(8, 2)
    assert rc.lynx_mass_decode(logits, logits, weights, idx, rule, torch.zeros(3, dtype=torch.bool), alpha=alpha,
                               beta=beta, price=0.1, unit="token") is None


def _generate(model, ids, mask, fused: bool, eos):
    lynx_hf.patch(model)  # the default LynxConfig (lynx, routing-mass growth)
    state = patcher._state(model)
    calls = [0]
    for block in state.blocks:
        plan = block.resolve()
        assert plan.fused is not None  # the default policy has a one-call CPU path
        inner = plan.fused

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)
        block.plan = dataclasses.replace(plan, fused=counted if fused else None,
                                         kernel=core.fused_step if fused else core.remap_step)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         eos_token_id=eos)
    stats = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    return out, stats, calls[0]


@pytest.mark.parametrize("family,kw,eos", [
    ("qwen2_moe", {}, 2), ("mixtral", {}, 2), ("deepseek_v2", {}, 2),
    ("deepseek_v2", {"topk_method": "greedy", "n_group": 1, "topk_group": 1}, 2),
    ("qwen2_moe", {}, list(range(3, fam.VOCAB, 3))),  # a third of the vocabulary stops: rows finish
])
def test_generation_with_and_without_the_fused_path(family, kw, eos):
    model = fam.build(family, seed=3, **kw)
    ids, mask = fam.prompts(8, 7, seed=5, left_pad=False)
    out_fused, stats_fused, calls = _generate(model, ids, mask, True, eos)
    out_plain, stats_plain, none_calls = _generate(model, ids, mask, False, eos)
    assert calls > 0 and none_calls == 0  # the fused path ran in one and not in the other
    assert torch.equal(out_fused, out_plain)
    if isinstance(eos, list):
        assert stats_fused["finished_row_tokens"] > 0  # finished rows were in the batch (live mask)
        assert stats_fused["finished_row_tokens"] == stats_plain["finished_row_tokens"]
    assert stats_fused["unique_experts_after"] < stats_fused["unique_experts_before"]  # it remapped something
    for key in ("decode_steps", "decode_tokens", "unique_experts_before", "unique_experts_after",
                "remapped_fraction", "fallbacks"):
        assert stats_fused[key] == stats_plain[key], key
    assert stats_fused["routing_mass_kept"] == pytest.approx(stats_plain["routing_mass_kept"], rel=1e-6)
