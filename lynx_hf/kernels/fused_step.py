"""One decode step of one MoE layer in one Triton launch: the device twin of the core's step-by-step path
(``lynx_hf.core.remap`` + ``lynx_hf.core.record_step``) and of the CPU one-call step (numba,
:func:`.routing_cpu.lynx_mass_decode`).

From the router logits (any float dtype) and the model's own top-k, one single-program kernel
(:func:`_fused_step_kernel`) computes, for every row of the step:

1. the row's flags: finite router logits, decode, live, padding (an id ``< 0``: vLLM's padding rows, neither decode
   nor live, returned as they came);
2. the selection scores ``s [T, N]`` fp32 of the family (:class:`FusedSelection`: the logits; DeepSeek-V2's
   group-limited greedy, groups by the max of ``softmax(logits)``; a selection-bias rule ``score(logits) + bias``
   with optional groups, as ``lynx_hf.selection.BiasedSelection``; or scores computed by the caller in torch);
3. the policy's critical set (:class:`FusedPolicy`: LYNX with routing-mass growth = the default, the paper's rule,
   OEA, XShare; or ``keep``: the model's routing, telemetry only), voted by the live decode rows with finite logits,
   seeded by the other live rows' experts and the caller's ``seed``;
4. the remap of those rows (each keeps exactly k distinct allowed experts, preferring the critical set; equal scores
   prefer the row's own experts, then the lower id, as OEA's top-k0 and XShare's warm-up do) and the family's weight
   rule (``softmax_all`` / ``softmax_chosen`` / ``sigmoid``, renormalised, scaled), the other rows' own routing
   copied through;
5. the step's telemetry row (:mod:`.telemetry_slots`), added to the layer's fp64 accumulators.

The integers (critical set, ids, counts) are the torch reference's (:mod:`.routing_torch`, composed as
``lynx_hf.core.remap``) wherever the floats they are decided on are the reference's: the bins, batch scores and
remap order are fp32 / fp64 arithmetic done in the same order; the relative routing weights of the mass rule, the
softmax probabilities of XShare and of DeepSeek-V2's groups, and sigmoid / log of a bias rule go through ``exp`` /
``log``, which may round one ulp apart from torch's, so a decision standing on a tie within an ulp can differ (the
tests compare ids and counts exactly on drawn inputs, weights and routing mass within fp32 rounding).

**No host work beyond the launch.** Buffers (outputs, scratch, the powers ``fp32(B ** -j)`` for every batch base
``B <= T``) are made on the first step of each size and reused (per thread, a bounded number of sizes); nothing is
read back; trip counts are shapes or device conditions. Under ``torch.compile`` the outputs and scratch are
allocated in the traced graph instead (inductor plans their memory).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from .routing import _bins_f, _mass_greedy, _splat_flag, _tie_keys, _tie_pick, block_sizes
from .routing_torch import MASS_UNIT, PRICE_UNITS, WEIGHT_RULES, batch_base_powers, mass_grow_steps
from .step_spec import (
    BIAS_SCORES,
    GROUP_SCORES,
    LOGITS,
    POLICIES,
    SCORES,
    SELECTIONS,
    FusedPolicy,
    FusedSelection,
)
from .telemetry_slots import NUM_SLOTS

#: the interpreter (CPU tests) is chosen when triton is first imported; read once, like triton does
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: Triton's interpreter patches ``triton.language`` for the length of each launch, which two threads launching at once
#: break ("Did you forget to add @triton.jit?"): interpreted launches take turns (compiled ones never wait)
_INTERPRETER_LOCK = threading.Lock() if _INTERPRET else contextlib.nullcontext()
#: distinct step sizes whose buffers one thread keeps per :class:`FusedStep` (least recently used dropped)
MAX_SIZES = 8
#: elements of one [BLOCK_T, BLOCK_N] tile of the fused kernel per policy (default 1024), its warps and registers
#: (spills checked by the AOT test, ``tests/accelerator/test_kernels_aot.py``: the default's int64 weight tiles spilled
#: 24 bytes at N 64 on sm_90 with 1024-element tiles, none with 512)
TILE = {"lynx_mass": 512}
NUM_WARPS = 8
MAXNREG = 255
_TINY = float(torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _row_flags(lg_ptr, idx_ptr, dec_ptr, live_ptr, offs_t, tm, offs_n, nmask, offs_k, stride_lt, stride_ln,
               stride_it, stride_ik, K: tl.constexpr, HAS_DEC: tl.constexpr, HAS_LIVE: tl.constexpr):
    """Rows ``offs_t`` (in range: ``tm``): ``(logits fp32 [BLOCK_T, BLOCK_N] (-inf outside), own ids [BLOCK_T,
    BLOCK_K] int64 (-1 outside), finite, decode, live, padding)``, each flag ``[BLOCK_T]`` bool and False outside the
    step. Padding rows (an id < 0) neither decode nor are live."""
    m2 = tm[:, None] & nmask[None, :]
    lg = tl.load(lg_ptr + offs_t[:, None] * stride_lt + offs_n[None, :] * stride_ln, mask=m2,
                 other=float("-inf")).to(tl.float32)
    bad = (lg != lg) | (tl.abs(lg) == float("inf"))
    finite = (tl.max((bad & m2).to(tl.int32), axis=1) == 0) & tm
    km = tm[:, None] & (offs_k[None, :] < K)
    own = tl.load(idx_ptr + offs_t[:, None] * stride_it + offs_k[None, :] * stride_ik, mask=km, other=-1).to(tl.int64)
    pad = (tl.min(tl.where(km, own, 0), axis=1) < 0) & tm
    dec = tm & (pad == 0)
    if HAS_DEC:
        dec = dec & (tl.load(dec_ptr + offs_t, mask=tm, other=0) != 0)
    live = tm & (pad == 0)
    if HAS_LIVE:
        live = live & (tl.load(live_ptr + offs_t, mask=tm, other=0) != 0)
    return lg, own, finite, dec, live, pad


@triton.jit
def _union_of(own, rows, offs_n, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N]`` int32 0/1: the experts of ``own [BLOCK_T, BLOCK_K]`` on ``rows [BLOCK_T]`` (ids < 0 skipped)."""
    offs_k = tl.arange(0, BLOCK_K)
    hit = tl.zeros([offs_n.shape[0]], dtype=tl.int32)
    for j in tl.static_range(K):
        e = tl.sum(tl.where(offs_k[None, :] == j, own, 0), axis=1)
        e = tl.where(rows & (e >= 0), e, -1)
        hit = tl.maximum(hit, tl.max((e[:, None] == offs_n[None, :]).to(tl.int32), axis=0))
    return hit


@triton.jit
def _tile_tie_keys(own, offs_n, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_T, BLOCK_N]`` int32 tie keys (``routing._tie_keys``: a row's own experts first, then lower id) from
    the rows' own ids already loaded, ``own [BLOCK_T, BLOCK_K]`` (ids < 0: none); ``routing._own_keys`` loads them."""
    offs_k = tl.arange(0, BLOCK_K)
    hit = tl.zeros([own.shape[0], offs_n.shape[0]], dtype=tl.int32) != 0
    for j in tl.static_range(K):
        e = tl.sum(tl.where(offs_k[None, :] == j, own, 0), axis=1)
        hit = hit | ((e[:, None] == offs_n[None, :]) & (e[:, None] >= 0))
    return _tie_keys(hit, offs_n, offs_n.shape[0])


@triton.jit
def _groups_allowed(c, offs_n, nmask, PER_GROUP: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                    GSCORE: tl.constexpr, BLOCK_G: tl.constexpr):
    """``[BLOCK_T, BLOCK_N]`` bool: the experts of each row's ``TOPK_GROUP`` best groups by ``GSCORE`` of ``c``
    (0: sum of the top two, 1: max; ties -> lower group)."""
    offs_g = tl.arange(0, BLOCK_G)
    gid = offs_n // PER_GROUP
    gsc = tl.full([c.shape[0], BLOCK_G], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(GROUPS):
        ing = (gid == g)[None, :] & nmask[None, :]
        cg = tl.where(ing, c, float("-inf"))
        m1 = tl.max(cg, axis=1)
        if GSCORE == 0:
            first = tl.min(tl.where(ing & (cg == m1[:, None]), offs_n[None, :], 1 << 30), axis=1)
            m2 = tl.max(tl.where(offs_n[None, :] == first[:, None], float("-inf"), cg), axis=1)
            m1 = m1 + m2
        gsc = tl.where(offs_g[None, :] == g, m1[:, None], gsc)
    chosen = offs_g[None, :] >= GROUPS
    for _ in tl.static_range(TOPK_GROUP):
        m = tl.max(tl.where(chosen, float("-inf"), gsc), axis=1)
        sel = tl.min(tl.where((chosen == 0) & (gsc == m[:, None]), offs_g[None, :], BLOCK_G), axis=1)
        chosen = chosen | (offs_g[None, :] == sel[:, None])
    allowed = tl.zeros(c.shape, dtype=tl.int1)
    for g in tl.static_range(GROUPS):
        cg = tl.max(tl.where(offs_g[None, :] == g, chosen.to(tl.int32), 0), axis=1) > 0
        allowed = allowed | ((gid == g)[None, :] & cg[:, None])
    return allowed


@triton.jit
def _softmax_rows(x, nmask):
    """Row softmax of ``x [BLOCK_T, BLOCK_N]`` over the columns in range (0 outside; an all ``-inf`` row: 0)."""
    m = tl.max(tl.where(nmask[None, :], x, float("-inf")), axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    ex = tl.where(nmask[None, :], tl.exp(x - m[:, None]), 0.0)
    z = tl.sum(ex, axis=1)
    return ex / tl.where(z > 0, z, 1.0)[:, None]


@triton.jit
def _selection_scores(lg, sin_ptr, offs_t, tm, offs_n, nmask, stride_st, stride_sn, bias, bmin,
                      SEL: tl.constexpr, SCORE: tl.constexpr, PER_GROUP: tl.constexpr, GROUPS: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, GSCORE: tl.constexpr, BLOCK_G: tl.constexpr, TINY: tl.constexpr):
    """Selection scores ``[BLOCK_T, BLOCK_N]`` fp32 of the logits tile ``lg`` (:class:`FusedSelection`)."""
    if SEL == 0:
        s = lg
    elif SEL == 3:
        s = tl.load(sin_ptr + offs_t[:, None] * stride_st + offs_n[None, :], mask=tm[:, None] & nmask[None, :],
                    other=float("-inf"))
    elif SEL == 1:
        p = _softmax_rows(lg, nmask)
        allowed = _groups_allowed(tl.where(nmask[None, :], p, float("-inf")), offs_n, nmask, PER_GROUP, GROUPS,
                                  TOPK_GROUP, 1, BLOCK_G)
        s = tl.where(allowed, lg, float("-inf"))
    else:
        if SCORE == 0:
            c = 1.0 / (1.0 + tl.exp(-lg))
        elif SCORE == 1:
            c = _softmax_rows(lg, nmask)
        else:
            c = lg
        c = c + bias[None, :]
        if GROUPS > 1:
            allowed = _groups_allowed(tl.where(nmask[None, :], c, float("-inf")), offs_n, nmask, PER_GROUP, GROUPS,
                                      TOPK_GROUP, GSCORE, BLOCK_G)
        else:
            allowed = nmask[None, :] & (offs_t[:, None] >= 0)
        if SCORE == 2:
            s = c
        else:
            s = tl.log(tl.maximum(c - bmin, TINY))
        s = tl.where(allowed, s, float("-inf"))
    return tl.where(nmask[None, :], s, float("-inf"))


@triton.jit
def _topk_union(s, keys, rows, offs_n, nmask, KSEL: tl.constexpr):
    """``[BLOCK_N]`` int32 0/1: the union over ``rows`` of each row's top-``KSEL`` of ``s`` (ties -> the row's own
    experts, then lower id: the tie ``keys`` of :func:`_tile_tie_keys`; a row with fewer finite scores takes ``-inf``
    experts in that order, as ``routing_torch.own_first_order`` does)."""
    BLOCK_N: tl.constexpr = s.shape[1]
    taken = (offs_n[None, :] >= 0) & (nmask[None, :] == 0)
    taken = taken | (rows[:, None] & (offs_n[None, :] < 0))
    union = tl.zeros([BLOCK_N], dtype=tl.int32)
    for _ in tl.static_range(KSEL):
        m = tl.max(tl.where(taken, float("-inf"), s), axis=1)
        sel = _tie_pick((taken == 0) & (s == m[:, None]), keys, BLOCK_N)
        hit = offs_n[None, :] == sel[:, None]
        taken = taken | hit
        union = tl.maximum(union, tl.max((hit & rows[:, None]).to(tl.int32), axis=0))
    return union


@triton.jit
def _cast_rtne(x, dtype: tl.constexpr):
    """fp32 ``x`` in ``dtype`` rounded to nearest even, as ``torch``'s ``.to(dtype)``; bf16 by hand on the bits (the
    interpreter's fp32 -> bf16 cast truncates; a GPU rounds to nearest even: both paths give the same bits)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _fixed_point(x):
    """``round(x)`` half to even for fp32 ``0 <= x <= 2**24`` (``torch.round``), exactly: below ``2**23`` by the
    ``2**23`` magic number (fp32 addition rounds to nearest even), above it every fp32 is an integer."""
    big = 8388608.0
    return tl.where(x < big, (x + big) - big, x).to(tl.int64)


# ---------------------------------------------------------------------------------------------------------------
# the kernel


# the step size and what follows from it are not specialised (a step of 1 token and one of 16 share the compiled
# kernel: no compile at a new batch size)
@triton.jit(do_not_specialize=["T", "steps", "budget"])
def _fused_step_kernel(
    lg_ptr, idx_ptr, w_ptr, dec_ptr, live_ptr, seed_ptr, bias_ptr, sin_ptr,
    s_ptr, fl_ptr, wf_ptr, lst_ptr, pow_ptr, par_ptr, acc_ptr, oidx_ptr, ow_ptr,
    T, N, alpha, price, steps, budget, scale, eps,
    stride_lt, stride_ln, stride_it, stride_ik, stride_wt, stride_wk, stride_b, stride_st, stride_sn,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BETA: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    POLICY: tl.constexpr, GROW: tl.constexpr, KSEL: tl.constexpr, UNIT: tl.constexpr,
    SEL: tl.constexpr, SCORE: tl.constexpr, PER_GROUP: tl.constexpr, GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GSCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DEC: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_SEED: tl.constexpr,
    RULE: tl.constexpr, RENORM: tl.constexpr, TELEM: tl.constexpr, VERIFY: tl.constexpr, TINY: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    kmask = offs_k < K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_b, mask=nmask, other=0.0).to(tl.float32)
        bmin = tl.min(tl.where(nmask, bias, float("inf")), axis=0)
    else:
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        bmin = tl.zeros([], dtype=tl.float32)
    if HAS_SEED:
        seeded = (tl.load(seed_ptr + offs_n, mask=nmask, other=0) != 0).to(tl.int32)
    else:
        seeded = tl.zeros([BLOCK_N], dtype=tl.int32)

    # -- pass A: flags, selection scores, unions, batch base, per-row policy inputs, telemetry of the own routing
    cand = tl.zeros([BLOCK_N], dtype=tl.int32)       # the voting rows' own experts
    pick = tl.zeros([BLOCK_N], dtype=tl.int32)       # OEA: their top-k0; XShare: their top-warmup
    xmass = tl.zeros([BLOCK_N], dtype=tl.int64)      # XShare: fixed-point softmax mass over the voting rows
    before = tl.zeros([BLOCK_N], dtype=tl.int32)     # telemetry: the counted rows' own experts
    loaded = tl.zeros([BLOCK_N], dtype=tl.int32)     # ... with the prefill rows'
    voters = tl.zeros([], dtype=tl.int64)
    counted_n = tl.zeros([], dtype=tl.float64)
    prefill_n = tl.zeros([], dtype=tl.float64)
    finished_n = tl.zeros([], dtype=tl.float64)
    fallback = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        lg, own, finite, dec, live, pad = _row_flags(lg_ptr, idx_ptr, dec_ptr, live_ptr, offs_t, tm, offs_n, nmask,
                                                     offs_k, stride_lt, stride_ln, stride_it, stride_ik, K, HAS_DEC,
                                                     HAS_LIVE)
        vote = dec & finite & live
        keep = ((finite == 0) | (dec == 0)) & live
        counted = dec & live
        tl.store(fl_ptr + offs_t, finite.to(tl.int8) + 2 * dec.to(tl.int8) + 4 * live.to(tl.int8), mask=tm)
        seeded = tl.maximum(seeded, _union_of(own, keep, offs_n, K, BLOCK_K))
        cand = tl.maximum(cand, _union_of(own, vote, offs_n, K, BLOCK_K))
        voters += tl.sum(vote.to(tl.int64), axis=0)
        if POLICY != 4:
            # a tile without a decode row needs no selection scores: the policy runs on the decode rows' tiles only
            # (a replayed mixed / prefill-only step; issue 54 N5: the model's routing, copied through, elsewhere)
            if tl.max(dec.to(tl.int32), axis=0) > 0:
                s = _selection_scores(lg, sin_ptr, offs_t, tm, offs_n, nmask, stride_st, stride_sn, bias, bmin, SEL,
                                      SCORE, PER_GROUP, GROUPS, TOPK_GROUP, GSCORE, BLOCK_G, TINY)
                s = tl.where(finite[:, None] | (nmask[None, :] == 0), s, 0.0)  # a non-finite row: zeros (core.remap)
                s = tl.where(nmask[None, :], s, float("-inf"))
                tl.store(s_ptr + offs_t[:, None] * BLOCK_N + offs_n[None, :], s, mask=tm[:, None])
                if POLICY == 0:  # routing_torch.relative_weights in 2**-24 fixed point, 0 on rows that do not vote
                    rm = tl.max(s, axis=1)
                    rm = tl.where(rm == float("-inf"), 0.0, rm)
                    rel = tl.where(s == float("-inf"), 0.0, tl.exp(s - rm[:, None]))
                    den = tl.zeros([BLOCK_T], dtype=tl.float32)
                    for j in tl.static_range(K):
                        e = tl.sum(tl.where(offs_k[None, :] == j, own, 0), axis=1)
                        den += tl.sum(tl.where(offs_n[None, :] == e[:, None], rel, 0.0), axis=1)
                    w = rel / tl.where(vote, den, 1.0)[:, None]
                    big_w = tl.where(vote[:, None], _fixed_point(w * 16777216.0), 0)
                    tl.store(wf_ptr + offs_t[:, None] * BLOCK_N + offs_n[None, :], big_w, mask=tm[:, None])
                if POLICY == 2 or POLICY == 3:
                    if KSEL > 0:
                        pick = tl.maximum(pick, _topk_union(s, _tile_tie_keys(own, offs_n, K, BLOCK_K), vote,
                                                            offs_n, nmask, KSEL))
                if POLICY == 3:
                    p = _softmax_rows(s, nmask)
                    xmass += tl.sum(tl.where(vote[:, None], _fixed_point(p * 16777216.0), 0), axis=0)
            elif POLICY == 0:  # no voting row: no relative weights (the mass growth reads every row's)
                tl.store(wf_ptr + offs_t[:, None] * BLOCK_N + offs_n[None, :],
                         tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.int64), mask=tm[:, None])
        if TELEM != 0:
            prefill = (dec == 0) & live
            before = tl.maximum(before, _union_of(own, counted, offs_n, K, BLOCK_K))
            loaded = tl.maximum(loaded, _union_of(own, counted | prefill, offs_n, K, BLOCK_K))
            counted_n += tl.sum(counted.to(tl.float64), axis=0)
            if HAS_DEC:
                prefill_n += tl.sum(prefill.to(tl.float64), axis=0)
            if HAS_LIVE:
                finished_n += tl.sum((dec & (live == 0) & tm).to(tl.float64), axis=0)
            fallback = tl.maximum(fallback, tl.max((counted & (finite == 0)).to(tl.int32), axis=0))
    tl.debug_barrier()
    cand = tl.where(nmask, tl.maximum(cand, seeded), 0)
    cand_b = cand > 0

    # -- the critical set
    crit = seeded
    if POLICY == 0 or POLICY == 1:
        # LYNX binning and the exponential batch score (routing_torch.lynx_critical_set, arXiv 2411.08982 Sec. 4)
        offs_j = tl.arange(0, BLOCK_J)
        counts = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            tm = offs_t < T
            vote = tl.load(fl_ptr + offs_t, mask=tm, other=0) == 7
            s = tl.load(s_ptr + offs_t[:, None] * BLOCK_N + offs_n[None, :], mask=tm[:, None], other=float("-inf"))
            b = tl.where(vote[:, None], _bins_f(s, alpha, cand_b), float("-inf"))
            for j in tl.static_range(BETA + 1):
                c = tl.sum(tl.where(b == -j, 1.0, 0.0), axis=0).to(tl.int32)
                counts += tl.where(offs_j[:, None] == j, c[None, :], 0)
        base = tl.maximum(voters, 1)
        score = tl.zeros([BLOCK_N], dtype=tl.float64)
        for j in tl.static_range(BETA + 1):
            cj = tl.sum(tl.where(offs_j[:, None] == j, counts, 0), axis=0)
            score = score + cj.to(tl.float64) * tl.load(pow_ptr + base * (BETA + 1) + j)
        score = tl.where(cand_b, score, 0.0)
        # (a) cover: each voting row's bin-0 candidate, a seeded one first, then by score (ties -> lower id)
        key = score + tl.where(seeded > 0, (T + 1) * 1.0, 0.0).to(tl.float64)
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            tm = offs_t < T
            vote = tl.load(fl_ptr + offs_t, mask=tm, other=0) == 7
            s = tl.load(s_ptr + offs_t[:, None] * BLOCK_N + offs_n[None, :], mask=tm[:, None], other=float("-inf"))
            bin0 = (_bins_f(s, alpha, cand_b) == 0) & vote[:, None]
            ck = tl.where(bin0, key[None, :], -1.0)
            has = tl.max(bin0.to(tl.int32), axis=1) > 0
            m = tl.max(ck, axis=1)
            sel = tl.min(tl.where(ck == m[:, None], offs_n[None, :], BLOCK_N), axis=1)
            crit = tl.maximum(crit, tl.max(((offs_n[None, :] == sel[:, None]) & has[:, None]).to(tl.int32), axis=0))
        if POLICY == 1:  # (b) consensus (the paper's rule; the default grows by routing mass instead)
            crit = tl.where(cand_b & (score >= tl.load(par_ptr)), 1, crit)
        # (c) grow by score until |S| >= GROW (k for the paper's rule, 1 before the default's mass growth)
        missing = GROW - tl.sum(crit, axis=0)
        gkey = tl.where(cand_b & (crit == 0), score, -1.0)
        gkey = tl.where(nmask, gkey, float("-inf"))
        for i in tl.static_range(GROW):
            m = tl.max(gkey, axis=0)
            sel = tl.min(tl.where(gkey == m, offs_n, BLOCK_N), axis=0)
            crit = tl.where((offs_n == sel) & _splat_flag((i < missing) & (m >= 0.0), offs_n), 1, crit)
            gkey = tl.where(offs_n == sel, float("-inf"), gkey)
    if POLICY == 0:
        crit = _mass_greedy(wf_ptr, BLOCK_N, lst_ptr, crit, cand_b, T, K, K, price, steps, voters, offs_n, nmask,
                            BLOCK_T, BLOCK_N, BLOCK_K, UNIT)
    if POLICY == 2:
        crit = tl.maximum(crit, pick)
    if POLICY == 3:  # the warm-up picks, then the candidates by batch mass until |S| >= max(budget, k)
        crit = tl.maximum(crit, pick)
        missing = tl.maximum(budget, K) - tl.sum(crit, axis=0)
        gkey = tl.where(cand_b & (crit == 0), xmass, -1)
        gkey = tl.where(nmask, gkey, -2)
        for added in range(0, N):
            m = tl.max(gkey, axis=0)
            sel = tl.min(tl.where(gkey == m, offs_n, BLOCK_N), axis=0)
            crit = tl.where((offs_n == sel) & _splat_flag((added < missing) & (m >= 0), offs_n), 1, crit)
            gkey = tl.where(offs_n == sel, -2, gkey)
    crit = tl.where(nmask, crit, 0)

    # -- remap, weight rule, merge with the rows that keep their routing; telemetry of the routing used
    after = tl.zeros([BLOCK_N], dtype=tl.int32)
    loaded_after = tl.zeros([BLOCK_N], dtype=tl.int32)
    remapped_n = tl.zeros([], dtype=tl.float64)
    mass = tl.zeros([], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tm = offs_t < T
        m2 = tm[:, None] & nmask[None, :]
        km = tm[:, None] & kmask[None, :]
        own = tl.load(idx_ptr + offs_t[:, None] * stride_it + offs_k[None, :] * stride_ik, mask=km, other=-1)
        own_w = tl.load(w_ptr + offs_t[:, None] * stride_wt + offs_k[None, :] * stride_wk, mask=km, other=0.0)
        new = own.to(tl.int64)
        new_w = own_w
        if POLICY != 4:
            remap = (tl.load(fl_ptr + offs_t, mask=tm, other=0) & 3) == 3
            if tl.max(remap.to(tl.int32), axis=0) > 0:  # a tile without a decode row keeps its routing as it is
                s = tl.load(s_ptr + offs_t[:, None] * BLOCK_N + offs_n[None, :], mask=tm[:, None],
                            other=float("-inf"))
                allowed = (s == s) & (s != float("-inf")) & nmask[None, :]
                tier = tl.where((crit > 0)[None, :] & allowed, 2, tl.where(allowed, 1, 0))
                keys = _tile_tie_keys(own.to(tl.int64), offs_n, K, BLOCK_K)  # ties -> the row's own experts, lower id
                taken = offs_n[None, :] >= N
                out = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
                for i in tl.static_range(K):
                    mt = tl.max(tl.where(taken, -1, tier), axis=1)
                    c1 = (taken == 0) & (tier == mt[:, None])
                    ms = tl.max(tl.where(c1, s, float("-inf")), axis=1)
                    choice = _tie_pick(c1 & (s == ms[:, None]), keys, BLOCK_N)
                    taken = taken | (offs_n[None, :] == choice[:, None])
                    out = tl.where(offs_k[None, :] == i, choice[:, None], out)
                lg = tl.load(lg_ptr + offs_t[:, None] * stride_lt + offs_n[None, :] * stride_ln, mask=m2,
                             other=float("-inf")).to(tl.float32)
                lg = tl.where(remap[:, None] | (nmask[None, :] == 0), lg, 0.0)
                chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
                if RULE == 1:
                    p = _softmax_rows(lg, nmask)
                for i in tl.static_range(K):
                    hit = offs_n[None, :] == tl.sum(tl.where(offs_k[None, :] == i, out, 0), axis=1)[:, None]
                    if RULE == 1:
                        v = tl.sum(tl.where(hit, p, 0.0), axis=1)
                    else:
                        v = tl.sum(tl.where(hit, lg, 0.0), axis=1)
                    chosen = tl.where(offs_k[None, :] == i, v[:, None], chosen)
                if RULE == 1:
                    w = chosen
                elif RULE == 2:
                    cm = tl.max(tl.where(kmask[None, :], chosen, float("-inf")), axis=1)
                    ex = tl.where(kmask[None, :], tl.exp(chosen - cm[:, None]), 0.0)
                    w = ex / tl.where(remap, tl.sum(ex, axis=1), 1.0)[:, None]
                else:
                    w = 1.0 / (1.0 + tl.exp(-chosen))
                if RENORM:
                    w = w / tl.where(remap, tl.sum(tl.where(kmask[None, :], w, 0.0), axis=1) + eps, 1.0)[:, None]
                w = w * scale
                new = tl.where(remap[:, None], out, new)
                new_w = tl.where(remap[:, None], _cast_rtne(w, own_w.dtype), own_w)
        if POLICY != 4:  # keep: the caller returns the model's own tensors
            tl.store(oidx_ptr + offs_t[:, None] * K + offs_k[None, :], new.to(own.dtype), mask=km)
            tl.store(ow_ptr + offs_t[:, None] * K + offs_k[None, :], new_w, mask=km)
        if TELEM != 0:
            fl = tl.load(fl_ptr + offs_t, mask=tm, other=0)
            live = (fl & 4) != 0
            counted = ((fl & 2) != 0) & live
            prefill = ((fl & 2) == 0) & live
            own2 = own.to(tl.int64)
            after = tl.maximum(after, _union_of(new, counted, offs_n, K, BLOCK_K))
            loaded_after = tl.maximum(loaded_after, _union_of(new, counted | prefill, offs_n, K, BLOCK_K))
            if TELEM == 2:  # the share of each counted row's own top-k weight still used, assignments changed
                kept = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int1)
                for i in tl.static_range(K):
                    ni = tl.sum(tl.where(offs_k[None, :] == i, new, 0), axis=1)
                    kept = kept | (own2 == ni[:, None])
                kept = kept & km & counted[:, None]
                wf = tl.where(km, own_w.to(tl.float32), 0.0)
                total = tl.maximum(tl.sum(wf, axis=1), 1e-30)
                mass += tl.sum(tl.where(counted, tl.sum(tl.where(kept, wf, 0.0), axis=1) / total, 0.0), axis=0)
                remapped_n += tl.sum(tl.sum((counted[:, None] & km & (kept == 0)).to(tl.float64), axis=1), axis=0)

    if TELEM != 0:
        # kernels.telemetry_slots order; one program: a plain read-modify-write of the layer's accumulators
        stepped = (counted_n > 0).to(tl.float64)
        n_before = tl.sum(before, axis=0).to(tl.float64)
        n_after = tl.sum(after, axis=0).to(tl.float64)
        if HAS_DEC:
            l_before = tl.sum(loaded, axis=0).to(tl.float64) * stepped
            l_after = tl.sum(loaded_after, axis=0).to(tl.float64) * stepped
        else:
            l_before = n_before * stepped
            l_after = n_after * stepped
        zero = tl.zeros([], dtype=tl.float64)
        offs_s = tl.arange(0, 16)
        row = tl.zeros([16], dtype=tl.float64)
        row = tl.where(offs_s == 0, stepped, row)
        row = tl.where(offs_s == 1, n_before, row)
        row = tl.where(offs_s == 2, n_after, row)
        if TELEM == 2:
            row = tl.where(offs_s == 3, remapped_n, row)
            row = tl.where(offs_s == 4, counted_n * K, row)
            row = tl.where(offs_s == 5, mass.to(tl.float64), row)
        row = tl.where(offs_s == 6, counted_n, row)
        row = tl.where(offs_s == 7, fallback.to(tl.float64), row)
        row = tl.where(offs_s == 8, counted_n if VERIFY else zero, row)
        row = tl.where(offs_s == 9, prefill_n * stepped, row)
        row = tl.where(offs_s == 10, finished_n, row)
        row = tl.where(offs_s == 11, l_before, row)
        row = tl.where(offs_s == 12, l_after, row)
        smask = offs_s < 13
        acc = tl.load(acc_ptr + offs_s, mask=smask, other=0.0)
        tl.store(acc_ptr + offs_s, acc + row, mask=smask)


# ---------------------------------------------------------------------------------------------------------------
# the launcher

_RULE_CODE = {"softmax_all": 1, "softmax_chosen": 2, "sigmoid": 3}


class _Buffers:
    """What one step size needs on one device (one thread's): outputs, scratch, the powers table, tau."""

    __slots__ = ("idx", "weights", "scores", "flags", "fixed", "lists", "powers", "params")

    def __init__(self, num_tokens, num_experts, top_k, policy: FusedPolicy, idx_dtype, w_dtype, device):
        blk = block_sizes(num_tokens, num_experts, top_k)
        block_n, block_k = blk["BLOCK_N"], blk["BLOCK_K"]
        self.idx = torch.empty(num_tokens, top_k, dtype=idx_dtype, device=device)
        self.weights = torch.empty(num_tokens, top_k, dtype=w_dtype, device=device)
        self.scores = torch.empty(num_tokens, block_n, dtype=torch.float32, device=device)
        self.flags = torch.empty(num_tokens, dtype=torch.int8, device=device)
        mass = policy.kind == "lynx_mass"
        self.fixed = torch.empty(num_tokens if mass else 1, block_n, dtype=torch.int64, device=device)
        self.lists = torch.empty(num_tokens if mass else 1, block_k, dtype=torch.int64, device=device)
        if policy.kind in ("lynx", "lynx_mass"):  # fp32(B ** -j) for every batch base B = 0..T (0 reads as 1)
            self.powers = torch.stack([batch_base_powers(b, policy.beta, device=device)
                                       for b in range(num_tokens + 1)]).contiguous()
        else:
            self.powers = self.flags
        self.params = torch.full((1,), float(policy.tau), dtype=torch.float64, device=device)


class FusedStep:
    """One MoE layer's decode step in one Triton launch (the module docstring), for a policy and a layer shape fixed at
    plan time (``lynx_hf.core.make_plan``; the family's weight rule comes with each call).

    ``policy``: a :class:`FusedPolicy`; ``num_experts`` (N) / ``top_k`` (k): ``1 <= k < N`` (``k == N`` only for the
    ``"keep"`` policy, which records telemetry). Raises ``ValueError`` for sizes out of range.
    """

    def __init__(self, policy: FusedPolicy, num_experts: int, top_k: int):
        if not 1 <= top_k <= num_experts or (top_k == num_experts and policy.kind != "keep"):
            raise ValueError(f"FusedStep needs 1 <= top_k < num_experts, got top_k={top_k}, num_experts={num_experts}")
        self.policy, self.num_experts, self.top_k = policy, int(num_experts), int(top_k)
        self._local = threading.local()
        #: launches captured into CUDA graphs (key -> launch), kept for the graphs' lifetime (bounded by the sizes an
        #: engine captures)
        self.pinned: dict = {}
        price = 0
        if policy.kind == "lynx_mass":  # routing_torch.batch_threshold's integer, clamped to a range no gain reaches
            price = math.ceil(policy.price * MASS_UNIT) if math.isfinite(policy.price) else 2**62
            price = max(-1, min(price, 2**40))
        self._price = int(price)
        ksel = policy.k0 if policy.kind == "oea" else policy.warmup if policy.kind == "xshare" else 0
        self._ksel = min(ksel, self.top_k if policy.kind == "xshare" else self.num_experts)

    def __getstate__(self):  # buffers are per process and thread: not copied
        state = dict(self.__dict__)
        state.pop("_local")
        state["pinned"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def _launch(self, key, num_tokens, idx, weights, kind, sel, rule, renormalize, scale, eps, flags) -> "_Launch":
        """What a launch of this shape and these options passes besides its tensors (constexprs, scalars) and this
        thread's buffers for it: made on first use, kept for :data:`MAX_SIZES` keys (least recently used dropped);
        fresh while ``torch.compile`` traces (the graph owns its memory). A launch captured into a CUDA graph (a vLLM
        engine's captured sizes) is kept for good (:attr:`pinned`): the graph replays into its buffers, which must
        never be freed and reused for anything else."""
        compiling = torch.compiler.is_compiling()
        cache = None if compiling else getattr(self._local, "cache", None)
        if cache is None and not compiling:
            cache = self._local.cache = OrderedDict()
        launch = None if compiling else cache.get(key) or self.pinned.get(key)
        if launch is not None:
            if key in cache and len(cache) > 1:
                cache.move_to_end(key)
            if key not in self.pinned and _pins(idx):
                self.pinned[key] = launch
            return launch
        policy, n, k = self.policy, self.num_experts, self.top_k
        has_dec, has_live, has_seed, has_bias, telem, verify = flags
        blk = block_sizes(num_tokens, n, k)
        groups = sel.n_group if sel.kind in ("group_softmax_max", "biased") else 1
        lynx = kind in ("lynx", "lynx_mass")
        beta = policy.beta if lynx else 0
        consts = dict(
            K=k, BLOCK_K=blk["BLOCK_K"], BETA=beta, BLOCK_J=triton.next_power_of_2(beta + 1),
            BLOCK_T=max(1, min(64, TILE.get(kind, 1024) // blk["BLOCK_N"])), BLOCK_N=blk["BLOCK_N"],
            BLOCK_G=triton.next_power_of_2(groups), POLICY=POLICIES.index(kind), GROW=k if kind == "lynx" else 1,
            KSEL=self._ksel, UNIT=PRICE_UNITS.index(policy.unit), SEL=SELECTIONS.index(sel.kind),
            SCORE=BIAS_SCORES.index(sel.score), PER_GROUP=max(n // groups, 1), GROUPS=groups,
            TOPK_GROUP=sel.topk_group, GSCORE=GROUP_SCORES.index(sel.group_score), HAS_BIAS=has_bias, HAS_DEC=has_dec,
            HAS_LIVE=has_live, HAS_SEED=has_seed, RULE=_RULE_CODE[rule], RENORM=bool(renormalize), TELEM=telem,
            VERIFY=verify, TINY=_TINY, num_warps=NUM_WARPS, maxnreg=MAXNREG)
        scalars = (num_tokens, n, policy.alpha if lynx else 1.0, self._price, mass_grow_steps(num_tokens, n, k),
                   policy.budget, float(scale), float(eps))
        buf = _Buffers(num_tokens, n, k, policy, idx.dtype, weights.dtype, idx.device)
        launch = _Launch(buf, scalars, consts)
        if cache is not None and _pins(idx):
            self.pinned[key] = launch
        elif cache is not None:
            cache[key] = launch
            while len(cache) > MAX_SIZES:
                cache.popitem(last=False)
        return launch

    def __call__(self, logits, weights, idx, rule="softmax_all", renormalize=False, scale=1.0, eps=0.0, *, decode=None,
                 live=None, seed=None, selection: FusedSelection = LOGITS, bias=None, scores=None, acc=None,
                 counts_only: bool = False, verify: bool = False, keep: bool = False):
        """One step. ``logits [T, N]`` (any float dtype), ``weights [T, k]`` (any float dtype) / ``idx [T, k]``
        (int32 / int64, an id < 0 marks a padding row) the model's routing; the family's weight rule (``docs/design.md``
        "Family rules"; ``lynx_hf.core.WeightRule``): ``rule`` one of ``routing_torch.WEIGHT_RULES``, ``renormalize``,
        ``scale``, ``eps``; ``decode`` / ``live [T]`` bool or ``None`` (every row), ``seed [N]`` bool or ``None``;
        ``selection`` (:class:`FusedSelection`) with ``bias`` (``[N]`` elements, any float dtype, strided; ``None``:
        zeros) or ``scores [T, N]`` fp32 (``"scores"``); ``acc``: the layer's telemetry accumulators (fp64
        ``[NUM_SLOTS]``) or ``None`` (not recorded), ``counts_only``: the counting mode; ``verify``: a verification
        forward; ``keep``: the model's routing stays (only the telemetry is recorded).

        Returns ``(weights [T, k] in weights.dtype, idx [T, k] in idx.dtype)``: buffers this step owns until its
        next call of the same size on the same thread (the model's own tensors with ``keep``). Sync-free; after the
        first call of a shape and options, one dictionary lookup and the launch. Raises ``ValueError`` for an unknown
        weight rule."""
        keep = keep or self.policy.kind == "keep"
        if keep and acc is None:
            return weights, idx
        if rule not in _RULE_CODE:
            raise ValueError(f"unknown weight rule {rule!r}; expected one of {WEIGHT_RULES}")
        sel = selection if scores is None else SCORES
        flags = (decode is not None, live is not None, seed is not None, bias is not None,
                 0 if acc is None else (1 if counts_only else 2), bool(verify))
        num_tokens = idx.shape[0]
        key = (num_tokens, idx.device, idx.dtype, weights.dtype, keep, sel, rule, renormalize, scale, eps, flags)
        launch = self._launch(key, num_tokens, idx, weights, "keep" if keep else self.policy.kind, sel, rule,
                              renormalize, scale, eps, flags)
        buf = launch.buffers
        dummy = buf.flags
        compiling = torch.compiler.is_compiling()
        kernel = _FUSED_TRACED if compiling else _fused_step_kernel
        with _INTERPRETER_LOCK:
            kernel[_GRID](
                logits, idx, weights,
                dummy if decode is None else decode, dummy if live is None else live, dummy if seed is None else seed,
                dummy if bias is None else bias, dummy if scores is None else scores,
                buf.scores, buf.flags, buf.fixed, buf.lists, buf.powers, buf.params, dummy if acc is None else acc,
                buf.idx, buf.weights, *launch.scalars,
                logits.stride(0), logits.stride(1), idx.stride(0), idx.stride(1), weights.stride(0), weights.stride(1),
                0 if bias is None else bias.stride(-1), 0 if scores is None else scores.stride(0),
                0 if scores is None else scores.stride(1), **(launch.traced if compiling else launch.consts))
        if keep:
            return weights, idx
        return buf.weights, buf.idx


_GRID = (1,)


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``t``'s (CUDA) stream now."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


_PINNING = threading.local()


@contextlib.contextmanager
def pinning():
    """Within the block (this thread), every launch a :class:`FusedStep` makes or finds is kept for good
    (:attr:`FusedStep.pinned`), as a captured one is: the vLLM plugin's warm-up before the first CUDA-graph capture
    (``lynx_hf.vllm.plans.warm_up``) launches each captured size once inside it, so the captures find their launches'
    buffers made, whatever the number of captured sizes (more than :data:`MAX_SIZES`)."""
    before = getattr(_PINNING, "on", False)
    _PINNING.on = True
    try:
        yield
    finally:
        _PINNING.on = before


def _pins(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` now is kept for good: a CUDA-graph capture (:func:`_capturing`) or :func:`pinning`."""
    return getattr(_PINNING, "on", False) or _capturing(t)


class _Launch:
    """``consts``: the constexprs and launch options of an eager launch; ``traced``: the constexprs alone (the launch
    options come from :data:`_FUSED_TRACED`'s one config)."""

    __slots__ = ("buffers", "scalars", "consts", "traced")

    def __init__(self, buffers: _Buffers, scalars: tuple, consts: dict):
        self.buffers, self.scalars, self.consts = buffers, scalars, consts
        self.traced = {k: v for k, v in consts.items() if k not in ("num_warps", "maxnreg")}


#: the kernel as ``torch.compile`` traces it (transformers' compiled static-cache generate): its launch options as a
#: one-config ``triton.autotune``, the form the routing kernels use under compile (checked on an H200); eager launches
#: pass them as keywords and skip the autotuner's per-launch work
_FUSED_TRACED = triton.autotune(configs=[triton.Config({}, num_warps=NUM_WARPS, maxnreg=MAXNREG)], key=[])(
    _fused_step_kernel)


__all__ = ["POLICIES", "SELECTIONS", "FusedPolicy", "FusedSelection", "FusedStep", "LOGITS", "SCORES", "MAX_SIZES",
           "NUM_SLOTS"]
