"""LYNX / OEA routing steps in torch: the canonical definition and the production path off CUDA.

This module defines the routing math (``docs/design.md``, "The LYNX policy"); the Triton kernels
in :mod:`kernels.routing` must return exactly the same integers. Nothing here knows about transformers
or model families: inputs are router *selection scores* ``s[T, N]`` in fp32 (pre-softmax logits for
softmax routers, pre-sigmoid logits for sigmoid routers, ``-inf`` where the model's own routing forbids
an expert) and the model's own top-k indices.

Every function is **sync-free**: no device->host read, no data-dependent output shape, loops with
data-independent trip counts only (masking instead of breaking out), so a decode step runs inside
CUDA graphs and ``torch.compile(fullgraph=True)``. Argument checks read shapes only. One exception,
for speed on CPU only: on CPU tensors in eager mode (not while ``torch.compile`` traces, and not
inside :func:`strict_sync_free`, which tests use to check the accelerator path on CPU), the greedy
loop of :func:`mass_greedy_grow` stops at its first idle iteration by reading a CPU tensor (there
is no device to synchronise with); the result is the same.

Per-token masks (``docs/design.md`` "Per-token decode mask"):

- ``vote [T]`` bool: the tokens whose routing the policy decides (live decode tokens). Other rows do
  not vote, do not count in the batch base ``B`` and do not add candidates. ``None``: every row votes.
- ``seed [N]`` bool: experts the step loads anyway (the experts of its prefill tokens). They start in
  the critical set and are free for the voting tokens. ``None``: no seed.

Steps (LYNX, Gupta et al., arXiv 2411.08982, Sec. 4 "Dynamic expert reduction"):

1. affinity gap ``g = s - max_e s`` (``<= 0``; equals ``log p_e / p_top1`` for softmax routers);
2. affinity binning: ``bin = ceil(g * alpha)``; an expert *votes* iff ``bin >= -beta``;
3. exponential batch score ``score[e] = sum_t vote[t, e] * B ** bin[t, e]`` (computed exactly:
   integer per-bin counts, then a fixed-order fp64 sum of ``count * fp32(B ** -j)``), ``B`` = number
   of voting tokens;
4. critical set ``S`` (restricted to ``U``, the union of the voting tokens' own top-k and the seed,
   so the batch never loads an expert it did not need anyway): the seed, cover (each voting token
   keeps one of its bin-0 experts: a seeded one if it has one, else the highest-scoring; ties -> lower
   id), consensus (``score >= tau``), grow by score until ``|S| >= k``;
5. remap: each token takes its top-k of ``s`` preferring experts in ``S`` (experts outside ``S`` only
   fill slots that the token's allowed experts inside ``S`` cannot).

OEA (Oncescu et al., arXiv 2511.02237, Sec. 3): ``S`` is the seed plus the union of every voting
token's top-``k0``; the same remap step then lets each token piggyback on experts already in ``S``.

Ties are deterministic (stable sorts). Where one token's own ranking is taken -- OEA's top-``k0``, XShare's
warm-up, the remap -- equal scores prefer the token's own experts (the model's top-k ids, ``topk_idx``), then
the lower expert id (:func:`own_first_order`): the model's ``torch.topk`` orders tied experts its own way, so
ranking ties by id alone would move a tied token off its own experts where the policy should keep them
(OEA with ``k0 = k``, XShare with a budget of ``N``). The batch-level selections (LYNX's cover and growth,
the mass greedy, XShare's fill) break ties to the lower expert id.
"""

from __future__ import annotations

import math
import struct

import torch

#: bin value stored for forbidden (``-inf``) experts and non-voting rows; far below any real bin.
FORBIDDEN_BIN = -(2**30)

#: weight rules a remap can reproduce (``docs/design.md`` "Family rules"); each family spec picks one.
WEIGHT_RULES = ("softmax_all", "softmax_chosen", "sigmoid")

#: fixed-point resolution of routing-mass gains (2**-24 of one token's top-k mass); shared by the numba and
#: Triton twins
MASS_UNIT = float(2**24)
_STRICT = [0]  # > 0 inside strict_sync_free()


class strict_sync_free:
    """Context manager: no host reads at all, also on CPU (the accelerator path, for tests on CPU)."""

    def __enter__(self):
        _STRICT[0] += 1
        return self

    def __exit__(self, *exc):
        _STRICT[0] -= 1
        return False


def in_strict_sync_free() -> bool:
    """Whether code runs inside :class:`strict_sync_free` (the accelerator path forced on CPU tensors)."""
    return _STRICT[0] > 0


def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether a loop over ``t`` may stop early by reading it: CPU tensors in eager mode only."""
    return t.device.type == "cpu" and not _STRICT[0] and not torch.compiler.is_compiling()


def default_lynx_bins(num_experts: int, top_k: int) -> tuple[float, int]:
    """Bin parameters derived only from ``k/N`` (``docs/design.md`` step 2; our choice, the paper is silent).

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


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value, as a Python float (``inf`` stays ``inf``)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond fp32's range: fp32 rounds it to inf, as torch.tensor(x, dtype=float32) does
        return math.copysign(math.inf, x)


def _rows(mask: torch.Tensor | None, num_rows: int, device) -> torch.Tensor:
    return torch.ones(num_rows, dtype=torch.bool, device=device) if mask is None else mask.to(torch.bool)


def voting_tokens(vote: torch.Tensor | None, num_tokens: int) -> torch.Tensor | int:
    """The batch base ``B``: the number of voting tokens (a 0-d int64 tensor), ``T`` when ``vote`` is None."""
    return num_tokens if vote is None else vote.sum()


def lynx_bins(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-token affinity bins. ``scores [T, N]`` fp32 -> ``bins [T, N]`` int32, ``<= 0``.

    ``bin = ceil((s - max_e s) * alpha)`` in fp32; ``FORBIDDEN_BIN`` where ``s == -inf``.
    Shift-invariant (``docs/cases.md`` C13): only the gap to the row maximum is used.
    """
    s = scores.float()
    gap = s - s.max(dim=-1, keepdim=True).values
    # alpha as a Python float rounded to fp32 (what the Triton kernels read): a scalar operand, not
    # torch.tensor(alpha, device=...), which is a host-to-device copy on an accelerator (a sync, and an error
    # under CUDA-graph capture; found by lab.gpu_check on an H200)
    bins = torch.ceil(gap * _fp32(alpha))
    finite = torch.isfinite(s)
    # clamp before the int cast (a huge alpha or finfo.min-masked logits would overflow int32); any
    # bin this low never votes, since beta < 2**30.
    bins = torch.where(finite, bins.clamp_min(FORBIDDEN_BIN + 1), torch.zeros_like(bins))
    return torch.where(finite, bins.to(torch.int32), torch.full_like(bins, FORBIDDEN_BIN, dtype=torch.int32))


def batch_base_powers(batch_base, beta: int, device=None) -> torch.Tensor:
    """``fp32(B ** -j)`` for ``j = 0..beta``, returned as fp64 ``[beta + 1]``.

    ``batch_base``: an int or a 0-d tensor (clamped to >= 1). Rounding the powers to fp32 makes
    ``count * power`` exact in fp64 (7 + 24 bits), so the score sum is bit-reproducible in any
    implementation that adds in the same order (with or without FMA). The Triton kernels read the
    powers this function computes, so both paths use the same values.
    """
    if isinstance(batch_base, torch.Tensor):
        base = batch_base.to(torch.float64).clamp_min(1.0)
        device = base.device
    else:
        # a fill, not torch.tensor(value, device=...): no host-to-device copy
        base = torch.full((), float(max(int(batch_base), 1)), dtype=torch.float64, device=device)
    j = torch.arange(beta + 1, dtype=torch.float64, device=device)
    return torch.pow(base, -j).to(torch.float32).to(torch.float64)


def lynx_scores(bins: torch.Tensor, candidates: torch.Tensor, beta: int, batch_base) -> torch.Tensor:
    """Exponential batch score. ``bins [T, N]`` int32, ``candidates [N]`` bool -> ``score [N]`` fp64.

    ``score[e] = sum_j count[e, j] * fp32(B ** -j)``, ``count[e, j] = #{t : bin[t, e] == -j}``,
    summed over ``j = 0..beta`` in ascending order; 0 for non-candidates.
    """
    powers = batch_base_powers(batch_base, beta, device=bins.device)
    in_range = (bins <= 0) & (bins >= -beta)
    j = torch.where(in_range, -bins, torch.full_like(bins, beta + 1)).long()  # beta + 1: no vote
    counts = torch.zeros(bins.shape[-1], beta + 2, dtype=torch.float64, device=bins.device)
    counts.scatter_add_(1, j.t(), torch.ones_like(j, dtype=torch.float64).t())
    score = torch.zeros(bins.shape[-1], dtype=torch.float64, device=bins.device)
    for jj in range(beta + 1):  # fixed order: ascending j
        score = score + counts[:, jj] * powers[jj]
    return torch.where(candidates, score, torch.zeros_like(score))


def union_mask(topk_idx: torch.Tensor, num_experts: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``topk_idx [T, k]`` int -> ``[N]`` bool, True for every expert some (selected) row chose.

    ``rows [T]`` bool restricts the union to those rows (``None``: all rows).
    """
    flat = topk_idx.reshape(-1).long()
    if rows is None:
        hits = torch.ones_like(flat, dtype=torch.int32)
    else:
        hits = rows.to(torch.int32)[:, None].expand(topk_idx.shape).reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device).index_add_(0, flat, hits)
    return counts > 0


def union_size(topk_idx: torch.Tensor, num_experts: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Distinct experts of ``topk_idx [T, k]`` over the selected ``rows [T]`` bool (``None``: all rows): a 0-d
    int64 tensor (no host read). Telemetry counts unique experts with it."""
    return union_mask(topk_idx, num_experts, rows).sum()


def _add_ranked(critical: torch.Tensor, key: torch.Tensor, eligible: torch.Tensor, count) -> torch.Tensor:
    """``critical`` plus the first ``count`` eligible experts by ``key`` descending (ties -> lower id).

    ``count``: int or 0-d tensor (negative = none). Sync-free: ranks instead of a data-dependent slice.
    """
    key = torch.where(eligible, key.to(torch.float64), torch.full_like(key, -1.0, dtype=torch.float64))
    order = torch.sort(key, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return critical | (eligible & (rank < count))


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")


def lynx_critical_set(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    top_k: int,
    alpha: float,
    beta: int,
    tau: float,
    batch_base=None,
    vote: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """LYNX critical set. ``scores [T, N]`` fp32, ``topk_idx [T, k]`` (the model's own) -> ``[N]`` bool.

    ``vote [T]`` / ``seed [N]``: see the module docstring. ``batch_base`` (int or 0-d tensor) defaults
    to the number of voting tokens. Raises ``ValueError`` for a non-positive ``alpha``, a negative
    ``beta`` or ``top_k`` outside ``1..N``.
    """
    num_tokens, num_experts = scores.shape
    _check_top_k(top_k, num_experts)
    if not alpha > 0 or beta < 0:
        raise ValueError(f"alpha must be > 0 and beta >= 0, got alpha={alpha}, beta={beta}")
    voters = _rows(vote, num_tokens, scores.device)
    seeded = torch.zeros(num_experts, dtype=torch.bool, device=scores.device) if seed is None else seed
    candidates = union_mask(topk_idx, num_experts, voters) | seeded
    if math.isinf(alpha):  # k == N or an explicit "all bin 0": nothing to reduce
        return candidates
    if batch_base is None:
        batch_base = voting_tokens(vote, num_tokens)
    bins = lynx_bins(scores, alpha)
    bins = torch.where(candidates[None, :] & voters[:, None], bins, torch.full_like(bins, FORBIDDEN_BIN))
    score = lynx_scores(bins, candidates, beta, batch_base)

    # (a) cover: each voting token's bin-0 candidate, a seeded one first, then by score (ties -> lower id).
    bin0 = bins == 0
    offset = float(num_tokens + 1)  # > any score (each token adds <= 1): seeded experts rank first
    key = score[None, :] + torch.where(seeded, offset, 0.0)[None, :]
    cover_key = torch.where(bin0, key, torch.full_like(key, -1.0))
    cover = cover_key.argmax(dim=-1)  # torch.argmax returns the first (lowest id) maximum
    has_cover = bin0.any(dim=-1)
    covered = torch.zeros(num_experts, dtype=torch.int32, device=scores.device).index_add_(0, cover, has_cover.int())
    critical = seeded | (covered > 0)
    # (b) consensus.
    critical = critical | (candidates & (score >= tau))
    # (c) grow by score until |S| >= k.
    missing = top_k - critical.sum()
    return _add_ranked(critical, score, candidates & ~critical, missing)


def own_mask(topk_idx: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor | None:
    """``[T, N]`` bool, True at each row's own experts ``topk_idx [T, k]`` (ids in ``0..N-1``); ``None`` for
    ``None`` (no own experts)."""
    if topk_idx is None:
        return None
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, topk_idx.long(), True)


def own_first_order(scores: torch.Tensor, topk_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's experts by score descending; equal scores: the row's own experts (``topk_idx [T, k]``) first,
    then the lower id. ``scores [T, N]`` fp32 -> ``[T, N]`` int64 (a permutation per row).

    Two stable sorts: own experts first (id order kept), then by score (the first order kept among equal scores).
    ``topk_idx`` ``None``: by score, ties -> lower id.
    """
    s = scores.float()
    own = own_mask(topk_idx, s)
    if own is None:
        return torch.sort(s, dim=-1, descending=True, stable=True).indices
    first = torch.sort(own.to(torch.int8), dim=-1, descending=True, stable=True).indices
    by_score = torch.sort(torch.gather(s, 1, first), dim=-1, descending=True, stable=True).indices
    return torch.gather(first, 1, by_score)


def oea_critical_set(
    scores: torch.Tensor,
    top_k0: int,
    vote: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    topk_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """OEA critical set: the seed plus the union of every voting token's top-``k0`` of ``scores``
    (ties -> the token's own experts ``topk_idx [T, k]``, then lower id; :func:`own_first_order`).
    ``scores [T, N]`` fp32 -> ``[N]`` bool. With ``k0 = k`` a voting token's top-``k0`` is exactly its own
    top-k, whatever order the model's top-k gave tied experts. ``topk_idx`` ``None``: ties -> lower id. Raises
    ``ValueError`` unless ``1 <= k0 <= N``.
    """
    num_experts = scores.shape[-1]
    if not 1 <= top_k0 <= num_experts:
        raise ValueError(f"k0 must be in 1..{num_experts}, got {top_k0}")
    order = own_first_order(scores, topk_idx)[:, :top_k0]
    union = union_mask(order, num_experts, vote)
    return union if seed is None else union | seed


def remap_topk(scores: torch.Tensor, critical: torch.Tensor, top_k: int, check: bool = True,
               topk_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Remap step: each token's top-k preferring the critical set.

    ``scores [T, N]`` fp32, ``critical [N]`` bool, ``topk_idx [T, k]`` int (the model's own top-k ids, or
    ``None``: no own experts) -> ``idx [T, k]`` int64, ordered by preference: in-S experts by score, then
    out-of-S experts by score; ties -> the token's own experts, then lower id. So a token whose own experts
    are all in S keeps exactly them. Never returns a forbidden (``-inf``) expert for a row with at least ``k``
    allowed experts. With ``check`` (one device sync; the decode path passes ``False``) raises ``ValueError``
    if a row has fewer.
    """
    s = scores.float()
    allowed = torch.isfinite(s) | (s > 0)
    if check and bool((allowed.sum(dim=-1) < top_k).any()):
        raise ValueError(f"a token has fewer than top_k={top_k} allowed (finite) router scores")
    # Key: membership tier (in S > outside S > forbidden), then score, then own, then id; the stable sort
    # of the tier-major ranking keeps the score / own / id order within a tier.
    order = own_first_order(s, topk_idx)
    tier = torch.where(critical[None, :] & allowed, 2, torch.where(allowed, 1, 0))
    tier_in_order = torch.gather(tier, 1, order)
    by_tier = torch.sort(tier_in_order, dim=-1, descending=True, stable=True).indices
    return torch.gather(order, 1, by_tier)[:, :top_k].contiguous()


def routing_weights(
    logits: torch.Tensor,
    topk_idx: torch.Tensor,
    rule: str,
    renormalize: bool = False,
    scale: float = 1.0,
    eps: float = 0.0,
) -> torch.Tensor:
    """Routing weights of the chosen experts, in fp32. ``logits [T, N]``, ``topk_idx [T, k]`` -> ``[T, k]``.

    Rules (computed in fp32; the caller casts to the model dtype where the family does):

    - ``"softmax_all"``: ``softmax(logits over all N)`` picked at ``topk_idx`` (Qwen2-MoE, DeepSeek-V2);
    - ``"softmax_chosen"``: softmax over the chosen ``k`` logits only (Mixtral; equals ``softmax_all``
      renormalized over the chosen set);
    - ``"sigmoid"``: ``sigmoid(logit)`` of each chosen expert (Llama-4, DeepSeek-V3 style).

    Then, if ``renormalize``, divide by the row sum plus ``eps`` (``w / (sum + eps)``: a family's denominator
    epsilon, LFM2-MoE ``1e-6``; ``eps`` 0 divides by the sum alone, bit for bit as before); then multiply by
    ``scale`` (``routed_scaling_factor``). Raises ``ValueError`` for an unknown rule.
    """
    x = logits if logits.dtype == torch.float32 else logits.float()
    if rule == "softmax_all":
        w = torch.softmax(x, dim=-1).gather(1, topk_idx)
    elif rule == "softmax_chosen":
        w = torch.softmax(x.gather(1, topk_idx), dim=-1)
    elif rule == "sigmoid":
        w = torch.sigmoid(x.gather(1, topk_idx))
    else:
        raise ValueError(f"unknown weight rule {rule!r}; expected one of {WEIGHT_RULES}")
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + eps) if eps else w / w.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        w = w * scale
    return w


def relative_weights(scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """``w[t, e] = exp(s - max s) / sum over the token's own top-k of exp(s - max s)``, fp32 ``[T, N]``.

    For softmax routers: each expert's routing probability as a share of the token's original top-k
    mass (0 for forbidden experts). The unit of the routing-mass rules below.
    """
    s = scores.float()
    rel = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    rel = torch.where(torch.isfinite(s), rel, torch.zeros_like(rel))
    return rel / rel.gather(1, topk_idx.long()).sum(dim=-1, keepdim=True)


def mass_grow_steps(num_tokens: int, num_experts: int, top_k: int) -> int:
    """The static iteration bound of :func:`mass_greedy_grow`: ``min(N, T * k)`` >= ``|U|``, so the
    greedy never needs more steps than this (each step adds one expert of ``U`` or none)."""
    return min(num_experts, num_tokens * top_k)


PRICE_UNITS = ("token", "batch", "sqrt")


def batch_threshold(price_fixed: int, voters, unit: str):
    """The mass greedy's integer threshold from ``price_fixed`` (``ceil(price * 2**24)``) and the number of
    voting tokens ``voters`` (a 0-d int tensor, or an int): ``unit`` ``"token"`` -> ``price_fixed``,
    ``"batch"`` -> ``price_fixed * B``, ``"sqrt"`` -> ``ceil(price_fixed * sqrt(B))`` (fp64, correctly
    rounded ``sqrt`` and product: the same integer on every backend). Raises ``ValueError`` for another unit."""
    if unit == "token":
        return price_fixed
    if unit == "batch":
        return price_fixed * voters
    if unit == "sqrt":
        if isinstance(voters, torch.Tensor):
            return torch.ceil(voters.double().sqrt() * float(price_fixed)).long()
        return math.ceil(math.sqrt(voters) * float(price_fixed))
    raise ValueError(f"unit must be one of {PRICE_UNITS}, got {unit!r}")


def mass_greedy_grow(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    critical: torch.Tensor,
    top_k: int,
    price: float,
    vote: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    unit: str = "token",
) -> torch.Tensor:
    """Grow a critical set greedily by routing mass gained per expert loaded (project extension).

    ``scores [T, N]`` fp32 selection scores, ``topk_idx [T, k]`` the model's own selection,
    ``critical [N]`` bool the starting set (e.g. LYNX's cover) -> ``[N]`` bool, a superset.

    Each voting token's relative weights ``w`` (:func:`relative_weights`), in fixed point
    ``W = round(w * 2**24)`` (int64; 0 for other rows). With S fixed, a token keeps the top-k of ``W``
    inside S, so adding expert ``e`` gains it ``max(0, W[t, e] - kth_t)`` (``kth_t``: the k-th largest
    ``W`` of the token inside S, 0 if fewer). Repeatedly add the candidate of ``U`` (the voting tokens'
    union and the seed) with the largest total gain over the voting tokens while that gain is
    ``>= threshold`` and in any case until ``|S| >= k``; ties -> lower id. ``unit`` sets the threshold from
    ``P = ceil(price * 2**24)`` and the number of voting tokens ``B``: ``"token"`` -> ``P`` (units: one
    token's whole top-k mass), ``"batch"`` -> ``P * B`` (a share of the batch's mass: a price on the mean
    mass per token), ``"sqrt"`` -> ``ceil(P * sqrt(B))`` in fp64 (between the two: an expert shared by more
    tokens must restore more mass, but less than in proportion). Integer sums: the result does not depend on the order of the
    tokens. Deterministic; ``S`` stays inside ``U``.

    Sync-free: :func:`mass_grow_steps` iterations, each adding its expert only while the rule still
    wants one (once it stops, no later iteration can add: gains only shrink as S grows). On CPU in
    eager mode the loop stops at the first idle iteration (:func:`host_reads_allowed`).
    """
    num_tokens, num_experts = scores.shape
    voters = _rows(vote, num_tokens, scores.device)
    w = relative_weights(scores, topk_idx)
    big_w = torch.where(voters[:, None], torch.round(w * MASS_UNIT).long(), torch.zeros_like(w, dtype=torch.long))
    candidates = union_mask(topk_idx, num_experts, voters)
    if seed is not None:
        candidates = candidates | seed
        critical = critical | seed
    kk = min(top_k, num_experts)
    price_fixed = batch_threshold(math.ceil(price * MASS_UNIT), voters.sum(), unit)
    ids = torch.arange(num_experts, device=scores.device)
    size = critical.sum()
    early = host_reads_allowed(scores)
    for _ in range(mass_grow_steps(num_tokens, num_experts, top_k)):
        in_s = torch.where(critical[None, :], big_w, -1)
        kth = in_s.topk(kk, dim=-1).values[:, -1].clamp_min(0)  # -1 (fewer than k in S) -> 0
        gain = (big_w - kth[:, None]).clamp_min(0).sum(dim=0)
        gain = torch.where(candidates & ~critical, gain, -1)
        best_gain, best = gain.max(dim=0)  # first maximum: lower id on ties
        add = (best_gain >= price_fixed) | ((best_gain >= 0) & (size < top_k))
        if early and not add:
            break
        critical = critical | ((ids == best) & add)
        size = size + add.long()
    return critical


def xshare_critical_set(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    top_k: int,
    budget: int,
    warmup: int,
    vote: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """XShare (Vankov et al., arXiv 2602.07265): batch-aware selection maximizing the total gating score
    kept under an expert budget, as the baseline on our harness. ``scores [T, N]`` fp32 -> ``[N]`` bool.

    The objective is modular (the sum over selected experts of their gating mass summed over the batch),
    so its greedy is exact: S = the seed, plus each voting token's top-``warmup`` experts (the paper's
    warm-up / the vLLM pull request's ``top_per_token``), then the candidates of ``U`` (the voting tokens'
    union) by aggregated gating score -- each token's routing probability ``softmax(s)`` (0 where
    forbidden), summed over the voting tokens in 2**-24 fixed point -- until ``|S| >= max(budget, k)``;
    ties -> lower id (in the warm-up, one token's ranking: ties -> the token's own experts ``topk_idx``, then
    lower id; :func:`own_first_order`). Restricting the fill to ``U`` is our choice (the batch never loads an
    expert no token chose); with a budget below ``|U|`` it changes nothing. The remap step then gives each token
    its top-k inside S (its own experts outside S fill what S cannot); with a budget of ``N`` (every candidate
    in S) each voting token keeps exactly its own experts. Sync-free.
    """
    num_tokens, num_experts = scores.shape
    voters = _rows(vote, num_tokens, scores.device)
    s = scores.float()
    probs = torch.softmax(torch.where(torch.isfinite(s), s, torch.full_like(s, -torch.inf)), dim=-1)
    probs = torch.where(torch.isfinite(probs), probs, torch.zeros_like(probs))  # all -inf rows
    mass = torch.where(voters[:, None], torch.round(probs * MASS_UNIT).long(), 0).sum(dim=0)
    candidates = union_mask(topk_idx, num_experts, voters)
    critical = torch.zeros(num_experts, dtype=torch.bool, device=scores.device) if seed is None else seed.clone()
    if seed is not None:
        candidates = candidates | seed
    if warmup > 0:
        order = own_first_order(s, topk_idx)[:, :warmup]
        critical = critical | union_mask(order, num_experts, voters)
    missing = max(budget, top_k) - critical.sum()
    return _add_ranked(critical, mass, candidates & ~critical, missing)
