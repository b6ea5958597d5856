"""XShare (the peer baseline, arXiv 2602.07265) and the batch price unit of the routing-mass greedy,
on hand-worked cases."""

import math

import pytest
import torch

import lynx_hf
from helpers import families as fam
from helpers.references import greedy_by_hand
from lynx_hf import policies
from lynx_hf.kernels import routing_torch as rt

NEG = -9.0  # far below: softmax weight ~1e-5, never chosen


def _scores():
    # T=3 tokens, N=5 experts, k=2. Softmax per row of (2, 1, 0) gives 0.665 / 0.245 / 0.090.
    return torch.tensor([[2.0, 1.0, 0.0, NEG, NEG],
                         [0.0, 2.0, 1.0, NEG, NEG],
                         [0.0, NEG, 1.0, 2.0, NEG]])


def test_xshare_hand_worked():
    """Aggregated gating mass: e0 = .665+.090+.090 = .845, e1 = .245+.665 = .910, e2 = .090+.245+.245
    = .580, e3 = .665 (e4 ~ 0, and in no token's top-2). Budget 2: {e1, e0}. Warm-up 1 first keeps each
    token's top-1 {e0, e1, e3}: already over budget. Budget 3 without warm-up: {e1, e0, e3}."""
    s = _scores()
    idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :2]
    assert idx.tolist() == [[0, 1], [1, 2], [3, 2]]
    assert rt.xshare_critical_set(s, idx, 2, budget=2, warmup=0).nonzero().flatten().tolist() == [0, 1]
    assert rt.xshare_critical_set(s, idx, 2, budget=2, warmup=1).nonzero().flatten().tolist() == [0, 1, 3]
    assert rt.xshare_critical_set(s, idx, 2, budget=3, warmup=0).nonzero().flatten().tolist() == [0, 1, 3]
    # the remap with S = {e0, e1}: every token takes its top-2 inside S, even token 2, for whom e1 is a
    # weak (score -9) but allowed expert: S supplies k experts, so its own e3 / e2 are dropped.
    crit = rt.xshare_critical_set(s, idx, 2, budget=2, warmup=0)
    assert rt.remap_topk(s, crit, 2).tolist() == [[0, 1], [1, 0], [0, 1]]


def test_xshare_votes_only_with_voting_rows_and_keeps_the_seed():
    s = _scores()
    idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :2]
    vote = torch.tensor([True, False, True])  # row 1 is a prefill row: its experts are the seed
    seed = rt.union_mask(idx, 5, ~vote)
    crit = rt.xshare_critical_set(s, idx, 2, budget=2, warmup=0, vote=vote, seed=seed)
    # seed {e1, e2} (|S| = 2 already = budget): nothing else joins
    assert crit.nonzero().flatten().tolist() == [1, 2]


def test_xshare_policy_config_budget_from_fraction():
    cfg = lynx_hf.LynxConfig(policy="xshare", xshare_fraction=0.4, xshare_warmup=0)
    s = _scores()
    idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :2]
    crit = policies.critical_set(cfg, s, idx)
    assert crit.sum().item() == math.ceil(0.4 * 5) == 2
    with pytest.raises(lynx_hf.LynxConfigError, match="xshare_fraction"):
        lynx_hf.LynxConfig(policy="xshare", xshare_fraction=0.0)


def test_greedy_gain_is_measured_against_the_kth_expert_in_the_set():
    """Tokens that already hold k experts of S gain only the difference to their k-th (a gain of w
    itself would admit e1 here): S0 = {e0, e3}, k = 2. Relative weights of (3, 2, 1.6, 0) over own
    top-2 {e0, e1}: .731, .269, .180, .036. Gains per token: e1 .233, e2 .144 (not .269 / .180)."""
    row = torch.tensor([3.0, 2.0, 1.6, 0.0])
    s = torch.stack([row, row])
    own = torch.tensor([[0, 1], [0, 1]])
    start = torch.tensor([True, False, False, True])
    # union U = {e0, e1}: e1 is the only candidate; total gain 2 x .233 = .466
    assert not rt.mass_greedy_grow(s, own, start, 2, 0.5)[1]  # .466 < .5 (a gain of w, .538, would pass)
    assert rt.mass_greedy_grow(s, own, start, 2, 0.45)[1]
    assert greedy_by_hand(s, own.tolist(), [0, 3], 2, math.ceil(0.45 * 2**24)) == {0, 1, 3}


def test_batch_price_unit_scales_the_price_with_the_voting_tokens():
    """price_unit="batch": the threshold is mass_price x B (B = voting tokens)."""
    row = torch.tensor([3.0, 2.0, 1.6, 0.0])
    s = torch.stack([row, row, row])
    own = torch.tensor([[0, 1]] * 3)
    start = torch.tensor([True, False, False, True])
    gain = 3 * 0.2331  # three tokens gain .233 each for e1
    for vote, voters in ((None, 3), (torch.tensor([True, True, False]), 2)):
        for price in (0.2, 0.24):
            got = bool(rt.mass_greedy_grow(s, own, start, 2, price, vote=vote, unit="batch")[1])
            assert got == (voters * 0.2331 >= voters * price)  # per token: .2331 vs the price
            absolute = bool(rt.mass_greedy_grow(s, own, start, 2, price * 3, vote=vote)[1])
            assert absolute == (voters * 0.2331 >= price * 3)
    assert gain > 0.6


def test_sqrt_price_unit_scales_the_price_with_the_square_root_of_the_voting_tokens():
    """price_unit="sqrt": the threshold is mass_price x sqrt(B). Four identical tokens each gain
    w1 - w(k-th in S) for e1 (hand-worked below); e1 joins iff 4 x gain >= price x sqrt(4) = 2 price."""
    row = torch.tensor([3.0, 2.0, 1.6, 0.0])
    s = torch.stack([row] * 4)
    own = torch.tensor([[0, 1]] * 4)
    start = torch.tensor([True, False, False, True])
    p = torch.softmax(row, 0)
    top = p[0] + p[1]
    per_token = float((p[1] - p[3]) / top)  # e1 displaces e3 (k = 2: S = {0, 3}): gain w1 - w3
    for price in (1.9 * per_token, 2.1 * per_token):  # 4 tokens x gain vs 2 x price: joins iff price <= 2 gain
        got = bool(rt.mass_greedy_grow(s, own, start, 2, price, unit="sqrt")[1])
        assert got == (price <= 2 * per_token), (price, per_token)
        # the same price with the two other units: token (threshold price) and batch (4 x price)
        assert bool(rt.mass_greedy_grow(s, own, start, 2, price, unit="token")[1])
        assert not bool(rt.mass_greedy_grow(s, own, start, 2, price, unit="batch")[1])
    assert rt.batch_threshold(3, torch.tensor(4), "sqrt").item() == 6 == rt.batch_threshold(3, 4, "sqrt")
    assert rt.batch_threshold(3, 2, "sqrt") == 5  # ceil(3 x 1.414...) = 5


@pytest.mark.parametrize("seed", range(40))
def test_greedy_matches_the_independent_reference(seed):
    g = torch.Generator().manual_seed(seed)
    T, N, k = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(2, 13, (1,), generator=g)), 0
    k = int(torch.randint(1, min(N, 4) + 1, (1,), generator=g))
    s = torch.randn(T, N, generator=g) * 2
    own = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    start = torch.zeros(N, dtype=torch.bool)
    start[own[0, 0]] = True
    price = float(torch.rand(1, generator=g)) * 1.5
    got = rt.mass_greedy_grow(s, own, start, k, price)
    want = greedy_by_hand(s, own.tolist(), [int(own[0, 0])], k, math.ceil(price * 2**24))
    assert set(got.nonzero().flatten().tolist()) == want


def test_policy_xshare_generates_and_remaps():
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(16, 5)
    # gate="always": the subject is the policy's remap, which the cost gate may skip on a tiny model
    with lynx_hf.patched(model, policy="xshare", xshare_fraction=0.25, gate="always"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        summary = lynx_hf.stats(model).summary()
    assert summary["decode_steps"] == 2
    # budget ceil(0.25 * 12) = 3 experts per step plus each token's top-1 (warm-up): fewer than before
    assert summary["unique_experts_after"] < summary["unique_experts_before"]
