"""Torch reference of the LYNX / OEA routing steps on plain tensors.

This is the canonical definition of the routing math (``../shared/DESIGN.md``, "The LYNX policy");
the Triton kernels in :mod:`kernels.routing` must return exactly the same integers. Nothing here
knows about transformers or model families: inputs are router *selection scores* ``s[T, N]`` in
fp32 (pre-softmax logits for softmax routers, pre-sigmoid logits for sigmoid routers, ``-inf``
where the model's own routing forbids an expert) and the model's own top-k indices.

Steps (LYNX, Gupta et al., arXiv 2411.08982, Sec. 4 "Dynamic expert reduction"):

1. affinity gap ``g = s - max_e s`` (``<= 0``; equals ``log p_e / p_top1`` for softmax routers);
2. affinity binning: ``bin = ceil(g * alpha)``; an expert *votes* iff ``bin >= -beta``;
3. exponential batch score ``score[e] = sum_t vote[t, e] * B ** bin[t, e]`` (computed exactly:
   integer per-bin counts, then a fixed-order fp64 sum of ``count * fp32(B ** -j)``);
4. critical set ``S`` (restricted to ``U``, the union of the model's own top-k, so the batch never
   loads an expert it did not need anyway): cover (each token keeps its highest-scoring bin-0
   expert), consensus (``score >= tau``), grow by score until ``|S| >= k``;
5. remap: each token takes its top-k of ``s`` preferring experts in ``S`` (experts outside ``S`` only
   fill slots that the token's allowed experts inside ``S`` cannot).

OEA (Oncescu et al., arXiv 2511.02237, Sec. 3): ``S`` is the union of every token's top-``k0``;
the same remap step then lets each token piggyback on experts already in ``S``.

Ties always break to the lower expert id (stable sorts), so results are deterministic.
"""

from __future__ import annotations

import math

import torch

#: bin value stored for forbidden (``-inf``) experts; far below any real bin.
FORBIDDEN_BIN = -(2**30)


def default_lynx_bins(num_experts: int, top_k: int) -> tuple[float, int]:
    """Bin parameters derived only from ``k/N`` (DESIGN.md step 2; our choice, the paper is silent).

    Returns ``(alpha, beta)``: ``beta = ceil(log2(N/k)) + 1`` bins of width ``w = ln(N/k) / beta``,
    ``alpha = 1/w``; an expert votes iff its probability is at least ``k/N`` of the token's top-1.
    Raises ``ValueError`` when ``top_k`` is not in ``1..num_experts``. For ``k == N`` every expert
    is always used and ``alpha`` is returned as ``inf`` (the policy is then the identity).
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..num_experts, got top_k={top_k}, num_experts={num_experts}")
    if top_k == num_experts:
        return math.inf, 1
    ratio = num_experts / top_k
    beta = math.ceil(math.log2(ratio)) + 1
    return beta / math.log(ratio), beta


def naive_lynx_bins(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-token affinity bins. ``scores [T, N]`` fp32 -> ``bins [T, N]`` int32, ``<= 0``.

    ``bin = ceil((s - max_e s) * alpha)`` in fp32; ``FORBIDDEN_BIN`` where ``s == -inf``.
    Shift-invariant (CASES C13): only the gap to the row maximum is used.
    """
    s = scores.float()
    gap = s - s.max(dim=-1, keepdim=True).values
    bins = torch.ceil(gap * torch.tensor(alpha, dtype=torch.float32))
    finite = torch.isfinite(s)
    # clamp before the int cast (a huge alpha or finfo.min-masked logits would overflow int32); any
    # bin this low never votes, since beta < 2**30.
    bins = torch.where(finite, bins.clamp_min(FORBIDDEN_BIN + 1), torch.zeros_like(bins))
    return torch.where(finite, bins.to(torch.int32), torch.full_like(bins, FORBIDDEN_BIN, dtype=torch.int32))


def batch_base_powers(batch_base: int, beta: int) -> torch.Tensor:
    """``fp32(B ** -j)`` for ``j = 0..beta``, returned as fp64 ``[beta + 1]``.

    Rounding the powers to fp32 makes ``count * power`` exact in fp64 (7 + 24 bits), so the score
    sum is bit-reproducible in any implementation that adds in the same order (with or without FMA).
    """
    j = torch.arange(beta + 1, dtype=torch.float64)
    return (float(batch_base) ** (-j)).to(torch.float32).to(torch.float64)


def naive_lynx_scores(
    bins: torch.Tensor, candidates: torch.Tensor, beta: int, batch_base: int
) -> torch.Tensor:
    """Exponential batch score. ``bins [T, N]`` int32, ``candidates [N]`` bool -> ``score [N]`` fp64.

    ``score[e] = sum_j count[e, j] * fp32(B ** -j)``, ``count[e, j] = #{t : bin[t, e] == -j}``,
    summed over ``j = 0..beta`` in ascending order; 0 for non-candidates.
    """
    num_experts = bins.shape[-1]
    powers = batch_base_powers(batch_base, beta).to(bins.device)
    score = torch.zeros(num_experts, dtype=torch.float64, device=bins.device)
    for j in range(beta + 1):
        count = (bins == -j).sum(dim=0).to(torch.float64)
        score = score + count * powers[j]
    return torch.where(candidates, score, torch.zeros_like(score))


def union_mask(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``topk_idx [T, k]`` int -> ``[N]`` bool, True for every expert some token selected."""
    mask = torch.zeros(num_experts, dtype=torch.bool, device=topk_idx.device)
    mask[topk_idx.reshape(-1).long()] = True
    return mask


def _rank_by_score(score: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Expert ids ordered by score descending, ties to the lower id; ineligible ones last."""
    key = torch.where(eligible, score, torch.full_like(score, -1.0))
    return torch.sort(key, descending=True, stable=True).indices


def naive_lynx_critical_set(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    top_k: int,
    alpha: float,
    beta: int,
    tau: float,
    batch_base: int | None = None,
) -> torch.Tensor:
    """LYNX critical set. ``scores [T, N]`` fp32, ``topk_idx [T, k]`` (the model's own) -> ``[N]`` bool.

    ``batch_base`` defaults to ``T`` (the number of tokens in the decode step). Raises ``ValueError``
    for a non-positive ``alpha``/``beta`` or ``top_k`` outside ``1..N``.
    """
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if not alpha > 0 or beta < 0:
        raise ValueError(f"alpha must be > 0 and beta >= 0, got alpha={alpha}, beta={beta}")
    candidates = union_mask(topk_idx, num_experts)
    if math.isinf(alpha):  # k == N or an explicit "all bin 0": nothing to reduce
        return candidates
    bins = naive_lynx_bins(scores, alpha)
    bins = torch.where(candidates[None, :], bins, torch.full_like(bins, FORBIDDEN_BIN))
    score = naive_lynx_scores(bins, candidates, beta, batch_base or num_tokens)

    # (a) cover: each token's highest-scoring bin-0 candidate (ties -> lower id).
    bin0 = bins == 0
    cover_key = torch.where(bin0, score[None, :], torch.full_like(score, -1.0)[None, :].expand_as(bin0))
    cover = cover_key.argmax(dim=-1)  # torch.argmax returns the first (lowest id) maximum
    has_cover = bin0.any(dim=-1)
    critical = torch.zeros(num_experts, dtype=torch.bool, device=scores.device)
    critical[cover[has_cover]] = True
    # (b) consensus.
    critical |= candidates & (score >= tau)
    # (c) grow by score until |S| >= k.
    missing = top_k - int(critical.sum())
    if missing > 0:
        order = _rank_by_score(score, candidates & ~critical)
        critical[order[:missing]] = True
    return critical


def naive_oea_critical_set(scores: torch.Tensor, top_k0: int) -> torch.Tensor:
    """OEA critical set: union of every token's top-``k0`` of ``scores`` (ties -> lower id).

    ``scores [T, N]`` fp32 -> ``[N]`` bool. Raises ``ValueError`` unless ``1 <= k0 <= N``.
    """
    num_experts = scores.shape[-1]
    if not 1 <= top_k0 <= num_experts:
        raise ValueError(f"k0 must be in 1..{num_experts}, got {top_k0}")
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[:, :top_k0]
    return union_mask(order, num_experts)


def naive_remap_topk(scores: torch.Tensor, critical: torch.Tensor, top_k: int) -> torch.Tensor:
    """Remap step: each token's top-k preferring the critical set.

    ``scores [T, N]`` fp32, ``critical [N]`` bool -> ``idx [T, k]`` int64, ordered by preference
    (in-S experts by score, then out-of-S experts by score; ties -> lower id). Never returns a
    forbidden (``-inf``) expert; raises ``ValueError`` if a row has fewer than ``k`` allowed experts.
    """
    s = scores.float()
    allowed = torch.isfinite(s) | (s > 0)
    if bool((allowed.sum(dim=-1) < top_k).any()):
        raise ValueError(f"a token has fewer than top_k={top_k} allowed (finite) router scores")
    # Two-level key: membership tier (in S > outside S > forbidden), then score; the stable sort
    # of the tier-major ranking keeps ties at the lower expert id.
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # by score, ties lower id
    tier = torch.where(critical[None, :] & allowed, 2, torch.where(allowed, 1, 0))
    tier_in_order = torch.gather(tier, 1, order)
    by_tier = torch.sort(tier_in_order, dim=-1, descending=True, stable=True).indices
    return torch.gather(order, 1, by_tier)[:, :top_k].contiguous()


#: weight rules a remap can reproduce (DESIGN.md "Family rules"); the adapters pick one.
WEIGHT_RULES = ("softmax_all", "softmax_chosen", "sigmoid")


def naive_routing_weights(
    logits: torch.Tensor,
    topk_idx: torch.Tensor,
    rule: str,
    renormalize: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    """Routing weights of the chosen experts, in fp32. ``logits [T, N]``, ``topk_idx [T, k]`` -> ``[T, k]``.

    Rules (computed in fp32; the caller casts to the model dtype where the family does):

    - ``"softmax_all"``: ``softmax(logits over all N)`` picked at ``topk_idx`` (Qwen2-MoE, DeepSeek-V2);
    - ``"softmax_chosen"``: softmax over the chosen ``k`` logits only (Mixtral; equals ``softmax_all``
      renormalized over the chosen set);
    - ``"sigmoid"``: ``sigmoid(logit)`` of each chosen expert (Llama-4, DeepSeek-V3 style).

    Then, if ``renormalize``, divide by the row sum; then multiply by ``scale``
    (``routed_scaling_factor``). Raises ``ValueError`` for an unknown rule.
    """
    x = logits.float()
    if rule == "softmax_all":
        w = torch.softmax(x, dim=-1).gather(1, topk_idx)
    elif rule == "softmax_chosen":
        w = torch.softmax(x.gather(1, topk_idx), dim=-1)
    elif rule == "sigmoid":
        w = torch.sigmoid(x.gather(1, topk_idx))
    else:
        raise ValueError(f"unknown weight rule {rule!r}; expected one of {WEIGHT_RULES}")
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        w = w * scale
    return w


def naive_mass_floor_set(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, floor: float) -> torch.Tensor:
    """Experts some token must keep so that it retains at least ``floor`` of its routing mass.

    ``topk_idx [T, k]`` int, ``topk_weights [T, k]`` (the model's own weights, any float dtype) ->
    ``[N]`` bool. For each token, its experts in decreasing weight order (ties -> lower slot) are kept
    while the weight kept *before* them is below ``floor`` of the token's top-k weight sum; so a
    confident token keeps its top-1 only, an unsure one keeps more. ``floor = 0`` keeps nothing,
    ``floor = 1`` keeps every original expert. (A project extension of LYNX, DESIGN.md "Improve
    them when the data says so"; the paper has no such floor.)
    """
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    mask = torch.zeros(num_experts, dtype=torch.bool, device=topk_idx.device)
    if floor == 0.0:
        return mask
    w = topk_weights.float()
    order = torch.sort(w, dim=-1, descending=True, stable=True).indices
    w_sorted = w.gather(1, order)
    total = w_sorted.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    before = (torch.cumsum(w_sorted, dim=-1) - w_sorted) / total  # mass kept before each slot
    keep = before < floor
    mask[topk_idx.gather(1, order)[keep].long()] = True
    return mask


_MASS_UNIT = float(2**24)  # fixed-point resolution of routing-mass gains


def naive_mass_greedy_grow(
    scores: torch.Tensor, topk_idx: torch.Tensor, critical: torch.Tensor, top_k: int, price: float
) -> torch.Tensor:
    """Grow a critical set greedily by routing mass gained per expert loaded (project extension).

    ``scores [T, N]`` fp32 selection scores, ``topk_idx [T, k]`` the model's own selection,
    ``critical [N]`` bool the starting set (e.g. LYNX's cover) -> ``[N]`` bool, a superset.

    Each token's relative weights ``w[t, e] = exp(s - max s) / sum over its own top-k of exp(s - max s)``
    (for softmax routers: its routing probabilities as a share of its original top-k mass). With S
    fixed, a token keeps the top-k of ``w`` inside S, so adding expert ``e`` gains it
    ``max(0, w[t, e] - kth_t)`` (``kth_t``: the k-th largest ``w`` of the token inside S, 0 if fewer).
    Repeatedly add the candidate of ``U`` (union of the model's top-k) with the largest total gain
    while that gain is ``>= price`` (units: one token's whole top-k mass), and in any case until
    ``|S| >= k``; ties -> lower id. Deterministic; ``S`` stays inside ``U``.
    """
    num_tokens, num_experts = scores.shape
    s = scores.float()
    rel = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    rel = torch.where(torch.isfinite(s), rel, torch.zeros_like(rel))
    w = rel / rel.gather(1, topk_idx.long()).sum(dim=-1, keepdim=True)
    candidates = union_mask(topk_idx, num_experts)
    critical = critical.clone()
    kk = min(top_k, num_experts)
    price_fixed = math.ceil(price * _MASS_UNIT)
    while True:
        in_s = torch.where(critical[None, :], w, torch.full_like(w, -1.0))
        kth = in_s.topk(kk, dim=-1).values[:, -1].clamp_min(0.0)  # -1 (missing) -> 0
        # per-token gains in fixed point (2**-24 of a token's mass), summed in int64: exact, so the
        # result does not depend on the order of the tokens (row-order invariance, ties stay ties)
        gain = torch.round((w - kth[:, None]).clamp_min(0.0) * _MASS_UNIT).long().sum(dim=0)
        gain = torch.where(candidates & ~critical, gain, torch.full_like(gain, -1))
        best = int(torch.argmax(gain))  # first maximum: lower id on ties
        if gain[best] < 0 or (gain[best] < price_fixed and int(critical.sum()) >= top_k):
            return critical
        critical[best] = True
