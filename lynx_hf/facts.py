"""The HF adapter of the cost gate: what a patched block's layer is, as the gate weighs it (``lynx_hf.gate.LayerFacts``).

The block (``lynx_hf.block.BlockRouting``) routes; this module reads it once per plan for the gate: the layer's shape
(:func:`layer_shape`), the step description of its key (:func:`step_description`), the experts paths it times for the
saving per avoided expert (:func:`expert_fn`, :func:`kernel_fn`), the router hook's work it times for the cost
(:func:`gate_probe`), and an offloaded expert's transfer (``lynx_hf.offload``). :func:`plan_stage` is the block's entry
in ``lynx_hf.patcher.PLAN_STAGES``: ``lynx_hf.gate.plan_stage`` decides whether there is a gate (``LynxConfig.gate``).
"""

from __future__ import annotations

import functools

import torch

from . import gate
from .core import StepInputs, WeightRule, host_reads_allowed
from .experts import implementations, original_implementation, uses_interface
from .kernels.backend import routing_ops


def gate_probe(block, run, inputs: StepInputs):
    """What ``block``'s router hook adds to a decode step the policy runs on, for the cost gate to time: unpack the
    router's output, the block's own selection scores, ``run(inputs)`` (the plan's step below the gate; telemetry into
    ``inputs.telemetry``), repack. ``inputs``: a step on synthetic router output (``logits [T, N]``, ``weights`` /
    ``idx [T, k]``). Returns the repacked output."""
    output = (inputs.logits, inputs.weights, inputs.idx)
    logits, weights, idx = block.spec.unpack(output)
    rule = block.rule if block.rule is not None else WeightRule("softmax_all")
    out = run(StepInputs(inputs.step, logits, weights, idx, rule, host_reads_allowed(logits), block._scores_fn(),
                         inputs.telemetry))
    return block.spec.repack(output, logits, out.weights, out.idx)


def expert_fn(block):
    """``block``'s own experts implementation as ``fn(hidden [T, H], idx [T, k], weights [T, k])``, which the cost gate
    times for the saving per avoided expert (``lynx_hf.gate.measure_module_expert_ms``); ``None`` when the experts
    module does not use transformers' experts interface or its weights are not materialized (offload)."""
    experts = block.experts
    if not isinstance(experts, torch.nn.Module) or not uses_interface(experts) or \
            any(p.device.type == "meta" for p in experts.parameters()):
        return None
    try:
        own = implementations(experts, original_implementation(experts))[0]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return None if own is None else (lambda h, i, w: own(experts, h, i, w))


def kernel_fn(block):
    """The sparse Triton expert kernel over ``block``'s experts as ``fn(hidden [T, H], idx [T, k], weights [T, k])``
    (what ``lynx_hf.experts`` runs where the plan says ``uses_kernel``), for the cost gate to time the saving per
    avoided expert on the path decode takes; ``None`` where the kernel may not read the experts' weights
    (``BlockRouting.kernel_allowed``) or the experts are not on CUDA (under the CPU interpreter the kernel is a test
    tool: it is not timed)."""
    experts = block.experts
    if not block.kernel_allowed or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj") \
            or experts.gate_up_proj.device.type != "cuda":
        return None
    try:
        ops = routing_ops("triton")
    except (ImportError, RuntimeError, ValueError):
        return None
    return lambda h, i, w: ops.sparse_moe(h, i, w, experts.gate_up_proj, experts.down_proj, exact_grid=False)


def step_description(block) -> dict:
    """What ``block``'s decode step runs besides its plan and shape, as plain data for the cost gate's key
    (``lynx_hf.gate.GateKey.engine``; ``docs/cases.md`` C41, C49): ``family`` (the family spec's name: it fixes the
    selection-scores function and any replaced forward), ``selection`` (the block's verified selection-bias rule, else
    what the family's scores read of the router: grouping, method; ``None``: top-k of the logits), ``weight`` (the
    weight rule), ``experts``: ``class`` (the experts module's class name), ``implementation`` (the experts
    implementation its config names, e.g. ``"grouped_mm"`` or ``"eager"``; ``None``: not the experts interface),
    ``storage`` (each weight tensor's class, dtype and device type, sorted: a quantized or wrapped tensor is another
    class), ``offload`` (``None``, or the resident cache's byte budget where the experts are read per expert from an
    offload, ``lynx_hf.offload``)."""
    experts = block.experts
    impl = None
    if isinstance(experts, torch.nn.Module) and uses_interface(experts):
        try:
            impl = original_implementation(experts)
        except (AttributeError, KeyError, TypeError, ValueError):
            impl = None
    storage = []
    if isinstance(experts, torch.nn.Module):
        storage = [list(s) for s in sorted({(type(t).__name__, str(t.dtype), t.device.type)
                                            for t in [*experts.parameters(), *experts.buffers()]})]
    offloaded = None
    if block.offload is not None:
        offloaded = {"cache_bytes": block.model_state.config.expert_cache_bytes}
    rule_of = block.spec.selection_rule_of
    selection = block.selection if block.selection is not None else \
        (rule_of(block.router) if rule_of is not None else None)
    return {"family": block.spec.family, "selection": selection, "weight": block.rule,
            "experts": {"class": type(experts).__qualname__, "implementation": impl, "storage": storage,
                        "offload": offloaded}}


def layer_shape(block) -> gate.LayerShape:
    """What the cost gate measures ``block`` at: N, k, H (the router weight's input size), I (one expert's intermediate
    size: the dimension of the experts' ``down_proj`` that is not H; ``None`` if there is no such tensor), the router's
    and the experts' weight dtypes."""
    weight = getattr(block.router, "weight", None)
    hidden = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    down = getattr(block.experts, "down_proj", None)
    intermediate = None
    if hidden is not None and isinstance(down, torch.Tensor) and down.dim() == 3:
        dims = [int(d) for d in down.shape[1:]]
        intermediate = next((d for d in dims if d != hidden), hidden) if hidden in dims else None
    dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32
    expert_dtype = down.dtype if isinstance(down, torch.Tensor) and down.is_floating_point() else None
    return gate.LayerShape(block.num_experts, block.top_k, hidden, intermediate, dtype, expert_dtype)


def layer_facts(block) -> gate.LayerFacts:
    """``block``'s :class:`lynx_hf.gate.LayerFacts`: :func:`layer_shape`, :func:`step_description`, :func:`expert_fn`,
    :func:`kernel_fn`, :func:`gate_probe` as the routing path, the block's selection scores, the transfer of one
    expert where its experts are read per expert from an offload (``lynx_hf.offload.OffloadedExperts.probe_ms``, ms,
    timed only if the gate measures; else 0), and a copy's carried decisions (``BlockRouting.carried_gate``)."""
    offloaded = block.offload
    return gate.LayerFacts(layer_shape(block), step=step_description(block), expert_fn=expert_fn(block),
                           kernel_fn=kernel_fn(block), route_fn=functools.partial(gate_probe, block),
                           selection=block._scores_fn(),
                           extra_expert_ms=0.0 if offloaded is None else offloaded.probe_ms,
                           carried=getattr(block, "carried_gate", None))


def plan_stage(block, config) -> gate.PlanGate | None:
    """The cost gate of ``block``'s plan (``lynx_hf.patcher.PLAN_STAGES``): ``lynx_hf.gate.plan_stage`` of its
    :func:`layer_facts` (read only where ``config.gate == "auto"``)."""
    return gate.plan_stage(lambda: layer_facts(block), config)


__all__ = ["layer_facts", "plan_stage", "layer_shape", "step_description", "expert_fn", "kernel_fn", "gate_probe"]
