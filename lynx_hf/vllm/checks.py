"""Never silent: the two checks every worker runs (``WorkerWrapperBase``, which every executor uses: in-process,
multiprocess, external launcher, the server's engine core). Imports no vLLM at import time.

- At engine start (:func:`check_start`, before ``initialize_from_config``, after the model is loaded): a configured
  plugin whose worker runs a model runner it does not hook, or in which no MoE layer was hooked, stops the start.
- Liveness (:func:`after_worker_step`, after each ``execute_model``): the scheduler output alone (the same for every
  runner) says whether a step schedules a decode query (:func:`decode_scheduled`); when :data:`LIVENESS_STEPS`
  consecutive such steps bring no decode token from the hooked input preparation, the step raises
  :class:`~lynx_hf.LynxHookError`, which stops the engine. ``phase="decode"`` (every row decode, no mask) is exempt.
"""

from __future__ import annotations

from ..errors import LynxHookError, UnsupportedModelError
from . import compat, plans, ranks
from .runners import HOOKED_RUNNERS, UNHOOKED, hooked_names
from .state import STATE, resolve_config, warn_once

__all__ = ["LIVENESS_STEPS", "OUTSIDE_RUNNER", "decode_scheduled", "after_worker_step", "check_start",
           "refused_parallelism", "check_parallelism", "unhooked_moe", "check_gathered", "check_layer_calls"]

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


def check_layer_calls() -> None:
    """After a worker step with decode tokens: every hooked layer's op must have been called (its router reached the
    plugin), except bypassed layers (the cost gate keeps vLLM's routing, no op) and under CUDA-graph replays (no op
    body runs; ``STATE.start.captured``). :data:`LIVENESS_STEPS` consecutive such steps without a call of a layer ->
    :class:`~lynx_hf.LynxHookError` naming the layers (their MoE forward no longer goes through the hooked router)."""
    if STATE.start.captured:
        return
    missed = []
    for layer in STATE.layers:
        if layer.bypass or layer.calls != layer.seen_calls:
            layer.misses = 0
        else:
            layer.misses += 1
            if layer.misses >= LIVENESS_STEPS:
                missed.append(layer.name)
        layer.seen_calls = layer.calls
    if missed:
        raise LynxHookError(
            f"lynx_hf.vllm: {len(missed)} of {len(STATE.layers)} hooked MoE layers were not routed through the "
            f"plugin in {LIVENESS_STEPS} consecutive decode steps ({', '.join(missed[:4])}"
            f"{', ...' if len(missed) > 4 else ''}): their forward no longer calls the router the plugin hooked; "
            "stopping rather than running those layers without the policy.")


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
    model = _model_of(runner)
    unhooked = [] if model is None else unhooked_moe(model)
    if unhooked:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: configured (policy {cfg.lynx.policy!r}) but MoE layers of this model route outside the "
            f"router the plugin hooks, so they would stay untouched: {', '.join(unhooked[:4])}"
            f"{', ...' if len(unhooked) > 4 else ''} ({len(unhooked)} of them)")
    check_gathered(plans.remaps(cfg), plans.gathered_layers())
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
