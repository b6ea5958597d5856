"""Property tests of the routing policies on plain tensors (hypothesis) and hand-worked cases
(CASES C11, C12, C13).

The strategies draw the score values, masks and row permutations themselves (so a counterexample shrinks to
a small tensor, not to a seed); the policy path (numba twins on CPU) is compared with plain-Python references
written from docs/design.md (``lynx_by_hand``, ``mass_greedy_by_hand``, ``remap_by_hand``), and hand-worked cases
pin each rule a mutant of lab/mutants.py would change."""

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from helpers.references import greedy_by_hand
from helpers.strategies import fuzz, planted_ties, tied_topk
from lynx_hf import LynxConfig
from lynx_hf import policies as P
from lynx_hf.kernels import routing_torch as R
from lynx_hf.policies.lynx import bin_parameters

SETTINGS = fuzz(3.5)

# Values are drawn by hypothesis (not from a drawn seed), so a failing case shrinks to a small tensor with
# simple values. Large shapes stay cheap: hypothesis' arrays draw a background value plus sparse elements.
VALUES = st.one_of(st.floats(-8.0, 8.0, width=32, allow_subnormal=False),
                   st.sampled_from([-2.0, -1.0, 0.0, 1.0]))  # few distinct values: many exact ties (C12)


@st.composite
def routing_case(draw, max_n=384, max_t=128):
    """``(s [T, N] fp32, k)``: drawn values, optional confident columns, ``-inf`` masks that leave at least k
    allowed experts per row, and a C13 shift."""
    n = draw(st.one_of(st.integers(2, 24), st.integers(2, max_n)))
    k = draw(st.integers(1, min(n, 16)))
    t = draw(st.one_of(st.integers(1, 8), st.integers(1, max_t)))
    scale = draw(st.sampled_from([1.0, 0.1, 4.0]))
    # small cases: every value drawn; large ones: a drawn background value plus sparsely drawn elements
    fill = st.nothing() if t * n <= 96 else None
    s = torch.from_numpy(draw(hnp.arrays(np.float32, (t, n), elements=VALUES, fill=fill)).copy()) * scale
    if draw(st.booleans()):  # confident rows: one large logit, at column (c0 + row * stride) mod N
        c0, stride = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        s[torch.arange(t), (c0 + torch.arange(t) * stride) % n] += 8.0
    if n > k and draw(st.booleans()):  # -inf masks leaving >= k allowed experts per row
        allowed = torch.from_numpy(draw(hnp.arrays(np.bool_, (t, n), elements=st.booleans())).copy())
        keep = torch.tensor(draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True)))
        rows = (keep[None, :] + torch.arange(t)[:, None]) % n  # a different k-subset per row
        allowed.scatter_(1, rows, True)
        s = s.masked_fill(~allowed, float("-inf"))
    s = s + draw(st.sampled_from([0.0, -1000.0, 1000.0, -3.5]))  # C13: shifts
    return s.float(), k


def own_topk(s, k):
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]


# -- independent references (plain Python over the score values; written from docs/design.md, not from the code) --
def _bins_by_hand(s, alpha):
    """bin = ceil((s - row max) * alpha), both steps rounded to fp32 as the spec says; None if forbidden."""
    out = []
    for row in s.tolist():
        m = np.float32(max(row))
        a = np.float32(alpha)
        out.append([None if math.isinf(v) else int(np.ceil(np.float32(np.float32(np.float32(v) - m) * a))) for v in row])
    return out


def lynx_by_hand(s, own, k, alpha, beta, tau):
    """The paper's rule (docs/design.md steps 1-4): votes of bins >= -beta weighted B ** bin (each power rounded to
    fp32, summed in fp64 from bin 0 down), restricted to U (the union of the own top-k); cover: each token's
    bin-0 expert of U with the highest score (lower id on ties); consensus: score >= tau (tau None: none);
    grow by score (lower id on ties) to k. Returns a set of expert ids."""
    bins = _bins_by_hand(s, alpha)
    union = {e for row in own for e in row}
    powers = [float(np.float32(float(len(own)) ** -j)) for j in range(beta + 1)]
    score = {}
    for e in union:
        acc = 0.0
        for j in range(beta + 1):
            acc = acc + sum(1 for row in bins if row[e] == -j) * powers[j]
        score[e] = acc
    crit = set()
    for row in bins:
        bin0 = [e for e in sorted(union) if row[e] == 0]
        if bin0:
            crit.add(max(bin0, key=lambda e: (score[e], -e)))
    if tau is not None:
        crit |= {e for e in union if score[e] >= tau}
    rest = sorted(union - crit, key=lambda e: (-score[e], e))
    return crit | set(rest[: max(k - len(crit), 0)])


def fixed_point_weights(s, own):
    """W[t][e] = round(2**24 * exp(s - max) / sum over the token's own top-k), 0 where forbidden (fp32 as torch
    computes it: the greedy below must see the production's exact integers to be compared bit for bit)."""
    rel = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    rel = torch.where(torch.isfinite(s), rel, torch.zeros_like(rel))
    return torch.round(rel / rel.gather(1, own).sum(-1, keepdim=True) * 2**24).long().tolist()


def mass_greedy_by_hand(weights, own, start, k, threshold):
    """The routing-mass greedy of helpers/references.py::greedy_by_hand on given integer weights."""
    union = sorted({e for row in own for e in row})
    S = set(start)
    while True:
        gains = {}
        for e in union:
            if e not in S:
                total = 0
                for w in weights:
                    inside = sorted((w[j] for j in S), reverse=True)
                    total += max(0, w[e] - (inside[k - 1] if len(inside) >= k else 0))
                gains[e] = total
        if not gains:
            return S
        best = max(gains, key=lambda e: (gains[e], -e))
        if not (gains[best] >= threshold or len(S) < k):
            return S
        S.add(best)


def reference_critical_set(cfg, s, own, k):
    n = s.shape[1]
    own_l = own.tolist()
    if cfg.policy == "oea":  # each token's top-k0 by score, ties -> its own experts, then lower id
        k0 = min(cfg.oea_k0, k)
        rows = [sorted(range(n), key=lambda e: (-v[e], e not in mine, e))[:k0] for v, mine in zip(s.tolist(), own_l)]
        return {e for row in rows for e in row}
    alpha, beta = bin_parameters(cfg, n, k)
    if math.isinf(alpha):  # k == N: the union
        return {e for row in own_l for e in row}
    if cfg.mass_price is None:
        return lynx_by_hand(s, own_l, k, alpha, beta, cfg.tau)
    cover = lynx_by_hand(s, own_l, 1, alpha, beta, None)
    price, voters = math.ceil(cfg.mass_price * 2**24), len(own_l)
    threshold = {"token": price, "batch": price * voters,
                 "sqrt": math.ceil(math.sqrt(voters) * float(price))}[cfg.price_unit]
    return mass_greedy_by_hand(fixed_point_weights(s, own), own_l, cover, k, threshold)


def remap_by_hand(s, critical, k, own):
    """Each token's top-k by (allowed and in S, allowed, forbidden), then score, then its own experts (``own``, the
    model's top-k ids per token), then lower id."""
    out = []
    for row, mine in zip(s.tolist(), own.tolist()):
        def key(e):
            allowed = not math.isinf(row[e])
            return (-(2 if allowed and e in critical else 1 if allowed else 0), -row[e] if allowed else 0.0,
                    e not in mine, e)
        out.append(sorted(range(len(row)), key=key)[:k])
    return out


PAPER = dict(policy="lynx", mass_price=None)  # LYNX as the paper specifies it (no project extension)
CONFIGS = [LynxConfig(policy="lynx"), LynxConfig(**PAPER), LynxConfig(**PAPER, tau=0.0), LynxConfig(**PAPER, tau=4.0, alpha=4.0),
           LynxConfig(policy="lynx", mass_price=2.0),
           LynxConfig(policy="oea", oea_k0=1), LynxConfig(policy="oea", oea_k0=3)]


REFERENCE_CONFIGS = CONFIGS + [LynxConfig(mass_price=0.3, price_unit="batch"),
                                LynxConfig(mass_price=0.2, price_unit="sqrt")]


@SETTINGS
@given(case=routing_case(), cfg=st.sampled_from(CONFIGS), data=st.data())
def test_remap_invariants(case, cfg, data):
    s, k = case
    t, n = s.shape
    idx = own_topk(s, k)
    new = P.remap(cfg, s, idx)
    critical = P.critical_set(cfg, s, idx, k)
    # exactly k distinct, allowed experts per token
    assert new.shape == (t, k) and new.dtype == torch.int64
    if k > 1:
        assert bool((new.sort(dim=-1).values.diff(dim=-1) > 0).all())
    assert bool(torch.isfinite(s.gather(1, new)).all())
    # the remap uses the critical set: a token with >= k allowed experts in S takes only experts of S,
    # otherwise it takes every allowed expert of S (and fills the rest outside)
    allowed_in_s = torch.isfinite(s) & critical[None, :]
    in_s = critical[new]
    enough = allowed_in_s.sum(-1) >= k
    assert bool(in_s[enough].all())
    assert bool((in_s.sum(-1) == allowed_in_s.sum(-1))[~enough].all())
    # the batch never loads an expert it did not need anyway: S and the experts used lie inside the union
    before, after = R.union_mask(idx, n), R.union_mask(new, n)
    assert bool((critical <= before).all()) and bool((after <= before).all())
    # determinism
    assert torch.equal(P.remap(cfg, s.clone(), idx.clone()), new)
    # row-order invariance: permuting tokens (a drawn permutation) permutes the result
    perm = torch.tensor(data.draw(st.permutations(range(t)), label="row permutation"), dtype=torch.long)
    assert torch.equal(P.remap(cfg, s[perm], idx[perm]), new[perm])
    if cfg.policy == "lynx":
        # each token keeps one of its bin-0 experts
        alpha, _ = bin_parameters(cfg, n, k)
        if not math.isinf(alpha):
            bins = R.lynx_bins(s, alpha)
            assert bool((bins.gather(1, new) == 0).any(dim=-1).all())
    else:
        # OEA: each token keeps its own top-k0
        k0 = min(cfg.oea_k0, k)
        assert bool((idx[:, :k0, None] == new[:, None, :]).any(-1).all())
    if t == 1:
        assert torch.equal(new.sort(-1).values, idx.sort(-1).values)


@SETTINGS
@given(case=routing_case(max_n=40, max_t=20), cfg=st.sampled_from(REFERENCE_CONFIGS), data=st.data())
def test_critical_set_and_remap_equal_the_independent_reference(case, cfg, data):
    """The policy's critical set and remap (the production path: numba twins on CPU) equal plain-Python
    references written from docs/design.md (paper rule, routing-mass greedy, OEA) on every drawn case; the model's
    own top-k takes tied experts lower id first, or in a drawn order (as ``torch.topk`` may)."""
    s, k = case
    idx = own_topk(s, k)
    if data.draw(st.booleans(), label="own ties in a drawn order"):
        order = torch.tensor(data.draw(st.permutations(range(s.shape[1])), label="tie order"))
        idx = tied_topk(s, k, order)
    want = reference_critical_set(cfg, s, idx, k)
    got = P.critical_set(cfg, s, idx, k)
    assert set(got.nonzero().flatten().tolist()) == want
    assert P.remap(cfg, s, idx).tolist() == remap_by_hand(s, want, k, idx)


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
    new = P.remap(LynxConfig(policy=policy, oea_k0=1), s, own_topk(s, k))
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


def _keeps_every_own_set(n, k):
    """The configurations that keep each token's own top-k: OEA with ``oea_k0 = k`` (each token keeps its own
    top-k0), XShare with a budget of N (every candidate joins), with and without its warm-up."""
    return [LynxConfig(policy="oea", oea_k0=k), LynxConfig(policy="xshare", xshare_budget=n, xshare_warmup=0),
            LynxConfig(policy="xshare", xshare_budget=n, xshare_warmup=k)]


def _assert_k_distinct_allowed(s, new, k):
    assert new.shape == (s.shape[0], k)
    assert all(len(set(row)) == k for row in new.tolist())
    assert bool(torch.isfinite(s.gather(1, new)).all())


@pytest.mark.parametrize("path", ["numba", "torch"])
@pytest.mark.parametrize("own_from", ["torch.topk", "ties highest id first"])
@pytest.mark.parametrize("case", ["zeros", "planted ties"])
@pytest.mark.parametrize("n,k,t", [(8, 2, 3), (12, 3, 9), (60, 4, 16)])
def test_ties_keep_the_tokens_own_experts(path, own_from, case, n, k, t):
    """Exact ties (all-zero router scores, the new-user finding of docs/guarantees.md; random scores with ties planted
    across each row's top-k boundary, some experts forbidden) with the model's own top-k ids in another order than
    lower id first (``torch.topk``'s own, or highest id first): OEA with ``oea_k0 = k`` and XShare with a budget of N
    return each token's own set exactly (ties -> the token's own experts, then lower id), on the numba twins (CPU,
    eager) and the torch ops (``strict_sync_free``: the accelerator path); LYNX (default and paper rule) and OEA with
    ``oea_k0 = 1`` still give k distinct allowed experts per token."""
    s = torch.zeros(t, n) if case == "zeros" else planted_ties(t, n, k, seed=n * 100 + t)
    own = torch.topk(s, k).indices if own_from == "torch.topk" else tied_topk(s, k, torch.arange(n).flip(0))
    # the subject: the model's own top-k is not the lower-id one on some row (else this would prove nothing)
    assert any(set(a) != set(b) for a, b in zip(own.tolist(), own_topk(s, k).tolist()))
    with R.strict_sync_free() if path == "torch" else contextlib.nullcontext():
        for cfg in _keeps_every_own_set(n, k):
            new = P.remap(cfg, s, own)
            assert [set(r) for r in new.tolist()] == [set(r) for r in own.tolist()], cfg
        for cfg in (LynxConfig(), LynxConfig(**PAPER), LynxConfig(policy="oea", oea_k0=1)):
            _assert_k_distinct_allowed(s, P.remap(cfg, s, own), k)


@SETTINGS
@given(case=routing_case(max_n=64, max_t=32), data=st.data())
def test_ties_keep_the_tokens_own_experts_drawn(case, data):
    """The same on drawn cases (grid values: many exact ties; ``-inf`` masks; shifts) with the model's own top-k
    taking tied experts in a drawn order: OEA ``oea_k0 = k`` and XShare budget N keep every token's own set."""
    s, k = case
    n = s.shape[1]
    own = tied_topk(s, k, torch.tensor(data.draw(st.permutations(range(n)), label="tie order")))
    for cfg in _keeps_every_own_set(n, k):
        new = P.remap(cfg, s, own)
        assert [set(r) for r in new.tolist()] == [set(r) for r in own.tolist()], cfg
        _assert_k_distinct_allowed(s, new, k)


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


def test_mass_price_hand_worked():
    """k=2, N=4, two tokens. Token 0 relative weights (e0, e1) = (2/3, 1/3), token 1 (e2, e1) = (0.8, 0.2).
    Cover (bin width ln 2 / 2 = 0.347) gives {e0, e2}; adding e1 restores 1/3 + 0.2 = 0.533 of a token's
    top-k mass: joins at price 0.5, not at 0.6."""
    s = torch.full((2, 4), -20.0)
    s[0, 0], s[0, 1] = 0.0, math.log(0.5)
    s[1, 2], s[1, 1] = 0.0, math.log(0.25)
    idx = own_topk(s, 2)
    for price, expected in ((0.5, [0, 1, 2]), (0.6, [0, 2])):
        new = P.remap(LynxConfig(mass_price=price, price_unit="token", tau=1e9), s, idx)
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


def _hand_worked_batch():
    """N=8, k=2, B=3 (test_hand_worked_lynx_example's tokens): own top-2 [[0,1],[1,2],[3,1]], U = {0,1,2,3}."""
    s = torch.full((3, 8), -10.0)
    s[0, 0], s[0, 1] = 0.0, -0.1
    s[1, 1], s[1, 2] = 0.0, -1.0
    s[2, 3], s[2, 1] = 0.0, -0.3
    return s, own_topk(s, 2)


@pytest.mark.parametrize("cfg", [LynxConfig(**PAPER), LynxConfig(mass_price=0.5, price_unit="token"),
                                 LynxConfig(mass_price=0.25)], ids=["paper", "token 0.5", "default unit sqrt 0.25"])
def test_policy_critical_set_is_smaller_than_the_union_hand_worked(cfg):
    """Through the policy (the decode path's ops): S = {0, 1, 3}, strictly inside U = {0, 1, 2, 3}; every
    token's remapped experts lie in S. Paper rule: cover {1}, consensus (score >= 1) e0, e1, e3. Mass
    price 0.5 / token, or 0.25 x sqrt(3) = .433 with the default unit: cover {1}; relative weights t0 (e0 .525, e1 .475), t1 (e1 .731, e2 .269), t2 (e3 .574,
    e1 .426): e3 joins first (.574, |S| < k), then e0 (.525 >= .5 / .433), then e2 would restore only .269."""
    s, idx = _hand_worked_batch()
    crit = P.critical_set(cfg, s, idx, 2)
    assert crit.nonzero().flatten().tolist() == [0, 1, 3]
    new = P.remap(cfg, s, idx)
    assert new.tolist() == [[0, 1], [1, 0], [3, 1]]  # t1 loses e2: e0 ties e3 at -10 -> lower id
    assert len(set(new.flatten().tolist())) == 3 < len(set(idx.flatten().tolist())) == 4


def test_policy_mass_price_gain_is_measured_against_the_kth_expert_in_the_set():
    """The default rule through the policy path (numba twins on CPU): S0 = cover {e0} + seed {e3}, k = 2, two
    tokens with relative weights (e0 .731, e1 .269, e2 .180, e3 .036): each already holds k experts of S,
    so e1 gains 2 x (.269 - .036) = .466 (< .5: not added; a gain of w, 2 x .269 = .538, would add it)."""
    row = torch.tensor([3.0, 2.0, 1.6, 0.0])
    s = torch.stack([row, row])
    own = own_topk(s, 2)
    seed = torch.tensor([False, False, False, True])
    assert P.critical_set(LynxConfig(mass_price=0.5, price_unit="token"), s, own, 2, seed=seed).nonzero().flatten().tolist() == [0, 3]
    assert P.critical_set(LynxConfig(mass_price=0.45, price_unit="token"), s, own, 2, seed=seed).nonzero().flatten().tolist() == [0, 1, 3]
    for price, want in ((0.5, {0, 3}), (0.45, {0, 1, 3})):
        assert greedy_by_hand(s, own.tolist(), [0, 3], 2, math.ceil(price * 2**24)) == want


@pytest.mark.parametrize("seed", range(12))
def test_policy_default_matches_greedy_by_hand(seed):
    """The default config's critical set (policy path) = cover + helpers/references.greedy_by_hand (the
    independent plain-Python greedy)."""
    g = torch.Generator().manual_seed(seed)
    t, n = int(torch.randint(2, 10, (1,), generator=g)), int(torch.randint(4, 16, (1,), generator=g))
    k = int(torch.randint(2, 5, (1,), generator=g))
    s = torch.randn(t, n, generator=g) * 2
    own = own_topk(s, k)
    alpha, beta = R.default_lynx_bins(n, k)
    cover = lynx_by_hand(s, own.tolist(), 1, alpha, beta, None)
    cfg = LynxConfig()  # the default: mass_price 7/64 per sqrt(B) voting tokens (B = t here)
    assert (cfg.mass_price, cfg.price_unit) == (0.109375, "sqrt")
    want = greedy_by_hand(s, own.tolist(), sorted(cover), k, math.ceil(math.sqrt(t) * float(math.ceil(0.109375 * 2**24))))
    assert set(P.critical_set(cfg, s, own, k).nonzero().flatten().tolist()) == want


def test_bin_minus_beta_still_votes():
    """The lowest voting bin is -beta (inclusive). N=8, k=2: beta = 3, bin width ln4/3 = .462. tau = 100: no
    consensus; cover {e0}; grow by score to k: e2 has votes in bins -3 (t0, gap -1.6) and -2 (t1, gap -1.2):
    1/27 + 1/9; e1 one vote in bin -2 (t2): 1/9. e2 joins. (Dropping bin -beta ties them: e1 would join.)"""
    s = torch.full((3, 8), -10.0)
    s[:, 0] = 0.0
    s[0, 2], s[1, 2], s[2, 1] = -1.6, -1.2, -1.2
    idx = own_topk(s, 2)
    a, b = R.default_lynx_bins(8, 2)
    assert R.lynx_bins(s, a)[0, 2].item() == -b == -3 and R.lynx_bins(s, a)[1, 2].item() == -2
    cfg = LynxConfig(**PAPER, tau=100.0)
    assert P.critical_set(cfg, s, idx, 2).nonzero().flatten().tolist() == [0, 2]
    assert R.lynx_critical_set(s, idx, 2, a, b, 100.0).nonzero().flatten().tolist() == [0, 2]
    assert lynx_by_hand(s, idx.tolist(), 2, a, b, 100.0) == {0, 2}


def test_consensus_admits_a_score_equal_to_tau():
    """Consensus is score >= tau: in the hand-worked batch e0 and e3 score exactly 1 (one bin-0 vote each)."""
    s, idx = _hand_worked_batch()
    assert P.critical_set(LynxConfig(**PAPER, tau=1.0), s, idx, 2).nonzero().flatten().tolist() == [0, 1, 3]
    assert P.critical_set(LynxConfig(**PAPER, tau=1.5), s, idx, 2).nonzero().flatten().tolist() == [0, 1]
