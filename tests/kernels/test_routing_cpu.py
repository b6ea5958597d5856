"""The numba CPU fast path (kernels/routing_cpu.py) returns exactly the integers of the canonical torch ops
(kernels/routing_torch.py, run inside strict_sync_free() so the torch code path is the accelerator one),
on hypothesis-drawn tensors (values drawn, so counterexamples shrink to small tensors): ties, -inf
experts, vote and seed masks, N not a power of two, k = 1, T = 1, the model's own top-k taking tied experts
lower id first or in a drawn order (as ``torch.topk`` may); and the tie rule of a token's own ranking (ties -> its
own experts, then lower id) on the twins themselves."""

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from helpers.strategies import fuzz, planted_ties, routing_scores, tied_topk
from lynx_hf.core import WeightRule
from lynx_hf.kernels import routing_cpu as rc
from lynx_hf.kernels import routing_torch as rt


def test_numba_is_available():
    assert rc.AVAILABLE  # a dependency (pyproject.toml): the CPU fast path is what users get


@st.composite
def steps(draw):
    scores, idx, k = draw(routing_scores())
    t, n = scores.shape
    if draw(st.booleans()):  # the model's own top-k with its tied experts in a drawn order (torch.topk has its own)
        idx = tied_topk(scores, k, torch.tensor(draw(st.permutations(range(n)))))
    vote = draw(st.one_of(st.none(), arrays(np.bool_, (t,)).map(torch.from_numpy)))
    seed = draw(st.one_of(st.none(), arrays(np.bool_, (n,)).map(torch.from_numpy)))
    return scores, idx, k, vote, seed


SETTINGS = fuzz(1.5)


@SETTINGS
@given(steps(), st.sampled_from([1.0, 0.5, math.inf]), st.sampled_from([None, 3.0]))
def test_lynx_critical_set_twin(step, tau, alpha):
    scores, idx, k, vote, seed = step
    n = scores.shape[1]
    a, b = rt.default_lynx_bins(n, k) if k < n else (1.0, 1)
    a = alpha or a
    with rt.strict_sync_free():
        want = rt.lynx_critical_set(scores, idx, k, a, b, tau, vote=vote, seed=seed)
    assert torch.equal(rc.lynx_critical_set(scores, idx, k, a, b, tau, vote=vote, seed=seed), want)


@SETTINGS
@given(steps(), st.integers(1, 3))
def test_oea_twin(step, k0):
    scores, idx, k, vote, seed = step
    k0 = min(k0, scores.shape[1])
    assert torch.equal(rc.oea_critical_set(scores, k0, vote, seed), rt.oea_critical_set(scores, k0, vote, seed))
    with rt.strict_sync_free():
        want = rt.oea_critical_set(scores, k0, vote, seed, idx)
    assert torch.equal(rc.oea_critical_set(scores, k0, vote, seed, idx), want)


@SETTINGS
@given(steps(), st.sampled_from([0.0, 0.2, 0.5, 1.5]), st.sampled_from(["token", "batch", "sqrt"]))
def test_mass_greedy_twin(step, price, unit):
    scores, idx, k, vote, seed = step
    start = torch.zeros(scores.shape[1], dtype=torch.bool)
    start[idx[0, 0]] = True
    with rt.strict_sync_free():
        want = rt.mass_greedy_grow(scores, idx, start, k, price, vote, seed, unit=unit)
    assert torch.equal(rc.mass_greedy_grow(scores, idx, start, k, price, vote, seed, unit=unit), want)
    # and the CPU early exit of the torch version gives the same
    assert torch.equal(rt.mass_greedy_grow(scores, idx, start, k, price, vote, seed, unit=unit), want)


@SETTINGS
@given(steps(), st.integers(1, 8), st.integers(0, 2))
def test_xshare_twin(step, budget, warmup):
    scores, idx, k, vote, seed = step
    want = rt.xshare_critical_set(scores, idx, k, budget, warmup, vote, seed)
    assert torch.equal(rc.xshare_critical_set(scores, idx, k, budget, warmup, vote, seed), want)


@SETTINGS
@given(steps(), st.data())
def test_remap_twin(step, data):
    scores, idx, k, vote, seed = step
    critical = torch.from_numpy(data.draw(arrays(np.bool_, (scores.shape[1],))))
    assert torch.equal(rc.remap_topk(scores, critical, k, check=False), rt.remap_topk(scores, critical, k, check=False))
    want = rt.remap_topk(scores, critical, k, check=False, topk_idx=idx)
    assert torch.equal(rc.remap_topk(scores, critical, k, check=False, topk_idx=idx), want)


def _same_sets(a, b):
    return [set(r) for r in a.tolist()] == [set(r) for r in b.tolist()]


@pytest.mark.parametrize("case", ["zeros", "planted ties"])
@pytest.mark.parametrize("n,k,t", [(8, 2, 3), (12, 3, 9), (64, 6, 16)])
def test_ties_keep_the_tokens_own_experts(case, n, k, t):
    """The numba twins with the model's own top-k from ``torch.topk`` (tied experts in its own order, not lower id
    first) on all-zero scores and on scores with ties planted across each row's top-k boundary: OEA's critical set
    with ``k0 = k`` is the union of the own sets and the remap into it (and into XShare's set with a budget of N)
    gives each token its own set exactly; the default policy's one-call step (``lynx_mass_decode``) gives k distinct
    allowed experts per token, the ids of the ops one by one."""
    s = torch.zeros(t, n) if case == "zeros" else planted_ties(t, n, k, seed=n * 100 + t)
    own = torch.topk(s, k).indices
    stable = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    assert not _same_sets(own, stable)  # the subject: torch.topk's ties are not lower id first
    oea = rc.oea_critical_set(s, k, topk_idx=own)
    assert torch.equal(oea, rt.union_mask(own, n))
    assert _same_sets(rc.remap_topk(s, oea, k, topk_idx=own), own)
    for warmup in (0, 1, k):
        xshare = rc.xshare_critical_set(s, own, k, n, warmup)
        assert torch.equal(xshare, rt.union_mask(own, n))
        assert _same_sets(rc.remap_topk(s, xshare, k, topk_idx=own), own)
    assert _same_sets(rc.remap_topk(s, torch.ones(n, dtype=torch.bool), k, topk_idx=own), own)
    a, b = rt.default_lynx_bins(n, k)
    logits = torch.where(torch.isfinite(s), s, torch.full_like(s, -40.0))  # forbidden: by the scores, not the logits
    weights = torch.softmax(logits, -1).gather(1, own)
    _, new, _ = rc.lynx_mass_decode(s, logits, weights, own, WeightRule("softmax_all"), alpha=a, beta=b, price=0.1,
                                    unit="sqrt")
    assert all(len(set(r)) == k for r in new.tolist()) and bool(torch.isfinite(s.gather(1, new)).all())
    cover = rt.lynx_critical_set(s, own, 1, a, b, math.inf)
    grown = rt.mass_greedy_grow(s, own, cover, k, 0.1, unit="sqrt")
    assert torch.equal(new, rt.remap_topk(s, grown, k, topk_idx=own))


@SETTINGS
@given(steps(), st.data())
def test_telemetry_twin(step, data):
    from lynx_hf.telemetry import BlockTelemetry

    scores, idx, k, vote, seed = step
    t, n = scores.shape
    critical = torch.from_numpy(data.draw(arrays(np.bool_, (n,))))
    new = rt.remap_topk(scores, critical, k, check=False)
    weights = torch.softmax(torch.where(torch.isfinite(scores), scores, -1e4), -1).gather(1, idx)
    counted = torch.ones(t, dtype=torch.bool) if vote is None else vote
    finished = ~counted
    fast, slow = BlockTelemetry(), BlockTelemetry()
    fast.record(n, idx, weights, new, counted, finished_rows=finished, fallback=torch.tensor(False))
    with rt.strict_sync_free():
        slow.record(n, idx, weights, new, counted, finished_rows=finished, fallback=torch.tensor(False))
    torch.testing.assert_close(fast.acc, slow.acc, rtol=1e-6, atol=1e-6)
    exact = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]  # every slot but the (fp32 vs fp64) mass sum is an integer count
    assert torch.equal(fast.acc[exact], slow.acc[exact])


@SETTINGS
@given(steps(), st.data())
def test_telemetry_counts_mode_and_every_row(step, data):
    """The counting mode (``LynxConfig.telemetry="counts"``) and ``counted=None`` (every row), numba and torch: the
    counted slots equal the full mode's with an all-True mask; the unmeasured slots (remapped, assignments, mass)
    stay 0 and the summary reports them as None."""
    from lynx_hf.kernels import telemetry_slots as sl
    from lynx_hf.telemetry import COUNTS, BlockTelemetry

    scores, idx, k, vote, seed = step
    t, n = scores.shape
    critical = torch.from_numpy(data.draw(arrays(np.bool_, (n,))))
    new = rt.remap_topk(scores, critical, k, check=False)
    weights = torch.softmax(torch.where(torch.isfinite(scores), scores, -1e4), -1).gather(1, idx)
    full = BlockTelemetry()
    full.record(n, idx, weights, new, torch.ones(t, dtype=torch.bool), fallback=torch.tensor(False))
    counted_slots = [sl.STEPS, sl.BEFORE, sl.AFTER, sl.TOKENS, sl.FALLBACKS, sl.VERIFY_TOKENS, sl.PREFILL_TOKENS,
                     sl.FINISHED_TOKENS]
    unmeasured = [sl.REMAPPED, sl.ASSIGNMENTS, sl.MASS]
    for strict in (False, True):
        with rt.strict_sync_free() if strict else contextlib.nullcontext():
            every = BlockTelemetry()
            every.record(n, idx, weights, new, None, fallback=torch.tensor(False))
            counts = BlockTelemetry(COUNTS)
            counts.record(n, idx, weights, new, None, fallback=torch.tensor(False))
        torch.testing.assert_close(every.acc, full.acc, rtol=1e-6, atol=1e-6)
        assert torch.equal(counts.acc[counted_slots], full.acc[counted_slots])
        assert not counts.acc[unmeasured].any()
        summary = counts.summary()
        assert summary["remapped_fraction"] is None and summary["routing_mass_kept"] is None
        assert summary["unique_experts_before"] == len(set(idx.flatten().tolist()))
        assert summary["unique_experts_after"] == len(set(new.flatten().tolist()))
