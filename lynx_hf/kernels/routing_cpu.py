"""CPU fast path of the routing ops: numba-compiled twins of :mod:`.routing_torch` (same integers).

On CPU a decode step's routing works on tiny tensors (``[T, N]`` with T, N <= a few hundred), where
torch's per-op overhead (microseconds each, a few hundred ops per step) costs more than the arithmetic.
These functions run the integer logic of each routing step in one compiled loop nest:
:func:`lynx_critical_set` (binning, exponential batch score, cover / consensus / grow),
:func:`oea_critical_set`, :func:`mass_greedy_grow`, :func:`xshare_critical_set`, :func:`remap_topk`, and
:func:`decode_step_counts` (the telemetry of one step). Float inputs that need transcendental functions
(the relative weights and probabilities behind the mass rules) are computed by torch and passed in as
fixed-point integers, so the results are exactly :mod:`.routing_torch`'s; the remaining float math
(``ceil((s - max s) * alpha)`` in fp32, fp64 sums of exact products in a fixed order) is IEEE-identical.
Tests compare every function with its torch twin element for element (tests/kernels/test_routing_cpu.py).

Returned by :func:`.backend.routing_ops` with ``host=True`` (CPU tensors in eager mode, ``routing_torch.host_reads_allowed``);
on accelerators, under ``torch.compile`` and inside ``routing_torch.strict_sync_free()`` the torch ops run.
``AVAILABLE`` is False when numba cannot be imported (the torch ops are used then). Compiled on first use
(about a second per function) and cached on disk (numba ``cache=True``, its writes locked across processes:
:mod:`.numba_cache`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import routing_torch as rt
from .numba_cache import cached_njit
from .telemetry_slots import (
    AFTER,
    ASSIGNMENTS,
    BEFORE,
    FALLBACKS,
    FINISHED_TOKENS,
    LOADED_AFTER,
    LOADED_BEFORE,
    MASS,
    NUM_SLOTS,
    PREFILL_TOKENS,
    REMAPPED,
    STEPS,
    TOKENS,
    VERIFY_TOKENS,
)

try:  # numba is a dependency; still, never let its absence break the package
    import numba

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None
    AVAILABLE = False

FORBIDDEN_BIN = rt.FORBIDDEN_BIN


def _jit(fn):
    return cached_njit(fn) if AVAILABLE else fn


@_jit
def _union(idx, rows, n):
    out = np.zeros(n, dtype=np.bool_)
    for t in range(idx.shape[0]):
        if rows[t]:
            for j in range(idx.shape[1]):
                out[idx[t, j]] = True
    return out


@_jit
def _add_ranked(critical, key, eligible, count):
    """``critical`` plus the first ``count`` eligible experts by ``key`` desc, ties -> lower id."""
    n = critical.shape[0]
    taken = np.zeros(n, dtype=np.bool_)
    for _ in range(max(count, 0)):
        best = -1
        for e in range(n):
            if eligible[e] and not taken[e] and (best < 0 or key[e] > key[best]):
                best = e
        if best < 0:
            break
        taken[best] = True
        critical[best] = True
    return critical


@_jit
def _lynx_critical(s, idx, top_k, alpha, beta, tau, powers, vote, seed, use_tau):
    t_count, n = s.shape
    cand = seed.copy()
    for t in range(t_count):
        if vote[t]:
            for j in range(idx.shape[1]):
                cand[idx[t, j]] = True
    counts = np.zeros((n, beta + 1), dtype=np.int64)
    bins = np.empty((t_count, n), dtype=np.int32)
    for t in range(t_count):
        rowmax = s[t, 0]
        for e in range(1, n):
            if s[t, e] > rowmax:
                rowmax = s[t, e]
        for e in range(n):
            v = s[t, e]
            b = FORBIDDEN_BIN
            if vote[t] and cand[e] and math.isfinite(v):
                c = np.ceil(np.float32(np.float32(v - rowmax) * alpha))
                b = FORBIDDEN_BIN + 1 if c < FORBIDDEN_BIN + 1 else np.int32(c)
            bins[t, e] = b
            if -beta <= b <= 0:
                counts[e, -b] += 1
    score = np.zeros(n, dtype=np.float64)
    for e in range(n):
        if cand[e]:
            acc = 0.0
            for j in range(beta + 1):
                acc = acc + counts[e, j] * powers[j]
            score[e] = acc
    offset = float(t_count + 1)
    critical = seed.copy()
    for t in range(t_count):
        best = -1
        best_key = 0.0
        for e in range(n):
            if bins[t, e] == 0:
                key = score[e] + (offset if seed[e] else 0.0)
                if best < 0 or key > best_key:
                    best = e
                    best_key = key
        if best >= 0:
            critical[best] = True
    if use_tau:
        for e in range(n):
            if cand[e] and score[e] >= tau:
                critical[e] = True
    size = 0
    for e in range(n):
        if critical[e]:
            size += 1
    eligible = cand & ~critical
    return _add_ranked(critical, score, eligible, top_k - size)


def _np(t: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """A numpy view of a CPU tensor (no copy unless a cast or a contiguous copy is needed); each torch call
    skipped here is a microsecond saved on a path that runs per MoE layer per decode step."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.numpy()


def _mask(mask, size: int) -> np.ndarray:
    return np.ones(size, dtype=np.bool_) if mask is None else _np(mask, torch.bool)


def lynx_critical_set(scores, topk_idx, top_k, alpha, beta, tau, batch_base=None, vote=None, seed=None):
    """Twin of :func:`.routing_torch.lynx_critical_set` (same arguments, same ``[N]`` bool)."""
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if not alpha > 0 or beta < 0:
        raise ValueError(f"alpha must be > 0 and beta >= 0, got alpha={alpha}, beta={beta}")
    voters = _mask(vote, num_tokens)
    seeded = np.zeros(num_experts, dtype=np.bool_) if seed is None else _np(seed)
    idx = _np(topk_idx, torch.int64)
    if math.isinf(alpha):
        return torch.from_numpy(_union(idx, voters, num_experts) | seeded)
    if batch_base is None:
        batch_base = int(voters.sum())
    powers = _powers(int(batch_base), int(beta))
    out = _lynx_critical(_np(scores, torch.float32), idx, int(top_k), np.float32(alpha), int(beta),
                         float(tau) if math.isfinite(tau) else 0.0, powers, voters, seeded, math.isfinite(tau))
    return torch.from_numpy(out)


@functools.lru_cache(maxsize=1024)
def _powers(batch_base: int, beta: int) -> np.ndarray:
    """``routing_torch.batch_base_powers`` (the same values: computed by it), cached per (B, beta)."""
    return rt.batch_base_powers(batch_base, beta).numpy()


def _fixed_point_weights(scores, topk_idx, vote):
    """``round(relative_weights * 2**24)`` as int64, 0 for non-voting rows (routing_torch's arithmetic)."""
    w = rt.relative_weights(scores, topk_idx)
    big_w = torch.round(w * rt.MASS_UNIT).long()
    return big_w if vote is None else torch.where(vote[:, None], big_w, 0)


@_jit
def _own_row(idx, t, own):
    """``own [N]`` bool := row ``t``'s own experts ``idx[t]`` (``idx [T, k]`` int64; ``[T, 0]``: none)."""
    own[:] = False
    for j in range(idx.shape[1]):
        e = idx[t, j]
        if 0 <= e < own.shape[0]:
            own[e] = True


@_jit
def _better(v, own_e, best_v, own_best):
    """Whether an expert of score ``v`` (own: ``own_e``) ranks before the best so far, scanned in id order: a
    higher score, or an equal one and own where the best is not (ties -> own, then lower id)."""
    return v > best_v or (v == best_v and own_e and not own_best)


@_jit
def _top_choices(s, idx, rows, k0, n):
    """Union over ``rows`` of each row's top-``k0`` of ``s`` (desc, ties -> the row's own experts ``idx``,
    then lower id)."""
    out = np.zeros(n, dtype=np.bool_)
    taken = np.zeros(n, dtype=np.bool_)
    own = np.zeros(n, dtype=np.bool_)
    for t in range(s.shape[0]):
        if not rows[t]:
            continue
        taken[:] = False
        _own_row(idx, t, own)
        for _ in range(k0):
            best = -1
            for e in range(n):
                if not taken[e] and (best < 0 or _better(s[t, e], own[e], s[t, best], own[best])):
                    best = e
            taken[best] = True
            out[best] = True
    return out


def _own_ids(topk_idx, num_tokens: int) -> np.ndarray:
    """The own ids as int64 numpy ``[T, k]``; ``[T, 0]`` for ``None`` (no own experts: ties -> lower id)."""
    return np.zeros((num_tokens, 0), dtype=np.int64) if topk_idx is None else _np(topk_idx, torch.int64)


def oea_critical_set(scores, top_k0, vote=None, seed=None, topk_idx=None):
    """Twin of :func:`.routing_torch.oea_critical_set`."""
    num_tokens, num_experts = scores.shape
    if not 1 <= top_k0 <= num_experts:
        raise ValueError(f"k0 must be in 1..{num_experts}, got {top_k0}")
    out = _top_choices(_np(scores, torch.float32), _own_ids(topk_idx, num_tokens), _mask(vote, num_tokens),
                       int(top_k0), num_experts)
    if seed is not None:
        out |= _np(seed)
    return torch.from_numpy(out)


@_jit
def _remap(s, idx, critical, top_k):
    """Each row's top-k by tier (allowed in S, allowed, forbidden), then score, then own (``idx [T, k]``),
    then lower id."""
    t_count, n = s.shape
    out = np.empty((t_count, top_k), dtype=np.int64)
    tier = np.empty(n, dtype=np.int64)
    taken = np.zeros(n, dtype=np.bool_)
    own = np.zeros(n, dtype=np.bool_)
    for t in range(t_count):
        for e in range(n):
            v = s[t, e]
            allowed = math.isfinite(v) or v > 0
            tier[e] = 2 if (allowed and critical[e]) else (1 if allowed else 0)
        taken[:] = False
        _own_row(idx, t, own)
        for i in range(top_k):
            best = -1
            for e in range(n):
                if taken[e]:
                    continue
                if best < 0 or tier[e] > tier[best] or (
                        tier[e] == tier[best] and _better(s[t, e], own[e], s[t, best], own[best])):
                    best = e
            taken[best] = True
            out[t, i] = best
    return out


def remap_topk(scores, critical, top_k, check=True, topk_idx=None):
    """Twin of :func:`.routing_torch.remap_topk` (``check`` reads the scores on the host, as there)."""
    if check:
        s = scores.float()
        if bool(((torch.isfinite(s) | (s > 0)).sum(dim=-1) < top_k).any()):
            raise ValueError(f"a token has fewer than top_k={top_k} allowed (finite) router scores")
    return torch.from_numpy(_remap(_np(scores, torch.float32), _own_ids(topk_idx, scores.shape[0]),
                                   _np(critical, torch.bool), int(top_k)))


@_jit
def _insert_desc(top, m, kk, v):
    """Insert ``v`` into the descending list ``top[:m]`` kept to ``kk`` entries; returns the new length."""
    if m < kk:
        top[m] = v
        m += 1
    elif v > top[kk - 1]:
        top[kk - 1] = v
    else:
        return m
    j = m - 1
    while j > 0 and top[j] > top[j - 1]:
        top[j], top[j - 1] = top[j - 1], top[j]
        j -= 1
    return m


@_jit
def _mass_greedy(w, cand, critical, top_k, price_fixed):
    t_count, n = w.shape
    kk = min(top_k, n)
    size = 0
    for e in range(n):
        if critical[e]:
            size += 1
    # each token's kk largest W inside S, descending (kept up to date as S grows: one insertion per step)
    top = np.zeros((t_count, kk), dtype=np.int64)
    filled = np.zeros(t_count, dtype=np.int64)
    for t in range(t_count):
        for e in range(n):
            if critical[e]:
                filled[t] = _insert_desc(top[t], filled[t], kk, w[t, e])
    gain = np.empty(n, dtype=np.int64)
    while True:
        gain[:] = 0
        for t in range(t_count):  # the kk-th largest W of the token inside S (0 if fewer than kk)
            kth = top[t, kk - 1] if filled[t] >= kk and top[t, kk - 1] > 0 else 0
            for e in range(n):
                d = w[t, e] - kth
                if d > 0:
                    gain[e] += d
        best = -1
        best_gain = -1
        for e in range(n):
            if cand[e] and not critical[e] and gain[e] > best_gain:
                best_gain = gain[e]
                best = e
        if best < 0 or not (best_gain >= price_fixed or size < top_k):
            return critical
        critical[best] = True
        size += 1
        for t in range(t_count):
            filled[t] = _insert_desc(top[t], filled[t], kk, w[t, best])


def mass_greedy_grow(scores, topk_idx, critical, top_k, price, vote=None, seed=None, unit="token"):
    """Twin of :func:`.routing_torch.mass_greedy_grow` (the fixed-point weights are computed by torch)."""
    num_tokens, num_experts = scores.shape
    big_w = _fixed_point_weights(scores, topk_idx, vote)
    voters = _mask(vote, num_tokens)
    cand = _union(_np(topk_idx, torch.int64), voters, num_experts)
    crit = _np(critical, torch.bool).copy()
    if seed is not None:
        seeded = _np(seed)
        cand |= seeded
        crit |= seeded
    price_fixed = rt.batch_threshold(math.ceil(price * rt.MASS_UNIT), int(voters.sum()), unit)
    return torch.from_numpy(_mass_greedy(_np(big_w), cand, crit, int(top_k), int(price_fixed)))


@_jit
def _xshare(s, idx, rows, mass, seed, top_k, budget, warmup):
    n = s.shape[1]
    cand = _union(idx, rows, n) | seed
    critical = seed.copy()
    if warmup > 0:
        critical |= _top_choices(s, idx, rows, warmup, n)
    size = 0
    for e in range(n):
        if critical[e]:
            size += 1
    return _add_ranked(critical, mass.astype(np.float64), cand & ~critical, max(budget, top_k) - size)


def xshare_critical_set(scores, topk_idx, top_k, budget, warmup, vote=None, seed=None):
    """Twin of :func:`.routing_torch.xshare_critical_set` (the fixed-point mass is computed by torch)."""
    num_tokens, num_experts = scores.shape
    voters_t = torch.ones(num_tokens, dtype=torch.bool) if vote is None else vote
    s = scores if scores.dtype == torch.float32 else scores.float()
    probs = torch.softmax(torch.where(torch.isfinite(s), s, torch.full_like(s, -torch.inf)), dim=-1)
    probs = torch.where(torch.isfinite(probs), probs, torch.zeros_like(probs))
    mass = torch.where(voters_t[:, None], torch.round(probs * rt.MASS_UNIT).long(), 0).sum(dim=0)
    seeded = np.zeros(num_experts, dtype=np.bool_) if seed is None else _np(seed)
    out = _xshare(_np(s), _np(topk_idx, torch.int64), _np(voters_t), _np(mass), seeded, int(top_k), int(budget),
                  int(warmup))
    return torch.from_numpy(out)


@_jit
def _counts(orig, new, w, counted, prefill, finished, n, verify, fallback):
    """The telemetry row of one step (slots of :mod:`.telemetry_slots`). ``counted``: ``[T]`` bool, or ``[0]``
    (every row); ``prefill`` / ``finished``: ``[T]`` bool or ``[0]`` (none); ``w``: ``[T, k]`` fp32, or ``[0, 0]``
    (the counting mode: the remapped assignments and the mass kept are not measured, their slots stay 0)."""
    t_count, k = orig.shape
    every = counted.shape[0] == 0
    weighed = w.shape[0] > 0
    mixed = prefill.shape[0] > 0
    before = np.zeros(n, dtype=np.bool_)
    after = np.zeros(n, dtype=np.bool_)
    loaded_before = np.zeros(n, dtype=np.bool_)
    loaded_after = np.zeros(n, dtype=np.bool_)
    remapped = 0
    mass = 0.0
    tokens = 0
    for t in range(t_count):
        if mixed and prefill[t]:
            for j in range(k):
                loaded_before[orig[t, j]] = True
                loaded_after[new[t, j]] = True
        if not every and not counted[t]:
            continue
        tokens += 1
        for j in range(k):
            before[orig[t, j]] = True
            after[new[t, j]] = True
        if not weighed:
            continue
        total = 0.0
        kept_mass = 0.0
        for j in range(k):
            total += w[t, j]
            kept = False
            for i in range(k):
                if orig[t, j] == new[t, i]:
                    kept = True
            if kept:
                kept_mass += w[t, j]
            else:
                remapped += 1
        mass += kept_mass / max(total, 1e-30)
    row = np.zeros(NUM_SLOTS, dtype=np.float64)
    row[STEPS] = 1.0 if tokens > 0 else 0.0
    row[BEFORE] = before.sum()
    row[AFTER] = after.sum()
    if weighed:
        row[REMAPPED] = remapped
        row[ASSIGNMENTS] = tokens * k
        row[MASS] = mass
    row[TOKENS] = tokens
    row[FALLBACKS] = 1.0 if fallback else 0.0
    row[VERIFY_TOKENS] = tokens if verify else 0
    row[PREFILL_TOKENS] = prefill.sum() if tokens > 0 else 0.0  # as telemetry.record: only in steps that decode
    row[FINISHED_TOKENS] = finished.sum()
    if tokens > 0:  # the counted tokens' experts and the prefill tokens' (what the experts kernel loads)
        row[LOADED_BEFORE] = (before | loaded_before).sum()
        row[LOADED_AFTER] = (after | loaded_after).sum()
    return row


_NO_ROWS = np.zeros(0, dtype=np.bool_)
_NO_WEIGHTS = np.zeros((0, 0), dtype=np.float32)


def decode_step_counts(num_experts, orig_idx, orig_weights, new_idx, counted, verify=False, prefill_rows=None,
                       finished_rows=None, fallback=None) -> torch.Tensor:
    """The telemetry sums of one step, fp64 ``[NUM_SLOTS]`` (:mod:`.telemetry_slots` order); twin of
    ``BlockTelemetry.record``'s torch arithmetic (the mass kept is summed in fp64 here, fp32 there: equal
    to ~1e-7 relative). ``counted [T]`` bool or ``None`` (every row); ``orig_weights [T, k]`` or ``None`` (the
    counting mode: the remapped / assignments / mass slots stay 0)."""
    row = _counts(_np(orig_idx, torch.int64), _np(new_idx, torch.int64),
                  _NO_WEIGHTS if orig_weights is None else _np(orig_weights, torch.float32),
                  _NO_ROWS if counted is None else _np(counted, torch.bool),
                  _NO_ROWS if prefill_rows is None else _np(prefill_rows),
                  _NO_ROWS if finished_rows is None else _np(finished_rows),
                  int(num_experts), bool(verify), bool(fallback) if fallback is not None else False)
    return torch.from_numpy(row)


@_jit
def _lynx_mass_decode(s, lg, rel, den, idx, w, voters, top_k, alpha, beta, powers, price_fixed, mass_unit, count,
                      verify):
    """One decode step of the default policy in one loop nest: LYNX cover, routing-mass growth, remap,
    telemetry row; ``voters [T]`` bool: the live rows (finished rows are remapped but neither vote nor count).
    Returns ``(ok, new_idx, row)``; ``ok`` False when a router logit is not finite or a score is NaN or
    ``+inf`` (the caller then takes the general path with its fallback)."""
    t_count, n = s.shape
    for t in range(t_count):
        for e in range(n):
            if not math.isfinite(lg[t, e]) or math.isnan(s[t, e]) or s[t, e] == math.inf:
                return False, idx, np.zeros(NUM_SLOTS, dtype=np.float64)
    seeded = np.zeros(n, dtype=np.bool_)
    critical = _lynx_critical(s, idx, 1, alpha, beta, 0.0, powers, voters, seeded, False)
    big_w = np.empty((t_count, n), dtype=np.int64)  # routing_torch.relative_weights in 2**-24 fixed point
    for t in range(t_count):
        for e in range(n):
            v = np.float32(rel[t, e] / den[t]) if voters[t] and math.isfinite(s[t, e]) else np.float32(0.0)
            big_w[t, e] = np.int64(np.rint(np.float32(v * mass_unit)))
    cand = _union(idx, voters, n)
    critical = _mass_greedy(big_w, cand, critical, top_k, price_fixed)
    new_idx = _remap(s, idx, critical, top_k)
    if count:
        row = _counts(idx, new_idx, w, voters, np.zeros(0, dtype=np.bool_), ~voters, n, verify, False)
    else:
        row = np.zeros(NUM_SLOTS, dtype=np.float64)
    return True, new_idx, row


def lynx_mass_decode(scores, logits, topk_weights, topk_idx, rule, live=None, *, alpha, beta, price, unit,
                     telemetry=False, verify=False):
    """The default policy's whole decode step on CPU in eager mode, for a step whose every token decodes
    (``Step.decode`` is ``None``): LYNX cover (``lynx_critical_set`` with k 1, no consensus), :func:`mass_greedy_grow`,
    :func:`remap_topk`, the family's weight rule and (``telemetry``) the step's telemetry row -- the same
    integers as those functions one by one (tests/kernels/test_fused_route.py), with one compiled call instead of a
    dozen torch ops and host conversions (at small batches on CPU torch's per-op overhead dominates the routing).

    ``scores [T, N]`` fp32 selection scores, ``logits [T, N]`` router logits (any float dtype; pass ``scores``
    itself where the scores are the fp32 logits: no second cast), ``topk_weights`` / ``topk_idx [T, k]`` the model's
    routing, ``rule`` the block's ``WeightRule``, ``live [T]`` bool or ``None`` (every row): rows of finished
    requests are remapped into the set but neither vote nor count. ``telemetry``: ``False`` (no row), ``True`` (the
    full row) or ``"counts"`` (the counting mode's row: the routing weights are not read).
    Returns ``None`` when a row is not finite or no row is live (the caller's general path handles those), else
    ``(weights [T, k] in topk_weights.dtype, idx [T, k] in topk_idx.dtype, row fp64 [NUM_SLOTS] or None)``.
    """
    num_tokens, num_experts = scores.shape
    top_k = topk_idx.shape[-1]
    s = scores if scores.dtype == torch.float32 else scores.float()
    logits32 = logits if logits.dtype == torch.float32 else logits.float()
    rel = torch.exp(s - s.max(dim=-1, keepdim=True).values)  # relative_weights' torch arithmetic
    idx64 = topk_idx if topk_idx.dtype == torch.int64 else topk_idx.long()
    den = rel.gather(1, idx64).sum(dim=-1)
    voters = np.ones(num_tokens, dtype=np.bool_) if live is None else _np(live, torch.bool)
    num_voters = int(voters.sum()) if live is not None else num_tokens
    if num_voters == 0:
        return None
    price_fixed = rt.batch_threshold(math.ceil(price * rt.MASS_UNIT), num_voters, unit)
    w = _np(topk_weights, torch.float32) if telemetry and telemetry != "counts" else _NO_WEIGHTS
    s_np = _np(s)
    ok, new_idx, row = _lynx_mass_decode(s_np, s_np if logits32 is s else _np(logits32), _np(rel), _np(den),
                                         _np(idx64), w, voters,
                                         int(top_k), np.float32(alpha), int(beta), _powers(num_voters, int(beta)),
                                         int(price_fixed), np.float32(rt.MASS_UNIT), bool(telemetry), bool(verify))
    if not ok:
        return None
    new_idx = torch.from_numpy(new_idx)
    weights = rt.routing_weights(logits32, new_idx, rule.kind, rule.renormalize, rule.scale, rule.renorm_eps)
    return (weights if weights.dtype == topk_weights.dtype else weights.to(topk_weights.dtype),
            new_idx if topk_idx.dtype == torch.int64 else new_idx.to(topk_idx.dtype),
            torch.from_numpy(row) if telemetry else None)
