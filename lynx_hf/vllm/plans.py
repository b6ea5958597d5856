"""Each MoE layer's plan, its stages and the bypass: the plugin's one door to the engine-independent core.

Every call the plugin makes into ``lynx_hf.core`` (``make_plan`` with a ``MoELayer`` and the plugin's stages,
``RoutePlan.run`` on a ``StepInputs``, ``host_reads_allowed``, the :class:`~lynx_hf.core.Step` values) and into the
cost gate (``lynx_hf.gate``: ``LayerShape``, the buckets, ``PlanGate`` decisions and counters, found with
``lynx_hf.gate.of(plan)``) is in this module, so a change of the core's plan API is a change here. A step runs as in
the HF path (``lynx_hf.block.BlockRouting.route``): :func:`route` calls ``plan.run``, and the plan's stages do the
rest, outermost first:

1. the cost gate (``gate="auto"``: :class:`lynx_hf.gate.PlanGate`): vLLM's routing where it is off at this call's
   step size (decided on the host from the static T and the host's count of decode rows, ``Step.decode_rows``);
   it counts its skips itself;
2. :class:`PaddingRows`: rows vLLM's router marked as padding (expert id -1) are neither decode nor live below it
   and come back with vLLM's -1 ids and weights;
3. the plan's decode-step function (``lynx_hf.core``: the policy's remap, or the one-call CPU path), which records
   the telemetry, the loaded-experts slots included (``BlockTelemetry.loaded``).

- :func:`plan_for` makes a layer's plan on first use, or :func:`before_forward` makes every layer's plan before the
  worker's first forward (a profiling / warm-up / capture run or a step): the gate gets its decisions then (a table,
  the per-user cache, or a measurement stored there: ``lynx_hf.gate.table``), and with several tensor-parallel ranks
  every rank adopts rank 0's (:func:`lynx_hf.vllm.ranks.agree`).
- A layer the gate keeps off at every step size this engine can run (:func:`gated_off_everywhere`) is *bypassed*:
  its router returns vLLM's routing without calling the op (:func:`lynx_hf.vllm.layers.attach`), so vLLM's compiled
  mode, which traces the forward once in its first profiling / warm-up run, compiles vLLM's own routing there. The
  bypass is decided once, from the agreed decisions; a compiled or captured forward (:func:`frozen`) keeps it.

Neither path reads a device value on the host nor makes a data-dependent shape, except the host shortcuts on CPU
tensors in eager mode (``host``: ``lynx_hf.core.host_reads_allowed``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core import DECODE as _DECODE_KIND
from ..core import MIXED, MoELayer, Routed, RoutePlan, Step, StepInputs, host_reads_allowed, keep_routing, make_plan
from ..errors import UnsupportedModelError
from ..gate import BUCKETS, LayerShape, PlanGate, bucket_of
from ..gate import of as gate_of
from ..policies import get as get_policy
from ..telemetry import mode_of
from . import ranks
from .state import DECODE, PADDING, STATE, Layer, buffer, target_layers, warn_once

logger = logging.getLogger("lynx_hf.vllm")

#: the plain decode step: every row of the call is a live decode token (no masks)
DECODE_STEP = Step(_DECODE_KIND)

__all__ = ["DECODE_STEP", "PaddingRows", "masked_step", "host_reads_allowed", "plan_for", "make_layer_plan",
           "install_plan", "step_key", "step_buckets", "gated_off_everywhere", "set_bypass", "settle_bypass",
           "route", "step_inputs", "skip_bypassed", "PENDING_MAX", "mark_calls", "count_replays", "gate_summary", "stage_summaries",
           "reset_layer", "remaps", "layer_shape", "before_forward", "agree", "frozen", "captured", "padding_rows",
           "without_padding", "is_gathered", "gathered_layers", "sequence_parallel_layers", "unmasked", "inspect_rows",
           "ROW_ATTRIBUTES", "torch_backend_layers", "capture_sizes", "warm_up", "capturing", "gated_off_call"]


def masked_step(kinds: torch.Tensor, decode_rows: int | None = None) -> Step:
    """The :class:`~lynx_hf.core.Step` of a call whose rows have these kinds (int8 ``[T]``, the step buffer's):
    decode rows ``kinds == DECODE``, live rows ``kinds != PADDING``; ``decode_rows``: how many rows decode where the
    host knows it (``STATE.step.num_decode``; ``None``: not known, e.g. while a CUDA graph is captured)."""
    return Step(MIXED, decode=kinds == DECODE, live=kinds != PADDING, decode_rows=decode_rows)


def remaps(cfg) -> bool:
    """Whether ``cfg``'s policy (a :class:`~lynx_hf.vllm.config.PluginConfig`) remaps routing."""
    return get_policy(cfg.lynx.policy).remaps


def layer_shape(num_experts: int, top_k: int, hidden=None, intermediate=None, expert_dtype=None,
                ep_size: int = 1) -> LayerShape:
    """The cost gate's shape of a layer (H and I unknown: the gate cannot measure and keeps the policy on); under
    expert parallelism over ``ep_size`` ranks the gate weighs the experts this rank saves (``LayerShape.ep_size``)."""
    return LayerShape(num_experts, top_k, hidden, intermediate, torch.float32, expert_dtype, ep_size=ep_size)


# --------------------------------------------------------------------------- padding rows: a stage of the plan


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
    ids = topk_ids.masked_fill(pad[:, None], 0)
    return Step(step.kind, decode=decode, live=live, decode_rows=step.decode_rows), ids


@dataclass(eq=False)
class PaddingRows:
    """The stage of a vLLM layer's plan (``lynx_hf.core.Stage``) that keeps vLLM's padding rows out of the step: rows
    whose expert ids are -1 (:func:`padding_rows`) are neither decode nor live for the stages below it and the
    decode-step function (the remap, the critical set's votes, the union, the telemetry: :func:`without_padding`),
    and come back with vLLM's -1 ids and its weights. A call without padding rows passes through unchanged (on the
    host, one read of the ids says so). Composed into every plan, below the cost gate."""

    #: how ``RoutePlan.stage`` finds it
    name: ClassVar[str] = "padding"

    def bind(self, plan: RoutePlan, inner):
        """The runner that wraps ``inner`` (``lynx_hf.core.make_plan``); ``None`` (left out) for a plan whose decode step
        is the fused device step (``RoutePlan.fused_device``): its kernel treats an id < 0 as a padding row itself."""
        if plan.fused_device is not None:
            return None

        def run(plan: RoutePlan, inputs: StepInputs) -> Routed:
            pad = padding_rows(inputs.idx, inputs.host)
            if pad is None:
                return inner(plan, inputs)
            step, ids = without_padding(inputs.step, inputs.idx, pad)
            out = inner(plan, inputs._replace(step=step, idx=ids))
            rows = pad[:, None]
            return Routed(torch.where(rows, inputs.weights, out.weights.to(inputs.weights.dtype)),
                          torch.where(rows, inputs.idx, out.idx.to(inputs.idx.dtype)), out.finite, out.gated_off)

        return run


# --------------------------------------------------------------------------- plans and the bypass


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
    (``lynx_hf.gate.key.make_key``, described by ``lynx_hf.gate.key.describe``): the router's rule (its class,
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
    cost gate (``gate="auto"``; it gets its decisions now) and :class:`PaddingRows` composed around the decode-step
    function."""
    shape = layer.gate_shape or LayerShape(layer.num_experts, layer.top_k, None, None)
    shape = LayerShape(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, dtype, shape.expert_dtype,
                       # the op's steps carry masks, except on CPU (eager: the op body always is) where an all-decode
                       # step is a plain decode step (the fused one-call path); off CPU none is fused
                       mixed_steps=cfg.phase != "decode" and device.type != "cpu", ep_size=shape.ep_size)
    stages = [PaddingRows()]
    if cfg.gate == "auto":
        # a CUDA-graph engine replays its captured sizes' steps and steps eagerly at the others (a size above the
        # largest graph, a mixed step outside the graphs): the gate holds both prices (``PlanGate.replayed``: the
        # routing timed as a replay, no launches; its own: timed eagerly), and a call being captured takes the
        # replay's (issue 54 N10, docs/cases.md C66)
        stages.insert(0, PlanGate(shape, telemetry=cfg.telemetry, expert_fn=_experts_fn(layer, device),
                                  step_key=step_key(layer), table=cfg.gate_table,
                                  replays=bool(STATE.start.captured), replay_now=_capturing_on(device)))
    # the model's MoE layers in this process (a pipeline-parallel stage holds only its own: fewer)
    return make_plan(cfg, MoELayer(layer.num_experts, layer.top_k, device, moe_layers=max(1, len(target_layers()))),
                     stages=stages)


def install_plan(layer: Layer, plan: RoutePlan, cfg) -> RoutePlan:
    """``plan`` becomes the layer's (its telemetry in the mode ``cfg.telemetry`` asks for). The bypass is set
    apart (:func:`settle_bypass`, :func:`set_bypass`), once the decisions are agreed."""
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


def settle_bypass() -> None:
    """Each layer's ``bypass`` from its plan (:func:`gated_off_everywhere`), unless the forward is frozen
    (``STATE.start.frozen``: the bypass a compiled / captured forward was traced with stays)."""
    if STATE.start.frozen:
        return
    for layer in target_layers():
        if layer.plan is not None:
            set_bypass(layer, gated_off_everywhere(layer.plan))


def step_buckets() -> tuple:
    """The gate's buckets (``lynx_hf.gate.BUCKETS``) a step of this engine can fall in: up to the bucket of
    ``max_num_batched_tokens`` (every bucket when it is not known)."""
    top = bucket_of(STATE.capacity) if STATE.capacity > 0 else BUCKETS[-1]
    return tuple(b for b in BUCKETS if b <= top)


def gated_off_everywhere(plan: RoutePlan) -> bool:
    """Whether ``plan``'s cost gate (``LynxConfig.gate="auto"``) keeps vLLM's routing at every step size this engine
    can run (:func:`step_buckets`), from its decisions. False without a gate (``gate="always"``, a policy that never
    remaps), or where a bucket was not decided from the layer's sizes (the gate keeps the policy on there)."""
    gate = gate_of(plan)
    if gate is None:
        return False
    for one in (gate, gate.replayed):  # eager and, on a captured engine, replayed steps
        for b in () if one is None else step_buckets():
            decision = one.decision(b)
            if decision.on or not decision.measured:
                return False
    return True


def set_bypass(layer: Layer, bypass: bool) -> None:
    flush_skips()  # the steps skipped so far belong to the layers bypassed so far
    layer.bypass = bool(bypass)
    targets = target_layers()
    STATE.bypassed = tuple(one for one in targets if one.bypass)
    # no op reads the step buffer (the drafter's layers never call the op)
    STATE.all_bypassed = bool(targets) and len(STATE.bypassed) == len(targets)


def skip_bypassed(num_tokens: int, decode_rows: int | None = None) -> None:
    """A step of ``num_tokens`` tokens of which ``decode_rows`` decode (> 0): each bypassed layer's gate counts it
    as a step it kept vLLM's routing on (the step size seen, one step skipped), as the op body does for a step the
    gate skips. Counted once per step here (``STATE.pending_skips``) and into each bypassed layer's gate when read
    (:func:`flush_skips`): a per-layer gate call per step cost ~8 us per layer. Bounded: past
    :data:`PENDING_MAX` distinct (tokens, decode rows) the pending steps are counted into the gates at once (a
    long-running server's steps take many distinct shapes: ``docs/cases.md`` C64)."""
    if STATE.bypassed:
        pending = STATE.pending_skips
        pending[(num_tokens, decode_rows)] += 1
        if len(pending) > PENDING_MAX:
            flush_skips()


#: most distinct (tokens, decode rows) :func:`skip_bypassed` keeps pending before counting them into the gates
PENDING_MAX = 64


def flush_skips() -> None:
    """Count the pending skipped steps (:func:`skip_bypassed`) into each bypassed layer's gate (``PlanGate.count``)."""
    pending = STATE.pending_skips
    if not pending:
        return
    for layer in STATE.bypassed:
        gate = gate_of(layer.plan)
        if gate is not None:
            for (num_tokens, decode_rows), steps in pending.items():
                gate.count(num_tokens, decode_rows, steps)
    pending.clear()


def mark_calls() -> None:
    """At a step's input preparation, in an engine whose forward is captured in CUDA graphs: each layer's op call
    count now, for :func:`count_replays` after the forward."""
    for layer in target_layers():
        layer.step_calls = layer.calls


def count_replays(num_tokens: int) -> None:
    """After a forward of ``num_tokens`` tokens with decode tokens, in an engine whose forward is captured in CUDA
    graphs (``STATE.start.captured``): a layer whose op body did not run in it (:func:`mark_calls`; bypassed layers
    aside, :func:`skip_bypassed` counts those) was replayed, and a replay repeats what the body did at capture, the
    gate's decision included (a host-side branch on the static T, the replay's price: ``PlanGate.replay_decision``;
    the decode rows are not known at capture); its gate counts the step as the body would have (``PlanGate.count``
    with ``replay``: the gate's one accounting path): the step size seen and, where the gate is off there, one step
    skipped. The telemetry needs nothing here: its device accumulators are added into by the replay
    itself."""
    for layer in target_layers():  # the drafter's layers run after the step, with no plan (no gate to count)
        if not layer.bypass and layer.plan is not None and layer.calls == layer.step_calls:
            gate = gate_of(layer.plan)
            if gate is not None:
                gate.count(num_tokens, replay=True)


def stage_summaries(layer: Layer) -> dict:
    """What each stage of the layer's plan that counts reports (``Stage.summary``), by stage name; the cost gate's
    entry is :func:`gate_summary`'s (always present)."""
    out = {}
    for stage in () if layer.plan is None else layer.plan.stages:
        summary = getattr(stage, "summary", None)
        if summary is not None and stage.name != PlanGate.name:
            out[stage.name] = summary()
    out[PlanGate.name] = gate_summary(layer)
    return out


def gate_summary(layer: Layer) -> dict:
    """The layer's gate for the telemetry: ``PlanGate.summary()`` (or the configured gate with no decision yet),
    plus ``bypassed``."""
    flush_skips()
    gate = gate_of(layer.plan)
    if gate is not None:
        entry = gate.summary()
    else:
        entry = {"gate": STATE.config.lynx.gate if STATE.config else "always", "by_tokens": {}, "steps_skipped": 0}
    entry["bypassed"] = layer.bypass
    return entry


def reset_layer(layer: Layer) -> None:
    """Zero the layer's telemetry (the loaded-experts slots included), skipped calls and its plan's stages' counters
    (``Stage.reset``; the gate's decisions stay). The device accumulators are zeroed in place, never reallocated
    (captured CUDA graphs keep adding into their addresses)."""
    STATE.pending_skips.clear()  # not counted yet: dropped with the counters
    layer.telemetry.reset()
    layer.skipped = 0
    for stage in () if layer.plan is None else layer.plan.stages:
        reset = getattr(stage, "reset", None)
        if reset is not None:
            reset()


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
    """The names of this process's MoE layers (the target's) whose router sees an all-gathered batch
    (:func:`is_gathered`)."""
    return [layer.name for layer in target_layers() if is_gathered(layer)]


def sequence_parallel_layers() -> list[str]:
    """The names of this process's MoE layers (the target's) that are sequence-parallel by their own configuration
    and not gathered (:func:`inspect_rows`): each rank's router sees its own slice of the step's rows."""
    out = []
    for layer in target_layers():
        inspect_rows(layer)
        if layer.sequence_parallel and not layer.gathered:
            out.append(layer.name)
    return out


def is_gathered(layer: Layer) -> bool:
    """Whether this layer's router sees several data-parallel / context-parallel ranks' tokens (vLLM's naive
    dispatch all-gathers hidden states and router logits before routing): this rank's step mask does not describe
    those rows, so the layer is left untouched (:func:`inspect_rows`, once per layer)."""
    inspect_rows(layer)
    return bool(layer.gathered)


def unmasked(layer: Layer) -> bool:
    """Whether the rows of this layer's router calls are not the step's rows from row 0, so the step mask does not
    describe them and the layer keeps vLLM's routing: an all-gathered batch (:func:`is_gathered`) or this rank's slice
    of a sequence-parallel layer (``Layer.sequence_parallel``). A remapping policy refuses both at engine start
    (``lynx_hf.vllm.checks.check_layers``)."""
    inspect_rows(layer)
    return bool(layer.gathered) or layer.sequence_parallel


#: what :func:`inspect_rows` reads of a vLLM ``MoERunner`` (``vllm/model_executor/layers/fused_moe/runner/moe_runner.py``,
#: ``fused_moe/config.py``: ``FusedMoEConfig`` / ``FusedMoEParallelConfig``; vLLM 0.32 to 0.34)
ROW_ATTRIBUTES = ("do_naive_dispatch_combine", "moe_config.pcp_size", "moe_config.is_sequence_parallel",
                  "moe_config.moe_parallel_config.use_all2all_kernels (where pcp_size > 1)")


def inspect_rows(layer: Layer) -> None:
    """Read once, from the layer's vLLM ``MoERunner``, whether its router's rows are the step's rows from row 0:
    ``Layer.gathered`` (``runner.do_naive_dispatch_combine``: DP / sequence-parallel rows all-gathered before routing;
    or ``moe_config.pcp_size > 1`` without all2all kernels: prefill context parallel all-gathers them) and
    ``Layer.sequence_parallel`` (the layer's own ``moe_config.is_sequence_parallel``, which a model sets per layer,
    e.g. Kimi-K3 under EP with the ``moonep`` / ``pplx`` / ``flashinfer_nvlink_two_sided`` all2all backends, whatever
    ``ParallelConfig.use_sequence_parallel_moe`` says). Raises :class:`~lynx_hf.UnsupportedModelError` naming the
    attribute when the runner lacks one it needs to answer (a vLLM whose runner differs: refused, never assumed);
    a layer whose runner is gone is neither."""
    if layer.gathered is not None:
        return
    runner = layer.runner() if layer.runner is not None else None
    if runner is None:
        layer.gathered, layer.sequence_parallel = False, False
        return
    try:
        cfg = runner.moe_config
        naive = bool(runner.do_naive_dispatch_combine)
        pcp = int(cfg.pcp_size)
        sequence_parallel = bool(cfg.is_sequence_parallel)
        gathered = naive or (pcp > 1 and not cfg.moe_parallel_config.use_all2all_kernels)
    except AttributeError as exc:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layer {layer.name}: cannot tell whether its router sees this rank's step from row 0 "
            f"({type(runner).__name__} has no {getattr(exc, 'name', None) or exc}; read: {', '.join(ROW_ATTRIBUTES)}): "
            "refused rather than assumed (a vLLM release whose MoERunner differs)") from exc
    if gathered:
        warn_once("gathered", "lynx_hf.vllm: MoE layers route an all-gathered batch of several data-/context-"
                  "parallel ranks (naive dispatch); they keep vLLM's routing (a remapping policy is refused at "
                  "engine start and in configure: lynx_hf.vllm.checks.check_gathered). Use an all2all backend "
                  "(routing before dispatch) for LYNX under DP+EP.")
    layer.gathered, layer.sequence_parallel = gathered, sequence_parallel


def torch_backend_layers() -> list[str]:
    """The target layers whose plan remaps with the torch routing ops (``RoutePlan.routing_backend == "torch"``), which
    no vLLM engine has been captured with yet (``lynx_hf.vllm.checks.check_captured``)."""
    return [layer.name for layer in target_layers() if layer.plan is not None and
            layer.plan.routing_backend == "torch" and layer.plan.kernel is not keep_routing]


# --------------------------------------------------------------------------- one step


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
    at every step size this engine can run is bypassed (``Layer.bypass``, :func:`settle_bypass`). Then the forward
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


# --------------------------------------------------------------------------- before the first capture


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
    each of ``sizes`` whose graph holds the step (the gate on there, or a lone token: :func:`gated_off_call` keeps
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


# --------------------------------------------------------------------------- gated off before the op


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _capturing_on(device: torch.device):
    """``fn() -> bool``: :func:`capturing` on ``device`` (looked up at each call), the gate's ``replay_now``."""
    return lambda: capturing(device)


def gated_off_call(layer: Layer, router_logits) -> bool:
    """Whether this router call of ``layer`` keeps vLLM's routing by its cost gate, known on the host before the op
    (issue 54 N10): the router wrapper then returns vLLM's routing without calling the op, so a step the gate keeps
    off runs no kernel of the plugin (no masks, no copies of vLLM's tensors). Asked outside ``torch.compile`` tracing
    only (a traced branch on T would be frozen for every size; on CPU vLLM traces the MoE layer, on a GPU its
    ``moe_forward`` op is opaque and runs the router in Python). Under a CUDA-graph capture: the gate's decision at the
    static T at a replay's price (``PlanGate.replay_decision``; no decode-row count), frozen into that graph as the
    op's own branch would be (a size it keeps off adds no op to that graph), and counted per replay by
    :func:`count_replays`; in an eager step the host describes (every row the step's, >= 1 decode row): the decision
    on its decode rows, counted as the op's gate counts it. Else (no plan yet, no gate, a step the host does not
    describe) the op decides. The layer's op call is counted all the same (``Layer.calls``: it was routed through the
    plugin)."""
    plan = layer.plan
    gate = gate_of(plan)
    if gate is None or STATE.config is None or STATE.config.lynx.phase == "decode" or unmasked(layer):
        return False
    num_tokens = int(router_logits.shape[0])
    if plan.keeps(num_tokens):  # a lone token: the step below the gate runs (its telemetry) whatever it decides
        return False
    if capturing(router_logits.device):
        if gate.replay_decision(num_tokens).on:  # the price of a replay (the capture's graph is replayed)
            return False
    else:
        step = STATE.step
        if not step.active or step.num_decode == 0 or num_tokens != step.num_tokens:
            return False
        if gate.decision(num_tokens, step.num_decode).on:
            return False  # the op's gate decides and counts the step
        gate.count(num_tokens, step.num_decode)  # seen, and skipped: as the op's gate counts a step it keeps off
    layer.calls += 1
    return True
