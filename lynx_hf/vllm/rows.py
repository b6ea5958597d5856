"""Which rows of a router call the step describes (imports no vLLM): the plugin's row concern, apart from the plans
(:mod:`lynx_hf.vllm.plans`) and the bypass (:mod:`lynx_hf.vllm.bypass`).

- :func:`step_for`: the :class:`~lynx_hf.core.Step` of one op call from the step mask and the host's counts
  (:func:`host_counts`: wherever the call is not being captured): the plain decode step
  (:data:`DECODE_STEP`) where every row is a live decode token on the host, else the mask's rows
  (:func:`masked_step`), or ``None`` where the call has no decode row or the mask does not describe its rows.
- :class:`PaddingRows`: the plan's stage that keeps rows vLLM's router marked as padding (expert id -1) out of the
  step (:func:`padding_rows`, :func:`without_padding`).
- :func:`inspect_rows` (once per layer, from its ``MoERunner``): whether the layer's router sees the step's rows from
  row 0 at all (:func:`unmasked`: all-gathered DP / context-parallel rows, a sequence-parallel layer's slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core import DECODE as _DECODE_KIND
from ..core import MIXED, Routed, RoutePlan, StageBase, Step, StepInputs
from ..errors import UnsupportedModelError
from .state import DECODE, PADDING, STATE, Layer, buffer, target_layers, warn_once

__all__ = ["DECODE_STEP", "masked_step", "step_for", "host_counts", "padding_rows", "without_padding", "PaddingRows",
           "inspect_rows", "ROW_ATTRIBUTES", "is_gathered", "gathered_layers", "sequence_parallel_layers", "unmasked"]

#: the plain decode step: every row of the call is a live decode token (no masks)
DECODE_STEP = Step(_DECODE_KIND)


def masked_step(kinds: torch.Tensor, decode_rows: int | None = None) -> Step:
    """The :class:`~lynx_hf.core.Step` of a call whose rows have these kinds (int8 ``[T]``, the step buffer's):
    decode rows ``kinds == DECODE``, live rows ``kinds != PADDING``; ``decode_rows``: how many rows decode where the
    host knows it (``STATE.step.num_decode``; ``None``: not known, e.g. while a CUDA graph is captured)."""
    return Step(MIXED, decode=kinds == DECODE, live=kinds != PADDING, decode_rows=decode_rows)


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
class PaddingRows(StageBase):
    """The stage of a vLLM layer's plan (``lynx_hf.core.Stage``) that keeps vLLM's padding rows out of the step: rows
    whose expert ids are -1 (:func:`padding_rows`) are neither decode nor live for the stages below it and the
    decode-step function (the remap, the critical set's votes, the union, the telemetry: :func:`without_padding`),
    and come back with vLLM's -1 ids and its weights. A call without padding rows passes through unchanged (on the
    host, one read of the ids says so). Composed into every plan, below the cost gate."""

    #: how ``RoutePlan.stage`` finds it
    name: ClassVar[str] = "padding"
    #: bound to a plan that keeps the routing too: policy ``none`` must not see vLLM's -1 ids either
    remaps_only: ClassVar[bool] = False

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


#: what :func:`inspect_rows` reads of a vLLM ``MoERunner`` (``vllm/model_executor/layers/fused_moe/runner/moe_runner.py``,
#: ``fused_moe/config.py``: ``FusedMoEConfig`` / ``FusedMoEParallelConfig``; vLLM 0.32 to 0.34)
ROW_ATTRIBUTES = ("do_naive_dispatch_combine", "moe_config.pcp_size", "moe_config.is_sequence_parallel",
                  "moe_config.moe_parallel_config.use_all2all_kernels (where pcp_size > 1)")


def is_gathered(layer: Layer) -> bool:
    """Whether this layer's router sees several data-parallel / context-parallel ranks' tokens (vLLM's naive
    dispatch all-gathers hidden states and router logits before routing): this rank's step mask does not describe
    those rows, so the layer is left untouched (:func:`inspect_rows`, once per layer)."""
    inspect_rows(layer)
    return bool(layer.gathered)


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


def unmasked(layer: Layer) -> bool:
    """Whether the rows of this layer's router calls are not the step's rows from row 0, so the step mask does not
    describe them and the layer keeps vLLM's routing: an all-gathered batch (:func:`is_gathered`) or this rank's slice
    of a sequence-parallel layer (``Layer.sequence_parallel``). A remapping policy refuses both at engine start
    (``lynx_hf.vllm.checks.check_layers``)."""
    inspect_rows(layer)
    return bool(layer.gathered) or layer.sequence_parallel


def host_counts(device: torch.device, host: bool) -> bool:
    """Whether the host's counts of the current step (``STATE.step``) describe this op call: always on CPU tensors in
    eager mode (``host``), and on a device whenever the op body is not being captured into a CUDA graph (an eager
    call: ``torch.cuda.is_current_stream_capturing()`` is False). A capture records what the body does for every
    later replay, whose steps the host counts at capture time do not describe; on a device type whose capture cannot
    be asked about, never (the body then always records the remap against the step buffer)."""
    if host or device.type == "cpu":
        return True
    if device.type == "cuda":
        return not torch.cuda.is_current_stream_capturing()
    return False


def step_for(layer: Layer, router_logits: torch.Tensor, host: bool):
    """The :class:`~lynx_hf.core.Step` of this call's rows, or ``None`` (leave the routing as it is): the plain
    decode step where every row decodes (``phase="decode"``, or on the host when the buffer says so), else the step
    buffer's masks with the host's count of decode rows (``Step.decode_rows``) where it describes the call
    (:func:`host_counts`). ``None`` where the host knows this call has no decode row (no step prepared, or none of its
    tokens decodes: returned at once on every device outside a capture) or where the call's rows are fewer than the
    step's tokens or more than the buffer holds (the mask does not describe them; counted in ``layer.skipped``).
    ``host``: CPU tensors in eager mode."""
    cfg = STATE.config
    if cfg is None or unmasked(layer):  # the rows are not this step's from row 0: gathered, sequence-parallel
        return None
    rows = router_logits.shape[0]
    if cfg.lynx.phase == "decode":  # forced: every row is a decode row (decode emulation)
        return DECODE_STEP
    step = STATE.step
    known = host_counts(router_logits.device, host)
    if known:
        if not step.active or step.num_decode == 0:  # a dummy / profiling run, or a step without decode tokens
            return None
        if rows < step.num_tokens:
            layer.skipped += 1
            return None
    kind = buffer(router_logits.device, rows)
    if rows > kind.shape[0]:
        layer.skipped += 1
        return None
    if host and rows == step.num_tokens == step.num_decode:
        # CPU eager, every row a live decode token (the buffer's kinds say so on the host): a plain decode step,
        # so the core's one-call CPU path (lynx_hf.core.fused_step) runs and records the telemetry in that call
        return DECODE_STEP
    return masked_step(kind[:rows], step.num_decode if known else None)
