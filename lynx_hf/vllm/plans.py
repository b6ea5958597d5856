"""Each MoE layer's plan and its stages: the plugin's one door to the engine-independent core, and the op's one
call per step (:func:`remap`).

Every call the plugin makes into ``lynx_hf.core`` (``make_plan`` with a ``MoELayer`` and the plugin's stages,
``RoutePlan.run`` on a ``StepInputs``, ``host_reads_allowed``) and every cost gate it makes (``lynx_hf.gate``:
``LayerShape``, ``PlanGate``) is in this module, so a change of the core's plan API is a change here. What the
plugin's steps describe (which rows decode, padding rows, rows a layer's router sees) is :mod:`lynx_hf.vllm.rows`;
where the gate keeps vLLM's routing without the op, and how those steps are counted, is :mod:`lynx_hf.vllm.bypass`.
A step runs as in the HF path (``lynx_hf.block.BlockRouting.route``): :func:`remap` (the op's body) describes the
call's rows (:func:`lynx_hf.vllm.rows.step_for`) and calls ``plan.run``, and the plan's stages do the rest, outermost
first:

1. the cost gate (``gate="auto"``: :class:`lynx_hf.gate.PlanGate`): vLLM's routing where it is off at this call's
   step size (decided on the host from the static T and the host's count of decode rows, ``Step.decode_rows``; a
   call being captured into a CUDA graph takes the replay's price, an eager step the eager one); it counts its
   skips itself;
2. :class:`lynx_hf.vllm.rows.PaddingRows`: rows vLLM's router marked as padding (expert id -1) are neither decode
   nor live below it and come back with vLLM's -1 ids and weights;
3. the plan's decode-step function (``lynx_hf.core``: the policy's remap, or the one-call CPU path), which records
   the telemetry, the loaded-experts slots included (``BlockTelemetry.loaded``).

- :func:`plan_for` makes a layer's plan on first use, or :func:`before_forward` makes every layer's plan before the
  worker's first forward (a profiling / warm-up / capture run or a step): the gate gets its decisions then (a table,
  the per-user cache, or a measurement stored there: ``lynx_hf.gate.table``), and with several tensor-parallel ranks
  every rank adopts rank 0's (:func:`lynx_hf.vllm.ranks.agree`); the bypass is settled from them
  (:func:`lynx_hf.vllm.bypass.settle_bypass`).
- :func:`warm_up`: before the first CUDA-graph capture, each layer's step run once at every captured size whose graph
  holds it.

Neither path reads a device value on the host nor makes a data-dependent shape, except the host shortcuts on CPU
tensors in eager mode (``host``: ``lynx_hf.core.host_reads_allowed``).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..core import (
    MoELayer,
    RoutePlan,
    Step,
    StepInputs,
    host_reads_allowed,
    keep_routing,
    make_plan,
    reset_stages,
    stage_report,
)
from ..errors import UnsupportedModelError
from ..gate import LayerFacts, LayerShape, PlanGate, plan_stage
from ..gate import of as gate_of
from ..policies import get as get_policy
from ..telemetry import mode_of
from . import ranks
from .bypass import capturing_on, gate_summary, gated_off_everywhere, set_bypass, settle_bypass, step_buckets
from .rows import PaddingRows, masked_step, step_for, unmasked
from .state import DECODE, STATE, Layer, buffer, target_layers

logger = logging.getLogger("lynx_hf.vllm")

__all__ = ["remap", "remap_step", "plan_for", "make_layer_plan", "install_plan", "step_key", "route", "step_inputs",
           "stage_summaries", "reset_layer", "remaps", "layer_shape", "before_forward", "agree", "frozen", "captured",
           "torch_backend_layers", "capture_sizes", "warm_up"]


def remap(layer: Layer, router_logits, topk_weights, topk_ids):
    """``(topk_weights, topk_ids)`` of one op call of ``layer`` after the plugin's policy on the current step: the op's
    one call into this module per layer-step (:func:`lynx_hf.vllm.op.remap_layer`). The call's rows
    (:func:`lynx_hf.vllm.rows.step_for`: ``None``, vLLM's routing as it is, where it has no decode row or the mask does
    not describe its rows), then :func:`remap_step`. May return its inputs."""
    host = host_reads_allowed(router_logits)
    step = step_for(layer, router_logits, host)
    if step is None:
        return topk_weights, topk_ids
    return remap_step(layer, step, router_logits, topk_weights, topk_ids, host)


def remap_step(layer: Layer, step, router_logits, topk_weights, topk_ids, host: bool):
    """``layer``'s routing after its plan (made on first use) on ``step``, a :class:`lynx_hf.core.Step` describing
    this call's rows: ``plan.run`` (:func:`route`). :func:`remap` passes the step
    :func:`lynx_hf.vllm.rows.step_for` chose; a caller may pass another description of the same rows (e.g.
    ``rows.masked_step(kinds)`` for an all-decode step: the masked path, the fused path's reference). Raises
    :class:`~lynx_hf.UnsupportedModelError` for logits of another width than the layer's logical experts."""
    if router_logits.shape[-1] != layer.num_experts:  # a static shape: a host-side check
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layer {layer.name}: router logits of width {router_logits.shape[-1]}, but the layer "
            f"was attached with {layer.num_experts} logical experts; the policy must see the logical experts only")
    if topk_ids.shape[-1] != layer.top_k:  # e.g. ROCm AITER's fused shared experts: k + s columns, ids >= N
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layer {layer.name}: its router returned {topk_ids.shape[-1]} expert columns for "
            f"top_k={layer.top_k} (shared experts fused into the routing, ids beyond the {layer.num_experts} routed "
            "experts); the policy can remap only the routed experts' k columns")
    plan = plan_for(layer, router_logits.device, router_logits.dtype, STATE.config.lynx)
    return route(layer, plan, step, router_logits, topk_weights, topk_ids, host)


def remaps(cfg) -> bool:
    """Whether ``cfg``'s policy (a :class:`~lynx_hf.vllm.config.PluginConfig`) remaps routing."""
    return get_policy(cfg.lynx.policy).remaps


def layer_shape(num_experts: int, top_k: int, hidden=None, intermediate=None, expert_dtype=None,
                ep_size: int = 1) -> LayerShape:
    """The cost gate's shape of a layer (H and I unknown: the gate cannot measure and keeps the policy on); under
    expert parallelism over ``ep_size`` ranks the gate weighs the experts this rank saves (``LayerShape.ep_size``)."""
    return LayerShape(num_experts, top_k, hidden, intermediate, torch.float32, expert_dtype, ep_size=ep_size)


def plan_for(layer: Layer, device: torch.device, dtype: torch.dtype, cfg) -> RoutePlan:
    """The layer's plan on ``device`` (made before the first forward by :func:`before_forward`, else here on first
    use: the cost gate gets its decisions then, on the worker's threads), the router logits having ``dtype``;
    ``cfg``: a LynxConfig. Raises :class:`~lynx_hf.LynxConfigError` where a plan with a cost gate would have to be
    made here, inside a forward, on several tensor-parallel ranks (its decisions could not be agreed)."""
    plan = layer.plan
    if plan is None or plan.device != device:
        plan = make_layer_plan(layer, device, dtype, cfg)
        if gate_of(plan) is not None and STATE.tp_size > 1:
            raise ranks.refusal(f"MoE layer {layer.name}'s plan would be made inside a forward on {device} (the plans "
                                f"were made on {STATE.start.device}), where the ranks cannot agree", STATE.tp_size)
        install_plan(layer, plan, cfg)
        if not STATE.start.frozen:
            set_bypass(layer, gated_off_everywhere(plan))
    return plan


def step_key(layer: Layer) -> dict:
    """What a vLLM layer's step runs besides its plan and shape, for the cost gate's decision key
    (``lynx_hf.gate.key.make_key``, made plain by ``lynx_hf.gate.key.readable``): the router's rule (its class,
    selection and weight rule: :class:`lynx_hf.vllm.routers.RouterRule`), the selection-scores function, the weight
    rule, and the runner's experts class and quant method class (the experts kernel whose time the saving is)."""
    runner = layer.runner() if layer.runner is not None else None
    experts = getattr(runner, "routed_experts", None)
    method = getattr(experts, "quant_method", None)
    return {"router": layer.router_rule, "scores": layer.scores, "weight": layer.rule,
            "experts": None if experts is None else type(experts),
            "quant_method": None if method is None else type(method),
            "expert_map": getattr(experts, "expert_map", None) is not None}


def make_layer_plan(layer: Layer, device: torch.device, dtype: torch.dtype, cfg) -> RoutePlan:
    """A new plan of ``layer`` for ``cfg`` (a ``LynxConfig``) on ``device``, the router logits having ``dtype``: the
    cost gate (``gate="auto"``; it gets its decisions now) and :class:`~lynx_hf.vllm.rows.PaddingRows` composed around
    the decode-step
    function."""
    shape = layer.gate_shape or LayerShape(layer.num_experts, layer.top_k, None, None)
    shape = LayerShape(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, dtype, shape.expert_dtype,
                       # the op's steps carry masks, except on CPU (eager: the op body always is) where an all-decode
                       # step is a plain decode step (the fused one-call path); off CPU none is fused
                       mixed_steps=cfg.phase != "decode" and device.type != "cpu", ep_size=shape.ep_size)
    # a CUDA-graph engine replays its captured sizes' steps and steps eagerly at the others (a size above the largest
    # graph, a mixed step outside the graphs): the gate holds both prices (``PlanGate.replayed``: the routing timed as
    # a replay, no launches; its own: timed eagerly), and a call being captured takes the replay's (docs/cases.md C66)
    facts = lambda: LayerFacts(shape, step=step_key(layer), expert_fn=_experts_fn(layer, device),  # noqa: E731
                               replays=bool(STATE.start.captured), replay_now=capturing_on(device))
    stages = [stage for stage in (plan_stage(facts, cfg), PaddingRows()) if stage is not None]
    # the model's MoE layers in this process (a pipeline-parallel stage holds only its own: fewer)
    return make_plan(cfg, MoELayer(layer.num_experts, layer.top_k, device, moe_layers=max(1, len(target_layers()))),
                     stages=stages)


def install_plan(layer: Layer, plan: RoutePlan, cfg) -> RoutePlan:
    """``plan`` becomes the layer's (its telemetry in the mode ``cfg.telemetry`` asks for). The bypass is set
    apart (:func:`lynx_hf.vllm.bypass.settle_bypass`), once the decisions are agreed."""
    layer.plan = plan
    if cfg.telemetry:  # LynxConfig.telemetry: "counts" is the cheaper counting mode (lynx_hf.telemetry)
        layer.telemetry.mode = mode_of(cfg.telemetry)
    return plan


def agree(cfg, plans: dict | None = None) -> int:
    """Every layer's cost gate takes rank 0's decisions where this process has tensor-parallel peers
    (:func:`lynx_hf.vllm.ranks.agree`; a collective: called at the same point on every rank). ``cfg``: the
    :class:`~lynx_hf.vllm.config.PluginConfig` the plans were made for; ``plans``: layer index -> plan (``None``:
    each layer's own). Returns the layers adopted (0: nothing to agree). Raises :class:`~lynx_hf.LynxConfigError`
    where they cannot be agreed."""
    entries = [(layer.name, layer.plan if plans is None else plans[layer.index]) for layer in target_layers()]
    return ranks.agree(entries, cfg, STATE.tp_size)


def stage_summaries(layer: Layer) -> dict:
    """What each stage of the layer's plan that counts reports (``Stage.summary``), by stage name; the cost gate's
    entry is :func:`lynx_hf.vllm.bypass.gate_summary`'s (always present)."""
    out = {name: summary for name, summary in stage_report(layer.plan).items() if name != PlanGate.name}
    out[PlanGate.name] = gate_summary(layer)
    return out


def reset_layer(layer: Layer) -> None:
    """Zero the layer's telemetry (the loaded-experts slots included), skipped calls and its plan's stages' counters
    (``Stage.reset``; the gate's decisions stay). The device accumulators are zeroed in place, never reallocated
    (captured CUDA graphs keep adding into their addresses)."""
    STATE.pending_skips.clear()  # not counted yet: dropped with the counters
    layer.telemetry.reset()
    layer.skipped = 0
    reset_stages(layer.plan)


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


def torch_backend_layers() -> list[str]:
    """The target layers whose plan remaps with the torch routing ops (``RoutePlan.routing_backend == "torch"``), which
    no vLLM engine has been captured with yet (``lynx_hf.vllm.checks.check_captured``)."""
    return [layer.name for layer in target_layers() if layer.plan is not None and
            layer.plan.routing_backend == "torch" and layer.plan.kernel is not keep_routing]


def step_inputs(layer: Layer, step: Step, router_logits, topk_weights, topk_ids, host: bool) -> StepInputs:
    """The layer-step the plan runs (``lynx_hf.core.StepInputs``): ``router_logits [T, N]`` (the model dtype),
    ``topk_weights [T, k]`` fp32 / ``topk_ids [T, k]`` int32 (vLLM's routing, logical ids; -1 on padding rows), the
    layer's weight rule and selection scores (``None``: the fp32 logits), its telemetry (``None`` where
    ``LynxConfig.telemetry`` is off); ``host``: CPU tensors in eager mode."""
    telemetry = layer.telemetry if STATE.config.lynx.telemetry else None
    return StepInputs(step, router_logits, topk_weights, topk_ids, layer.rule, host, layer.scores, telemetry)


def route(layer: Layer, plan: RoutePlan, step: Step, router_logits, topk_weights, topk_ids, host: bool):
    """``(topk_weights, topk_ids)`` of one call of ``layer`` after ``plan`` on ``step`` (``plan.run``: the cost gate,
    the padding rows, then the decode-step function with the telemetry; :func:`step_inputs` describes the
    arguments). vLLM's own tensors where nothing was remapped (the gate off at this size, ``decode_rows`` 0)."""
    out = plan.run(step_inputs(layer, step, router_logits, topk_weights, topk_ids, host))
    return out.weights, out.idx


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
    """Whether ``model_runner``'s forward is captured in device graphs: on an accelerator (CUDA / ROCm, and XPU, whose
    ``XPUGraph`` capture vLLM drives with the same ``cudagraph_mode``; any device but CPU: assumed able to capture), not
    ``enforce_eager``, and ``compilation_config.cudagraph_mode`` not ``NONE`` (unknown: assumed captured, so
    ``configure`` is stricter, never wrong)."""
    if device.type in ("cpu", "meta") or getattr(getattr(model_runner, "model_config", None), "enforce_eager", False):
        return False
    cudagraphs = getattr(getattr(model_runner, "compilation_config", None), "cudagraph_mode", None)
    return cudagraphs is None or getattr(cudagraphs, "name", "NONE") != "NONE"


def before_forward(model_runner) -> None:
    """Before the first forward of this worker (hooked on the model runners' ``_dummy_run`` and ``execute_model``;
    once): every layer's plan is made on the runner's device (its cost gate gets its decisions), the decisions are
    agreed across the tensor-parallel ranks (:func:`agree`: rank 0's, on every rank), and a layer the gate keeps off
    at every step size this engine can run is bypassed (``Layer.bypass``, :func:`lynx_hf.vllm.bypass.settle_bypass`).
    Then the forward
    counts as frozen where it is compiled or captured (:func:`frozen`). Raises :class:`~lynx_hf.LynxConfigError`
    where the decisions of several ranks cannot be agreed (``gate="always"`` is the fix the message names)."""
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
    start.captured = captured(model_runner, device)  # before the plans: the cost gate times a captured step as such
    t0 = time.perf_counter()
    for layer in target_layers():  # the drafter's layers keep vLLM's routing: no plan (Layer.drafter)
        install_plan(layer, make_layer_plan(layer, start.device, start.dtype, cfg.lynx), cfg.lynx)
    agreed = agree(cfg)
    logger.debug("lynx_hf.vllm: %d plans made, cost gate decided in %.2f s (%d layers' decisions agreed with rank 0)",
                 len(target_layers()), time.perf_counter() - t0, agreed)
    settle_bypass()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the expert timing's scratch weights: not reserved when vLLM profiles memory
    start.frozen = frozen(model_runner)
    if STATE.bypassed:
        logger.warning("lynx_hf.vllm: the cost gate (gate='auto') keeps vLLM's routing on %d/%d MoE layers at every "
                       "step size up to %d tokens on this device (expected saving <= measured routing cost); those "
                       "layers run vLLM's own routing path without the plugin's op (stats: layers[i]['gate']). "
                       "gate='always' or LYNX_HF_GATE=always runs the policy on every decode step",
                       len(STATE.bypassed), len(target_layers()), step_buckets()[-1])


def capture_sizes(model_runner) -> tuple:
    """The step sizes ``model_runner``'s forward is captured at (``compilation_config.cudagraph_capture_sizes``, and
    vLLM 0.34's ``decoder_replay_cudagraph_capture_sizes`` where given: YOCO models' replay graphs; when left empty
    vLLM derives them from the sliding window, which this does not), up to the engine's tokens per step, largest first;
    the engine's tokens per step alone where the runner does not say."""
    compilation = getattr(model_runner, "compilation_config", None)
    sizes = [*(getattr(compilation, "cudagraph_capture_sizes", None) or ()),
             *(getattr(compilation, "decoder_replay_cudagraph_capture_sizes", None) or ())]
    cap = STATE.capacity if STATE.capacity > 0 else None
    out = sorted({int(t) for t in sizes if int(t) > 0 and (cap is None or int(t) <= cap)}, reverse=True)
    return tuple(out) if out else ((cap,) if cap else ())


def warm_up(sizes, seed: int = 0) -> int:
    """Before the first CUDA-graph capture (``lynx_hf.vllm.checks.start_forward`` after the plans are made and the
    captured forward's refusals passed, every rank; issue 54 N8, ``docs/cases.md`` C62):
    the step buffer made at the largest size, and each layer's step *below its cost gate* (the padding rows and the
    decode-step function: the fused device step's one launch and its buffers per size, or the routing kernels, and
    the telemetry accumulators; the fused step's launches kept for good, ``kernels.fused_step.pinning``) run once at
    each of ``sizes`` whose graph holds the step (the gate on there, or a lone token:
    :func:`lynx_hf.vllm.bypass.gated_off_call` keeps
    the others free of the op) on synthetic masked inputs, as a capture describes its rows (the step buffer's masks,
    no decode-row count). So no capture launches a
    kernel for the first time or creates a buffer it would zero on each replay. Bypassed layers (no op in any graph)
    and layers whose rows the mask does not describe are left out. The layers' telemetry and counters are zeroed
    afterwards (in place). Returns the layer-steps run."""
    cfg = STATE.config
    if cfg is None or not sizes:
        return 0
    device, dtype = STATE.start.device, STATE.start.dtype
    buffer(device, max(sizes))
    generator = torch.Generator().manual_seed(seed)
    ran = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        fused = [layer.plan for layer in target_layers() if layer.plan is not None and layer.plan.fused_device]
        if fused:  # every captured size's launch kept for good (more than MAX_SIZES): the Triton ops' pinning
            stack.enter_context(fused[0].ops.pinning())
        for layer in target_layers():
            plan = layer.plan
            if plan is None or layer.bypass or unmasked(layer):
                continue
            if cfg.lynx.telemetry:
                layer.telemetry.ensure(device)
            gate = gate_of(plan)
            for t in sizes:
                if gate is not None and not plan.keeps(t) and not gate.replay_decision(t).on:
                    continue  # no graph of this size holds the step (gated_off_call: vLLM's routing, no op)
                logits = torch.randn(t, layer.num_experts, generator=generator).to(device=device, dtype=dtype)
                values, ids = torch.topk(logits.float(), layer.top_k, dim=-1)
                weights = torch.softmax(values, dim=-1)
                kinds = torch.full((t,), DECODE, dtype=torch.int8, device=device)
                inputs = step_inputs(layer, masked_step(kinds), logits, weights, ids.to(torch.int32), False)
                if gate is not None and gate.inner is not None:
                    gate.inner(gate.plan, inputs)
                else:
                    plan.run(inputs)
                ran += 1
            reset_layer(layer)
    return ran
