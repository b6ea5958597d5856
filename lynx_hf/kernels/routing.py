"""Triton kernels of the LYNX / OEA routing steps (``docs/design.md`` "The LYNX policy", "Kernels").

Each launcher has the signature and the outputs of its torch reference in :mod:`.routing_torch`
and returns exactly the same integers (tests compare them element for element), including the
per-token masks (``vote [T]``: the rows that decide and count in the batch base ``B``; ``seed [N]``:
experts the step loads anyway) and a batch base given as a 0-d device tensor:

- :func:`lynx_critical_set` — LYNX (Gupta et al., arXiv 2411.08982, Sec. 4 "Dynamic expert
  reduction"): affinity binning, exponential batch score, cover / consensus / grow, fused in one
  single-program kernel (decode batches are small; the steps need batch-global reductions);
- :func:`oea_critical_set` — OEA (Oncescu et al., arXiv 2511.02237, Sec. 3): union of each voting
  token's top-``k0`` plus the seed (ties -> the token's own experts, then lower id);
- :func:`mass_greedy_grow` — the project's routing-mass growth (integer greedy, one program);
- :func:`remap_topk` — the remap step (LYNX Sec. 4 / OEA piggybacking): each token's top-k
  preferring the critical set (ties -> the token's own experts, then lower id), optionally with the
  family's routing weights recomputed.

**Sync-free.** No launcher reads a device value on the host: grids and block sizes depend on shapes
only (:func:`block_sizes`), loops inside the kernels have bounds given by shapes or stop on device
conditions, scalars that must stay exact (``tau`` in fp64, the powers ``fp32(B ** -j)``) are passed
in device tensors built with fills and device ops (never a host-to-device copy of a Python list). So a
decode step that calls them can be captured in a CUDA graph. The only exception is the optional
``remap_topk(check=True)`` (one device sync); the decode path passes ``check=False``.

Exactness notes. Bins are ``ceil((s - max s) * fp32(alpha))`` in fp32, as in the reference (``alpha`` is
a Triton fp32 scalar argument: the launcher rounds it to nearest, as ``torch.tensor(alpha,
dtype=float32)`` does); they are kept as floats (never cast to int, so huge gaps cannot overflow) and
compared with ``-j``. The score is ``sum_j count_j * fp32(B ** -j)`` in fp64 with the counts totalled
over the voting rows first and ``j`` ascending; every product is exact in fp64, so the sum is
bit-identical to the reference with or without FMA. The powers are the ones
:func:`.routing_torch.batch_base_powers` computes (on the device). The mass greedy's fixed-point
weights ``W`` are computed by the reference's own torch expression (``exp`` rounding differs between
libraries, integers do not); the kernel then runs the integer greedy. Offsets are int64.

Inputs must not contain NaN (the reference's behaviour on NaN is defined by torch's sort order;
these kernels do not reproduce it). :func:`mass_greedy_grow` additionally needs every voting row to
have a finite score (an all ``-inf`` voting row has NaN relative weights in the reference).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .routing_torch import (
    MASS_UNIT,
    PRICE_UNITS,
    WEIGHT_RULES,
    batch_base_powers,
    mass_grow_steps,
    relative_weights,
)

_RULE_CODE = {None: 0, "softmax_all": 1, "softmax_chosen": 2, "sigmoid": 3}
#: the interpreter (CPU tests) is chosen when triton is first imported; read once, like triton does.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: elements of one [BLOCK_T, BLOCK_N] tile (registers of one program; checked for spills by the AOT test)
_TILE = 4096
#: Launch configuration of the single-program kernels (LYNX, OEA, mass greedy): one CTA does the whole
#: step, so occupancy is irrelevant; ``maxnreg=255`` lets ptxas keep what it needs in registers instead of
#: spilling 8-36 bytes to reach an occupancy tier, which it did without it (lab/kernel_report.py).
#: A one-config ``triton.autotune`` is how torch.compile represents launch options of a user kernel too.
#: The mass greedy keeps int64 tiles (twice the registers): 8 warps. The LYNX kernel too: with 4 warps ptxas
#: put 8 bytes on the stack (local loads/stores) at Mixtral's N = 8, 64-row tiles on sm_90; 8 warps: 47 registers, none.
SINGLE_PROGRAM = triton.Config({}, num_warps=4, maxnreg=255)
SINGLE_PROGRAM_WIDE = triton.Config({}, num_warps=8, maxnreg=255)


def _single_program(fn, config=SINGLE_PROGRAM):
    return triton.autotune(configs=[config], key=[])(fn)


def block_sizes(num_tokens: int, num_experts: int, top_k: int) -> dict:
    """Block sizes of the routing kernels for ``T`` tokens, ``N`` experts, ``k`` slots (one source of truth:
    every launcher here and the AOT compile test, ``tests/accelerator/test_kernels_aot.py``, use it).

    Returns ``{"BLOCK_N", "BLOCK_T", "BLOCK_P", "BLOCK_K", "REMAP_BLOCK_T"}``: ``BLOCK_N`` = next power
    of two ``>= N`` (a whole row per tile); ``BLOCK_T`` rows per tile so that a tile holds at most
    4096 elements (at most 64 rows); ``BLOCK_P`` (token, slot) pairs per chunk of the union; ``BLOCK_K``
    = next power of two ``>= k``; ``REMAP_BLOCK_T`` rows per program of the remap kernel (at most 16,
    tile at most 2048 elements, several programs run in parallel). Depends on shapes only.
    """
    block_n = triton.next_power_of_2(max(1, num_experts))
    block_t = max(1, min(64, _TILE // block_n))
    return {
        "BLOCK_N": block_n,
        "BLOCK_T": block_t,
        "BLOCK_P": block_t,
        "BLOCK_K": triton.next_power_of_2(max(1, top_k)),
        "REMAP_BLOCK_T": max(1, min(16, 2048 // block_n)),
    }


# ---------------------------------------------------------------------------------------------
# shared device helpers


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
def _splat_flag(flag, like):
    """A scalar bool as a vector shaped like ``like`` (the interpreter mis-types ``vector & scalar`` when the
    scalar comes from a reduction; on the GPU this is a plain broadcast)."""
    return (tl.zeros(like.shape, dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _row_votes(vote_ptr, offs_t, tm, stride_v, HAS_VOTE: tl.constexpr):
    """``[BLOCK_T]`` bool: rows in range that vote (every row in range without a vote mask)."""
    if HAS_VOTE:
        v = tl.load(vote_ptr + offs_t * stride_v, mask=tm, other=0) != 0
        return tm & v
    else:
        return tm


@triton.jit
def _score_tile(s_ptr, vote_ptr, t0, T, offs_n, nmask, stride_st, stride_sn, stride_v, HAS_VOTE: tl.constexpr,
                BLOCK_T: tl.constexpr):
    """Rows ``t0 .. t0 + BLOCK_T`` of the selection scores: ``(votes [BLOCK_T] bool, scores [BLOCK_T, BLOCK_N]
    fp32)``, ``-inf`` outside the rows / experts in range (both passes of the LYNX kernel read the same tile)."""
    offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
    tm = offs_t < T
    rv = _row_votes(vote_ptr, offs_t, tm, stride_v, HAS_VOTE)
    s = tl.load(s_ptr + offs_t[:, None] * stride_st + offs_n[None, :] * stride_sn,
                mask=tm[:, None] & nmask[None, :], other=float("-inf"))
    return rv, s


@triton.jit
def _tie_keys(own, offs_n, BLOCK_N: tl.constexpr):
    """``[BLOCK_T, BLOCK_N]`` int32 tie keys of :func:`_tie_pick`: ``id`` for a row's own experts (``own``, bool),
    ``id + BLOCK_N`` for the others."""
    ids = offs_n.to(tl.int32)[None, :]
    return tl.where(own, ids, ids + BLOCK_N)


@triton.jit
def _own_keys(own_ptr, offs_t, tm, offs_n, stride_ot, stride_ok, KO: tl.constexpr, HAS_OWN: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """:func:`_tie_keys` of each row's own experts (``topk_idx [T, KO]``; none without one: the keys are the ids)."""
    own = (offs_t[:, None] < 0) & (offs_n[None, :] < 0)
    if HAS_OWN:
        for j in tl.static_range(KO):
            e = tl.load(own_ptr + offs_t * stride_ot + j * stride_ok, mask=tm, other=-1).to(tl.int64)
            own = own | (offs_n[None, :] == e[:, None])
    return _tie_keys(own, offs_n, BLOCK_N)


@triton.jit
def _tie_pick(cand, keys, BLOCK_N: tl.constexpr):
    """``[BLOCK_T]`` int64: per row, among the experts ``cand [BLOCK_T, BLOCK_N]`` (those with the best score), the
    row's own experts if any is there, and among those the lower id: the min of the tie ``keys`` (:func:`_tie_keys`)
    mod ``BLOCK_N``. ``BLOCK_N`` for a row with no candidate."""
    sel = tl.min(tl.where(cand, keys, 2 * BLOCK_N), axis=1)
    return tl.where(sel >= 2 * BLOCK_N, BLOCK_N, sel % BLOCK_N).to(tl.int64)


@triton.jit
def _seed_mask(seed_ptr, offs_n, nmask, stride_sd, HAS_SEED: tl.constexpr):
    """``[BLOCK_N]`` int32 0/1: the seed (zeros without one)."""
    if HAS_SEED:
        return (tl.load(seed_ptr + offs_n * stride_sd, mask=nmask, other=0) != 0).to(tl.int32)
    else:
        return tl.zeros(offs_n.shape, dtype=tl.int32)


@triton.jit
def _voters_union(idx_ptr, vote_ptr, T, offs_n, stride_it, stride_ik, stride_v,
                  K: tl.constexpr, HAS_VOTE: tl.constexpr, BLOCK_P: tl.constexpr):
    """``[BLOCK_N]`` int32 0/1: experts some voting row chose in ``topk_idx`` (``union_mask(idx, N, vote)``)."""
    union = tl.zeros(offs_n.shape, dtype=tl.int32)
    num_pairs = T * K
    for p0 in range(0, num_pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        pm = offs_p < num_pairs
        tok = offs_p // K
        slot = offs_p % K
        pm = _row_votes(vote_ptr, tok, pm, stride_v, HAS_VOTE)
        e = tl.load(idx_ptr + tok * stride_it + slot * stride_ik, mask=pm, other=-1).to(tl.int64)
        e = tl.where(pm, e, -1)
        hit = (e[:, None] == offs_n[None, :]).to(tl.int32)
        union = tl.maximum(union, tl.max(hit, axis=0))
    return union


# ---------------------------------------------------------------------------------------------
# LYNX critical set


@functools.partial(_single_program, config=SINGLE_PROGRAM_WIDE)
@triton.jit
def _lynx_critical_kernel(
    s_ptr, idx_ptr, vote_ptr, seed_ptr, pow_ptr, tau_ptr, out_ptr,
    T, N, top_k, alpha,
    stride_st, stride_sn, stride_it, stride_ik, stride_v, stride_sd,
    K: tl.constexpr, BETA: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_VOTE: tl.constexpr, HAS_SEED: tl.constexpr, UNION_ONLY: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    seeded = _seed_mask(seed_ptr, offs_n, nmask, stride_sd, HAS_SEED)
    # Candidates U: the voting rows' own top-k, plus the seed.
    cand = tl.maximum(_voters_union(idx_ptr, vote_ptr, T, offs_n, stride_it, stride_ik, stride_v,
                                    K, HAS_VOTE, BLOCK_P), seeded)
    if UNION_ONLY:  # alpha = inf (k == N): nothing to reduce
        crit = cand
    else:
        cand_b = (cand > 0) & nmask
        # Pass 1: integer per-bin vote counts over the voting rows.
        offs_j = tl.arange(0, BLOCK_J)
        counts = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            rv, s = _score_tile(s_ptr, vote_ptr, t0, T, offs_n, nmask, stride_st, stride_sn, stride_v, HAS_VOTE,
                                BLOCK_T)
            b = tl.where(rv[:, None], _bins_f(s, alpha, cand_b), float("-inf"))
            for j in tl.static_range(BETA + 1):
                # Counted in fp32 (exact: at most BLOCK_T <= 64 ones per tile): the sum of an int32 cast of a
                # bool became a popcount of packed bits (ctpop <4 x i4>) that triton 3.8's LLVM built through
                # a 2-byte `.local` array on sm_90 (Qwen2-57B / DeepSeek-V2-Lite, T >= 16); fp32 adds are kept.
                c = tl.sum(tl.where(b == -j, 1.0, 0.0), axis=0).to(tl.int32)
                counts += tl.where(offs_j[:, None] == j, c[None, :], 0)
        # Exponential batch score, fixed order j = 0..beta, fp64 (products exact).
        score = tl.zeros([BLOCK_N], dtype=tl.float64)
        for j in tl.static_range(BETA + 1):
            cj = tl.sum(tl.where(offs_j[:, None] == j, counts, 0), axis=0)
            score = score + cj.to(tl.float64) * tl.load(pow_ptr + j)
        score = tl.where(cand_b, score, 0.0)

        # (a) cover: each voting row's bin-0 candidate, a seeded one first, then by score (ties -> lower id).
        offset = tl.zeros([BLOCK_N], dtype=tl.float64) + (T + 1)  # > any score: seeded experts rank first
        key = score + tl.where(seeded > 0, offset, 0.0)
        crit = seeded
        for t0 in range(0, T, BLOCK_T):
            rv, s = _score_tile(s_ptr, vote_ptr, t0, T, offs_n, nmask, stride_st, stride_sn, stride_v, HAS_VOTE,
                                BLOCK_T)
            bin0 = (_bins_f(s, alpha, cand_b) == 0) & rv[:, None]
            ck = tl.where(bin0, key[None, :], -1.0)
            has = tl.max(bin0.to(tl.int32), axis=1) > 0
            m = tl.max(ck, axis=1)
            sel = tl.min(tl.where(ck == m[:, None], offs_n[None, :], BLOCK_N), axis=1)
            hit = (offs_n[None, :] == sel[:, None]) & has[:, None]
            crit = tl.maximum(crit, tl.max(hit.to(tl.int32), axis=0))
        # (b) consensus.
        tau = tl.load(tau_ptr)
        crit = tl.where(cand_b & (score >= tau), 1, crit)
        # (c) grow by score until |S| >= k: the first `missing` eligible experts by score (ties -> lower
        # id); never an ineligible one (fewer eligible than missing: all of them).
        missing = top_k - tl.sum(crit, axis=0)
        gkey = tl.where(cand_b & (crit == 0), score, -1.0)
        gkey = tl.where(nmask, gkey, float("-inf"))
        for i in range(0, top_k):
            m = tl.max(gkey, axis=0)
            sel = tl.min(tl.where(gkey == m, offs_n, BLOCK_N), axis=0)
            pick = (offs_n == sel) & _splat_flag((i < missing) & (m >= 0.0), offs_n)
            crit = tl.where(pick, 1, crit)
            gkey = tl.where(offs_n == sel, float("-inf"), gkey)
    tl.store(out_ptr + offs_n, crit.to(tl.int8), mask=nmask)


def _check_scores(scores: torch.Tensor) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a [T, N] tensor, got shape {tuple(getattr(scores, 'shape', ()))}")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 (router math stays in fp32), got {scores.dtype}")
    if scores.shape[0] < 1 or scores.shape[1] < 1:
        raise ValueError(f"scores must be non-empty, got shape {tuple(scores.shape)}")


def _check_topk_idx(topk_idx: torch.Tensor, num_tokens: int) -> None:
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be [T={num_tokens}, k] int64 (or int32), got "
                         f"{tuple(topk_idx.shape)} {topk_idx.dtype}")
    if topk_idx.shape[1] < 1:
        raise ValueError("topk_idx must have at least one slot")


def _mask_arg(mask, size: int, name: str, like: torch.Tensor):
    """``(tensor to pass, stride, present)`` for an optional ``[size]`` bool mask; a dummy pointer when absent."""
    if mask is None:
        return like, 0, False
    if not isinstance(mask, torch.Tensor) or mask.shape != (size,) or mask.dtype != torch.bool:
        got = (tuple(mask.shape), mask.dtype) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a [{size}] bool tensor, got {got}")
    if mask.device != like.device:
        raise ValueError(f"{name} is on {mask.device}, scores on {like.device}")
    as_int8 = mask.to(torch.int8)  # a copy, not .view: inductor (torch 2.11, H200) cannot lower view.dtype of bool
    return as_int8, as_int8.stride(0), True


def _device_powers(batch_base, beta: int, num_tokens: int, vote, device) -> torch.Tensor:
    """``fp32(B ** -j)``, ``j = 0..beta``, fp64 on ``device``: :func:`.routing_torch.batch_base_powers` of the
    batch base (default: the number of voting rows), an int base filled on the device (no host copy)."""
    if batch_base is None:
        batch_base = num_tokens if vote is None else vote.sum()
    if not isinstance(batch_base, torch.Tensor):
        batch_base = torch.full((), float(max(int(batch_base), 1)), dtype=torch.float64, device=device)
    elif batch_base.dim() != 0:
        raise ValueError(f"batch_base must be an int or a 0-d tensor, got shape {tuple(batch_base.shape)}")
    return batch_base_powers(batch_base.to(device), beta)


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
    """LYNX critical set (arXiv 2411.08982, Sec. 4; ``docs/design.md`` steps 1-4), one fused Triton program.

    ``scores [T, N]`` fp32 selection scores (``-inf`` = forbidden), ``topk_idx [T, k]`` int32/int64
    (the model's own selection, ids in ``0..N-1``), ``vote [T]`` / ``seed [N]`` bool or ``None``,
    ``batch_base`` an int or a 0-d tensor (default: the number of voting rows, counted on the device)
    -> ``[N]`` bool, equal element for element to :func:`.routing_torch.lynx_critical_set`. Sync-free.
    Raises ``ValueError`` for non-2-d / non-fp32 / empty scores, a ``topk_idx`` that is not ``[T, k]``
    integer, masks of the wrong shape / dtype / device, ``top_k`` outside ``1..N``, ``alpha <= 0``
    or ``beta < 0``.
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    _check_topk_idx(topk_idx, num_tokens)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if not alpha > 0 or beta < 0:
        raise ValueError(f"alpha must be > 0 and beta >= 0, got alpha={alpha}, beta={beta}")
    vote_t, stride_v, has_vote = _mask_arg(vote, num_tokens, "vote", scores)
    seed_t, stride_sd, has_seed = _mask_arg(seed, num_experts, "seed", scores)
    dev = scores.device
    beta = int(beta)
    union_only = math.isinf(alpha)
    if union_only:
        powers = tau_t = scores  # not read
    else:
        powers = _device_powers(batch_base, beta, num_tokens, vote, dev)
        tau_t = torch.full((1,), float(tau), dtype=torch.float64, device=dev)
    out = torch.empty(num_experts, dtype=torch.int8, device=dev)
    blk = block_sizes(num_tokens, num_experts, topk_idx.shape[1])
    _lynx_critical_kernel[(1,)](
        scores, topk_idx, vote_t, seed_t, powers, tau_t, out,
        num_tokens, num_experts, int(top_k), 1.0 if union_only else float(alpha),
        scores.stride(0), scores.stride(1), topk_idx.stride(0), topk_idx.stride(1), stride_v, stride_sd,
        K=topk_idx.shape[1], BETA=beta, BLOCK_J=triton.next_power_of_2(beta + 1),
        BLOCK_T=blk["BLOCK_T"], BLOCK_N=blk["BLOCK_N"], BLOCK_P=blk["BLOCK_P"],
        HAS_VOTE=has_vote, HAS_SEED=has_seed, UNION_ONLY=union_only,
    )
    return out.to(torch.bool)


# ---------------------------------------------------------------------------------------------
# OEA critical set


@_single_program
@triton.jit
def _oea_kernel(
    s_ptr, vote_ptr, seed_ptr, own_ptr, out_ptr, T, N, k0,
    stride_st, stride_sn, stride_v, stride_sd, stride_ot, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_VOTE: tl.constexpr, HAS_SEED: tl.constexpr,
    KO: tl.constexpr, HAS_OWN: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    union = _seed_mask(seed_ptr, offs_n, nmask, stride_sd, HAS_SEED)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        rv = _row_votes(vote_ptr, offs_t, tm, stride_v, HAS_VOTE)
        s = tl.load(s_ptr + offs_t[:, None] * stride_st + offs_n[None, :] * stride_sn,
                    mask=tm[:, None] & nmask[None, :], other=float("-inf"))
        keys = _own_keys(own_ptr, offs_t, tm, offs_n, stride_ot, stride_ok, KO, HAS_OWN, BLOCK_N)
        taken = (offs_n[None, :] >= N) | (offs_t[:, None] < 0)  # [BLOCK_T, BLOCK_N], padding pre-taken
        for _ in range(0, k0):
            m = tl.max(tl.where(taken, float("-inf"), s), axis=1)
            sel = _tie_pick((taken == 0) & (s == m[:, None]), keys, BLOCK_N)  # ties -> own, then lower id
            hit = offs_n[None, :] == sel[:, None]
            taken = taken | hit
            union = tl.maximum(union, tl.max((hit & rv[:, None]).to(tl.int32), axis=0))
    tl.store(out_ptr + offs_n, union.to(tl.int8), mask=nmask)


def _own_arg(topk_idx, num_tokens: int, like: torch.Tensor):
    """``(tensor to pass, row stride, slot stride, slots, present)`` for an optional ``topk_idx [T, k]``."""
    if topk_idx is None:
        return like, 0, 0, 1, False
    _check_topk_idx(topk_idx, num_tokens)
    if topk_idx.device != like.device:
        raise ValueError(f"topk_idx is on {topk_idx.device}, scores on {like.device}")
    return topk_idx, topk_idx.stride(0), topk_idx.stride(1), topk_idx.shape[1], True


def oea_critical_set(scores: torch.Tensor, top_k0: int, vote: torch.Tensor | None = None,
                     seed: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None) -> torch.Tensor:
    """OEA critical set (arXiv 2511.02237, Sec. 3): the seed plus the union of every voting token's
    top-``k0`` (ties -> the token's own experts ``topk_idx [T, k]``, then lower id; ``None``: lower id).

    ``scores [T, N]`` fp32, ``vote [T]`` / ``seed [N]`` bool or ``None`` -> ``[N]`` bool, equal to
    :func:`.routing_torch.oea_critical_set` (including ``-inf`` experts picked by that order when a row
    has fewer than ``k0`` finite scores). Sync-free. Raises ``ValueError`` for non-2-d / non-fp32 /
    empty scores, masks or ``topk_idx`` of the wrong shape / dtype / device, or ``k0`` outside ``1..N``.
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k0 <= num_experts:
        raise ValueError(f"k0 must be in 1..{num_experts}, got {top_k0}")
    vote_t, stride_v, has_vote = _mask_arg(vote, num_tokens, "vote", scores)
    seed_t, stride_sd, has_seed = _mask_arg(seed, num_experts, "seed", scores)
    own_t, stride_ot, stride_ok, slots, has_own = _own_arg(topk_idx, num_tokens, scores)
    out = torch.empty(num_experts, dtype=torch.int8, device=scores.device)
    blk = block_sizes(num_tokens, num_experts, 1)
    _oea_kernel[(1,)](
        scores, vote_t, seed_t, own_t, out, num_tokens, num_experts, int(top_k0),
        scores.stride(0), scores.stride(1), stride_v, stride_sd, stride_ot, stride_ok,
        BLOCK_T=blk["BLOCK_T"], BLOCK_N=blk["BLOCK_N"], HAS_VOTE=has_vote, HAS_SEED=has_seed,
        KO=slots, HAS_OWN=has_own,
    )
    return out.to(torch.bool)


# ---------------------------------------------------------------------------------------------
# routing-mass greedy growth


@triton.jit
def _mass_greedy(w_ptr, stride_wt, lst_ptr, crit, cand_b, T, top_k, kk, price, steps, voters, offs_n, nmask,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, KK: tl.constexpr, UNIT: tl.constexpr):
    """The routing-mass greedy (``routing_torch.mass_greedy_grow``) on fixed-point weights ``w [T, N]`` int64 (0 on
    rows that do not vote; row stride ``stride_wt``), from the critical set ``crit [BLOCK_N]`` int32 over the
    candidates ``cand_b``: the candidate with the largest integer gain joins while the gain reaches the threshold
    (``price`` in fixed point; ``UNIT`` 1: x ``voters``, 2: x sqrt(``voters``) rounded up) or ``|S| < top_k``, at most
    ``steps`` times, stopping on the device at the first idle step. ``lst [T, KK]`` int64 scratch: per row, the KK
    largest W of the experts in S (descending, -1 padded); the ``kk``-th is the row's threshold. Returns ``crit``."""
    offs_k = tl.arange(0, KK).to(tl.int64)
    # Initial lists: the KK largest W (clamped at -1, which changes no threshold) of the experts in S.
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        w = tl.load(w_ptr + offs_t[:, None] * stride_wt + offs_n[None, :],
                    mask=tm[:, None] & nmask[None, :], other=0)
        vals = tl.where((crit > 0)[None, :] & nmask[None, :], tl.maximum(w, -1), -2)  # -2: not in S / listed
        lst = tl.full([BLOCK_T, KK], -1, dtype=tl.int64)
        for i in tl.static_range(KK):
            m = tl.max(vals, axis=1)
            sel = tl.min(tl.where(vals == m[:, None], offs_n[None, :], BLOCK_N), axis=1)
            vals = tl.where(offs_n[None, :] == sel[:, None], -2, vals)
            lst = tl.where(offs_k[None, :] == i, tl.maximum(m, -1)[:, None], lst)
        tl.store(lst_ptr + offs_t[:, None] * KK + offs_k[None, :], lst, mask=tm[:, None])
    tl.debug_barrier()

    price = price + tl.zeros([], dtype=tl.int64)  # (an int arg equal to 1 arrives as a constexpr)
    if UNIT == 1:
        price = price * voters
    elif UNIT == 2:
        # fp64 sqrt is correctly rounded (PTX has no approximate f64 sqrt: sqrt.rn.f64), as torch's / numba's
        price = tl.ceil(tl.sqrt(voters.to(tl.float64)) * price.to(tl.float64)).to(tl.int64)
    size = tl.sum(crit, axis=0)
    it = tl.zeros([], dtype=tl.int32)
    go = it < steps
    while go:
        # gain[e] = sum over rows of max(0, W[t, e] - kth_t)
        gain = tl.zeros([BLOCK_N], dtype=tl.int64)
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            tm = offs_t < T
            w = tl.load(w_ptr + offs_t[:, None] * stride_wt + offs_n[None, :],
                        mask=tm[:, None] & nmask[None, :], other=0)
            kth = tl.load(lst_ptr + offs_t * KK + (kk - 1), mask=tm, other=0)
            kth = tl.maximum(kth, 0)
            gain += tl.sum(tl.maximum(w - kth[:, None], 0), axis=0)
        elig = cand_b & (crit == 0) & nmask
        g = tl.where(elig, gain, -1)
        best_gain = tl.max(g, axis=0)
        best = tl.min(tl.where(g == best_gain, offs_n, BLOCK_N), axis=0)
        add = (best_gain >= price) | ((best_gain >= 0) & (size < top_k))
        crit = tl.where((offs_n == best) & _splat_flag(add, offs_n), 1, crit)
        size += add.to(tl.int32)
        # insert column `best` into every row's list (inserting -1 when nothing is added: a no-op):
        # new[i] = max(l[i], min(l[i - 1], x)), l[-1] = +inf.
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            tm = offs_t < T
            x = tl.load(w_ptr + offs_t * stride_wt + best, mask=tm & _splat_flag(add, tm), other=-1)
            x = tl.maximum(x, -1)
            lm = tm[:, None] & (offs_k[None, :] >= 0)
            cur = tl.load(lst_ptr + offs_t[:, None] * KK + offs_k[None, :], mask=lm, other=-1)
            prev = tl.load(lst_ptr + offs_t[:, None] * KK + offs_k[None, :] - 1,
                           mask=lm & (offs_k[None, :] >= 1), other=9223372036854775807)
            new = tl.maximum(cur, tl.minimum(prev, x[:, None]))
            tl.debug_barrier()  # every thread has read the old list before any writes the new one
            tl.store(lst_ptr + offs_t[:, None] * KK + offs_k[None, :], new, mask=lm)
        tl.debug_barrier()
        it += 1
        go = add & (it < steps)
    return crit


@functools.partial(_single_program, config=SINGLE_PROGRAM_WIDE)
@triton.jit
def _mass_greedy_kernel(
    w_ptr, idx_ptr, vote_ptr, seed_ptr, crit_ptr, lst_ptr, out_ptr,
    T, N, top_k, kk, price, steps,
    stride_wt, stride_it, stride_ik, stride_v, stride_sd, stride_c,
    K: tl.constexpr, KK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_VOTE: tl.constexpr, HAS_SEED: tl.constexpr, UNIT: tl.constexpr,
):
    # w [T, N] int64 fixed-point weights (0 on non-voting rows); lst [T, KK] int64 scratch: per row, the
    # KK largest W of the experts in S (descending, -1 padded): the k-th one is the row's threshold.
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    seeded = _seed_mask(seed_ptr, offs_n, nmask, stride_sd, HAS_SEED)
    cand = tl.maximum(_voters_union(idx_ptr, vote_ptr, T, offs_n, stride_it, stride_ik, stride_v,
                                    K, HAS_VOTE, BLOCK_P), seeded)
    crit = (tl.load(crit_ptr + offs_n * stride_c, mask=nmask, other=0) != 0).to(tl.int32)
    crit = tl.maximum(crit, seeded)

    voters = tl.zeros([], dtype=tl.int64)
    if UNIT != 0:  # the threshold depends on the number of voting tokens B (counted on the device)
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            tm = offs_t < T
            voters += tl.sum((_row_votes(vote_ptr, offs_t, tm, stride_v, HAS_VOTE) & tm).to(tl.int64), axis=0)
    crit = _mass_greedy(w_ptr, stride_wt, lst_ptr, crit, cand > 0, T, top_k, kk, price, steps, voters, offs_n, nmask,
                        BLOCK_T, BLOCK_N, KK, UNIT)
    tl.store(out_ptr + offs_n, crit.to(tl.int8), mask=nmask)


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
    """Routing-mass greedy growth of a critical set, one Triton program; exact twin of
    :func:`.routing_torch.mass_greedy_grow` (same integers, same result element for element).

    ``scores [T, N]`` fp32, ``topk_idx [T, k]`` the model's own selection, ``critical [N]`` bool the
    starting set, ``vote [T]`` / ``seed [N]`` bool or ``None``, ``price`` in units of one token's top-k
    routing mass, ``unit`` ``"token"`` / ``"batch"`` / ``"sqrt"`` (threshold P, P x B, ceil(P sqrt B), B the voting
    tokens counted in the kernel; :func:`.routing_torch.batch_threshold`) -> ``[N]`` bool, a superset of ``critical`` (and of ``seed``). The fixed-point weights
    ``W = round(w * 2**24)`` (int64) come from the reference's torch expression; the kernel then adds,
    while the rule wants one, the candidate with the largest integer gain (ties -> lower id), at most
    :func:`.routing_torch.mass_grow_steps` times, stopping on the device at the first idle step (the
    reference's later steps are then no-ops). Sync-free. Every voting row needs a finite score.
    Raises ``ValueError`` for bad shapes / dtypes / devices and a NaN ``price``.
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    _check_topk_idx(topk_idx, num_tokens)
    if not isinstance(critical, torch.Tensor) or critical.shape != (num_experts,) or critical.dtype != torch.bool:
        raise ValueError(f"critical must be a [N={num_experts}] bool tensor")
    if int(top_k) < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if math.isnan(price):
        raise ValueError("price must not be NaN")
    vote_t, stride_v, has_vote = _mask_arg(vote, num_tokens, "vote", scores)
    seed_t, stride_sd, has_seed = _mask_arg(seed, num_experts, "seed", scores)
    dev = scores.device
    # The reference's fixed-point weights, exactly as it computes them (torch ops, on the device).
    w = relative_weights(scores, topk_idx)
    big_w = torch.round(w * MASS_UNIT).long()
    if vote is not None:
        big_w = torch.where(vote[:, None], big_w, torch.zeros_like(big_w))
    big_w = big_w.contiguous()
    kk = min(int(top_k), num_experts)
    # price in fixed point, clamped to a range that changes no comparison: gains are >= -1 (none) and
    # below 2**62 (sums of at most T weights of at most 2**24 each, for finite scores)
    price_fixed = math.ceil(price * MASS_UNIT) if math.isfinite(price) else (2**62 if price > 0 else -1)
    if unit not in PRICE_UNITS:
        raise ValueError(f"unit must be one of {PRICE_UNITS}, got {unit!r}")
    price_fixed = max(-1, min(price_fixed, 2**62 // max(num_tokens, 1) if unit != "token" else 2**62))
    blk = block_sizes(num_tokens, num_experts, topk_idx.shape[1])
    block_kk = triton.next_power_of_2(max(kk, 1))
    crit_i8 = critical.to(torch.int8)
    scratch = torch.empty(num_tokens, block_kk, dtype=torch.int64, device=dev)
    out = torch.empty(num_experts, dtype=torch.int8, device=dev)
    _mass_greedy_kernel[(1,)](
        big_w, topk_idx, vote_t, seed_t, crit_i8, scratch, out,
        num_tokens, num_experts, int(top_k), kk, price_fixed, mass_grow_steps(num_tokens, num_experts, top_k),
        big_w.stride(0), topk_idx.stride(0), topk_idx.stride(1), stride_v, stride_sd, crit_i8.stride(0),
        K=topk_idx.shape[1], KK=block_kk,
        BLOCK_T=blk["BLOCK_T"], BLOCK_N=blk["BLOCK_N"], BLOCK_P=blk["BLOCK_P"],
        HAS_VOTE=has_vote, HAS_SEED=has_seed, UNIT=PRICE_UNITS.index(unit),
    )
    return out.to(torch.bool)


# ---------------------------------------------------------------------------------------------
# remap


@triton.jit
def _remap_kernel(
    s_ptr, crit_ptr, l_ptr, own_ptr, idx_ptr, w_ptr,
    T, N, scale, eps,
    stride_st, stride_sn, stride_lt, stride_ln, stride_ot, stride_ok,
    K: tl.constexpr, RULE: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KO: tl.constexpr, HAS_OWN: tl.constexpr,
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
    keys = _own_keys(own_ptr, offs_t, tm, offs_n, stride_ot, stride_ok, KO, HAS_OWN, BLOCK_N)
    taken = offs_n[None, :] >= N
    offs_k = tl.arange(0, BLOCK_K)
    out = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(K):
        mt = tl.max(tl.where(taken, -1, tier), axis=1)
        c1 = (taken == 0) & (tier == mt[:, None])
        ms = tl.max(tl.where(c1, s, float("-inf")), axis=1)
        sel = _tie_pick(c1 & (s == ms[:, None]), keys, BLOCK_N)  # ties -> own, then lower id
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
            w = w / tl.where(tm, tl.sum(tl.where(kmask[None, :], w, 0.0), axis=1) + eps, 1.0)[:, None]
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
    eps: float = 0.0,
    check: bool = True,
    topk_idx: torch.Tensor | None = None,
):
    """Remap step (arXiv 2411.08982 Sec. 4; OEA piggybacking, arXiv 2511.02237 Sec. 3), in Triton.

    ``scores [T, N]`` fp32, ``critical [N]`` bool, ``topk_idx [T, k]`` int32/int64 the model's own top-k ids
    (or ``None``) -> ``idx [T, k]`` int64, equal element for element to :func:`.routing_torch.remap_topk`
    (in-S experts by score, then out-of-S by score, ties -> the token's own experts, then lower id; never a
    forbidden ``-inf`` expert).

    With ``rule`` in ``("softmax_all", "softmax_chosen", "sigmoid")`` returns ``(idx, weights)``, the
    weights ``[T, k]`` fp32 computed in the same kernel from ``logits [T, N]`` (default: ``scores``)
    as :func:`.routing_torch.routing_weights` does (agrees within fp32 rounding, ~1e-6; ``eps``: the
    renormalisation's denominator epsilon, ``w / (sum + eps)``).

    Raises ``ValueError`` for non-2-d / non-fp32 scores or logits of another shape, a ``critical``
    that is not ``[N]`` bool, a ``topk_idx`` that is not ``[T, k]`` integer on the scores' device, ``top_k``
    outside ``1..N``, an unknown rule, and (when ``check``, which costs one device sync; the decode path
    passes ``False``) a row with fewer than ``top_k`` allowed (finite) scores.
    """
    _check_scores(scores)
    num_tokens, num_experts = scores.shape
    if not isinstance(critical, torch.Tensor) or critical.shape != (num_experts,) or critical.dtype != torch.bool:
        got = (tuple(critical.shape), critical.dtype) if isinstance(critical, torch.Tensor) else type(critical).__name__
        raise ValueError(f"critical must be [N={num_experts}] bool, got {got}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if rule not in _RULE_CODE:
        raise ValueError(f"unknown weight rule {rule!r}; expected one of {WEIGHT_RULES}")
    if logits is None:
        logits = scores
    elif logits.shape != scores.shape or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 {tuple(scores.shape)}, got {tuple(logits.shape)} {logits.dtype}")
    own_t, stride_ot, stride_ok, slots, has_own = _own_arg(topk_idx, num_tokens, scores)
    if check:
        allowed = torch.isfinite(scores) | (scores > 0)
        if bool((allowed.sum(dim=-1) < top_k).any()):
            raise ValueError(f"a token has fewer than top_k={top_k} allowed (finite) router scores")
    dev = scores.device
    idx = torch.empty(num_tokens, top_k, dtype=torch.int64, device=dev)
    w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev) if rule else idx
    blk = block_sizes(num_tokens, num_experts, top_k)
    block_t = blk["REMAP_BLOCK_T"]
    grid = (triton.cdiv(num_tokens, block_t),)
    crit_i8 = critical.contiguous().to(torch.int8)
    _remap_kernel[grid](
        scores, crit_i8, logits, own_t, idx, w,
        num_tokens, num_experts, float(scale), float(eps),
        scores.stride(0), scores.stride(1), logits.stride(0), logits.stride(1), stride_ot, stride_ok,
        K=top_k, RULE=_RULE_CODE[rule], RENORM=bool(renormalize),
        BLOCK_T=block_t, BLOCK_N=blk["BLOCK_N"], BLOCK_K=blk["BLOCK_K"], KO=slots, HAS_OWN=has_own,
    )
    return (idx, w) if rule else idx
