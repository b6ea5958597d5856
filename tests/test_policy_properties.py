"""Property tests of the routing policies on plain tensors (hypothesis) and hand-worked cases
(CASES C11, C12, C13)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx_hf import LynxConfig
from lynx_hf import errors as lynx_hf_errors
from lynx_hf import policies as P
from lynx_hf.policies.lynx import bin_parameters
from lynx_hf.kernels import routing_torch as R

SETTINGS = settings(max_examples=350, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routing_case(draw, max_n=384, max_t=128):
    n = draw(st.integers(2, max_n))
    k = draw(st.integers(1, min(n, 16)))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "ties", "peaked"]))
    if kind == "normal":
        s = torch.randn(t, n, generator=g) * draw(st.sampled_from([0.1, 1.0, 4.0]))
    elif kind == "ties":  # few distinct values: many exact ties (C12)
        s = torch.randint(-2, 2, (t, n), generator=g).float()
    else:  # confident rows: one large logit
        s = torch.randn(t, n, generator=g)
        s[torch.arange(t), torch.randint(0, n, (t,), generator=g)] += 8.0
    if draw(st.booleans()) and n > k:  # -inf masks leaving >= k allowed experts per row
        allowed = torch.rand(t, n, generator=g) < draw(st.sampled_from([0.3, 0.7]))
        keep = torch.rand(t, n, generator=g).argsort(dim=-1)[:, :k]
        allowed.scatter_(1, keep, True)
        s = s.masked_fill(~allowed, float("-inf"))
    s = s + draw(st.sampled_from([0.0, -1000.0, 1000.0, -3.5]))  # C13: shifts
    return s.float(), k


def own_topk(s, k):
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]


PAPER = dict(policy="lynx", mass_price=None)  # LYNX as the paper specifies it (no project extension)
CONFIGS = [LynxConfig(policy="lynx"), LynxConfig(**PAPER), LynxConfig(**PAPER, tau=0.0), LynxConfig(**PAPER, tau=4.0, alpha=4.0),
           LynxConfig(policy="lynx", mass_price=2.0),
           LynxConfig(policy="oea", k0=1), LynxConfig(policy="oea", k0=3)]


@SETTINGS
@given(case=routing_case(), cfg=st.sampled_from(CONFIGS))
def test_remap_invariants(case, cfg):
    s, k = case
    t, n = s.shape
    idx = own_topk(s, k)
    new = P.remap(cfg, s, idx)
    # exactly k distinct, allowed experts per token
    assert new.shape == (t, k) and new.dtype == torch.int64
    assert bool((new.sort(dim=-1).values.diff(dim=-1) > 0).all()) if k > 1 else True
    assert bool(torch.isfinite(s.gather(1, new)).all())
    # the batch never loads an expert it did not need anyway: unique after <= before
    before, after = R.union_mask(idx, n), R.union_mask(new, n)
    assert bool((after <= before).all())
    # determinism
    assert torch.equal(P.remap(cfg, s.clone(), idx.clone()), new)
    # row-order invariance: permuting tokens permutes the result
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(t))
    assert torch.equal(P.remap(cfg, s[perm], idx[perm]), new[perm])
    if cfg.policy == "lynx":
        # each token keeps one of its bin-0 experts
        alpha, _ = bin_parameters(cfg, n, k)
        if not math.isinf(alpha):
            bins = R.lynx_bins(s, alpha)
            assert bool((bins.gather(1, new) == 0).any(dim=-1).all())
    else:
        # OEA: each token keeps its own top-k0
        k0 = min(cfg.k0, k)
        assert bool((idx[:, :k0, None] == new[:, None, :]).any(-1).all())
    if t == 1:
        assert torch.equal(new.sort(-1).values, idx.sort(-1).values)


@SETTINGS
@given(case=routing_case(max_n=64, max_t=32), cfg=st.sampled_from(CONFIGS), shift=st.sampled_from([-1000.0, 17.0]))
def test_C13_shift_invariance(case, cfg, shift):
    """C13: adding a constant to every logit changes neither bins, scores nor the remap."""
    s, k = case
    s = s.clamp(min=-50, max=50).masked_fill(torch.isinf(s), float("-inf"))  # keep the shift exact in fp32
    s = torch.round(s * 64) / 64  # dyadic values: s + shift is exact, so gaps are unchanged
    idx = own_topk(s, k)
    assert torch.equal(P.remap(cfg, s + shift, idx), P.remap(cfg, s, idx))


@pytest.mark.parametrize("policy", ["lynx", "oea"])
@pytest.mark.parametrize("n,k,t", [(8, 2, 5), (60, 4, 16), (384, 8, 3)])
def test_C12_all_zero_logits_pick_lowest_ids(policy, n, k, t):
    """C12: all-zero logits -> every token takes experts 0..k-1 (lower-index tie-breaking)."""
    s = torch.zeros(t, n)
    new = P.remap(LynxConfig(policy=policy, k0=1), s, own_topk(s, k))
    assert torch.equal(new, torch.arange(k).expand(t, k))


@pytest.mark.parametrize("policy", ["lynx", "oea"])
def test_C12_rows_inf_except_two_experts(policy):
    """C12: rows that are -inf except two experts: always those two, never a forbidden one."""
    s = torch.full((4, 10), float("-inf"))
    s[0, [3, 7]] = torch.tensor([0.5, 0.5])
    s[1, [0, 9]] = torch.tensor([-1.0, 2.0])
    s[2, [3, 7]] = torch.tensor([-5.0, -5.0])
    s[3, [1, 2]] = torch.tensor([1.0, 0.0])
    new = P.remap(LynxConfig(policy=policy), s, own_topk(s, 2))
    assert [set(r) for r in new.tolist()] == [{3, 7}, {0, 9}, {3, 7}, {1, 2}]
    assert new[0].tolist() == [3, 7]  # exact tie -> lower id first
    with pytest.raises(ValueError, match="fewer than top_k"):
        R.remap_topk(s, torch.ones(10, dtype=torch.bool), 3)


def test_hand_worked_lynx_example():
    """N=8, k=2, B=3 worked by hand: alpha = beta/ln(4), beta = 3 -> bin width ln(4)/3 = 0.462."""
    a, b = R.default_lynx_bins(8, 2)
    assert b == 3 and a == pytest.approx(3 / math.log(4))
    s = torch.full((3, 8), -10.0)
    s[0, 0], s[0, 1] = 0.0, -0.1     # token 0: experts 0,1 near-tied (both bin 0)
    s[1, 1], s[1, 2] = 0.0, -1.0     # token 1: confident 1; expert 2 is bin ceil(-1*2.164) = -2
    s[2, 3], s[2, 1] = 0.0, -0.3     # token 2: 3 then 1 (bin 0)
    idx = own_topk(s, 2)              # [[0,1],[1,2],[3,1]] ; U = {0,1,2,3}
    bins = R.lynx_bins(s, a)
    assert bins[1, 2].item() == -2 and bins[0, 1].item() == 0 and bins[2, 1].item() == 0
    # scores: e0 = 1, e1 = 3 (three bin-0 votes), e2 = B^-2 = 1/9, e3 = 1
    crit = R.lynx_critical_set(s, idx, 2, a, b, tau=1.0)
    # cover: t0 -> e1 (score 3 > 1), t1 -> e1, t2 -> e1 (bin-0 {3, 1}); consensus tau=1: e0, e1, e3
    assert crit.nonzero().flatten().tolist() == [0, 1, 3]
    crit2 = R.lynx_critical_set(s, idx, 2, a, b, tau=2.0)  # consensus only e1; grow by score: e0 (tie e3 -> lower id)
    assert crit2.nonzero().flatten().tolist() == [0, 1]
    new = R.remap_topk(s, crit2, 2)
    assert new.tolist() == [[0, 1], [1, 0], [1, 0]]


def test_C11_bf16_ties_within_one_ulp_match_fp32_reference():
    """C11: bf16 router logits that tie within one bf16 ulp: the remap runs on the exact fp32 upcast
    and breaks the tie to the lower id; weights computed in fp32 and only then cast."""
    fp32 = torch.tensor([[1.0, 1.001, 0.2, 1.002, -0.5, 0.9]] * 3 + [[0.1, 0.3, 1.0, 1.003, 0.0, 0.2]])
    bf16 = fp32.to(torch.bfloat16)
    assert bf16[0, 0] == bf16[0, 1] == bf16[0, 3]  # all three tie in bf16
    s = bf16.float()
    idx = own_topk(s, 2)
    assert idx[0].tolist() == [0, 1]
    new = P.remap(LynxConfig(**PAPER), s, idx)
    ref = R.remap_topk(s, R.lynx_critical_set(s, idx, 2, *R.default_lynx_bins(6, 2), 1.0), 2)
    assert torch.equal(new, ref)
    w = R.routing_weights(bf16, new, "softmax_all").to(torch.bfloat16)
    w_ref = torch.softmax(s, -1).gather(1, new).to(torch.bfloat16)
    assert torch.equal(w, w_ref)


@pytest.mark.parametrize("rule,renorm,scale", [("softmax_all", False, 1.0), ("softmax_all", True, 1.0),
                                               ("softmax_chosen", False, 1.0), ("sigmoid", False, 1.0),
                                               ("softmax_all", False, 2.5)])
def test_weight_rules_against_formulas(rule, renorm, scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, generator=g)
    idx = own_topk(logits, 3)
    w = R.routing_weights(logits, idx, rule, renorm, scale)
    chosen = logits.gather(1, idx)
    if rule == "softmax_all":
        ref = torch.exp(chosen) / torch.exp(logits).sum(-1, keepdim=True)
    elif rule == "softmax_chosen":
        ref = torch.exp(chosen) / torch.exp(chosen).sum(-1, keepdim=True)
    else:
        ref = 1 / (1 + torch.exp(-chosen))
    if renorm:
        ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(w, ref * scale, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="unknown weight rule"):
        R.routing_weights(logits, idx, "relu")


@pytest.mark.parametrize("floor", [0.0, 0.3, 0.6, 1.0])
def test_mass_floor_keeps_each_tokens_leading_mass(floor):
    """mass_floor: each token keeps its highest-weight experts until they hold >= floor of its top-k
    weight (worked by hand for one token below); floor 1 keeps every original expert."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(16, 24, generator=g) * 2
    idx = own_topk(s, 4)
    w = torch.softmax(s, -1).gather(1, idx)
    cfg = LynxConfig(**PAPER, mass_floor=floor, tau=1e6)  # tau huge: consensus adds nothing
    new = P.remap(cfg, s, idx, topk_weights=w)
    share = w / w.sum(-1, keepdim=True)
    for t in range(16):
        kept = [e for e in idx[t].tolist() if e in new[t].tolist()]
        kept_share = sum(share[t, j].item() for j, e in enumerate(idx[t].tolist()) if e in kept)
        assert kept_share >= floor - 1e-6
    if floor == 1.0:
        assert torch.equal(new.sort(-1).values, idx.sort(-1).values)
    # by hand: weights [0.5, 0.3, 0.15, 0.05], floor 0.6 -> keep slots 0 and 1 (0.5 < 0.6, 0.8 >= 0.6)
    keep = R.mass_floor_set(torch.tensor([[7, 2, 5, 1]]), torch.tensor([[0.5, 0.3, 0.15, 0.05]]), 8, 0.6)
    assert keep.nonzero().flatten().tolist() == [2, 7]
    with pytest.raises(lynx_hf_errors.LynxConfigError, match="mass_floor"):
        LynxConfig(mass_floor=1.5)


def test_mass_price_hand_worked():
    """k=2, N=4, two tokens. Token 0 relative weights (e0, e1) = (2/3, 1/3), token 1 (e2, e1) = (0.8, 0.2).
    Cover (bin width ln 2 / 2 = 0.347) gives {e0, e2}; adding e1 restores 1/3 + 0.2 = 0.533 of a token's
    top-k mass: joins at price 0.5, not at 0.6."""
    s = torch.full((2, 4), -20.0)
    s[0, 0], s[0, 1] = 0.0, math.log(0.5)
    s[1, 2], s[1, 1] = 0.0, math.log(0.25)
    idx = own_topk(s, 2)
    for price, expected in ((0.5, [0, 1, 2]), (0.6, [0, 2])):
        new = P.remap(LynxConfig(mass_price=price, tau=1e9), s, idx)
        assert sorted(set(new.flatten().tolist())) == expected


@SETTINGS
@given(case=routing_case(max_n=96, max_t=48), prices=st.tuples(st.floats(0, 3), st.floats(0, 3)))
def test_mass_price_is_monotone_and_stays_in_union(case, prices):
    """A higher price never loads more experts (the greedy path is the same, it stops earlier); the set
    stays inside the union of the model's own top-k and always holds >= k experts."""
    s, k = case
    n = s.shape[1]
    idx = own_topk(s, k)
    lo, hi = sorted(prices)
    crit = {p: P.critical_set(LynxConfig(mass_price=p), s, idx, k) for p in (lo, hi)}
    assert bool((crit[hi] <= crit[lo]).all())
    assert bool((crit[lo] <= R.union_mask(idx, n)).all())
    assert int(crit[hi].sum()) >= k
    new = P.remap(LynxConfig(mass_price=hi), s, idx)
    assert bool(torch.isfinite(s.gather(1, new)).all())
