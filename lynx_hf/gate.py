"""The cost gate: run the policy on a decode step only where it pays (``LynxConfig.gate``).

The paper's phase-aware optimizer (Gupta et al., arXiv 2411.08982, Sec. 4: "LYNX is bypassed when an
iteration is not memory bound", i.e. prefill) extended from phase to *cost*: per MoE layer shape and decode step
size, the policy runs only where the expert reads it is expected to save outweigh the routing work it adds.

Engine-independent (no transformers import): a stage of the plan (``lynx_hf.core.Stage``), composed by
``lynx_hf.core.make_plan`` for the HF path (``lynx_hf.block.gate_stage``) and asked by the vLLM plugin
(``lynx_hf.vllm.plans``). The core does not import it.

- :func:`decide` is a pure function of the measurements (hand-checked in ``tests/policies/test_gate.py``):
  saving = experts saved x (time one expert costs in the experts path + any extra per-expert cost, e.g. the
  transfer of an offloaded expert); the policy runs iff saving > margin x cost (:func:`measure` decides with
  :data:`MARGIN`, the measured overestimate of the synthetic logits).
- :func:`measure_routing` times what a decode step adds: the engine's whole per-step routing path where it gives one
  (``route_fn``: the HF router hook's unpack, the block's own selection scores, the plan's step below the gate,
  repack), else that step (selection scores, policy, remap, weight rule, telemetry in the configured mode) on
  synthetic router logits at the layer's real ``(T, N)`` and dtype on the real device, and *estimates* the experts
  before / after by running the policy on those synthetic logits
  (i.i.d. normal logits of std :data:`LOGIT_STD`; real routers differ, so the estimate is a model, not a
  measurement of the user's traffic). The gated-off path does nothing (the model's own routing, no telemetry),
  so the whole step time is the cost.
- :func:`measure_expert_ms` times one expert's weights in a fused experts path: the slope, per expert, of a
  batched SwiGLU MLP (``[E, m, H] @ [E, H, 2I]``, ``silu * up``, ``@ [E, I, H]``) over E experts at m tokens per
  expert, in the layer's dtype on the device (weights a pool of up to :data:`POOL_BYTES`, capped at N experts, so
  large layers read them from memory as a decode step does). Per-call launch costs are excluded (a per-expert
  Python loop saves those too: the gate errs towards "off").
- :class:`PlanGate` (one per plan, i.e. per layer and device; :func:`stage` makes it for a ``LynxConfig``): the
  decisions per step size, measured once when it is composed into the plan (:meth:`PlanGate.bind`: patch time in HF,
  before the first forward in vLLM) for the buckets :data:`BUCKETS` (a step of T tokens uses the smallest bucket >=
  T; above the largest, the largest) and shared by every layer of the same shape and config (:data:`_CACHE`,
  in-process). As a stage it asks :meth:`PlanGate.on` once per layer-step, a host-side lookup on the static ``T``:
  no device read, no data-dependent shape (CUDA graphs and ``torch.compile`` see a Python branch on
  ``logits.shape[0]``); off, the step returns the model's own routing with ``Routed.gated_off`` set.

Units: milliseconds per layer-step throughout. Measurement is skipped (the gate stays on, reason
``"not measured: ..."``) while ``torch.compile`` traces, during CUDA-graph capture, and on ``meta`` tensors.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import torch

from .config import GATE_ENV as ENV  # the environment variable that sets LynxConfig.gate's default (messages)
from .config import LynxConfig
from .core import (
    DECODE,
    MIXED,
    Routed,
    RoutePlan,
    Runner,
    Step,
    StepInputs,
    WeightRule,
    host_reads_allowed,
    keep_routing,
)
from .telemetry import BlockTelemetry, mode_of

#: :attr:`PlanGate.name`: how ``RoutePlan.stage`` finds the gate (:func:`of`)
NAME = "gate"
#: step sizes (tokens) measured per shape; a step of T tokens uses the smallest bucket >= T (the largest above it)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: std of the synthetic router logits the expected experts before / after are estimated on
LOGIT_STD = 2.0
#: synthetic draws per bucket the expected experts are averaged over
DRAWS = 4
#: bytes of expert weights the expert timing cycles through (at most N experts)
POOL_BYTES = 96 << 20
#: wall-clock budget of one timing (seconds); each timing takes at least 3 and at most ``reps`` calls
TIME_BUDGET_S = 0.05
#: further timings of the figure that decided a bucket (:func:`measure`: the smallest of them counts)
CONFIRM = 2
#: a figure whose timing took this long (seconds) or more is not timed again (:func:`measure`)
CONFIRM_MAX_S = 0.5
#: served decode steps over which an engine whose step body runs eagerly on the host (the vLLM plugin on CPU) times
#: the policy's real per-step cost where the gate decided on, before deciding again with it
#: (:meth:`PlanGate.observe`)
OBSERVE_STEPS = 8
#: the margin :func:`measure` decides with (the saving must exceed ``MARGIN x cost``): the synthetic i.i.d. logits
#: overestimate the experts a real batch saves. Measured on fixture A (``eval/fixtures/qwen2moe-tiny``, held-out
#: prompts, ``generate`` 24 tokens, gate forced on, the mean over its 4 layers): B = 16 real 21.4 -> 10.8 distinct
#: experts (10.6 saved), synthetic 28.0 -> 14.75 (13.25 saved): 1.25x too many; B = 4 real 12.1 -> 5.65 (6.5),
#: synthetic 12.5 -> 6.75 (5.75: fewer). The margin takes back the larger overestimate.
MARGIN = 1.25


@dataclass(frozen=True)
class GateDecision:
    """One gate decision (ms per layer-step).

    ``on``: the policy runs; ``cost_ms``: added time of the decode-step routing work; ``saving_ms``: expected
    experts saved x (``expert_ms`` + ``extra_expert_ms``); ``experts_before`` / ``experts_after``: expected
    distinct experts per step without / with the policy (``nan`` when not estimated); ``reason``: one line.
    """

    on: bool
    cost_ms: float
    saving_ms: float
    experts_saved: float
    expert_ms: float
    extra_expert_ms: float = 0.0
    experts_before: float = float("nan")
    experts_after: float = float("nan")
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def decide(cost_ms: float, experts_saved: float, expert_ms: float, extra_expert_ms: float = 0.0,
           margin: float = 1.0) -> GateDecision:
    """The gate's rule, a pure function of its measurements.

    ``cost_ms`` (>= 0 after clamping: a negative measurement is timing noise and counts as 0): what the policy adds
    to one layer-step; ``experts_saved``: expected distinct experts per step the policy avoids (clamped to >= 0);
    ``expert_ms``: what one expert costs in the experts path at this step size; ``extra_expert_ms``: any further
    cost per expert read (e.g. the transfer of an offloaded expert, >= 0); ``margin`` (> 0): the saving must
    exceed ``margin x cost``. saving = experts_saved x (expert_ms + extra_expert_ms); ``on`` iff saving > margin x
    cost (strict: with nothing saved the policy never runs). Raises ``ValueError`` for a non-finite input, a
    negative ``expert_ms`` / ``extra_expert_ms`` or a ``margin`` <= 0.
    """
    for name, value in (("cost_ms", cost_ms), ("experts_saved", experts_saved), ("expert_ms", expert_ms),
                        ("extra_expert_ms", extra_expert_ms), ("margin", margin)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"gate.decide: {name} must be a finite number, got {value!r}")
    if expert_ms < 0 or extra_expert_ms < 0:
        raise ValueError(f"gate.decide: expert_ms and extra_expert_ms must be >= 0, got {expert_ms}, {extra_expert_ms}")
    if margin <= 0:
        raise ValueError(f"gate.decide: margin must be > 0, got {margin}")
    cost = max(float(cost_ms), 0.0)
    saved = max(float(experts_saved), 0.0)
    saving = saved * (float(expert_ms) + float(extra_expert_ms))
    on = saving > margin * cost
    reason = (f"expected saving {saving:.3g} ms {'>' if on else '<='} "
              f"{'' if margin == 1 else f'{margin:g} x '}cost {cost:.3g} ms per layer-step")
    return GateDecision(on, cost, saving, saved, float(expert_ms), float(extra_expert_ms), reason=reason)


def always_on(reason: str) -> GateDecision:
    """A decision that keeps the policy on without a measurement (``reason`` says why)."""
    nan = float("nan")
    return GateDecision(True, nan, nan, nan, nan, reason=reason)


# -- measurement ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device: torch.device, reps: int = 25, budget_s: float | None = None) -> float:
    """Shortest wall time of ``fn()`` in ms over up to ``reps`` calls within ``budget_s`` (one warm-up call; device
    synchronized around each call; ``budget_s`` default :data:`TIME_BUDGET_S`, read at call time). The minimum, not
    the median: on a shared or loaded host it is the stable estimate of what the work itself costs, for the cost and
    the saving alike."""
    budget_s = TIME_BUDGET_S if budget_s is None else budget_s
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if len(times) >= 3 and sum(times) > budget_s:
            break
    return min(times) * 1e3


@contextlib.contextmanager
def untouched(device=None):
    """Run a measurement without changing what the user sees (``docs/cases.md`` C38): the global CPU RNG stream and
    the CUDA one of ``device`` (where CUDA is initialised), torch's intra-op thread count (where settable,
    :func:`thread_count_settable`) and the grad mode are put back as they were, also when the body raises. The
    measurements themselves draw from private generators (:func:`synthetic_routing`, :func:`measure_expert_ms`);
    this guards what they call (the model's own experts implementation)."""
    device = torch.device(device) if device is not None else None
    cpu_rng = torch.get_rng_state()
    cuda = device is not None and device.type == "cuda" and torch.cuda.is_initialized()
    cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
        if torch.get_num_threads() != threads and thread_count_settable():
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)


def cannot_measure(device: torch.device) -> str | None:
    """Why a measurement cannot run now (``None``: it can): tracing by ``torch.compile``, CUDA-graph capture, or a
    ``meta`` device."""
    device = torch.device(device)
    if device.type == "meta":
        return "meta device"
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "CUDA-graph capture"
    return None


def synthetic_routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, device, seed: int = 0):
    """Synthetic router output at the layer's shape: ``(logits [T, N] in dtype, weights [T, k] in dtype,
    idx [T, k] int64)``; logits i.i.d. normal of std :data:`LOGIT_STD` (seeded, drawn on the CPU), weights the
    softmax over all N picked at the top-k (the routing weights' values do not change the routing work)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * LOGIT_STD).to(device=device, dtype=dtype)
    probs = logits.float().softmax(-1)
    weights, idx = probs.topk(top_k, dim=-1)
    return logits, weights.to(dtype), idx


def thread_count_settable() -> bool:
    """Whether ``torch.set_num_threads`` is torch's own. vLLM's CPU worker replaces it, once its threads are bound to
    cores, with a function that only logs a warning (``vllm/v1/worker/cpu_worker.py``); there the timings run on the
    worker's threads, as its served steps do (the repeated timings of :func:`measure` take the load spikes out)."""
    return torch.set_num_threads is getattr(torch._C, "set_num_threads", torch.set_num_threads)


@torch.no_grad()
def measure_routing(plan: RoutePlan, num_tokens: int, dtype: torch.dtype = torch.float32, telemetry: bool | str = True,
                    draws: int = DRAWS, mixed: bool = False, route_fn=None) -> tuple[float, float, float]:
    """``(cost_ms, experts_before, experts_after)`` of ``plan`` (a ``lynx_hf.core.RoutePlan``) at a decode step of
    ``num_tokens`` tokens whose router logits have dtype ``dtype``.

    ``cost_ms``: shortest time (:func:`_time_ms`) of ``plan.run(inputs)`` (the gate measures a view of its plan whose
    runner is the step below the gate, :meth:`PlanGate.bind`) on synthetic logits (:func:`synthetic_routing`, every token a decode token, the
    weight rule ``softmax_all``, the scores the fp32 logits; ``mixed``: described as a continuous-batching step with
    per-token masks, as the vLLM plugin does), with a scratch telemetry when ``telemetry`` (``LynxConfig.telemetry``:
    ``True``, ``"counts"`` or ``False``); ``route_fn(run, inputs)``: the engine's whole per-step routing path around
    ``run(inputs)``, called with ``plan.run`` (e.g. ``lynx_hf.block.BlockRouting.gate_probe``), timed instead, except on a step the plan keeps
    (``RoutePlan.keeps``). The experts before / after are the mean distinct experts over ``draws`` synthetic draws
    (an estimate, see the module docstring). Raises ``RuntimeError`` when :func:`cannot_measure` says so."""
    why = cannot_measure(plan.device)
    if why:
        raise RuntimeError(f"gate: cannot measure now ({why})")
    n, k = plan.num_experts, plan.top_k
    rule, step = WeightRule("softmax_all"), Step(DECODE)
    if mixed:
        every = torch.ones(num_tokens, dtype=torch.bool, device=plan.device)
        step = Step(MIXED, decode=every, live=every)
    before = after = 0.0
    for seed in range(draws):
        logits, weights, idx = synthetic_routing(num_tokens, n, k, dtype, plan.device, seed=seed)
        new_idx = plan.run(StepInputs(step, logits, weights, idx, rule, host_reads_allowed(logits))).idx
        before += float(torch.unique(idx).numel())
        after += float(torch.unique(new_idx).numel())
    logits, weights, idx = synthetic_routing(num_tokens, n, k, dtype, plan.device, seed=draws)
    host = host_reads_allowed(logits)
    scratch = BlockTelemetry(mode_of(telemetry)) if mode_of(telemetry) else None
    inputs = StepInputs(step, logits, weights, idx, rule, host, None, scratch)
    threads = torch.get_num_threads()
    if plan.device.type == "cpu" and threads > 1 and thread_count_settable():
        # the routing work is a chain of small ops (T x N, far below torch's intra-op grain size: they run on one
        # thread anyway); timed on one thread it is the work itself, not OpenMP's barriers on a busy host, which
        # measured up to 200x slower and flipped decisions between runs on a loaded 2-core machine
        torch.set_num_threads(1)
    try:
        if route_fn is not None and not plan.keeps(num_tokens):
            cost = _time_ms(lambda: route_fn(plan.run, inputs), plan.device)
        else:
            cost = _time_ms(lambda: plan.run(inputs), plan.device)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return cost, before / draws, after / draws


@torch.no_grad()
def measure_expert_ms(hidden: int, intermediate: int, dtype: torch.dtype, device, tokens_per_expert: int = 1,
                      num_experts: int = 64) -> float:
    """Time (ms) one expert's weights cost in a fused experts path on ``device``: the per-expert slope of a batched
    SwiGLU MLP (module docstring) between E/4 and E experts at ``tokens_per_expert`` tokens each, E = the experts
    of :data:`POOL_BYTES` of weights in ``dtype`` (at least 2, at most ``num_experts``). ``hidden`` (H),
    ``intermediate`` (I): the expert's sizes. Clamped at >= 0. Raises ``RuntimeError`` when :func:`cannot_measure`
    says so, ``ValueError`` for a size < 1."""
    device = torch.device(device)
    why = cannot_measure(device)
    if why:
        raise RuntimeError(f"gate: cannot measure now ({why})")
    if min(hidden, intermediate, tokens_per_expert, num_experts) < 1:
        raise ValueError(f"gate: sizes must be >= 1, got H={hidden} I={intermediate} m={tokens_per_expert} "
                         f"N={num_experts}")
    per_expert = 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()
    big = max(2, min(int(num_experts), math.ceil(POOL_BYTES / per_expert)))
    small = max(1, big // 4)
    # drawn from a private generator on the CPU, never the global CPU / CUDA streams (docs/cases.md C38)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(big, hidden, 2 * intermediate, generator=g) * 0.02).to(device=device, dtype=dtype)
    down = (torch.randn(big, intermediate, hidden, generator=g) * 0.02).to(device=device, dtype=dtype)
    x = torch.randn(big, tokens_per_expert, hidden, generator=g).to(device=device, dtype=dtype)

    def mlp(e: int):
        h = torch.bmm(x[:e], gate_up[:e])
        g, u = h.chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(g) * u, down[:e])

    t_big = _time_ms(lambda: mlp(big), device)
    t_small = _time_ms(lambda: mlp(small), device)
    slope = (t_big - t_small) / (big - small) if big > small else t_big / big
    return max(slope, 0.0)


@torch.no_grad()
def measure_module_expert_ms(expert_fn, hidden: int, num_experts: int, top_k: int, num_tokens: int, before: float,
                             after: float, dtype: torch.dtype, device) -> float | None:
    """Time (ms) one expert costs in the layer's *own* experts path at a step of ``num_tokens`` tokens: the model's
    experts implementation ``expert_fn(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k])`` run on
    synthetic routing that touches ``round(before)`` and ``round(after)`` distinct experts (row i uses experts
    ``(i k + j) mod E``), the difference divided by the experts between. This is the saving per avoided expert as the
    layer really runs (per-expert loops, launches and weight reads included). ``None`` when it cannot be measured
    (fewer than one expert between, the implementation raises on synthetic inputs, or the median difference is not
    positive: on a loaded host one burst can make the larger call the faster one, and "an expert costs 0 ms" would
    switch the policy off at that step size for the whole process): the caller falls back to
    :func:`measure_expert_ms`."""
    device = torch.device(device)
    big = min(int(num_experts), int(round(before)))
    small = max(int(top_k), int(round(after)))
    if big - small < 1 or cannot_measure(device):
        return None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(num_tokens, hidden, generator=g) * 0.1).to(device=device, dtype=dtype)
    w = torch.full((num_tokens, top_k), 1.0 / top_k, dtype=dtype, device=device)
    rows = torch.arange(num_tokens)[:, None] * top_k + torch.arange(top_k)[None, :]
    ids = {e: (rows % e).to(device) for e in (big, small)}
    diffs = []
    try:
        expert_fn(x, ids[big], w)
        for _ in range(3):  # interleaved pairs, the median difference: drift and bursts of load hit both sides
            t_big = _time_ms(lambda: expert_fn(x, ids[big], w), device, budget_s=TIME_BUDGET_S / 2)
            t_small = _time_ms(lambda: expert_fn(x, ids[small], w), device, budget_s=TIME_BUDGET_S / 2)
            diffs.append(t_big - t_small)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
        return None
    median = statistics.median(diffs)
    return median / (big - small) if median > 0 else None


# -- the per-plan gate ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerShape:
    """What the gate measures a layer at: ``num_experts`` (N), ``top_k`` (k), ``hidden`` (H) and ``intermediate``
    (I, one expert's intermediate size) or ``None`` where unknown, the router logits' ``dtype``, the expert
    weights' ``expert_dtype`` and ``mixed_steps`` (the engine's steps carry per-token masks)."""

    num_experts: int
    top_k: int
    hidden: int | None
    intermediate: int | None
    dtype: torch.dtype = torch.float32
    expert_dtype: torch.dtype | None = None
    #: the engine describes its steps with per-token masks (vLLM: ``Step("mixed", decode=..., live=...)``), so the
    #: routing cost is measured on that path (on CPU the one-call fused path does not run there)
    mixed_steps: bool = False


#: (shape, device, plan key, bucket, extra ms, cost key, threads) -> GateDecision, shared by every layer of this
#: process whose key is equal (:func:`measure`)
_CACHE: dict = {}
#: the batched-MLP expert timing (:func:`measure_expert_ms`) per (H, I, dtype, device, tokens, N, threads)
_EXPERT_CACHE: dict = {}


def _plan_key(plan, telemetry) -> tuple:
    return (plan.policy.name if hasattr(plan.policy, "name") else type(plan.policy).__name__, repr(plan.params),
            plan.routing_backend, getattr(plan.kernel, "__name__", repr(plan.kernel)), mode_of(telemetry))


def bucket_of(num_tokens: int, buckets=BUCKETS) -> int:
    """The measured step size a step of ``num_tokens`` tokens uses: the smallest bucket >= it, else the largest."""
    for b in buckets:
        if num_tokens <= b:
            return b
    return buckets[-1]


def measure(plan, shape: LayerShape, num_tokens: int, telemetry: bool | str = True,
            extra_expert_ms: float = 0.0, expert_fn=None, route_fn=None, cost_key: tuple = ()) -> GateDecision:
    """The gate's decision for ``plan`` at a step of ``num_tokens`` tokens (the bucket's, cached in-process per shape,
    device, policy configuration and bucket), decided with :data:`MARGIN`. The figure that decided is timed again up to
    :data:`CONFIRM` times while the decision flips, the smallest timing kept (on: the saving per expert; off: the
    cost), so that one burst of load does not fix a wrong decision for the process; not where that timing took
    :data:`CONFIRM_MAX_S` or more (a burst does not move a timing of seconds). ``route_fn``: the engine's per-step
    routing path (:func:`measure_routing`). ``cost_key``: what else changes the cost and the saving of this layer
    (the engine's description of its experts: implementation, module class, weight storage, offload; HF:
    ``lynx_hf.block.BlockRouting.gate_key``), part of the cache key with the shape, device, dtypes, policy
    configuration, bucket, extra per-expert cost and torch's intra-op thread count, so two layers share measured
    figures only where all of it is equal (``docs/cases.md`` C41). Without H and I (``shape.hidden`` /
    ``intermediate`` ``None``) or where :func:`cannot_measure` says so, :func:`always_on`."""
    if shape.hidden is None or shape.intermediate is None:
        return always_on("not measured: the layer's hidden / intermediate size is unknown")
    why = cannot_measure(plan.device)
    if why:
        return always_on(f"not measured: {why}")
    b = bucket_of(num_tokens)
    threads = torch.get_num_threads()
    key = (shape, str(plan.device), _plan_key(plan, telemetry), b, float(extra_expert_ms), expert_fn is not None,
           route_fn is not None, tuple(cost_key), threads)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    def routing_cost(draws: int = DRAWS):
        return measure_routing(plan, b, shape.dtype, telemetry=telemetry, mixed=shape.mixed_steps, route_fn=route_fn,
                               draws=draws)

    def timed(fn):  # (fn(), seconds it took)
        start = time.perf_counter()
        return fn(), time.perf_counter() - start

    (cost, before, after), cost_s = timed(routing_cost)
    # tokens per expert at this step size, rounded up to a power of two (the expert time grows slowly with it in
    # decode; fewer distinct measurements); nothing saved (one token, every expert kept): no expert timing needed
    tokens = 1 << max(0, math.ceil(math.log2(max(1.0, b * shape.top_k / max(before, 1.0)))))
    edtype = shape.expert_dtype or shape.dtype
    ekey = (shape.hidden, shape.intermediate, edtype, str(plan.device), tokens, shape.num_experts, threads)

    def expert_time() -> float:
        if expert_fn is not None:  # the layer's own experts path: what it really saves
            own = measure_module_expert_ms(expert_fn, shape.hidden, shape.num_experts, shape.top_k, b, before, after,
                                           edtype, plan.device)
            if own is not None:
                return own
        slope = measure_expert_ms(shape.hidden, shape.intermediate, edtype, plan.device, tokens, shape.num_experts)
        _EXPERT_CACHE[ekey] = min(slope, _EXPERT_CACHE.get(ekey, slope))
        return _EXPERT_CACHE[ekey]

    saved = before - after
    expert = 0.0 if saved <= 0 else (_EXPERT_CACHE.get(ekey) if expert_fn is None else None)
    expert_s = 0.0  # seconds the last timing of the expert figure took (0: not timed here)
    if expert is None:
        expert, expert_s = timed(expert_time)
    d = decide(cost, saved, expert, extra_expert_ms, margin=MARGIN)
    # confirm: a burst of load during one timing inflates it (the cost; the expert figure, a difference, when it hits
    # the larger call), and the decision is kept for the whole process. So the figure that decided is timed again, up
    # to CONFIRM times, keeping the smallest: on -> the saving per expert (a spike there switched a bypassed vLLM
    # layer back on: 0.39 ms for an expert that costs ~0.004), off -> the cost (one timing of 23.9 ms for ~0.1 ms work).
    # Only where that timing is short (< CONFIRM_MAX_S): a long one (large experts: seconds of calls) is not moved
    # by a burst, and timing it again would add seconds per bucket to the start
    for _ in range(CONFIRM if saved > 0 else 0):
        if d.on:
            if expert_s >= CONFIRM_MAX_S:
                break
            again, expert_s = timed(expert_time)
            expert = min(expert, again)
        else:
            if cost_s >= CONFIRM_MAX_S:
                break
            (again, _, _), cost_s = timed(lambda: routing_cost(draws=1))
            cost = min(cost, again)
        new = decide(cost, saved, expert, extra_expert_ms, margin=MARGIN)
        flipped, d = new.on != d.on, new
        if not flipped:
            break
    d = GateDecision(d.on, d.cost_ms, d.saving_ms, d.experts_saved, d.expert_ms, d.extra_expert_ms, before, after,
                     d.reason)
    _CACHE[key] = d
    return d


@dataclass(eq=False)  # identity: a RoutePlan holding it stays hashable
class PlanGate:
    """The gate of one plan (one MoE layer on one device), a stage of it (``lynx_hf.core.Stage``, :meth:`bind`).

    ``decisions``: bucket -> :class:`GateDecision` (filled by :meth:`measure_all` when the gate is bound, or lazily by
    :meth:`decision` outside tracing); ``seen``: step sizes (tokens) asked, eager steps only; ``skipped``: step
    size -> decode steps the gate kept the model's own routing on (eager steps only: a step traced by
    ``torch.compile`` or replayed from a CUDA graph is not counted).
    """

    #: how ``RoutePlan.stage`` finds it (:func:`of`)
    name: ClassVar[str] = NAME

    shape: LayerShape
    #: the plan it measures: a view of the plan it is bound to whose runner is the step below the gate (:meth:`bind`)
    plan: object = None
    telemetry: bool | str = True
    extra_expert_ms: float = 0.0
    #: the layer's own experts implementation ``fn(hidden [T, H], idx [T, k], weights [T, k])`` (HF path; vLLM on CPU:
    #: the runner's experts kernel), timed for the saving per expert (:func:`measure_module_expert_ms`); ``None``: the
    #: batched-MLP model (:func:`measure_expert_ms`)
    expert_fn: object = None
    #: the engine's per-step routing path ``fn(run, inputs)`` around ``run(inputs)`` (HF: the router hook's work,
    #: ``lynx_hf.block.BlockRouting.gate_probe``), timed for the cost; ``None``: the step below the gate alone
    route_fn: object = None
    #: what else changes this layer's cost (:func:`measure`'s ``cost_key``: HF, ``BlockRouting.gate_key``)
    cost_key: tuple = ()
    #: the engine's step body runs eagerly on the host (the vLLM plugin's op on CPU): a host step the gate runs is timed
    #: and the bucket decided again from those timings (:meth:`observe`)
    observe_served: bool = False
    #: the runner below the gate (:meth:`bind`)
    inner: object = None
    decisions: dict = field(default_factory=dict)
    seen: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    #: bucket -> per-step costs (ms) timed in the engine so far (:meth:`observe`); a bucket leaves it once decided
    observed: dict = field(default_factory=dict)
    #: buckets decided again from their served cost (:meth:`observe`)
    checked: set = field(default_factory=set)

    def bind(self, plan: RoutePlan, inner: Runner) -> Runner | None:
        """Compose the gate into ``plan`` (``lynx_hf.core.make_plan``): ``None`` for a plan that never remaps
        (:func:`~lynx_hf.core.keep_routing`: no gate); else every bucket is measured now when the shape is known and a
        measurement can run (:func:`cannot_measure`; else each on first use), and the returned runner asks the gate
        once per layer-step: a step the plan keeps (one token) runs ``inner`` (recorded) with ``gated_off`` from the
        bucket's decision; off, the model's own routing (the same objects, nothing recorded, counted as skipped,
        ``gated_off``); on, ``inner`` (timed for :meth:`observe` where :attr:`observe_served`)."""
        if plan.kernel is keep_routing:
            return None
        self.plan, self.inner = replace(plan, runner=inner), inner
        shape = self.shape
        if shape.hidden is not None and shape.intermediate is not None and cannot_measure(plan.device) is None:
            self.measure_all()
        return self._run

    def _run(self, plan: RoutePlan, inputs: StepInputs) -> Routed:
        num_tokens = inputs.idx.shape[0]  # a static shape: the gate's branch is host-side, no sync
        if plan.keeps(num_tokens):  # a lone token keeps its routing; the bucket's figure says whose experts run
            out = self.inner(plan, inputs)
            return out if self.decision(num_tokens).on else out._replace(gated_off=True)
        if not self.on(num_tokens):
            self.skip(num_tokens)
            return Routed(inputs.weights, inputs.idx, None, True)
        if self.observe_served and inputs.host and self.observing(num_tokens):
            start = time.perf_counter()
            out = self.inner(plan, inputs)
            self.observe(num_tokens, (time.perf_counter() - start) * 1e3)
            return out
        return self.inner(plan, inputs)

    def measure_all(self, buckets=BUCKETS) -> "PlanGate":
        """Measure every bucket now (eager, at patch time). Returns ``self``."""
        for b in buckets:
            self.decision(b)
        return self

    def decision(self, num_tokens: int) -> GateDecision:
        """The :class:`GateDecision` of a step of ``num_tokens`` tokens (measured now if its bucket was not)."""
        b = bucket_of(num_tokens)
        d = self.decisions.get(b)
        if d is None:
            extra = {} if self.route_fn is None else {"route_fn": self.route_fn}
            if self.cost_key:
                extra["cost_key"] = self.cost_key
            quiet = untouched(self.plan.device) if cannot_measure(self.plan.device) is None else contextlib.nullcontext()
            with quiet:
                d = measure(self.plan, self.shape, b, self.telemetry, self.extra_expert_ms, self.expert_fn, **extra)
            if not d.reason.startswith("not measured"):
                self.decisions[b] = d
        return d

    def on(self, num_tokens: int) -> bool:
        """Whether the policy runs on a decode step of ``num_tokens`` tokens (a static shape): a host-side lookup,
        no device read. Unmeasured buckets are measured on first use outside tracing / capture, else on."""
        d = self.decisions.get(bucket_of(num_tokens))
        if d is None:
            d = self.decision(num_tokens)
        if not torch.compiler.is_compiling():
            self.seen[num_tokens] += 1
        return d.on

    def observing(self, num_tokens: int) -> bool:
        """Whether the caller should time this step's routing work for :meth:`observe`: the bucket was measured, the
        gate is on there and it has not been decided again from served steps yet."""
        b = bucket_of(num_tokens)
        d = self.decisions.get(b)
        return d is not None and d.on and b not in self.checked and math.isfinite(d.cost_ms)

    def observe(self, num_tokens: int, cost_ms: float) -> None:
        """One served step's routing cost (ms, host wall time of the step's whole routing work, on a host that runs
        it synchronously: the vLLM plugin's op body on CPU). After :data:`OBSERVE_STEPS` of a bucket its decision is
        made again (:func:`decide`, :data:`MARGIN`) with their median as the cost and the measured saving kept: the
        patch-time cost is timed on a quiet host, one thread, the shortest call, and inside a running engine the same
        work measured several times that (fixture A, vLLM CPU, 16 requests: ~0.3 ms against ~0.08 ms). Only an *on*
        decision is checked (off, the work does not run), so this can switch the policy off, never on."""
        b = bucket_of(num_tokens)
        d = self.decisions.get(b)
        if d is None or b in self.checked:
            return
        samples = self.observed.setdefault(b, [])
        samples.append(float(cost_ms))
        if len(samples) < OBSERVE_STEPS:
            return
        cost = statistics.median(samples)
        new = decide(cost, d.experts_saved, d.expert_ms, d.extra_expert_ms, margin=MARGIN)
        self.decisions[b] = replace(new, experts_before=d.experts_before, experts_after=d.experts_after,
                                    reason=f"{new.reason} (cost: median of {len(samples)} served steps; "
                                           f"{d.cost_ms:.3g} ms measured before serving)")
        self.checked.add(b)
        del self.observed[b]

    def skip(self, num_tokens: int) -> None:
        """Count one decode step the gate kept the model's routing on (eager only)."""
        if not torch.compiler.is_compiling():
            self.skipped[num_tokens] += 1

    def reset(self) -> None:
        """Zero the counters (the decisions stay)."""
        self.seen.clear()
        self.skipped.clear()

    def summary(self) -> dict:
        """Per step size seen: ``{"gate": "auto", "by_tokens": {T: {"on", "cost_ms", "saving_ms", "experts_before",
        "experts_after", "expert_ms", "extra_expert_ms", "steps_skipped", "reason"}}, "steps_skipped": total}`` (ms per
        layer-step; ``extra_expert_ms``: the further cost per expert read, an offloaded expert's transfer;
        ``None`` where not measured, so the dict is plain JSON)."""
        by_tokens = {}
        for t in sorted(self.seen):
            d = self.decisions.get(bucket_of(t)) or always_on("not measured")
            by_tokens[int(t)] = {"on": d.on, "cost_ms": _num(d.cost_ms), "saving_ms": _num(d.saving_ms),
                                 "experts_before": _num(d.experts_before), "experts_after": _num(d.experts_after),
                                 "expert_ms": _num(d.expert_ms), "extra_expert_ms": _num(d.extra_expert_ms),
                                 "steps_skipped": int(self.skipped.get(t, 0)),
                                 "reason": d.reason}
        return {"gate": "auto", "by_tokens": by_tokens, "steps_skipped": int(sum(self.skipped.values()))}


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def off_line(layers: list[dict]) -> str | None:
    """One line when the gate switched the policy off on some layer at the step size most seen, e.g.
    ``"LYNX off on 24/24 layers at 16 tokens: expected saving 0.02 ms < cost 0.05 ms per layer-step"`` (means over
    the layers it is off on); ``None`` when it is on everywhere or no layer has a gate. ``layers``: per-layer stats
    dicts holding ``"gate"`` (:meth:`PlanGate.summary`)."""
    gates = [layer.get("gate") for layer in layers]
    gates = [g for g in gates if isinstance(g, dict) and g.get("by_tokens")]
    if not gates:
        return None
    seen = Counter()
    for g in gates:
        for t in g["by_tokens"]:
            seen[int(t)] += 1
    tokens = max(seen, key=lambda t: (seen[t], t))
    off = [g["by_tokens"].get(tokens) or g["by_tokens"].get(str(tokens)) for g in gates]
    off = [e for e in off if e is not None and not e["on"]]
    if not off:
        return None
    saving = sum(e["saving_ms"] for e in off) / len(off)
    cost = sum(e["cost_ms"] for e in off) / len(off)
    return (f"LYNX off on {len(off)}/{len(layers)} layers at {tokens} tokens per step: expected saving "
            f"{saving:.3g} ms <= cost {cost:.3g} ms per layer-step (gate='always' or {ENV}=always forces it on)")


def patch_note(gates: list) -> str | None:
    """One line for ``lynx_hf.patch`` when the gate measured at patch time keeps the model's own routing at some
    step sizes, e.g. ``"... off on 4/4 MoE layers for decode steps of 1-64 tokens ..."``; ``None`` when it is on
    everywhere it measured (or nothing was measured). ``gates``: one entry per patched layer, its :class:`PlanGate`
    (:func:`of` its plan) or ``None``."""
    measured = [g for g in gates if g is not None and g.decisions]
    if not measured:
        return None
    # a step size where the policy would save nothing (one token; every expert used either way) is not news
    def off(d):
        return not d.on and d.experts_saved > 0

    off_buckets = sorted({b for g in measured for b, d in g.decisions.items() if off(d)})
    if not off_buckets:
        return None
    layers = sum(1 for g in measured if any(off(d) for d in g.decisions.values()))
    return (f"lynx_hf: the cost gate (gate='auto') keeps the model's own routing on {layers}/{len(gates)} MoE layers "
            f"at decode step sizes (tokens, rounded up to these) {', '.join(str(b) for b in off_buckets)} on this "
            f"device (expected "
            f"saving <= measured routing cost; lynx_hf.stats(model).summary()['per_layer'][i]['gate'] has the "
            f"figures); gate='always' or {ENV}=always runs the policy on every decode step")


def stage(config: LynxConfig, shape: LayerShape, extra_expert_ms: float = 0.0, expert_fn=None, route_fn=None,
          observe_served: bool = False, cost_key: tuple = ()) -> PlanGate | None:
    """The cost gate to hand to ``lynx_hf.core.make_plan`` (``stages=``) for ``config``: ``None`` unless
    ``config.gate == "auto"``; else a :class:`PlanGate` of a layer of ``shape`` that times ``expert_fn`` and
    ``route_fn`` and weighs ``extra_expert_ms`` per expert (the :class:`PlanGate` fields), in ``config.telemetry``'s
    mode. It measures when bound (:meth:`PlanGate.bind`)."""
    if config.gate != "auto":
        return None
    return PlanGate(shape, telemetry=config.telemetry, extra_expert_ms=extra_expert_ms, expert_fn=expert_fn,
                    route_fn=route_fn, observe_served=observe_served, cost_key=tuple(cost_key))


def of(plan: RoutePlan | None) -> PlanGate | None:
    """The cost gate composed into ``plan`` (a ``lynx_hf.core.RoutePlan``), or ``None`` (no gate, or no plan)."""
    return None if plan is None else plan.stage(NAME)


__all__ = ["ENV", "NAME", "BUCKETS", "LOGIT_STD", "MARGIN", "OBSERVE_STEPS", "GateDecision", "LayerShape", "PlanGate",
           "decide", "always_on", "measure", "measure_routing", "measure_expert_ms", "synthetic_routing", "bucket_of",
           "cannot_measure", "untouched", "off_line", "patch_note", "stage", "of"]
