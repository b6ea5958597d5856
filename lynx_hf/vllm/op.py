"""The custom op ``torch.ops.lynx_vllm.remap_routing`` that every hooked MoE router calls (imports vLLM).

The remap runs inside a ``torch.library.Library`` op registered as vLLM registers its own
(``direct_register_custom_op``, with a fake implementation): under ``torch.compile`` (vLLM's compiled mode; on CPU
Dynamo traces straight through the MoE layer) the op is an opaque node, so its Python body (:func:`remap_layer`: the
step's rows, then the layer's plan) runs on every step instead of being traced once and frozen.

The body runs the layer's plan as the HF path does (``plan.run``: the cost gate, the padding rows, the decode-step
function and its telemetry; :func:`lynx_hf.vllm.plans.route`) on a :class:`~lynx_hf.core.Step` describing the call's
rows (:func:`step_for`). The host's counts of the step (``STATE.step``: written by the input preparation) are used
wherever the op body is not being captured into a CUDA graph (:func:`host_counts`; eager calls on any device, the op
body inside vLLM's compiled mode included): a step without decode tokens returns vLLM's routing at once, and the
count of decode rows is passed on (``Step.decode_rows``), so the cost gate decides a mixed step on its decode rows.
Under capture the op always records the remap against the step buffer, whose address never changes (a replay
repeats it). On CPU tensors in eager mode (``host``), a step whose every row is a live decode token is a plain decode
step without masks (:data:`lynx_hf.vllm.plans.DECODE_STEP`), so the core's one-call CPU decode step
(``lynx_hf.core.fused_step``, the policy's ``fused_decode``) runs and records the telemetry in the same call, as in the
HF path. Mixed steps carry the masks (:func:`lynx_hf.vllm.plans.masked_step`).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from . import plans
from .state import STATE, Layer
from .steps import buffer

__all__ = ["remap_routing", "remap_layer", "remap_step", "step_for", "host_counts", "is_gathered"]


def _remap_routing(router_logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: :func:`remap_layer`, returning new tensors (a custom op may not return its inputs)."""
    weights, ids = remap_layer(router_logits, topk_weights, topk_ids, layer)
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
#: ``remap_routing(router_logits [T, N], topk_weights [T, k] fp32, topk_ids [T, k] int32, layer: int)`` ->
#: ``(topk_weights, topk_ids)`` of MoE layer ``layer`` after the plugin's policy (logical expert ids)
remap_routing = torch.ops.lynx_vllm.remap_routing


def remap_layer(router_logits, topk_weights, topk_ids, index: int):
    """``(topk_weights, topk_ids)`` of MoE layer ``index`` of this process after the plugin's policy on the current
    step (the op's body; it may return its inputs). ``router_logits [T, N]`` (the model dtype),
    ``topk_weights [T, k]`` fp32 and ``topk_ids [T, k]`` int32 (vLLM's routing, logical expert ids; -1 on padding
    rows). Raises :class:`~lynx_hf.UnsupportedModelError` for logits of another width than the layer's logical
    experts."""
    layer = STATE.layers[index]
    layer.calls += 1  # the liveness rule per layer (lynx_hf.vllm.checks.after_worker_step)
    host = plans.host_reads_allowed(router_logits)
    step = step_for(layer, router_logits, host)
    if step is None:
        return topk_weights, topk_ids
    return remap_step(layer, step, router_logits, topk_weights, topk_ids, host)


def remap_step(layer: Layer, step, router_logits, topk_weights, topk_ids, host: bool):
    """``layer``'s routing after its plan (made on first use) on ``step``, a :class:`lynx_hf.core.Step` describing
    this call's rows: ``plan.run`` (:func:`lynx_hf.vllm.plans.route`). :func:`remap_layer` passes the step
    :func:`step_for` chose; a caller may pass another description of the same rows (e.g.
    ``plans.masked_step(kinds)`` for an all-decode step: the masked path, the fused path's reference). Raises
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
    plan = plans.plan_for(layer, router_logits.device, router_logits.dtype, STATE.config.lynx)
    return plans.route(layer, plan, step, router_logits, topk_weights, topk_ids, host)


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
    if cfg is None or plans.unmasked(layer):  # the rows are not this step's from row 0: gathered, sequence-parallel
        return None
    rows = router_logits.shape[0]
    if cfg.lynx.phase == "decode":  # forced: every row is a decode row (decode emulation)
        return plans.DECODE_STEP
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
        return plans.DECODE_STEP
    return plans.masked_step(kind[:rows], step.num_decode if known else None)


#: whether a layer's router sees several ranks' all-gathered rows (:func:`lynx_hf.vllm.plans.is_gathered`)
is_gathered = plans.is_gathered
