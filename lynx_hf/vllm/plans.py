"""Each MoE layer's plan, its cost gate and the bypass: the plugin's one door to the engine-independent core.

Every call the plugin makes into ``lynx_hf.core`` (``make_plan`` with a ``MoELayer`` and the gate as its one stage,
the plan's decode-step function ``plan.kernel`` on a ``StepInputs``, ``record_step``, ``host_reads_allowed``, the
:class:`~lynx_hf.core.Step` values) and into the cost gate (``lynx_hf.gate``: ``LayerShape``, the buckets,
``PlanGate`` decisions / observations / counters, found with ``lynx_hf.gate.of(plan)``) is in this module, so a
change of the core's plan API is a change here. The plugin asks its gate itself (once per layer-step, in
:func:`route`, which also times served steps and bypasses a layer the gate switches off) and then runs the plan's
kernel, not ``plan.run``, whose gate stage would ask again.

- :func:`plan_for` makes a layer's plan on first use, or :func:`before_forward` makes every layer's plan before the
  worker's first forward (a profiling / warm-up / capture run or a step), where the gate measures (``gate="auto"``:
  every bucket, a few seconds per layer shape at most, shared by the layers of one shape).
- A layer the gate keeps off at every step size this engine can run (:func:`gated_off_everywhere`) is *bypassed*:
  its router returns vLLM's routing without calling the op (:func:`lynx_hf.vllm.layers.attach`), so vLLM's compiled
  mode, which traces the forward once in its first profiling / warm-up run, compiles vLLM's own routing there. A
  compiled or captured forward (:func:`frozen`) keeps the bypass it was traced with.
- :func:`route` runs a plan on one step (the gate's on / skip / observe, then the decode-step function and the
  telemetry); the op body (:mod:`lynx_hf.vllm.op`) calls it.

Neither path reads a device value on the host nor makes a data-dependent shape, except the host shortcuts on CPU
tensors in eager mode (``host``: ``lynx_hf.core.host_reads_allowed``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..core import DECODE as _DECODE_KIND
from ..core import MIXED, MoELayer, RoutePlan, Step, StepInputs, host_reads_allowed, make_plan, record_step
from ..gate import BUCKETS, LayerShape, PlanGate, bucket_of
from ..gate import of as gate_of
from ..policies import get as get_policy
from ..telemetry import BlockTelemetry, mode_of, union_size
from ..telemetry import slots as _slots  # kernels.telemetry_slots, through the telemetry tier
from .state import DECODE, PADDING, STATE, Layer, warn_once

logger = logging.getLogger("lynx_hf.vllm")

#: the plain decode step: every row of the call is a live decode token (no masks)
DECODE_STEP = Step(_DECODE_KIND)
_LOADED_SLOTS = [_slots.STEPS, _slots.BEFORE, _slots.AFTER]

__all__ = ["DECODE_STEP", "masked_step", "host_reads_allowed", "plan_for", "make_layer_plan", "install_plan",
           "step_buckets", "gated_off_everywhere", "set_bypass", "route", "skip_bypassed", "mark_calls", "count_replays",
           "gate_summary",
           "reset_layer", "remaps", "layer_shape", "before_forward", "frozen", "captured", "padding_rows",
           "without_padding", "is_gathered", "gathered_layers"]


def masked_step(kinds: torch.Tensor) -> Step:
    """The :class:`~lynx_hf.core.Step` of a call whose rows have these kinds (int8 ``[T]``, the step buffer's):
    decode rows ``kinds == DECODE``, live rows ``kinds != PADDING``."""
    return Step(MIXED, decode=kinds == DECODE, live=kinds != PADDING)


def remaps(cfg) -> bool:
    """Whether ``cfg``'s policy (a :class:`~lynx_hf.vllm.config.PluginConfig`) remaps routing."""
    return get_policy(cfg.lynx.policy).remaps


def layer_shape(num_experts: int, top_k: int, hidden=None, intermediate=None, expert_dtype=None) -> LayerShape:
    """The cost gate's shape of a layer (H and I unknown: the gate cannot measure and keeps the policy on)."""
    return LayerShape(num_experts, top_k, hidden, intermediate, torch.float32, expert_dtype)


# --------------------------------------------------------------------------- plans and the bypass


def plan_for(layer: Layer, device: torch.device, dtype: torch.dtype, cfg) -> RoutePlan:
    """The layer's plan on ``device`` (made on first use, or before the first forward by :func:`before_forward`; the
    cost gate measures then, on the worker's threads), the router logits having ``dtype``; ``cfg``: a LynxConfig."""
    plan = layer.plan
    if plan is None or plan.device != device:
        plan = install_plan(layer, make_layer_plan(layer, device, dtype, cfg), cfg)
    return plan


def make_layer_plan(layer: Layer, device: torch.device, dtype: torch.dtype, cfg) -> RoutePlan:
    """A new plan of ``layer`` for ``cfg`` (a ``LynxConfig``) on ``device``; its cost gate measures now."""
    shape = layer.gate_shape or LayerShape(layer.num_experts, layer.top_k, None, None)
    shape = LayerShape(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, dtype, shape.expert_dtype,
                       # the op's steps carry masks, except on CPU (eager: the op body always is) where an all-decode
                       # step is a plain decode step (the fused one-call path); off CPU none is fused
                       mixed_steps=cfg.phase != "decode" and device.type != "cpu")
    # the cost gate (gate="auto") is the plan's one stage; the plugin asks it itself per step (route)
    stages = (PlanGate(shape, telemetry=cfg.telemetry, expert_fn=_experts_fn(layer, device)),) \
        if cfg.gate == "auto" else ()
    return make_plan(cfg, MoELayer(layer.num_experts, layer.top_k, device), stages=stages)


def install_plan(layer: Layer, plan: RoutePlan, cfg) -> RoutePlan:
    """``plan`` becomes the layer's; it sets the layer's ``bypass`` (:func:`gated_off_everywhere`) unless the
    forward is frozen (``STATE.start.frozen``)."""
    layer.plan = plan
    if cfg.telemetry:  # LynxConfig.telemetry: "counts" is the cheaper counting mode (lynx_hf.telemetry)
        layer.telemetry.mode = mode_of(cfg.telemetry)
    if not STATE.start.frozen:
        set_bypass(layer, gated_off_everywhere(plan))
    return plan


def step_buckets() -> tuple:
    """The gate's buckets (``lynx_hf.gate.BUCKETS``) a step of this engine can fall in: up to the bucket of
    ``max_num_batched_tokens`` (every bucket when it is not known)."""
    top = bucket_of(STATE.capacity) if STATE.capacity > 0 else BUCKETS[-1]
    return tuple(b for b in BUCKETS if b <= top)


def gated_off_everywhere(plan: RoutePlan) -> bool:
    """Whether ``plan``'s cost gate (``LynxConfig.gate="auto"``) keeps vLLM's routing at every step size this engine
    can run (:func:`step_buckets`), each bucket measured now if it was not. False without a gate (``gate="always"``,
    a policy that never remaps), or where a bucket cannot be measured (the gate keeps the policy on there)."""
    gate = gate_of(plan)
    if gate is None:
        return False
    for b in step_buckets():
        decision = gate.decision(b)
        if decision.on or decision.reason.startswith("not measured"):
            return False
    return True


def set_bypass(layer: Layer, bypass: bool) -> None:
    layer.bypass = bool(bypass)
    STATE.bypassed = tuple(one for one in STATE.layers if one.bypass)


def skip_bypassed(num_tokens: int) -> None:
    """A step of ``num_tokens`` tokens with decode tokens: each bypassed layer's gate counts it as a step it kept
    vLLM's routing on, as the op body does for a step the gate skips."""
    for layer in STATE.bypassed:
        _count_without_op(layer, num_tokens)


def _count_without_op(layer: Layer, num_tokens: int) -> None:
    """A step with decode tokens in which ``layer``'s op body did not run (bypassed, or a CUDA-graph replay): its
    gate counts it as the body would have, the step size seen (``PlanGate.on``) and a skip where the gate is off."""
    gate = gate_of(layer.plan)
    if gate is not None and not gate.on(num_tokens):
        gate.skip(num_tokens)


def mark_calls() -> None:
    """At a step's input preparation, in an engine whose forward is captured in CUDA graphs: each layer's op call
    count now, for :func:`count_replays` after the forward."""
    for layer in STATE.layers:
        layer.step_calls = layer.calls


def count_replays(num_tokens: int) -> None:
    """After a forward of ``num_tokens`` tokens with decode tokens, in an engine whose forward is captured in CUDA
    graphs (``STATE.start.captured``): a layer whose op body did not run in it (:func:`mark_calls`; bypassed layers
    aside, :func:`skip_bypassed` counts those) was replayed, and a replay repeats what the body did at capture, the
    gate's decision included (a host-side branch); its gate counts the step as the body would have: the step size
    seen (``PlanGate.on``) and, where the gate is off there, one step skipped. The telemetry needs nothing here:
    its device accumulators are added into by the replay itself."""
    for layer in STATE.layers:
        if not layer.bypass and layer.plan is not None and layer.calls == layer.step_calls:
            _count_without_op(layer, num_tokens)


def gate_summary(layer: Layer) -> dict:
    """The layer's gate for the telemetry: ``PlanGate.summary()`` (or the configured gate with no decision yet),
    plus ``bypassed``."""
    gate = gate_of(layer.plan)
    if gate is not None:
        entry = gate.summary()
    else:
        entry = {"gate": STATE.config.lynx.gate if STATE.config else "always", "by_tokens": {}, "steps_skipped": 0}
    entry["bypassed"] = layer.bypass
    return entry


def reset_layer(layer: Layer) -> None:
    """Zero the layer's telemetry, loaded-experts counts, skipped calls and its gate's counters. The device
    accumulators are zeroed in place, never reallocated (captured CUDA graphs keep adding into their addresses)."""
    layer.telemetry.reset()
    loaded = layer.loaded
    if loaded is not None:
        if loaded.is_inference() and not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                loaded.zero_()
        else:
            loaded.zero_()
    layer.skipped = 0
    gate = gate_of(layer.plan)
    if gate is not None:
        gate.reset()


def _experts_fn(layer: Layer, device: torch.device):
    """The layer's own routed-experts path as ``fn(hidden [T, H], idx [T, k] int64, weights [T, k])`` for the cost
    gate to time the saving per avoided expert on (``lynx_hf.gate.measure_module_expert_ms``): the runner's
    ``routed_experts.quant_method.apply`` (on CPU vLLM's ``cpu_fused_moe`` on the layer's prepacked weights), with
    the ids and weights in vLLM's dtypes (int32, fp32). ``None`` (the gate's batched-MLP model instead) off CPU (there
    the first decode step may be a CUDA-graph capture and the kernel's workspaces are shared with the forward in
    flight), under expert parallelism (``expert_map``: physical ids) or where the runner has no such path."""
    if device.type != "cpu":
        return None
    runner = layer.runner() if layer.runner is not None else None
    experts = getattr(runner, "routed_experts", None)
    method = getattr(experts, "quant_method", None)
    if method is None or not callable(getattr(method, "apply", None)) or \
            getattr(experts, "expert_map", None) is not None:
        return None

    def fn(hidden, idx, weights):
        return method.apply(experts, hidden, weights.float(), idx.to(torch.int32), None, None)

    return fn


def gathered_layers() -> list[str]:
    """The names of this process's MoE layers whose router sees an all-gathered batch (:func:`is_gathered`)."""
    return [layer.name for layer in STATE.layers if is_gathered(layer)]


def is_gathered(layer: Layer) -> bool:
    """Whether this layer's router sees several data-parallel / context-parallel ranks' tokens (vLLM's naive
    dispatch all-gathers hidden states and router logits before routing): this rank's step mask does not describe
    those rows, so the layer is left untouched (checked once per layer)."""
    if layer.gathered is None:
        runner = layer.runner() if layer.runner is not None else None
        gathered = False
        if runner is not None:
            try:
                cfg = runner.moe_config
                gathered = bool(runner.do_naive_dispatch_combine) or (
                    cfg.pcp_size > 1 and not cfg.moe_parallel_config.use_all2all_kernels)
            except AttributeError:
                gathered = False
        if gathered:
            warn_once("gathered", "lynx_hf.vllm: MoE layers route an all-gathered batch of several data-/context-"
                      "parallel ranks (naive dispatch); they keep vLLM's routing (a remapping policy is refused at "
                      "engine start and in configure: lynx_hf.vllm.checks.check_gathered). Use an all2all backend "
                      "(routing before dispatch) for LYNX under DP+EP.")
        layer.gathered = gathered
    return layer.gathered


# --------------------------------------------------------------------------- one step


def route(layer: Layer, plan: RoutePlan, step: Step, router_logits, topk_weights, topk_ids, host: bool):
    """``(topk_weights, topk_ids)`` of one call of ``layer`` after its plan on ``step``: vLLM's own where the cost
    gate is off at this call's size (counted as skipped), else the plan's decode-step function, with the telemetry
    (``LynxConfig.telemetry``) and the experts the step's live tokens load. ``host``: CPU tensors in eager mode,
    where the op body's wall time is the routing cost as served and the gate decides again from a few of them
    (``PlanGate.observe``: it can only switch off)."""
    num_tokens = router_logits.shape[0]
    gate = gate_of(plan)
    if gate is not None and not gate.on(num_tokens):  # static T: a host-side branch
        gate.skip(num_tokens)
        return topk_weights, topk_ids
    if host and gate is not None and gate.observing(num_tokens):
        start = time.perf_counter()
        out = _routed(layer, plan, step, router_logits, topk_weights, topk_ids, host)
        gate.observe(num_tokens, (time.perf_counter() - start) * 1e3)
        if not STATE.start.frozen and not gate.decision(num_tokens).on:  # decided again: off; off everywhere now?
            set_bypass(layer, gated_off_everywhere(plan))
        return out
    return _routed(layer, plan, step, router_logits, topk_weights, topk_ids, host)


def padding_rows(topk_ids: torch.Tensor, host: bool):
    """``[T]`` bool, the rows vLLM's router marked as padding (expert id -1: ``FusedTopKRouter`` /
    ``FusedTopKBiasRouter`` under ``VLLM_MOE_SKIP_PADDING=1``, every row of a CUDA-graph capture warm-up, DP dummy
    runs, padded decode batches), or ``None`` where there are none: on the host (CPU eager) asked there, once (the
    router classes that run on CPU never mark any); off the host always the mask (no host read)."""
    if host and not bool((topk_ids < 0).any()):
        return None
    return (topk_ids < 0).any(dim=-1)


def without_padding(step: Step, topk_ids: torch.Tensor, pad: torch.Tensor) -> tuple[Step, torch.Tensor]:
    """``(step, ids)`` with the padding rows ``pad [T]`` neither decode nor live (they do not vote, seed, remap or
    count; :func:`lynx_hf.core.remap` / :func:`~lynx_hf.core.record_step`) and their ids 0 (a valid index for every
    index op of the remap, the union and the telemetry; nothing counts them). Sync-free."""
    keep = ~pad
    decode = keep if step.decode is None else step.decode & keep
    live = keep if step.live is None else step.live & keep
    return Step(step.kind, decode=decode, live=live), topk_ids.masked_fill(pad[:, None], 0)


def _routed(layer, plan, step, router_logits, topk_weights, topk_ids, host):
    pad = padding_rows(topk_ids, host)
    if pad is not None:  # padding rows come back as vLLM gave them (id -1, its weights)
        step, ids = without_padding(step, topk_ids, pad)
        new_weights, new_ids = _routed_rows(layer, plan, step, router_logits, topk_weights, ids, host)
        return (torch.where(pad[:, None], topk_weights, new_weights.to(topk_weights.dtype)),
                torch.where(pad[:, None], topk_ids, new_ids.to(topk_ids.dtype)))
    return _routed_rows(layer, plan, step, router_logits, topk_weights, topk_ids, host)


def _routed_rows(layer, plan, step, router_logits, topk_weights, topk_ids, host):
    record = STATE.config.lynx.telemetry
    if step is DECODE_STEP and host:
        # every row a live decode row: the step function records the telemetry itself (the fused path in the same
        # call), and the experts the kernel loads are the telemetry's own before / after of this step
        telemetry = layer.telemetry if record else None
        start = _decode_slots(telemetry) if telemetry is not None else None
        out = plan.kernel(plan, _inputs(layer, step, router_logits, topk_weights, topk_ids, host, telemetry))
        if telemetry is not None:
            _add_loaded(layer, _decode_slots(telemetry) - start)
        return out.weights, out.idx
    out = plan.kernel(plan, _inputs(layer, step, router_logits, topk_weights, topk_ids, host, None))
    if record:
        _record(layer, step, topk_ids, topk_weights, out.idx, out.finite, host)
    return out.weights, out.idx


def _inputs(layer: Layer, step: Step, router_logits, topk_weights, topk_ids, host: bool, telemetry) -> StepInputs:
    """The layer-step for the plan's kernel: ``layer.scores`` the router class's selection scores (``None``: the fp32
    logits, which the weight rule then reuses)."""
    return StepInputs(step, router_logits, topk_weights, topk_ids, layer.rule, host, layer.scores, telemetry)


def _decode_slots(telemetry: BlockTelemetry) -> np.ndarray:
    """fp64 ``[3]``: the accumulated STEPS / BEFORE / AFTER slots of ``telemetry`` (host path: CPU accumulators)."""
    acc = telemetry.acc
    if acc is None:
        return np.zeros(3)
    return acc.detach().numpy()[_LOADED_SLOTS]  # fancy indexing: a copy


def _add_loaded(layer: Layer, row: np.ndarray) -> None:
    """Host path: add one all-decode step's loaded-experts row (``[3]``) to ``layer.loaded`` (CPU)."""
    loaded = layer.loaded
    if loaded is None or loaded.device.type != "cpu":
        loaded = layer.loaded = torch.zeros(3, dtype=torch.float64)
    loaded.detach().numpy()[:] += row  # in place through a view: no torch op (works on inference tensors too)


@torch.no_grad()
def _record(layer: Layer, step: Step, ids, weights, new_ids, finite, host: bool) -> None:
    dev = ids.device
    counted, live = record_step(layer.telemetry, layer.num_experts, step, ids, weights, new_ids, finite, host=host)
    has_decode = counted.any().to(torch.float64)
    row = torch.stack([has_decode,
                       union_size(ids, layer.num_experts, live).to(torch.float64) * has_decode,
                       union_size(new_ids, layer.num_experts, live).to(torch.float64) * has_decode])
    if layer.loaded is None or layer.loaded.device != dev:
        layer.loaded = torch.zeros(3, dtype=torch.float64, device=dev)
    elif layer.loaded.is_inference() and not torch.is_inference_mode_enabled():
        layer.loaded = layer.loaded.clone()  # created under vLLM's inference_mode, updated outside it
    layer.loaded.add_(row)


# --------------------------------------------------------------------------- before the first forward


def frozen(model_runner) -> bool:
    """Whether ``model_runner``'s forward is traced once or captured (vLLM's compiled mode, CUDA graphs): a Python
    branch in the hooked router is then read when the forward is traced, not on every step."""
    if getattr(getattr(model_runner, "model_config", None), "enforce_eager", False):
        return False
    compilation = getattr(model_runner, "compilation_config", None)
    if compilation is None:
        return True  # unknown: assume the forward is compiled (configure is then stricter, never wrong)
    mode = getattr(compilation, "mode", None)
    cudagraphs = getattr(compilation, "cudagraph_mode", None)
    return bool(mode is None or int(mode) != 0 or (cudagraphs is not None and
                                                   getattr(cudagraphs, "name", "NONE") != "NONE"))


def captured(model_runner, device: torch.device) -> bool:
    """Whether ``model_runner``'s forward is captured in CUDA graphs: on a CUDA device, not ``enforce_eager``, and
    ``compilation_config.cudagraph_mode`` not ``NONE`` (unknown: assumed captured, so ``configure`` is stricter,
    never wrong)."""
    if device.type != "cuda" or getattr(getattr(model_runner, "model_config", None), "enforce_eager", False):
        return False
    cudagraphs = getattr(getattr(model_runner, "compilation_config", None), "cudagraph_mode", None)
    return cudagraphs is None or getattr(cudagraphs, "name", "NONE") != "NONE"


def before_forward(model_runner) -> None:
    """Before the first forward of this worker (hooked on the model runners' ``_dummy_run`` and ``execute_model``;
    once): every layer's plan is made on the runner's device, its cost gate measured, and a layer the gate keeps off
    at every step size this engine can run is bypassed (``Layer.bypass``). Then the forward counts as frozen where it
    is compiled or captured (:func:`frozen`)."""
    start = STATE.start
    if start.started:
        return
    start.started = True
    cfg = STATE.config
    if cfg is None or not STATE.layers:
        return
    device = torch.device(getattr(model_runner, "device", "cpu"))
    dtype = getattr(getattr(model_runner, "model_config", None), "dtype", None)
    start.device, start.dtype = device, dtype if isinstance(dtype, torch.dtype) else torch.float32
    t0 = time.perf_counter()
    for layer in STATE.layers:
        plan_for(layer, start.device, start.dtype, cfg.lynx)
    logger.debug("lynx_hf.vllm: %d plans made, cost gate decided in %.2f s", len(STATE.layers),
                 time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the expert timing's scratch weights: not reserved when vLLM profiles memory
    start.frozen = frozen(model_runner)
    start.captured = captured(model_runner, device)
    if STATE.bypassed:
        logger.warning("lynx_hf.vllm: the cost gate (gate='auto') keeps vLLM's routing on %d/%d MoE layers at every "
                       "step size up to %d tokens on this device (expected saving <= measured routing cost); those "
                       "layers run vLLM's own routing path without the plugin's op (stats: layers[i]['gate']). "
                       "gate='always' or LYNX_HF_GATE=always runs the policy on every decode step",
                       len(STATE.bypassed), len(STATE.layers), step_buckets()[-1])
