"""Measuring a layer's decisions: what the policy's routing work costs and what one avoided expert saves.

Runs only where no table has the layer's key (``lynx_hf.gate.table``): once per key and machine, the result stored.
It leaves no trace: every random number comes from a private ``torch.Generator`` (never the global CPU / CUDA
streams), torch's thread count is never changed (the figures hold for the thread count in the key), and grad mode is
switched off for the calling thread only (``torch.no_grad``). Callers serialize measurements (one at a time per
process: ``DecisionStore``), so two timings never share the CPU with each other.

- :func:`measure_routing`: ``(cost_ms, experts_before, experts_after)`` of a plan at one step size: the engine's whole
  per-step routing path where it gives one (``route_fn``), on synthetic router logits at the layer's ``(T, N)``; the
  experts before / after an *estimate* from the policy on i.i.d. normal logits of std ``Tuning.logit_std``.
- :func:`measure_module_expert_ms`: the saving per avoided expert in the layer's own experts implementation;
  :func:`measure_expert_ms`: the batched-SwiGLU model of it where that cannot run.
- :func:`measure_bucket` / :func:`measure_layer`: the decision of one bucket / every bucket.

Units: milliseconds per layer-step.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..core import DECODE, MIXED, Step, StepInputs, WeightRule, host_reads_allowed
from ..telemetry import BlockTelemetry, mode_of
from .decision import TUNING, GateDecision, Tuning, by_rule, decide

#: the version of this measuring code, part of every decision key (``lynx_hf.gate.key.GateKey.measure``): bumped when
#: what is timed or how a bucket is decided changes, so the decisions an older measurement stored miss (and stay in the
#: files for the builds that wrote them) while every other part of a key, the tables' format and the file names stay.
#: Pinned by ``tests/policies/test_gate_store.py::test_measure_version_pins_the_measuring_code`` to a hash of this
#: module's code (docstrings and comments left out): a change to the code fails that test until this is bumped.
#: 2: on CUDA the saving per expert is timed with L2 flushed and on the experts path each step size runs, a captured
#: engine's routing cost as a graph replay, under expert parallelism a rank's own share saved (1 measured none of it)
MEASURE_VERSION = 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: bytes written between timed expert calls on CUDA to evict the weights from L2 (what triton.testing.do_bench
#: flushes): in decode every layer's experts stream from HBM, but timed alone in a loop a DeepSeek-V2-Lite expert
#: (17 MB) stays in an H200's L2 and measured 1.4 us instead of ~3.6 us (lab.gpu_check gate section)
L2_FLUSH_BYTES = 256 << 20


def _time_ms(fn, device: torch.device, budget_s: float, reps: int = 25, flush_l2: bool = False) -> float:
    """Shortest wall time of ``fn()`` in ms over up to ``reps`` calls within ``budget_s`` (one warm-up call; device
    synchronized around each call). The minimum, not the median: on a shared or loaded host it is the stable estimate
    of what the work itself costs, for the cost and the saving alike. ``flush_l2`` (CUDA only): each call timed on the
    device with CUDA events after :data:`L2_FLUSH_BYTES` are written, so weights are read from HBM as in decode."""
    if flush_l2 and device.type == "cuda":
        return _time_flushed_ms(fn, device, budget_s, reps)
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


def _time_flushed_ms(fn, device: torch.device, budget_s: float, reps: int) -> float:
    scratch = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    fn()
    _sync(device)
    times, spent = [], time.perf_counter()
    for _ in range(reps):
        scratch.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) >= 3 and time.perf_counter() - spent > budget_s:
            break
    return min(times)


def _time_captured_ms(fn, device: torch.device, budget_s: float, reps: int = 25, replays: int = 10) -> float | None:
    """Shortest time (ms) of one replay of ``fn()`` captured in a CUDA graph (``replays`` replays per timed call, so
    the host's launch of the graph is shared): what the work costs in an engine whose decode forward is captured,
    where launching each kernel costs the host nothing. ``None`` where ``fn`` cannot be captured (the caller then
    times it eagerly: the launch-bound, higher figure)."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture (lazy allocations, autotune)
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return None
    graph.replay()
    _sync(device)
    times, spent = [], time.perf_counter()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
        if len(times) >= 3 and time.perf_counter() - spent > budget_s:
            break
    del graph
    return min(times)


def cannot_measure(device) -> str | None:
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


def synthetic_routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, device, seed: int = 0,
                      tuning: Tuning = TUNING, selection=None):
    """Synthetic router output at the layer's shape: ``(logits [T, N] in dtype, weights [T, k] in dtype,
    idx [T, k] int64)``; logits i.i.d. normal of std ``tuning.logit_std`` from a private generator seeded ``seed``
    (drawn on the CPU); idx the top-k of ``selection(logits)`` (the layer's selection scores ``[T, N]`` fp32, ``-inf``
    where its routing forbids an expert: a group-limited router's ids stay in the token's groups, as the model's
    would) or of the logits (``None``); weights the softmax over all N picked there (their values do not change the
    work)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * tuning.logit_std).to(device=device, dtype=dtype)
    choice = logits.float() if selection is None else selection(logits).float()
    idx = choice.topk(top_k, dim=-1).indices
    weights = logits.float().softmax(-1).gather(-1, idx)
    return logits, weights.to(dtype), idx


@torch.no_grad()
def measure_routing(plan, num_tokens: int, dtype: torch.dtype = torch.float32, telemetry: bool | str = True,
                    mixed: bool = False, route_fn=None, draws: int | None = None, tuning: Tuning = TUNING,
                    selection=None, captured: bool = False) -> tuple[float, float, float]:
    """``(cost_ms, experts_before, experts_after)`` of ``plan`` (a ``lynx_hf.core.RoutePlan``: the gate measures a
    view of its plan whose runner is the step below the gate) at a decode step of ``num_tokens`` tokens whose router
    logits have dtype ``dtype``.

    ``cost_ms``: shortest time of ``plan.run(inputs)`` on synthetic logits (:func:`synthetic_routing`, every token a
    decode token; ``mixed``: described as a continuous-batching step with per-token masks, as the vLLM plugin does),
    with a scratch telemetry in mode ``telemetry``; ``route_fn(run, inputs)``: the engine's whole per-step routing
    path around ``run(inputs)`` (e.g. ``lynx_hf.facts.gate_probe``), timed instead, except on a step
    the plan keeps; ``selection``: the layer's selection scores (:func:`synthetic_routing`); ``captured``: the step
    runs inside a captured CUDA graph (``LayerShape.captured``: a vLLM engine with CUDA graphs), so on CUDA the cost
    is the time of a graph replay (:func:`_time_captured_ms`; eager where the capture fails, and off CUDA). The experts before /
    after: the mean distinct experts over ``draws`` (default ``tuning.draws``) synthetic draws. Raises
    ``RuntimeError`` when :func:`cannot_measure` says so."""
    why = cannot_measure(plan.device)
    if why:
        raise RuntimeError(f"gate: cannot measure now ({why})")
    draws = tuning.draws if draws is None else draws
    n, k = plan.num_experts, plan.top_k
    rule, step = WeightRule("softmax_all"), Step(DECODE)
    if mixed:
        every = torch.ones(num_tokens, dtype=torch.bool, device=plan.device)
        step = Step(MIXED, decode=every, live=every)
    before = after = 0.0
    for seed in range(draws):
        logits, weights, idx = synthetic_routing(num_tokens, n, k, dtype, plan.device, seed, tuning, selection)
        new_idx = plan.run(StepInputs(step, logits, weights, idx, rule, host_reads_allowed(logits),
                                      selection)).idx
        before += float(torch.unique(idx).numel())
        after += float(torch.unique(new_idx).numel())
    logits, weights, idx = synthetic_routing(num_tokens, n, k, dtype, plan.device, draws, tuning, selection)
    host = host_reads_allowed(logits)
    scratch = BlockTelemetry(mode_of(telemetry)) if mode_of(telemetry) else None
    inputs = StepInputs(step, logits, weights, idx, rule, host, selection, scratch)
    if route_fn is not None and not plan.keeps(num_tokens):
        step_fn = lambda: route_fn(plan.run, inputs)  # noqa: E731
    else:
        step_fn = lambda: plan.run(inputs)  # noqa: E731
    cost = None
    if captured and torch.device(plan.device).type == "cuda":
        cost = _time_captured_ms(step_fn, torch.device(plan.device), tuning.time_budget_s)
    if cost is None:
        cost = _time_ms(step_fn, plan.device, tuning.time_budget_s)
    return cost, before / max(draws, 1), after / max(draws, 1)


@torch.no_grad()
def measure_expert_ms(hidden: int, intermediate: int, dtype: torch.dtype, device, tokens_per_expert: int = 1,
                      num_experts: int = 64, tuning: Tuning = TUNING) -> float:
    """Time (ms) one expert's weights cost in a fused experts path on ``device``: the per-expert slope of a batched
    SwiGLU MLP (``[E, m, H] @ [E, H, 2I]``, ``silu * up``, ``@ [E, I, H]``) between E/4 and E experts at
    ``tokens_per_expert`` tokens each, E = the experts of ``tuning.pool_bytes`` of weights in ``dtype`` (at least 2,
    at most ``num_experts``). ``hidden`` (H), ``intermediate`` (I): the expert's sizes. Clamped at >= 0. Per-call
    launch costs are excluded (the gate errs towards "off"). Raises ``RuntimeError`` when :func:`cannot_measure` says
    so, ``ValueError`` for a size < 1."""
    device = torch.device(device)
    why = cannot_measure(device)
    if why:
        raise RuntimeError(f"gate: cannot measure now ({why})")
    if min(hidden, intermediate, tokens_per_expert, num_experts) < 1:
        raise ValueError(f"gate: sizes must be >= 1, got H={hidden} I={intermediate} m={tokens_per_expert} "
                         f"N={num_experts}")
    per_expert = 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()
    big = max(2, min(int(num_experts), math.ceil(tuning.pool_bytes / per_expert)))
    small = max(1, big // 4)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(big, hidden, 2 * intermediate, generator=g) * 0.02).to(device=device, dtype=dtype)
    down = (torch.randn(big, intermediate, hidden, generator=g) * 0.02).to(device=device, dtype=dtype)
    x = torch.randn(big, tokens_per_expert, hidden, generator=g).to(device=device, dtype=dtype)

    def mlp(e: int):
        h = torch.bmm(x[:e], gate_up[:e])
        g, u = h.chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(g) * u, down[:e])

    t_big = _time_ms(lambda: mlp(big), device, tuning.time_budget_s, flush_l2=True)
    t_small = _time_ms(lambda: mlp(small), device, tuning.time_budget_s, flush_l2=True)
    slope = (t_big - t_small) / (big - small) if big > small else t_big / big
    return max(slope, 0.0)


@torch.no_grad()
def measure_module_expert_ms(expert_fn, hidden: int, num_experts: int, top_k: int, num_tokens: int, before: float,
                             after: float, dtype: torch.dtype, device, tuning: Tuning = TUNING) -> float | None:
    """Time (ms) one expert costs in the layer's *own* experts path at a step of ``num_tokens`` tokens: the model's
    experts implementation ``expert_fn(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k])`` run on
    synthetic routing that touches ``round(before)`` and ``round(after)`` distinct experts (row i uses experts
    ``(i k + j) mod E``), the median difference of three interleaved pairs divided by the experts between. ``None``
    when it cannot be measured (fewer than one expert between, the implementation raises on synthetic inputs, or the
    median difference is not positive): the caller falls back to :func:`measure_expert_ms`."""
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
            t_big = _time_ms(lambda: expert_fn(x, ids[big], w), device, tuning.time_budget_s / 2, flush_l2=True)
            t_small = _time_ms(lambda: expert_fn(x, ids[small], w), device, tuning.time_budget_s / 2, flush_l2=True)
            diffs.append(t_big - t_small)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
        return None
    median = statistics.median(diffs)
    return median / (big - small) if median > 0 else None


def _timed(fn):
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def measure_bucket(gate, bucket: int, expert_times: dict, tuning: Tuning = TUNING) -> GateDecision:
    """The decision of ``gate`` (a ``lynx_hf.gate.PlanGate``, bound) at a step of ``bucket`` tokens, measured now
    and decided with ``tuning.margin``. ``expert_times``: the owner's cache of batched-MLP expert timings (per H, I,
    dtype, device, tokens per expert, N and thread count; ``DecisionStore.expert_times``).

    The figure that decided is timed again up to ``tuning.confirm`` times while the decision flips, the smallest
    timing kept (on: the saving per expert; off: the cost), so one burst of load does not fix a wrong decision; not
    where that timing took ``tuning.confirm_max_s`` or more."""
    plan, shape = gate.plan, gate.shape
    threads = torch.get_num_threads()

    def routing_cost(draws=None):
        return measure_routing(plan, bucket, shape.dtype, telemetry=gate.telemetry, mixed=shape.mixed_steps,
                               route_fn=gate.route_fn, draws=draws, tuning=tuning, selection=gate.selection,
                               captured=shape.captured)

    (cost, before, after), cost_s = _timed(routing_cost)
    # tokens per expert at this step size, rounded up to a power of two (the expert time grows slowly with it in
    # decode); nothing saved (one token, every expert kept): no expert timing needed
    tokens = 1 << max(0, math.ceil(math.log2(max(1.0, bucket * shape.top_k / max(before, 1.0)))))
    edtype = shape.expert_dtype or shape.dtype
    ekey = (shape.hidden, shape.intermediate, str(edtype), str(plan.device), tokens, shape.num_experts, threads)

    # the experts path decode runs at this step size: the sparse kernel where the plan runs it, else the layer's own
    path_fn = gate.kernel_fn if gate.kernel_fn is not None and plan.uses_kernel(bucket) else gate.expert_fn

    def expert_time() -> float:
        if path_fn is not None:  # the layer's experts path: what it really saves
            own = measure_module_expert_ms(path_fn, shape.hidden, shape.num_experts, shape.top_k, bucket,
                                           before, after, edtype, plan.device, tuning=tuning)
            if own is not None:
                return own
        try:
            slope = measure_expert_ms(shape.hidden, shape.intermediate, edtype, plan.device, tokens,
                                      shape.num_experts, tuning=tuning)
        except (RuntimeError, NotImplementedError, TypeError):  # no batched matmul in the experts' dtype (fp8)
            slope = rule_at(gate, bucket, "", tuning).expert_ms  # their bytes at the rule's bandwidth
        expert_times[ekey] = min(slope, expert_times.get(ekey, slope))
        return expert_times[ekey]

    # under expert parallelism each rank runs N / ep_size experts: it saves its own share of the avoided ones
    saved = (before - after) / max(1, int(shape.ep_size))
    expert = 0.0 if saved <= 0 else (expert_times.get(ekey) if path_fn is None else None)
    expert_s = 0.0
    if expert is None:
        expert, expert_s = _timed(expert_time)
    d = decide(cost, saved, expert, gate.extra_ms(), margin=tuning.margin)
    for _ in range(tuning.confirm if saved > 0 else 0):
        if d.on:
            if expert_s >= tuning.confirm_max_s:
                break
            again, expert_s = _timed(expert_time)
            expert = min(expert, again)
        else:
            if cost_s >= tuning.confirm_max_s:
                break
            (again, _, _), cost_s = _timed(lambda: routing_cost(draws=1))
            cost = min(cost, again)
        new = decide(cost, saved, expert, gate.extra_ms(), margin=tuning.margin)
        flipped, d = new.on != d.on, new
        if not flipped:
            break
    return GateDecision(d.on, d.cost_ms, d.saving_ms, d.experts_saved, d.expert_ms, d.extra_expert_ms, before, after,
                        d.reason)


def measure_layer(gate, expert_times: dict, tuning: Tuning = TUNING) -> dict:
    """``{bucket: GateDecision}`` of ``gate`` (a bound ``PlanGate``) over every bucket of ``tuning``, measured now."""
    return {b: measure_bucket(gate, b, expert_times, tuning) for b in tuning.buckets}


def rule_layer(gate, why: str, tuning: Tuning = TUNING) -> dict:
    """``{bucket: GateDecision}`` of ``gate`` by the closed-form rule (:func:`~lynx_hf.gate.decision.by_rule`)."""
    return {b: rule_at(gate, b, why, tuning) for b in tuning.buckets}


def rule_at(gate, num_tokens: int, why: str, tuning: Tuning = TUNING) -> GateDecision:
    """The closed-form decision of ``gate`` at ``num_tokens`` tokens (its layer's sizes must be known)."""
    shape = gate.shape
    edtype = shape.expert_dtype or shape.dtype
    return by_rule(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate,
                   torch.empty((), dtype=edtype).element_size(), num_tokens, torch.device(gate.plan.device).type,
                   gate.extra_ms(), why, tuning, ep_size=shape.ep_size)
