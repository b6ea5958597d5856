"""Triton routing kernels (interpreter) vs the torch reference in kernels/routing_torch.py.

Integer outputs (critical sets, remapped indices) must be *exactly* equal; routing weights agree
within fp32 rounding (atol 1e-6, rtol 1e-5). Outputs are allocated by a NaN/sentinel-poisoned
``torch.empty`` so unwritten elements show.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (also set in tests/conftest.py)

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lynx_hf.kernels import routing_torch as ref  # noqa: E402
from lynx_hf.kernels.backend import resolve_backend  # noqa: E402
from lynx_hf.kernels.routing import lynx_critical_set, oea_critical_set, remap_topk  # noqa: E402

W_ATOL, W_RTOL = 1e-6, 1e-5  # fp32 routing weights


@pytest.fixture(autouse=True)
def _poison_empty(poisoned_empty):
    """Every test here allocates through a poisoned ``torch.empty`` (tests/conftest.py)."""


def _topk(scores, k):
    """The model's own selection: stable top-k of the fp32 scores (ties -> lower id)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def _check_all(scores, k, taus=(0.0, 0.5, 1.0, 1.5, 3.0, math.inf), alpha=None, beta=None, batch_base=None, k0s=(1, 2)):
    """Every kernel vs its reference on one score matrix; returns the reference critical sets."""
    num_experts = scores.shape[1]
    a0, b0 = ref.default_lynx_bins(num_experts, k)
    alpha = a0 if alpha is None else alpha
    beta = b0 if beta is None else beta
    idx = _topk(scores, k)
    crits = []
    for tau in taus:
        want = ref.lynx_critical_set(scores, idx, k, alpha, beta, tau, batch_base)
        got = lynx_critical_set(scores, idx, k, alpha, beta, tau, batch_base)
        assert got.dtype == torch.bool and got.shape == (num_experts,)
        assert torch.equal(got, want), f"tau={tau}: {got.nonzero().flatten()} vs {want.nonzero().flatten()}"
        crits.append(want)
    for k0 in k0s:
        if k0 <= num_experts:
            want = ref.oea_critical_set(scores, k0)
            assert torch.equal(oea_critical_set(scores, k0), want), f"k0={k0}"
            crits.append(want)
    for crit in crits[:3] + crits[-1:]:
        want_idx = ref.remap_topk(scores, crit, k)
        got_idx = remap_topk(scores, crit, k)
        assert got_idx.dtype == torch.int64 and torch.equal(got_idx, want_idx)
    return crits


# (T, N, k), one comment each.
SHAPES = [
    (1, 8, 2),  # T=1 decode, Mixtral-like N/k
    (3, 8, 2),  # T < any block
    (16, 60, 4),  # N not a power of two (Qwen1.5-MoE), C16
    (64, 64, 8),  # Qwen2-57B-A14B N/k at B=64
    (16, 64, 6),  # DeepSeek-V2-Lite N/k
    (8, 128, 8),  # N=128 (Qwen3)
    (5, 384, 8),  # N=384 (Kimi-K2 style), small T, C16
    (16, 16, 1),  # k=1 (Llama-4)
    (130, 32, 4),  # T larger than the kernel's token chunk (several chunks)
    (4, 5, 5),  # k == N: alpha = inf, identity
]


@pytest.mark.parametrize("T,N,k", SHAPES)
def test_C16_random_scores_match_reference(T, N, k):
    g = torch.Generator().manual_seed(T * 1000 + N + k)
    scores = torch.randn(T, N, generator=g) * 2.0
    _check_all(scores, k)


@pytest.mark.parametrize("skew", [0.3, 1.0, 4.0])
def test_skewed_router_matches_reference(skew):
    # a few popular experts (low-rank bias) + token noise: the regime where LYNX shrinks the set
    g = torch.Generator().manual_seed(7)
    bias = torch.linspace(3.0, -3.0, 64) * skew
    scores = bias + torch.randn(32, 64, generator=g)
    crits = _check_all(scores, 8)
    assert int(crits[1].sum()) < int(ref.union_mask(_topk(scores, 8), 64).sum()) or skew < 1.0


def test_bin_and_batch_base_variants():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(16, 32, generator=g) * 1.5
    a, b = ref.default_lynx_bins(32, 4)
    _check_all(scores, 4, alpha=2 * a, beta=2 * b)  # halved bin width (DESIGN sweep)
    _check_all(scores, 4, batch_base=1)  # B = 1: every voting bin counts 1
    _check_all(scores, 4, batch_base=1000)  # B larger than T
    _check_all(scores, 4, alpha=0.25, beta=0)  # beta = 0: only bin-0 votes


def test_tau_exactly_on_a_score():
    # scores on a coarse grid give exact ties of the batch score with tau (>= must include them)
    g = torch.Generator().manual_seed(11)
    scores = torch.randint(-6, 1, (16, 16), generator=g).float()
    idx = _topk(scores, 2)
    a, b = ref.default_lynx_bins(16, 2)
    bins = ref.lynx_bins(scores, a)
    cand = ref.union_mask(idx, 16)
    bins = torch.where(cand[None], bins, torch.full_like(bins, ref.FORBIDDEN_BIN))
    score = ref.lynx_scores(bins, cand, b, 16)
    for tau in sorted(set(score.tolist()))[:6]:
        _check_all(scores, 2, taus=(tau, math.nextafter(tau, math.inf)), k0s=())


# C12: exact ties -> deterministic lower-index choice, k distinct, never a forbidden expert.
def test_C12_all_zero_logits():
    scores = torch.zeros(8, 12)
    crits = _check_all(scores, 3)
    for crit in crits:
        idx = remap_topk(scores, crit, 3)
        assert all(len(set(r)) == 3 for r in idx.tolist())
    # all ties: the model's own top-k is experts 0..2 and LYNX keeps exactly those
    assert lynx_critical_set(scores, _topk(scores, 3), 3, *ref.default_lynx_bins(12, 3), 1.0).nonzero().flatten().tolist() == [0, 1, 2]


def test_C12_rows_forbidden_except_two():
    # rows are -inf except two experts (one of them tied): k=2 must take exactly those two
    g = torch.Generator().manual_seed(5)
    T, N = 9, 24
    scores = torch.full((T, N), -math.inf)
    for t in range(T):
        e = torch.randperm(N, generator=g)[:2]
        scores[t, e[0]] = 0.5
        scores[t, e[1]] = 0.5 if t % 2 else -0.25
    crits = _check_all(scores, 2, k0s=(1, 2, 3))  # k0=3 > finite count: reference picks -inf by id
    for crit in crits:
        idx = remap_topk(scores, crit, 2)
        assert torch.isfinite(scores.gather(1, idx)).all()
        assert torch.equal(idx.sort(1).values, _topk(scores, 2).sort(1).values)


def test_forbidden_groups_remap_never_picks_forbidden():
    # DeepSeek-style group limits: half of each row forbidden; critical set over the other half
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(12, 16, generator=g)
    scores[:6, 8:] = -math.inf
    scores[6:, :8] = -math.inf
    crits = _check_all(scores, 3)
    for crit in crits:
        idx = remap_topk(scores, crit, 3)
        assert torch.isfinite(scores.gather(1, idx)).all()


def test_too_few_allowed_raises():
    scores = torch.full((2, 8), -math.inf)
    scores[:, :2] = 1.0
    with pytest.raises(ValueError, match="fewer than top_k"):
        remap_topk(scores, torch.ones(8, dtype=torch.bool), 3)


# C13: every logit negative / shifted by -1000: kernels still equal the reference, and with an exact
# shift (values on a 1/64 grid, so s - 1000 is exact in fp32) nothing changes at all.
@pytest.mark.parametrize("shift", [-1000.0, -30.0])
def test_C13_shift_invariance(shift):
    g = torch.Generator().manual_seed(13)
    scores = torch.round(torch.randn(16, 32, generator=g) * 2 * 64) / 64
    shifted = scores + shift
    assert (shifted < 0).all()
    c0 = _check_all(scores, 4)
    c1 = _check_all(shifted, 4)
    for a, b in zip(c0, c1):
        assert torch.equal(a, b)
    for a, b in zip(c0, c1):
        assert torch.equal(remap_topk(scores, a, 4), remap_topk(shifted, b, 4))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gap * alpha -> -inf, on purpose
def test_huge_gaps_do_not_vote():
    # masking with finfo.min instead of -inf (some models do): gaps overflow int32 if cast; no vote
    g = torch.Generator().manual_seed(17)
    scores = torch.randn(8, 16, generator=g)
    scores[:, 10:] = torch.finfo(torch.float32).min
    scores[0, 3] = -1e30
    _check_all(scores, 2)


def test_non_contiguous_scores():
    g = torch.Generator().manual_seed(19)
    base = torch.randn(24, 10, generator=g)
    scores = base.t()  # [10, 24], strides (1, 10)
    assert not scores.is_contiguous()
    idx = _topk(scores, 3)
    a, b = ref.default_lynx_bins(24, 3)
    crit = ref.lynx_critical_set(scores, idx, 3, a, b, 1.0)
    assert torch.equal(lynx_critical_set(scores, idx, 3, a, b, 1.0), crit)
    assert torch.equal(oea_critical_set(scores, 2), ref.oea_critical_set(scores, 2))
    assert torch.equal(remap_topk(scores, crit, 3), ref.remap_topk(scores, crit, 3))
    assert torch.equal(lynx_critical_set(scores, idx.int(), 3, a, b, 1.0), crit)  # int32 topk_idx


@pytest.mark.parametrize("rule", ["softmax_all", "softmax_chosen", "sigmoid"])
@pytest.mark.parametrize("renormalize,scale", [(False, 1.0), (True, 1.0), (False, 2.5)])
def test_remap_weights(rule, renormalize, scale):
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(20, 60, generator=g) * 3
    scores = logits.clone()
    scores[:4, :30] = -math.inf  # group-limited rows: selection masked, weights from full logits
    idx0 = _topk(scores, 6)
    a, b = ref.default_lynx_bins(60, 6)
    crit = ref.lynx_critical_set(scores, idx0, 6, a, b, 1.0)
    idx, w = remap_topk(scores, crit, 6, logits=logits, rule=rule, renormalize=renormalize, scale=scale)
    assert torch.equal(idx, ref.remap_topk(scores, crit, 6))
    want = ref.routing_weights(logits, idx, rule, renormalize, scale)
    torch.testing.assert_close(w, want, atol=W_ATOL, rtol=W_RTOL)


def test_remap_weights_k1():
    # Llama-4: k=1, sigmoid weight
    g = torch.Generator().manual_seed(29)
    scores = torch.randn(7, 16, generator=g)
    crit = ref.oea_critical_set(scores, 1)
    idx, w = remap_topk(scores, crit, 1, rule="sigmoid")
    assert torch.equal(idx, ref.remap_topk(scores, crit, 1))
    torch.testing.assert_close(w, ref.routing_weights(scores, idx, "sigmoid"), atol=W_ATOL, rtol=W_RTOL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(1, 40),
    N=st.sampled_from([4, 7, 12, 33, 64]),
    kfrac=st.floats(0.0, 1.0),
    tau=st.sampled_from([0.0, 0.9, 1.0, 2.0, 5.0, math.inf]),
    grid=st.sampled_from([0, 2, 8]),
    seed=st.integers(0, 2**16),
)
def test_property_critical_set_and_remap(T, N, kfrac, tau, grid, seed):
    # grid > 0 quantizes logits (many exact ties between experts and bins)
    k = max(1, min(N, 1 + int(kfrac * min(N, 8))))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, N, generator=g) * 2
    if grid:
        scores = torch.round(scores * grid) / grid
    idx = _topk(scores, k)
    a, b = ref.default_lynx_bins(N, k)
    crit = ref.lynx_critical_set(scores, idx, k, a, b, tau)
    assert torch.equal(lynx_critical_set(scores, idx, k, a, b, tau), crit)
    assert int(crit.sum()) >= k and not (crit & ~ref.union_mask(idx, N)).any()
    new = remap_topk(scores, crit, k)
    assert torch.equal(new, ref.remap_topk(scores, crit, k))
    assert all(len(set(r)) == k for r in new.tolist())


def test_invalid_arguments():
    s = torch.randn(4, 8)
    idx = _topk(s, 2)
    with pytest.raises(ValueError):
        lynx_critical_set(s.double(), idx, 2, 1.0, 2, 1.0)  # fp64 scores
    with pytest.raises(ValueError):
        lynx_critical_set(s[0], idx, 2, 1.0, 2, 1.0)  # 1-d scores
    with pytest.raises(ValueError):
        lynx_critical_set(s, idx[:3], 2, 1.0, 2, 1.0)  # T mismatch
    with pytest.raises(ValueError):
        lynx_critical_set(s, idx, 9, 1.0, 2, 1.0)  # k > N
    with pytest.raises(ValueError):
        lynx_critical_set(s, idx, 2, 0.0, 2, 1.0)  # alpha <= 0
    with pytest.raises(ValueError):
        oea_critical_set(s, 0)
    with pytest.raises(ValueError):
        remap_topk(s, torch.ones(7, dtype=torch.bool), 2)  # critical of the wrong size
    with pytest.raises(ValueError):
        remap_topk(s, torch.ones(8, dtype=torch.bool), 2, rule="relu")
    with pytest.raises(ValueError):
        remap_topk(s, torch.ones(8, dtype=torch.bool), 2, logits=torch.randn(4, 9), rule="sigmoid")


def test_resolve_backend(monkeypatch):
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("triton", "cuda:0") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("triton", "cpu")
    with pytest.raises(ValueError):
        resolve_backend("cuda", "cpu")
