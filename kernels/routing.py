"""Triton kernels of the LYNX / OEA routing steps (DESIGN.md "The LYNX policy", "Kernels").

Each launcher has the signature and the outputs of its torch reference in :mod:`.routing_torch`
and returns exactly the same integers (tests compare them element for element):

- :func:`lynx_critical_set` — LYNX (Gupta et al., arXiv 2411.08982, Sec. 4 "Dynamic expert
  reduction"): affinity binning, exponential batch score, cover / consensus / grow, fused in one
  single-program kernel (decode batches are small; the steps need batch-global reductions);
- :func:`oea_critical_set` — OEA (Oncescu et al., arXiv 2511.02237, Sec. 3): union of each
  token's top-``k0``;
- :func:`remap_topk` — the remap step (LYNX Sec. 4 / OEA piggybacking): each token's top-k
  preferring the critical set, optionally with the family's routing weights recomputed.

Exactness notes. Bins are ``ceil((s - max s) * fp32(alpha))`` in fp32, as in the reference; they are
kept as floats (never cast to int, so huge gaps cannot overflow) and compared with ``-j``. The score
is ``sum_j count_j * fp32(B ** -j)`` in fp64 with the counts totalled over the whole batch first and
``j`` ascending; every product is exact in fp64, so the sum is bit-identical to the reference with
or without FMA. ``tau`` is read from an fp64 tensor (a Triton float argument would be fp32).
All control flow is static or a loop with a data-independent trip count; offsets are int64.

Inputs must not contain NaN (the reference's behaviour on NaN is defined by torch's sort order;
these kernels do not reproduce it).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import routing_torch as _rt
from .routing_torch import WEIGHT_RULES, batch_base_powers

_RULE_CODE = {None: 0, "softmax_all": 1, "softmax_chosen": 2, "sigmoid": 3}


@triton.jit
def _bins_f(s, alpha, ok_cols):
    """Float bins ``ceil((s - rowmax) * alpha)``; ``-inf`` where ``s`` is not finite or the column not ok."""
    rowmax = tl.max(s, axis=1)
    rowmax = tl.where(rowmax == float("-inf"), 0.0, rowmax)  # all -inf rows (padding): avoid -inf - -inf
    gap = s - rowmax[:, None]
    b = tl.ceil(gap * alpha)
    finite = (s == s) & (tl.abs(s) != float("inf"))
    return tl.where(finite & ok_cols[None, :], b, float("-inf"))


@triton.jit
def _lynx_critical_kernel(
    s_ptr, idx_ptr, par_ptr, out_ptr,
    T, N, top_k,
    stride_st, stride_sn, stride_it, stride_ik,
    K: tl.constexpr, BETA: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    # par = [tau, fp32(alpha), fp32(B**-0), ..., fp32(B**-beta)] in fp64
    tau = tl.load(par_ptr)
    alpha = tl.load(par_ptr + 1).to(tl.float32)  # exact: the value is an fp32
    pow_ptr = par_ptr + 2

    # Candidates U: union of the model's own top-k.
    cand = tl.zeros([BLOCK_N], dtype=tl.int32)
    num_pairs = T * K
    for p0 in range(0, num_pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        pm = offs_p < num_pairs
        tok = offs_p // K
        slot = offs_p % K
        e = tl.load(idx_ptr + tok * stride_it + slot * stride_ik, mask=pm, other=-1).to(tl.int64)
        hit = (e[:, None] == offs_n[None, :]).to(tl.int32)
        cand = tl.maximum(cand, tl.max(hit, axis=0))
    cand_b = (cand > 0) & nmask

    # Pass 1: integer per-bin vote counts over the whole batch.
    offs_j = tl.arange(0, BLOCK_J)
    counts = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        s = tl.load(
            s_ptr + offs_t[:, None] * stride_st + offs_n[None, :] * stride_sn,
            mask=tm[:, None] & nmask[None, :], other=float("-inf"),
        )
        b = _bins_f(s, alpha, cand_b)
        for j in tl.static_range(BETA + 1):
            c = tl.sum((b == -j).to(tl.int32), axis=0)
            counts += tl.where(offs_j[:, None] == j, c[None, :], 0)
    # Exponential batch score, fixed order j = 0..beta, fp64.
    score = tl.zeros([BLOCK_N], dtype=tl.float64)
    for j in tl.static_range(BETA + 1):
        cj = tl.sum(tl.where(offs_j[:, None] == j, counts, 0), axis=0)
        pj = tl.load(pow_ptr + j)
        score = score + cj.to(tl.float64) * pj
    score = tl.where(cand_b, score, 0.0)

    # (a) cover: each token's highest-scoring bin-0 candidate (ties -> lower id).
    crit = tl.zeros([BLOCK_N], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        s = tl.load(
            s_ptr + offs_t[:, None] * stride_st + offs_n[None, :] * stride_sn,
            mask=tm[:, None] & nmask[None, :], other=float("-inf"),
        )
        b = _bins_f(s, alpha, cand_b)
        bin0 = b == 0
        key = tl.where(bin0, score[None, :], -1.0)
        has = tl.max(bin0.to(tl.int32), axis=1) > 0
        m = tl.max(key, axis=1)
        sel = tl.min(tl.where(key == m[:, None], offs_n[None, :], BLOCK_N), axis=1)
        hit = (offs_n[None, :] == sel[:, None]) & (has & tm)[:, None]
        crit = tl.maximum(crit, tl.max(hit.to(tl.int32), axis=0))
    # (b) consensus.
    crit = tl.where(cand_b & (score >= tau), 1, crit)
    # (c) grow by score until |S| >= k: the first `missing` experts of the reference's order
    # (eligible by score desc, ties -> lower id; then ineligible at key -1 by id).
    missing = top_k - tl.sum(crit, axis=0)
    key = tl.where(cand_b & (crit == 0), score, -1.0)
    key = tl.where(nmask, key, float("-inf"))
    for i in range(0, top_k):
        m = tl.max(key, axis=0)
        sel = tl.min(tl.where(key == m, offs_n, BLOCK_N), axis=0)
        pick = (offs_n == sel) & (i < missing)
        crit = tl.where(pick, 1, crit)
        key = tl.where(offs_n == sel, float("-inf"), key)
    tl.store(out_ptr + offs_n, crit.to(tl.int8), mask=nmask)


def _check_scores(scores: torch.Tensor) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [T, N], got shape {tuple(scores.shape)}")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 (router math stays in fp32), got {scores.dtype}")
    if scores.shape[0] < 1 or scores.shape[1] < 1:
        raise ValueError(f"scores must be non-empty, got shape {tuple(scores.shape)}")


def _block_t(num_experts_pow2: int, cap: int = 4096) -> int:
    """Rows per chunk so that a [BLOCK_T, BLOCK_N] tile stays about ``cap`` elements."""
    return max(1, min(64, cap // num_experts_pow2))


@functools.lru_cache(maxsize=256)
def _lynx_params(batch_base: int, beta: int, alpha: float, tau: float, device: torch.device) -> torch.Tensor:
    """``[tau, fp32(alpha), fp32(B**-j) for j = 0..beta]`` as one fp64 device tensor, cached (no
    host-to-device copy per decode step; the tensor is only read)."""
    alpha32 = torch.tensor(alpha, dtype=torch.float32).double().reshape(1)
    head = torch.cat([torch.tensor([tau], dtype=torch.float64), alpha32])
    return torch.cat([head, batch_base_powers(batch_base, beta)]).to(device)


def lynx_critical_set(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    top_k: int,
    alpha: float,
    beta: int,
    tau: float,
    batch_base: int | None = None,
    vote: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """LYNX critical set (arXiv 2411.08982, Sec. 4; DESIGN.md steps 1-4), one fused Triton kernel.

    ``scores [T, N]`` fp32 selection scores (``-inf`` = forbidden), ``topk_idx [T, k]`` int32/int64
    (the model's own selection, ids in ``0..N-1``) -> ``[N]`` bool, equal element for element to
    :func:`.routing_torch.lynx_critical_set`. ``batch_base`` defaults to ``T``.
    Raises ``ValueError`` for non-2-d / non-fp32 / empty scores, a ``topk_idx`` that is not ``[T, k]``
    integer, ``top_k`` outside ``1..N``, ``alpha <= 0`` or ``beta < 0``.
    """
    if vote is not None or seed is not None or isinstance(batch_base, torch.Tensor):  # TODO(kernels): masks
        return _rt.lynx_critical_set(scores, topk_idx, top_k, alpha, beta, tau, batch_base, vote=vote, seed=seed)
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be [T={num_tokens}, k] int64, got {tuple(topk_idx.shape)} {topk_idx.dtype}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if not alpha > 0 or beta < 0:
        raise ValueError(f"alpha must be > 0 and beta >= 0, got alpha={alpha}, beta={beta}")
    if math.isinf(alpha):  # k == N or "all bin 0": the reference returns the union unchanged
        mask = torch.zeros(num_experts, dtype=torch.bool, device=scores.device)
        mask[topk_idx.reshape(-1).long()] = True
        return mask
    dev = scores.device
    params = _lynx_params(int(batch_base or num_tokens), int(beta), float(alpha), float(tau), dev)
    out = torch.empty(num_experts, dtype=torch.int8, device=dev)
    block_n = triton.next_power_of_2(num_experts)
    k_width = topk_idx.shape[1]
    _lynx_critical_kernel[(1,)](
        scores, topk_idx, params, out,
        num_tokens, num_experts, top_k,
        scores.stride(0), scores.stride(1), topk_idx.stride(0), topk_idx.stride(1),
        K=k_width, BETA=int(beta), BLOCK_J=triton.next_power_of_2(int(beta) + 1),
        BLOCK_T=_block_t(block_n), BLOCK_N=block_n, BLOCK_P=_block_t(block_n),
    )
    return out.bool()


@triton.jit
def _oea_kernel(
    s_ptr, out_ptr, T, N, k0, stride_st, stride_sn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    union = tl.zeros([BLOCK_N], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        s = tl.load(
            s_ptr + offs_t[:, None] * stride_st + offs_n[None, :] * stride_sn,
            mask=tm[:, None] & nmask[None, :], other=float("-inf"),
        )
        taken = (offs_n[None, :] >= N) | (offs_t[:, None] < 0)  # [BLOCK_T, BLOCK_N], padding pre-taken
        for _ in range(0, k0):
            m = tl.max(tl.where(taken, float("-inf"), s), axis=1)
            sel = tl.min(tl.where((taken == 0) & (s == m[:, None]), offs_n[None, :], BLOCK_N), axis=1)
            hit = offs_n[None, :] == sel[:, None]
            taken = taken | hit
            union = tl.maximum(union, tl.max((hit & tm[:, None]).to(tl.int32), axis=0))
    tl.store(out_ptr + offs_n, union.to(tl.int8), mask=nmask)


def oea_critical_set(scores: torch.Tensor, top_k0: int, vote=None, seed=None) -> torch.Tensor:
    """OEA critical set (arXiv 2511.02237, Sec. 3): union of every token's top-``k0`` (ties -> lower id).

    ``scores [T, N]`` fp32 -> ``[N]`` bool, equal to :func:`.routing_torch.oea_critical_set`
    (including ``-inf`` experts picked by id order when a row has fewer than ``k0`` finite scores).
    Raises ``ValueError`` for non-2-d / non-fp32 / empty scores or ``k0`` outside ``1..N``.
    """
    if vote is not None or seed is not None:  # TODO(kernels): masks
        return _rt.oea_critical_set(scores, top_k0, vote=vote, seed=seed)
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k0 <= num_experts:
        raise ValueError(f"k0 must be in 1..{num_experts}, got {top_k0}")
    out = torch.empty(num_experts, dtype=torch.int8, device=scores.device)
    block_n = triton.next_power_of_2(num_experts)
    _oea_kernel[(1,)](
        scores, out, num_tokens, num_experts, top_k0, scores.stride(0), scores.stride(1),
        BLOCK_T=_block_t(block_n), BLOCK_N=block_n,
    )
    return out.bool()


@triton.jit
def _remap_kernel(
    s_ptr, crit_ptr, l_ptr, idx_ptr, w_ptr,
    T, N, scale,
    stride_st, stride_sn, stride_lt, stride_ln,
    K: tl.constexpr, RULE: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = offs_t < T
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    m2 = tm[:, None] & nmask[None, :]
    s = tl.load(s_ptr + offs_t[:, None] * stride_st + offs_n[None, :] * stride_sn, mask=m2, other=float("-inf"))
    crit = tl.load(crit_ptr + offs_n, mask=nmask, other=0) != 0
    allowed = (s == s) & (s != float("-inf")) & nmask[None, :]
    tier = tl.where(crit[None, :] & allowed, 2, tl.where(allowed, 1, 0))
    taken = offs_n[None, :] >= N
    offs_k = tl.arange(0, BLOCK_K)
    out = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(K):
        mt = tl.max(tl.where(taken, -1, tier), axis=1)
        c1 = (taken == 0) & (tier == mt[:, None])
        ms = tl.max(tl.where(c1, s, float("-inf")), axis=1)
        c2 = c1 & (s == ms[:, None])
        sel = tl.min(tl.where(c2, offs_n[None, :], BLOCK_N), axis=1)
        taken = taken | (offs_n[None, :] == sel[:, None])
        out = tl.where(offs_k[None, :] == i, sel[:, None], out)
    kmask = offs_k < K
    om = tm[:, None] & kmask[None, :]
    tl.store(idx_ptr + offs_t[:, None] * K + offs_k[None, :], out, mask=om)
    if RULE != 0:
        lg = tl.load(l_ptr + offs_t[:, None] * stride_lt + offs_n[None, :] * stride_ln, mask=m2, other=float("-inf"))
        chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for i in tl.static_range(K):
            sel_i = tl.sum(tl.where(offs_k[None, :] == i, out, 0), axis=1)
            hit = offs_n[None, :] == sel_i[:, None]
            if RULE == 1:
                rmax = tl.max(lg, axis=1)
                rmax = tl.where(rmax == float("-inf"), 0.0, rmax)
                ex = tl.exp(lg - rmax[:, None])
                z = tl.sum(tl.where(nmask[None, :], ex, 0.0), axis=1)
                z = tl.where(tm, z, 1.0)  # padding rows: no 0/0
                v = tl.sum(tl.where(hit, ex, 0.0), axis=1) / z
            else:
                v = tl.sum(tl.where(hit, lg, 0.0), axis=1)
            chosen = tl.where(offs_k[None, :] == i, v[:, None], chosen)
        if RULE == 1:
            w = chosen
        elif RULE == 2:
            cm = tl.max(tl.where(kmask[None, :], chosen, float("-inf")), axis=1)
            cm = tl.where(cm == float("-inf"), 0.0, cm)
            ex = tl.where(kmask[None, :], tl.exp(chosen - cm[:, None]), 0.0)
            w = ex / tl.where(tm, tl.sum(ex, axis=1), 1.0)[:, None]
        else:
            w = 1.0 / (1.0 + tl.exp(-chosen))
        if RENORM:
            w = w / tl.where(tm, tl.sum(tl.where(kmask[None, :], w, 0.0), axis=1), 1.0)[:, None]
        w = w * scale
        tl.store(w_ptr + offs_t[:, None] * K + offs_k[None, :], w, mask=om)


def remap_topk(
    scores: torch.Tensor,
    critical: torch.Tensor,
    top_k: int,
    *,
    logits: torch.Tensor | None = None,
    rule: str | None = None,
    renormalize: bool = False,
    scale: float = 1.0,
    check: bool = True,
):
    """Remap step (arXiv 2411.08982 Sec. 4; OEA piggybacking, arXiv 2511.02237 Sec. 3), in Triton.

    ``scores [T, N]`` fp32, ``critical [N]`` bool -> ``idx [T, k]`` int64, equal element for element
    to :func:`.routing_torch.remap_topk` (in-S experts by score, then out-of-S by score, ties
    -> lower id; never a forbidden ``-inf`` expert).

    With ``rule`` in ``("softmax_all", "softmax_chosen", "sigmoid")`` returns ``(idx, weights)``, the
    weights ``[T, k]`` fp32 computed in the same kernel from ``logits [T, N]`` (default: ``scores``)
    as :func:`.routing_torch.routing_weights` does (agrees within fp32 rounding, ~1e-6).

    Raises ``ValueError`` for non-2-d / non-fp32 scores or logits of another shape, a ``critical``
    that is not ``[N]`` bool, ``top_k`` outside ``1..N``, an unknown rule, and (when ``check``, which
    costs one device sync) a row with fewer than ``top_k`` allowed (finite) scores.
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if critical.shape != (num_experts,) or critical.dtype != torch.bool:
        raise ValueError(f"critical must be [N={num_experts}] bool, got {tuple(critical.shape)} {critical.dtype}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if rule not in _RULE_CODE:
        raise ValueError(f"unknown weight rule {rule!r}; expected one of {WEIGHT_RULES}")
    if logits is None:
        logits = scores
    elif logits.shape != scores.shape or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 {tuple(scores.shape)}, got {tuple(logits.shape)} {logits.dtype}")
    if check:
        allowed = torch.isfinite(scores) | (scores > 0)
        if bool((allowed.sum(dim=-1) < top_k).any()):
            raise ValueError(f"a token has fewer than top_k={top_k} allowed (finite) router scores")
    dev = scores.device
    idx = torch.empty(num_tokens, top_k, dtype=torch.int64, device=dev)
    w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev) if rule else idx
    block_n = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // block_n))
    grid = (triton.cdiv(num_tokens, block_t),)
    _remap_kernel[grid](
        scores, critical.to(torch.int8), logits, idx, w,
        num_tokens, num_experts, float(scale),
        scores.stride(0), scores.stride(1), logits.stride(0), logits.stride(1),
        K=top_k, RULE=_RULE_CODE[rule], RENORM=bool(renormalize),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(top_k),
    )
    return (idx, w) if rule else idx


mass_greedy_grow = _rt.mass_greedy_grow  # TODO(kernels): Triton twin
