"""The custom op ``torch.ops.lynx_vllm.remap_routing`` that every hooked MoE router calls (imports vLLM).

The remap runs inside a ``torch.library.Library`` op registered as vLLM registers its own
(``direct_register_custom_op``, with a fake implementation): under ``torch.compile`` (vLLM's compiled mode; on CPU
Dynamo traces straight through the MoE layer) the op is an opaque node, so its Python body (:func:`remap_layer`: the
step's rows, then the layer's plan) runs on every step instead of being traced once and frozen.

The body runs the layer's plan as the HF path does (``plan.run``: the cost gate, the padding rows, the decode-step
function and its telemetry; :func:`lynx_hf.vllm.plans.remap`, the op's one call into the plans per layer-step) on a
:class:`~lynx_hf.core.Step` describing the call's rows (:func:`lynx_hf.vllm.rows.step_for`). The host's counts of the
step (``STATE.step``: written by the input preparation) are used wherever the op body is not being captured into a CUDA
graph (:func:`lynx_hf.vllm.rows.host_counts`; eager calls on any device, the op body inside vLLM's compiled mode
included): a step without decode tokens returns vLLM's routing at once, and the
count of decode rows is passed on (``Step.decode_rows``), so the cost gate decides a mixed step on its decode rows.
Under capture the op always records the remap against the step buffer, whose address never changes (a replay
repeats it). On CPU tensors in eager mode (``host``), a step whose every row is a live decode token is a plain decode
step without masks (:data:`lynx_hf.vllm.rows.DECODE_STEP`), so the core's one-call CPU decode step
(``lynx_hf.core.fused_step``, the policy's ``fused_decode``) runs and records the telemetry in the same call, as in the
HF path. Mixed steps carry the masks (:func:`lynx_hf.vllm.rows.masked_step`).
"""

from __future__ import annotations

import torch

from . import plans, rows
from .state import STATE

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
    step (the op's body; it may return its inputs): its call counted (the liveness rule), then one call into the plans
    (:func:`lynx_hf.vllm.plans.remap`: the call's rows, the layer's plan). ``router_logits [T, N]`` (the model dtype),
    ``topk_weights [T, k]`` fp32 and ``topk_ids [T, k]`` int32 (vLLM's routing, logical expert ids; -1 on padding
    rows). Raises :class:`~lynx_hf.UnsupportedModelError` for logits of another width than the layer's logical
    experts."""
    layer = STATE.layers[index]
    layer.calls += 1  # the liveness rule per layer (lynx_hf.vllm.checks.after_worker_step)
    return plans.remap(layer, router_logits, topk_weights, topk_ids)


#: a layer's routing after its plan on a given :class:`~lynx_hf.core.Step` (:func:`lynx_hf.vllm.plans.remap_step`)
remap_step = plans.remap_step
#: the :class:`~lynx_hf.core.Step` of a call's rows (:func:`lynx_hf.vllm.rows.step_for`)
step_for = rows.step_for
#: whether the host's counts describe a call (:func:`lynx_hf.vllm.rows.host_counts`)
host_counts = rows.host_counts
#: whether a layer's router sees several ranks' all-gathered rows (:func:`lynx_hf.vllm.rows.is_gathered`)
is_gathered = rows.is_gathered
