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
from . import compat
from .runners import HOOKED_RUNNERS, UNHOOKED, hooked_names
from .state import STATE, resolve_config, warn_once

__all__ = ["LIVENESS_STEPS", "decode_scheduled", "after_worker_step", "check_start"]

#: consecutive steps with decode queries but no decode token from the hooked input preparation -> LynxHookError
LIVENESS_STEPS = 4


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
    :class:`~lynx_hf.LynxHookError` naming the worker's model runner and the hooked ones."""
    cfg = STATE.config
    if cfg is None or not STATE.layers or cfg.lynx.phase == "decode":
        return
    if STATE.counts.seen_decode != seen_before:
        STATE.strikes = 0
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
    if getattr(runner, "pcp_manager", None) is not None:
        raise UnsupportedModelError("lynx_hf.vllm: prefill context parallel on Model Runner V2 partitions each "
                                    "step's tokens across ranks; the plugin's step mask does not describe them")
