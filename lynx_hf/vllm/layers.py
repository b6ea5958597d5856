"""The MoE layers of this process: :func:`attach` hooks one vLLM ``MoERunner`` (hooked on its ``__init__``), and
:func:`configure` switches every layer to another configuration at run time (imports vLLM through the op).

``BaseRouter._select_experts`` calls ``_compute_routing`` (router logits -> logical ``(topk_weights, topk_ids)``),
then the routed-experts capture, then the EPLB logical->physical mapping, then the index dtype cast; :func:`attach`
wraps the runner's router's ``_compute_routing``, so the remap acts on logical expert ids, before EPLB, and everything
downstream (capture, EPLB load recording, the experts kernel) sees the remapped routing.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from ..core import WeightRule
from ..errors import LynxConfigError, UnsupportedModelError
from . import bypass, checks, plans, routers, telemetry
from . import config as plugin_config
from .op import remap_routing
from .state import STATE, Layer, resolve_config, target_layers

__all__ = ["attach", "hook_layer", "HOOKED_METHODS", "expert_parallel_size", "logical_experts", "original_routing",
           "weight_rule", "monolithic", "configure", "graph_changes", "HOST_FIELDS"]


def weight_rule(router) -> WeightRule:
    """The fp32 rule that reproduces ``router``'s own ``topk_weights`` on any expert set: the weight part of
    :func:`lynx_hf.vllm.routers.derive` (every router class and its rule are listed there; e.g. ``CPURouter``'s
    plain softmax path: softmax over all N picked, renormalized iff ``renormalize``, no scaling factor; its
    grouped path: times ``routed_scaling_factor``). Raises :class:`~lynx_hf.UnsupportedModelError` for routing
    the plugin cannot remap (hash routing, ``sqrtsoftplus``, unknown custom routing functions, other router
    classes)."""
    return routers.derive(router).weight


def monolithic(runner) -> bool:
    """Whether ``runner``'s experts kernel takes the router logits itself (the router is bypassed)."""
    try:
        return bool(runner.routed_experts.quant_method.is_monolithic)
    except AttributeError:
        return False


def logical_experts(runner) -> int:
    """N of ``runner``'s routing: the **logical** expert count (the router logits' width, the ids the router returns),
    ``moe_config.num_logical_experts``; the router's ``global_num_experts`` counts EPLB's redundant physical slots too
    (logical + redundant), which would skew LYNX's bins and can drop the group restriction (``N % num_expert_group``).
    The router's ``global_num_experts`` where the runner has no such config (no EPLB there)."""
    logical = getattr(getattr(runner, "moe_config", None), "num_logical_experts", None)
    return int(logical) if isinstance(logical, int) and logical > 0 else int(runner.router.global_num_experts)


def expert_parallel_size(moe_config) -> int:
    """The expert-parallel ranks a layer's experts are split over (``FusedMoEConfig.ep_size`` where ``use_ep``; 1
    without expert parallelism or where the config does not say): each rank runs N / that many of them, so the cost
    gate weighs the experts this rank saves (``LayerShape.ep_size``)."""
    parallel = getattr(moe_config, "moe_parallel_config", None)
    use_ep = getattr(parallel, "use_ep", None)
    size = getattr(parallel, "ep_size", None)
    if use_ep is None or size is None:
        use_ep, size = getattr(moe_config, "use_ep", False), getattr(moe_config, "ep_size", 1)
    return max(1, int(size)) if isinstance(use_ep, bool) and use_ep and isinstance(size, int) else 1


def attach(runner) -> None:
    """A vLLM ``MoERunner`` was built (its ``__init__`` returned): when the plugin is configured in this engine, its
    router's rules are derived (:func:`lynx_hf.vllm.routers.derive`, refusing routing the plugin cannot reproduce),
    a :class:`~lynx_hf.vllm.state.Layer` is added to :data:`~lynx_hf.vllm.state.STATE` and the layer is hooked
    (:func:`hook_layer`: the router's ``_compute_routing`` wrapped, vLLM's routing then the op; the runner's runs
    counted). A layer the cost gate bypasses later is unhooked again (vLLM's own methods, no plugin frame).
    Raises :class:`~lynx_hf.UnsupportedModelError`."""
    cfg = _process_config()
    if cfg is None:
        return
    router = runner.router
    if not hasattr(router, "_compute_routing"):
        raise UnsupportedModelError(f"lynx_hf.vllm: router {type(router).__name__} has no _compute_routing")
    if monolithic(runner) and cfg.lynx.policy != "none":
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layer {runner.layer_name} uses a monolithic experts kernel that routes "
            "internally (the router is bypassed), so its routing cannot be remapped")
    num_experts = logical_experts(runner)
    # the router class's selection (scores, allowed groups); read live at each call
    rule = routers.derive(router, num_experts)
    layer = Layer(index=len(STATE.layers), name=str(runner.layer_name), top_k=int(router.top_k),
                  num_experts=num_experts, rule=rule.weight, runner=weakref.ref(runner),
                  router_rule=rule, scores=routers.selection_scores_fn(rule, router))
    routers.check_groups(rule, plans.remaps(cfg), layer.name)
    # the cost gate's layer shape: H and I (this rank's shard) from the runner's FusedMoEConfig; where they are not
    # there the gate cannot measure and keeps the policy on (reason "not measured")
    moe = getattr(runner, "moe_config", None)
    hidden, inter = getattr(moe, "hidden_dim", None), getattr(moe, "intermediate_size_per_partition", None)
    layer.gate_shape = plans.layer_shape(layer.num_experts, layer.top_k, int(hidden) if hidden else None,
                                         int(inter) if inter and inter > 0 else None, getattr(moe, "in_dtype", None),
                                         ep_size=expert_parallel_size(moe))
    STATE.layers.append(layer)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        STATE.rank = torch.distributed.get_rank()
    layer.rehook = hook_layer  # bypass.set_bypass unhooks a bypassed layer and hooks it again (imports no vLLM)
    hook_layer(layer, True)


#: the methods :func:`hook_layer` wraps, as instance attributes: on the router, then on the runner
HOOKED_METHODS = ("_compute_routing", "_forward_impl")


def hook_layer(layer: Layer, hooked: bool) -> None:
    """Put the plugin's wrappers on ``layer``'s vLLM objects (``hooked``) or take them off. Hooked: its router's
    ``_compute_routing`` is :func:`_routing_wrapper` (vLLM's routing, then the op) and its runner's ``_forward_impl``
    counts the runner's runs (:func:`_count_runs`), each an attribute of the instance. Unhooked: those attributes are
    removed, so the router and the runner run vLLM's own methods of their classes, with no plugin frame in an eager step
    and no plugin code in a traced one: a layer the cost gate bypasses (``Layer.bypass``, set by
    :func:`lynx_hf.vllm.bypass.set_bypass` before the first forward, so a compiled forward is traced as vLLM's own;
    issue 54 item 7). Idempotent; ``Layer.runs`` keeps its count across (its runs are not counted while unhooked, and
    the liveness rule does not judge a bypassed layer). A layer whose runner is gone is left alone."""
    runner = layer.runner() if layer.runner is not None else None
    if runner is None:
        return
    router = runner.router
    if not hooked:
        for owner, name in zip((router, runner), HOOKED_METHODS):
            if getattr(getattr(owner, name, None), "__lynx_layer__", None) is layer:
                vars(owner).pop(name, None)  # the class's method again
        return
    if getattr(router._compute_routing, "__lynx_layer__", None) is not layer:
        router._compute_routing = _routing_wrapper(router._compute_routing, layer)
    _count_runs(runner, layer)


def _routing_wrapper(original, layer: Layer):
    """``_compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None)`` of a hooked router:
    ``original`` (vLLM's bound method: router logits ``[T, N]`` -> ``(topk_weights [T, k] fp32, topk_ids [T, k])``),
    then the op on its result, unless the layer is bypassed, the drafter's or gated off at this call
    (:func:`lynx_hf.vllm.bypass.gated_off_call`)."""
    index = layer.index

    def _compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        topk_weights, topk_ids = original(hidden_states, router_logits, indices_type, input_ids=input_ids)
        if layer.bypass:  # a Python branch: read on every eager call, once where the forward is traced / captured
            return topk_weights, topk_ids
        if layer.drafter:  # the drafter's forward (after the step, rows of its own): vLLM's routing, its calls counted
            layer.calls += 1
            return topk_weights, topk_ids
        if not torch.compiler.is_compiling() and bypass.gated_off_call(layer, router_logits):
            return topk_weights, topk_ids  # the gate keeps vLLM's routing here: no op, no kernel (issue 54 N10)
        return remap_routing(router_logits, topk_weights, topk_ids, index)

    _compute_routing.__wrapped__ = original
    _compute_routing.__lynx_layer__ = layer
    return _compute_routing


def _count_runs(runner, layer: Layer) -> None:
    """Count the runs of ``runner`` itself (``Layer.runs``): its ``_forward_impl`` (vLLM 0.32 to 0.34: what the
    ``moe_forward`` / ``moe_forward_shared`` ops call, by the layer's name) wrapped on the instance, counting where the
    forward is not being traced by ``torch.compile`` (a traced count would be a guard on a Python int). A runner
    without it is left as it is (``Layer.runs`` stays ``None``); one already counted for ``layer`` too."""
    impl = getattr(runner, "_forward_impl", None)
    if not callable(impl) or getattr(impl, "__lynx_layer__", None) is layer:
        return
    if layer.runs is None:
        layer.runs = 0

    def _forward_impl(*args, **kwargs):
        if not torch.compiler.is_compiling():
            layer.runs += 1
        return impl(*args, **kwargs)

    _forward_impl.__wrapped__ = impl
    _forward_impl.__lynx_layer__ = layer
    runner._forward_impl = _forward_impl


def _process_config():
    """This process's configuration (read once, from the engine's ``VllmConfig`` being built)."""
    if STATE.resolved:
        return STATE.config
    from vllm.config import get_current_vllm_config

    return resolve_config(get_current_vllm_config())


def original_routing(router):
    """vLLM's own ``_compute_routing`` of ``router`` (the bound method :func:`attach` wrapped; the router's own where
    it is not hooked)."""
    routing = router._compute_routing
    if inspect.ismethod(routing):  # not hooked: vLLM's own method, bound to the router
        return routing
    return routing.__wrapped__


#: what ``configure`` may change under captured CUDA graphs: read on the host at every step (the step mask's rule;
#: where and how often the telemetry is written), never inside the captured op
HOST_FIELDS = ("q_max", "verify", "stats_path", "stats_every")


def graph_changes(old, new) -> list[str]:
    """The fields of ``new`` (a :class:`~lynx_hf.vllm.config.PluginConfig`) that differ from ``old`` and that a
    captured CUDA graph cannot follow (every field but :data:`HOST_FIELDS`)."""
    before = {} if old is None else old.to_dict()
    after = new.to_dict()
    return sorted(k for k in set(before) | set(after) if k not in HOST_FIELDS and before.get(k) != after.get(k))


def configure(options) -> bool:
    """Replace this process's configuration (``options``: as ``additional_config["lynx"]``); the per-layer plans are
    re-resolved (made now where the engine has started: the cost gate gets its decisions here, not in a served step,
    and with several tensor-parallel ranks every rank takes rank 0's: a collective, as ``collective_rpc`` calls it on
    every worker) and the telemetry restarts. Returns False (nothing changed) when the plugin is off in this engine
    (no layer attached). Raises :class:`~lynx_hf.LynxConfigError` for a bad value, where the engine's forward is
    compiled without the op on a layer the new configuration would need it on, or where the cost gate's decisions of
    several ranks cannot be agreed; :class:`~lynx_hf.UnsupportedModelError` for a policy a layer cannot remap."""
    cfg = plugin_config.parse(options, source="lynx_hf.vllm.configure")
    if cfg is None:
        raise LynxConfigError("lynx_hf.vllm.configure: empty configuration (the plugin cannot be switched off "
                              "at run time; use policy 'none')")
    if STATE.config is None or not STATE.layers:
        return False
    for layer in target_layers():
        runner = layer.runner() if layer.runner is not None else None
        if runner is not None and monolithic(runner) and cfg.lynx.policy != "none":
            raise UnsupportedModelError(f"lynx_hf.vllm: MoE layer {layer.name} bypasses its router")
        if layer.router_rule is not None:
            routers.check_groups(layer.router_rule, plans.remaps(cfg), layer.name)
    checks.check_layers(cfg)
    start = STATE.start
    if start.captured:
        changed = graph_changes(STATE.config, cfg)
        if changed:
            raise LynxConfigError(
                f"lynx_hf.vllm.configure: this engine's forward is captured in CUDA graphs; a replay repeats what the "
                f"plugin's op did at capture (policy, its parameters, plan, cost-gate decision, telemetry buffers), so "
                f"it cannot follow a change of {', '.join(changed)}. Nothing changed. Only "
                f"{', '.join(HOST_FIELDS)} (read on the host every step) can change here; start the engine with the "
                "configuration wanted, or with enforce_eager=True to switch configurations at run time.")
    made = None
    if start.started and start.device is not None:
        # a frozen forward cannot take the op back into a layer it was traced without
        made = {layer.index: plans.make_layer_plan(layer, start.device, start.dtype, cfg.lynx)
                for layer in target_layers()}
        plans.agree(cfg, made)  # every tensor-parallel rank takes rank 0's decisions (a collective)
        if start.frozen:
            needs = [layer.name for layer in target_layers()
                     if layer.bypass and not bypass.gated_off_everywhere(made[layer.index])]
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
    for layer in target_layers():
        if made is None:
            layer.plan = None  # made on first use
        else:
            plans.install_plan(layer, made[layer.index], cfg.lynx)
    if made is not None:
        bypass.settle_bypass()  # from the agreed decisions (an eager engine only: a frozen one keeps its bypass)
    telemetry.reset()
    return True
