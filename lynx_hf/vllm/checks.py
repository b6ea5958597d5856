"""Never silent: the checks every worker runs (``WorkerWrapperBase``, which every executor uses: in-process,
multiprocess, external launcher, the server's engine core). Imports no vLLM at import time.

- Before the first forward (:func:`start_forward`, the model runners' first ``_dummy_run`` / ``execute_model``: the
  profiling run precedes ``initialize_from_config``): the drafter's MoE layers are told apart (:func:`mark_drafters`),
  every layer whose rows the step mask does not describe (all-gathered, sequence-parallel by its own configuration) or
  whose vLLM attributes cannot say so is refused under a remapping policy (:func:`check_layers`), the plans are made
  (:func:`lynx_hf.vllm.plans.before_forward`), and a plan a captured forward cannot run is refused
  (:func:`check_captured`).
- At engine start (:func:`check_start`, before ``initialize_from_config``, after the model is loaded): a configured
  plugin whose worker runs a model runner it does not hook, or in which no MoE layer was hooked, stops the start; so
  does a configuration that routes decode outside the hooked routers (:func:`refused_decode_paths`, also checked in the
  driver).
- Liveness (:func:`after_worker_step`, after each ``execute_model``): the scheduler output alone (the same for every
  runner) says whether a step schedules a decode query (:func:`decode_scheduled`); when :data:`LIVENESS_STEPS`
  consecutive such steps bring no decode token from the hooked input preparation, the step raises
  :class:`~lynx_hf.LynxHookError`, which stops the engine. ``phase="decode"`` (every row decode, no mask) is exempt.
  Per layer (:func:`check_layer_calls`, and :func:`check_warmup` after each ``_dummy_run``: profiling, capture
  warm-ups and captures): in a forward where any layer's op ran, every layer that is not bypassed must have run.
"""

from __future__ import annotations

import logging

import torch

from ..errors import LynxConfigError, LynxHookError, UnsupportedModelError
from . import compat, plans, ranks, rows
from .runners import HOOKED_RUNNERS, UNHOOKED, hooked_names
from .state import STATE, resolve_config, target_layers, warn_once

logger = logging.getLogger("lynx_hf.vllm")

__all__ = ["LIVENESS_STEPS", "OUTSIDE_RUNNER", "DECODE_PATH_OPTIONS", "decode_scheduled", "after_worker_step",
           "check_start", "refused_parallelism", "refused_decode_paths", "check_parallelism", "unhooked_moe",
           "check_gathered", "check_sequence_parallel", "check_layers", "check_captured", "check_layer_calls",
           "check_warmup", "check_profile_run", "op_calls", "mark_drafters", "drafter_modules", "start_forward"]

#: consecutive steps with decode queries but no decode token from the hooked input preparation -> LynxHookError
LIVENESS_STEPS = 4


#: MoE modules that route and run their experts without a vLLM ``MoERunner`` (so without the router the plugin hooks):
#: class names, matched along the MRO (vLLM 0.34: DeepGEMM's MegaMoE, used directly by the NVIDIA DeepSeek-V4, Kimi-K3,
#: MiniMax-M3 and GLM-5-Next models, which compute their own top-k)
OUTSIDE_RUNNER = ("DeepGemmMegaMoEExperts",)


def refused_parallelism(vllm_config) -> list[str]:
    """The configurations of ``vllm_config`` (a ``VllmConfig``) the plugin refuses, each with its reason: where a MoE
    layer's router call holds rows the step mask cannot place (the op reads the mask from row 0)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return []
    out = []
    try:
        sequence_parallel = bool(parallel.use_sequence_parallel_moe)
    except AttributeError:
        sequence_parallel = False
    if sequence_parallel:
        out.append("sequence-parallel MoE (expert parallel with tensor parallel > 1, data parallel > 1 and the "
                   f"{parallel.all2all_backend!r} all2all backend): each rank's router sees a slice of the step's "
                   "rows that does not start at row 0")
    ubatching = bool(getattr(parallel, "enable_dbo", False)) or int(getattr(parallel, "ubatch_size", 0) or 0) > 1
    if ubatching:
        out.append("dual-batch overlap / micro-batching (enable_dbo, ubatch_size): a micro-batch's router call holds "
                   "rows that do not start at row 0 of the step")
    backend = getattr(parallel, "distributed_executor_backend", None)
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
    if name == "ray" or "Ray" in str(name):
        out.append("the Ray executor (distributed_executor_backend='ray'): its compiled DAG calls the model runner "
                   "directly, past the worker hook the liveness rule runs in")
    return out


#: engine options that run decode steps through a specialized executor computing its own top-k (never the router the
#: plugin hooks): ``additional_config["decode_backend"] = "latency_specialized"`` (vLLM 0.33 / 0.34: DeepSeek-V4.1,
#: Kimi-K3 (NVIDIA and AMD), Muse-Spark, Mistral-Large-4 on AMD: ``vllm/models/*/specialized_decode``) and
#: ``kernel_config.monokernel`` (Mistral-Large-4 on AMD, the same executor)
DECODE_PATH_OPTIONS = ('additional_config["decode_backend"]', "kernel_config.monokernel")


def refused_decode_paths(vllm_config) -> list[str]:
    """The options of ``vllm_config`` (a ``VllmConfig``) that route decode outside the hooked MoE routers
    (:data:`DECODE_PATH_OPTIONS`), each named with its value; ``decode_backend`` ``"auto"`` (vLLM's own decode) and an
    absent key pass. A model that does not read the option would ignore it; it is refused all the same: the plugin
    cannot tell which models read it, and a missed one would run without the policy, silently."""
    out = []
    extra = getattr(vllm_config, "additional_config", None)
    backend = extra.get("decode_backend", "auto") if isinstance(extra, dict) else "auto"
    if backend not in (None, "auto"):
        out.append(f'additional_config["decode_backend"] = {backend!r} (a specialized decode executor that computes '
                   "its own top-k outside vLLM's MoE router)")
    if getattr(getattr(vllm_config, "kernel_config", None), "monokernel", False):
        out.append("kernel_config.monokernel (--monokernel: the specialized decode executor, its own top-k)")
    return out


def check_parallelism(vllm_config, cfg) -> None:
    """Engine start (the driver's ``EngineArgs.create_engine_config``, before any engine process, and every worker's
    start): a configured plugin (``cfg`` not ``None``) refuses :func:`refused_parallelism`'s configurations with
    :class:`~lynx_hf.UnsupportedModelError` naming each and why, and the cost gate (``gate="auto"``) on several
    tensor-parallel ranks where this vLLM offers no way to agree their decisions with :class:`~lynx_hf.LynxConfigError`
    naming why and the fix, ``gate="always"`` (:func:`lynx_hf.vllm.ranks.check`)."""
    if cfg is None:
        return
    refused = refused_parallelism(vllm_config)
    if refused:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) on an engine the plugin cannot follow: "
            f"{'; '.join(refused)}. Start it without these, or without the plugin's configuration.")
    paths = refused_decode_paths(vllm_config)
    if paths:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) on an engine whose decode steps would not reach "
            f"the routers the plugin hooks: {'; '.join(paths)}. The policy would never act on decode. Start it with "
            "vLLM's own decode (decode_backend 'auto', no monokernel), or without the plugin's configuration.")
    ranks.check(vllm_config, cfg)


def unhooked_moe(model) -> list[str]:
    """The MoE modules of ``model`` (a ``torch.nn.Module``) the plugin does not route: vLLM ``MoERunner`` s whose router
    it did not hook (built before the hook, or a runner class that skips ``MoERunner.__init__``) and modules of
    :data:`OUTSIDE_RUNNER` (routing outside any ``MoERunner``), as ``"name (class)"``."""
    hooked = {id(layer.runner()) for layer in STATE.layers if layer.runner is not None and layer.runner() is not None}
    out = []
    for name, module in model.named_modules():
        mro = [cls.__name__ for cls in type(module).__mro__]
        outside = any(n in OUTSIDE_RUNNER for n in mro)
        if outside or ("MoERunnerInterface" in mro and id(module) not in hooked):
            out.append(f"{name or '<model>'} ({type(module).__name__})")
    return out


def check_gathered(remaps: bool, names: list[str]) -> None:
    """A policy that remaps (``remaps``) refuses MoE layers whose router sees an all-gathered batch of several
    data-/context-parallel ranks (``names``; :func:`lynx_hf.vllm.op.is_gathered`): this rank's step mask does not
    describe those rows. Raises :class:`~lynx_hf.UnsupportedModelError`."""
    if remaps and names:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layers {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} route an "
            "all-gathered batch of several data-/context-parallel ranks (naive dispatch: DP without EP, the "
            "all-gather dispatch, prefill context parallel without all2all); this rank's step mask does not describe "
            "those rows, so a remapping policy cannot act there. Use an all2all backend (routing before dispatch), "
            "or policy 'none'.")


def check_sequence_parallel(remaps: bool, names: list[str]) -> None:
    """A policy that remaps (``remaps``) refuses MoE layers that are sequence-parallel by their own configuration
    (``names``; ``moe_config.is_sequence_parallel``, :func:`lynx_hf.vllm.rows.inspect_rows`): each rank's router sees
    its own slice of the step's rows, while the op reads the step mask from row 0, so every rank after the first would
    remap with another rank's mask. Raises :class:`~lynx_hf.UnsupportedModelError`."""
    if remaps and names:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layers {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} are sequence-parallel "
            "by their model's own configuration (moe_config.is_sequence_parallel; e.g. Kimi-K3 under expert parallel "
            "with the moonep / pplx / flashinfer_nvlink_two_sided all2all backends): each rank's router sees a slice "
            "of the step's rows that does not start at row 0, which the plugin's step mask does not describe. Use "
            "another all2all backend (no sequence-parallel MoE), or policy 'none' (those layers keep vLLM's routing).")


def drafter_modules(model_runner) -> list:
    """The drafter models of ``model_runner`` (Model Runner V2: ``get_draft_model()``, its speculator's ``model``;
    V1: its ``drafter``'s ``model``), as ``torch.nn.Module`` s (none without speculative decoding)."""
    found = []
    getter = getattr(model_runner, "get_draft_model", None)
    candidates = []
    if callable(getter):
        try:
            candidates.append(getter())
        except Exception:  # noqa: BLE001 - a runner whose speculator is not built: the others are asked
            pass
    for owner in ("speculator", "drafter"):
        candidates.append(getattr(getattr(model_runner, owner, None), "model", None))
    for module in candidates:
        if isinstance(module, torch.nn.Module) and all(module is not seen for seen in found):
            found.append(module)
    return found


def mark_drafters(model_runner) -> list[str]:
    """Tell the drafter's MoE layers apart (``Layer.drafter``) before the first forward: a hooked layer whose
    ``MoERunner`` is a module of a drafter model (:func:`drafter_modules`), or, in an engine with speculative decoding
    (``speculative_config``), one that is not a module of the model the runner serves (``get_model()``). V2 runs the
    drafter in ``sample_tokens``, after ``execute_model`` returned and the step mask was cleared (MTP / EAGLE, vLLM 0.32
    to 0.34; V1 likewise after its forward): its layers see no step of their own, so they keep vLLM's routing (their
    router calls the op no more), count their own calls and are reported apart (a warning now, ``drafter_layers`` in
    the stats), never as the target's. Returns their names."""
    drafts = {id(m) for model in drafter_modules(model_runner) for m in model.modules()}
    target = _model_of(model_runner)
    served = None if target is None else {id(m) for m in target.modules()}
    speculative = STATE.spec_tokens > 0 or bool(drafts)
    names = []
    for layer in STATE.layers:
        runner = layer.runner() if layer.runner is not None else None
        if runner is None:
            continue
        inside = served is not None and id(runner) in served
        if (id(runner) in drafts and not inside) or (speculative and served is not None and not inside):
            layer.drafter = True
            names.append(layer.name)
    if names:
        logger.warning("lynx_hf.vllm: %d MoE layers belong to the drafter (%s%s); they run after the step with rows of "
                       "their own and keep vLLM's routing (stats: drafter_layers); the %d layers of the served model "
                       "are remapped", len(names), ", ".join(names[:3]), ", ..." if len(names) > 3 else "",
                       len(target_layers()))
    return names


def check_layers(cfg) -> None:
    """Before the first forward, every target layer's rows (:func:`lynx_hf.vllm.rows.inspect_rows`; a vLLM attribute
    it needs and the runner lacks raises :class:`~lynx_hf.UnsupportedModelError`): a remapping policy refuses layers
    that route an all-gathered batch (:func:`check_gathered`) or are sequence-parallel by their own configuration
    (:func:`check_sequence_parallel`). ``cfg``: the :class:`~lynx_hf.vllm.config.PluginConfig`."""
    remaps = plans.remaps(cfg)
    check_gathered(remaps, rows.gathered_layers())
    check_sequence_parallel(remaps, rows.sequence_parallel_layers())


def check_captured(cfg) -> None:
    """After the plans are made, before the first forward: in an engine whose forward is captured in device graphs
    (``STATE.start.captured``) a plan that remaps with the torch routing ops is refused
    (:class:`~lynx_hf.LynxConfigError`, naming ``routing_backend``): its decode step created tensors from Python
    scalars on the device, a host-to-device copy a CUDA-graph capture fails on. That copy is gone (lab.gpu_check's
    ``torch_capture`` section now captures the torch ops' step on an H200), but no vLLM engine has been captured with
    them yet, so the refusal stays until one is. (The Triton routing ops, ``routing_backend="auto"`` on CUDA, are the
    ones verified under capture.)"""
    if cfg is None or not STATE.start.captured:
        return
    names = plans.torch_backend_layers()
    if names:
        raise LynxConfigError(
            f"lynx_hf.vllm: routing_backend={cfg.lynx.routing_backend!r} runs the torch routing ops on MoE layers "
            f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}, and this engine captures its forward in "
            f"device graphs ({STATE.start.device}, cudagraph_mode not NONE): the torch ops have not been verified under "
            "a vLLM engine's graph capture. Use routing_backend='auto' (the Triton routing ops on CUDA, verified), or "
            "start the engine with enforce_eager=True.")


def start_forward(model_runner) -> None:
    """Before this worker's first forward (hooked on the model runners' ``_dummy_run`` and ``execute_model``; once):
    :func:`mark_drafters`, :func:`check_layers`, the plans (:func:`lynx_hf.vllm.plans.before_forward`), then
    :func:`check_captured`; on an engine captured in device graphs, then each layer's step run once at every captured
    size before any capture (:func:`lynx_hf.vllm.plans.warm_up`). Raises what those raise."""
    if STATE.start.started:
        return
    cfg = STATE.config
    if cfg is not None and STATE.layers:
        mark_drafters(model_runner)
        check_layers(cfg)
    plans.before_forward(model_runner)
    check_captured(cfg)
    if cfg is not None and STATE.start.captured:
        plans.warm_up(plans.capture_sizes(model_runner))  # kernels and buffers before the first capture


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


def after_worker_step(worker, scheduler_output, seen_before: int) -> None:
    """Liveness, after one worker step (``seen_before``: ``STATE.counts.seen_decode`` before it): requests decode but
    the hooked input preparation reported no decode token for :data:`LIVENESS_STEPS` consecutive such steps ->
    :class:`~lynx_hf.LynxHookError` naming the worker's model runner and the hooked ones. Per layer
    (:func:`check_layer_calls`): a hooked layer whose op was not called in :data:`LIVENESS_STEPS` consecutive steps
    with decode tokens -> :class:`~lynx_hf.LynxHookError` naming it."""
    cfg = STATE.config
    if cfg is None or not STATE.layers or cfg.lynx.phase == "decode":
        return
    if STATE.counts.seen_decode != seen_before:
        STATE.strikes = 0
        check_layer_calls()
        return
    if not decode_scheduled(scheduler_output, cfg.lynx.q_max, cfg.lynx.verify):
        return
    STATE.strikes += 1
    if STATE.strikes >= LIVENESS_STEPS:
        kind = type(getattr(worker, "model_runner", None))
        raise LynxHookError(
            f"lynx_hf.vllm: requests are decoding but the plugin classified no decode token in {STATE.strikes} "
            f"consecutive steps: the input preparation of model runner {kind.__module__}.{kind.__qualname__} "
            f"did not reach the plugin's hook (hooked: {hooked_names()}). Policy {cfg.lynx.policy!r} would "
            "run without acting; stopping (vLLM version / model runner not supported by lynx_hf.vllm).")


def op_calls() -> dict:
    """Each target layer's op call count and runner run count now (``Layer.calls``, ``Layer.runs``), by index:
    :func:`check_warmup` compares them."""
    return {layer.index: (layer.calls, layer.runs) for layer in target_layers()}


def _missing(layers: list, called, ran) -> list:
    """The layers of ``layers`` (target, not bypassed) whose op was not called (``called``: layer -> bool) where they
    should have been: a layer whose runner's runs are counted (``Layer.runs``) where its runner ran (``ran``) and its
    op did not (a layer whose MoE forward did not run this time, such as a VLM's vision experts in a text-only step,
    is not); a layer whose runs are not counted where any layer's op was called."""
    any_called = any(called(layer) for layer in layers)
    return [layer for layer in layers if not called(layer) and
            (ran(layer) if layer.runs is not None else any_called)]


def check_layer_calls() -> None:
    """After a worker step with decode tokens: every hooked layer that is not bypassed (the cost gate keeps vLLM's
    routing, no op) must have been called (its router reached the plugin) where its ``MoERunner`` ran
    (``Layer.runs``; a layer whose MoE forward did not run in the step, e.g. a VLM's vision experts on text-only steps,
    is not counted: ``docs/cases.md`` C63). A layer whose runner's runs are not counted (``Layer.runs`` ``None``) is
    judged by the others: on an engine whose forward is captured in device graphs (``STATE.start.captured``) a step in
    which no layer's op ran is a replay (no op body runs) and is not counted; a step in which some ran (an eager step:
    a size above the largest graph, a mixed step, a capture) is. The drafter's layers run in another forward
    (``Layer.drafter``) and are not counted. :data:`LIVENESS_STEPS` consecutive counted steps without a call of a
    layer -> :class:`~lynx_hf.LynxHookError` naming the layers (their MoE forward no longer goes through the hooked
    router)."""
    if STATE.all_bypassed:  # no layer calls the op: nothing to check, no loop over the layers (item 7)
        return
    layers = [layer for layer in target_layers() if not layer.bypass]
    any_called = any(layer.calls != layer.seen_calls for layer in layers)
    replay = STATE.start.captured and not any_called
    missed = []
    for layer in layers:
        if layer.calls != layer.seen_calls:
            layer.misses = 0
        elif (layer.runs != layer.seen_runs) if layer.runs is not None else not replay:
            layer.misses += 1
            if layer.misses >= LIVENESS_STEPS:
                missed.append(layer.name)
        layer.seen_calls = layer.calls
        layer.seen_runs = layer.runs or 0
    for layer in target_layers():
        if layer.bypass:
            layer.misses, layer.seen_calls, layer.seen_runs = 0, layer.calls, layer.runs or 0
    if missed:
        raise LynxHookError(
            f"lynx_hf.vllm: {len(missed)} of {len(target_layers())} hooked MoE layers were not routed through the "
            f"plugin in {LIVENESS_STEPS} consecutive decode steps ({', '.join(missed[:4])}"
            f"{', ...' if len(missed) > 4 else ''}): their forward no longer calls the router the plugin hooked; "
            "stopping rather than running those layers without the policy.")


def check_warmup(before: dict) -> None:
    """After one of the model runner's ``_dummy_run`` s (profiling, a capture warm-up, a capture; ``before``: the
    :func:`op_calls` before it): a target layer that is not bypassed whose runner ran in it while its op was not called
    (:func:`_missing`; a layer whose runner's runs are not counted: where any other layer's op ran) ->
    :class:`~lynx_hf.LynxHookError` at once, naming them (a layer routed outside the hooked router, found at engine
    start). A layer whose MoE forward did not run in the warm-up (a VLM's vision experts on a text-only dummy batch)
    is not flagged; a dummy run with no op call at all (a replay) says nothing of the uncounted ones."""
    if STATE.config is None or STATE.config.lynx.phase == "decode":
        return
    layers = [layer for layer in target_layers() if not layer.bypass and layer.index in before]
    missed = _missing(layers, lambda layer: layer.calls != before[layer.index][0],
                      lambda layer: layer.runs != before[layer.index][1])
    if missed:
        names = [layer.name for layer in missed]
        raise LynxHookError(
            f"lynx_hf.vllm: in a warm-up run of the model {len(names)} of {len(layers)} hooked MoE layers ran "
            "without being routed through the plugin "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): their forward does "
            "not call the router the plugin hooked, so they would run without the policy; stopping at engine start.")


def check_profile_run(before: dict) -> None:
    """After the model runner's first ``_dummy_run`` (the profiling run, which runs the whole model before any
    capture; ``before``: the :func:`op_calls` before it): where the plugin is configured and some target layer is not
    bypassed, at least one layer's op must have been called in it, else :class:`~lynx_hf.LynxHookError` at once (the
    model's MoE forward reaches none of the hooked routers, so the plugin would serve without acting; issue 54 N9).
    ``phase="decode"`` is exempt, as in :func:`check_warmup`."""
    if STATE.config is None or STATE.config.lynx.phase == "decode":
        return
    layers = [layer for layer in target_layers() if not layer.bypass and layer.index in before]
    if layers and all(layer.calls == before[layer.index][0] for layer in layers):
        raise LynxHookError(
            f"lynx_hf.vllm: the model's profiling run called the plugin's op in none of its {len(layers)} hooked MoE "
            f"layers ({', '.join(layer.name for layer in layers[:3])}{', ...' if len(layers) > 3 else ''}): its MoE "
            "forward does not reach the routers the plugin hooked, so the plugin would serve without acting; stopping "
            "at engine start.")


def check_start(worker) -> None:
    """Engine start (after the model is loaded, every worker, every way an engine starts): a configured plugin
    is active in this worker or the start fails. Raises :class:`~lynx_hf.LynxHookError` when the model runner
    is not one whose input preparation is hooked, :class:`~lynx_hf.UnsupportedModelError` when no MoE layer
    was hooked (single pipeline stage) or Model Runner V2 partitions prefill (prefill context parallel)."""
    cfg = resolve_config(getattr(worker, "vllm_config", None))
    if cfg is None:
        return
    runner = getattr(worker, "model_runner", None)
    kind = type(runner)
    if runner is None or not isinstance(runner, tuple(HOOKED_RUNNERS)):
        unhooked = "".join(f"; not hooked: {name} ({why})" for name, why in UNHOOKED.items())
        raise LynxHookError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) but this worker's model runner "
            f"{kind.__module__}.{kind.__qualname__} is not one whose input preparation the plugin hooks "
            f"({hooked_names()}{unhooked}), so it cannot tell which tokens decode "
            f"(vLLM {compat.installed_version()})")
    if not STATE.layers:
        parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
        if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
            warn_once("no_layers", "lynx_hf.vllm: this pipeline stage has no MoE layer; nothing to remap here")
            return
        raise UnsupportedModelError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) but no MoE layer of this model was hooked "
            "(no vLLM MoERunner was built: a dense model, or MoE layers outside vLLM's fused-MoE)")
    check_parallelism(getattr(worker, "vllm_config", None), cfg)
    if not STATE.start.started:
        mark_drafters(runner)  # (where no forward ran before the start check; else start_forward did)
    model = _model_of(runner)
    unhooked = [] if model is None else unhooked_moe(model)
    if unhooked:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) but MoE layers of this model route outside the "
            f"router the plugin hooks, so they would stay untouched: {', '.join(unhooked[:4])}"
            f"{', ...' if len(unhooked) > 4 else ''} ({len(unhooked)} of them)")
    check_layers(cfg)
    if getattr(runner, "pcp_manager", None) is not None:
        raise UnsupportedModelError("lynx_hf.vllm: prefill context parallel on Model Runner V2 partitions each "
                                    "step's tokens across ranks; the plugin's step mask does not describe them")


def _model_of(runner):
    """The model a model runner runs (``get_model()`` where it has one), or ``None``."""
    try:
        return runner.get_model()
    except Exception:  # noqa: BLE001 - runners without a model yet / another layout: the check is skipped
        model = getattr(runner, "model", None)
        return model if hasattr(model, "named_modules") else None
