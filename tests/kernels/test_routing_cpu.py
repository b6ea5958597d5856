"""The numba CPU fast path (kernels/routing_cpu.py) returns exactly the integers of the canonical torch ops
(kernels/routing_torch.py, run inside strict_sync_free() so the torch code path is the accelerator one),
on hypothesis-drawn tensors (values drawn, so counterexamples shrink to small tensors): ties, -inf
experts, vote and seed masks, N not a power of two, k = 1, T = 1."""

import contextlib
import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from helpers.strategies import fuzz, routing_scores
from lynx_hf.kernels import routing_cpu as rc
from lynx_hf.kernels import routing_torch as rt


def test_numba_is_available():
    assert rc.AVAILABLE  # a dependency (pyproject.toml): the CPU fast path is what users get


@st.composite
def steps(draw):
    scores, idx, k = draw(routing_scores())
    t, n = scores.shape
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
