"""What each vLLM router class computes, stated as lynx_hf's own family rules (imports no vLLM).

vLLM 0.32 to 0.34 build one router per MoE layer (``vllm/model_executor/layers/fused_moe/router/router_factory.py``):
on CPU always ``CPURouter``; elsewhere ``GroupedTopKRouter`` (DeepSeek-V2/V3, GLM-4.5+, Kimi-K2, ...),
``CustomRoutingRouter`` (Llama-4, Cohere2-MoE, ...), ``FusedTopKBiasRouter`` (a score-correction bias without
groups) or ``FusedTopKRouter`` (plain top-k). :func:`derive` reads a router's attributes and returns a
:class:`RouterRule`: the three things a remap must reproduce,

(a) the **selection scores** the policies rank by: the fp32 router logits for routers without a bias (softmax
    and sigmoid are increasing, so the logits rank as the router does; ``docs/design.md``); with a
    ``e_score_correction_bias``, the DeepSeek-V3 rule ``log(score(logits) + bias - min(bias))`` of
    :class:`lynx_hf.selection.BiasedSelection` (the HF path's rule, not a copy of it);
(b) the **allowed groups** of grouped top-k: ``BiasedSelection.allowed`` on ``score(logits) (+ bias)``, the
    router's own ops (group score = the max without a bias, the sum of the top-2 with one; the
    ``topk_group`` best groups by ``torch.topk``), and ``-inf`` selection scores elsewhere, so a remap never
    picks an expert outside the token's allowed groups (``kernels.routing_torch.remap_topk``);
(c) the **weight rule** (:class:`lynx_hf.core.WeightRule`): the unbiased ``softmax`` over all N or ``sigmoid``
    of the chosen experts, renormalized iff the router renormalizes, times the router's own
    ``routed_scaling_factor`` *only where the router applies it*: the grouped paths and ``FusedTopKBiasRouter``
    multiply by it; ``CPURouter``'s plain softmax and custom paths and ``FusedTopKRouter`` do not. vLLM 0.34 added
    a plain *sigmoid* path to ``CPURouter`` (MiniMax-M2; 0.32 and 0.33 assert softmax there): its grouped top-k
    with one group, so it reads the bias for selection and scales like the grouped path. vLLM's DeepSeek-V2/V3
    pass ``apply_routed_scale_to_output=True`` (``FusedMoE``), so their routers get a factor of 1 and the
    ``MoERunner`` scales the layer output; the rule reads the router's attribute, so the factor is applied
    exactly once either way.

Refused (:class:`~lynx_hf.UnsupportedModelError`, naming the router and what it has): hash routing, DeepSeek-V4's
``sqrtsoftplus`` scoring, vision-token biases, fused shared-expert slots on any router class (ROCm AITER's fused shared
experts: ``num_fused_shared_experts > 0``, k + s columns with ids >= N; ``GroupedTopKRouter`` included), custom
routing functions other than Llama-4's and Cohere2-MoE's, and any other router class (zero-expert, routing simulator,
``AiterSharedRoutedFusedMoERouter``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..core import WeightRule
from ..errors import UnsupportedModelError
from ..selection import BiasedSelection

#: router classes the plugin can remap
ROUTERS = ("CPURouter", "GroupedTopKRouter", "FusedTopKBiasRouter", "FusedTopKRouter", "CustomRoutingRouter")

#: known custom routing functions (``module``, ``qualname``) -> (weight kind, uses the router's renormalize)
#: Llama-4 (``Llama4MoE.custom_routing_function``): top-k of the logits, weight ``sigmoid(logit)``, never
#: renormalized; Cohere2-MoE (``token_choice_with_bias``): top-k of ``sigmoid(logits)``, renormalized iff
#: ``renormalize``. Both rank as the logits do.
CUSTOM_ROUTING = {
    ("vllm.model_executor.models.llama4", "Llama4MoE.custom_routing_function"): ("sigmoid", False),
    ("vllm.model_executor.models.cohere2_moe", "token_choice_with_bias"): ("sigmoid", True),
}


@dataclass(frozen=True)
class RouterRule:
    """One vLLM router's routing as lynx_hf rules (see the module docstring).

    ``router``: its class name; ``weight``: the weight rule; ``selection``: the grouped / biased selection rule
    (``None``: plain top-k of the logits); ``bias``: the selection reads ``router.e_score_correction_bias``
    (live, at each call); ``top_k`` / ``num_experts``: the router's."""

    router: str
    weight: WeightRule
    selection: BiasedSelection | None
    bias: bool
    top_k: int
    num_experts: int

    @property
    def allowed_experts(self) -> int:
        """Experts a token may choose from (``topk_group`` groups of ``N / n_group``; N without groups)."""
        if self.selection is None or self.selection.n_group <= 1:
            return self.num_experts
        return self.selection.topk_group * (self.num_experts // self.selection.n_group)

    def describe(self) -> str:
        w = self.weight
        weights = (f"{w.kind}{', renormalized' if w.renormalize else ''}"
                   f"{f', x {w.scale:g}' if w.scale != 1.0 else ''}")
        select = "top-k of the logits" if self.selection is None else self.selection.describe()
        return f"{self.router}: {select}; weights {weights}"


def _custom_rule(fn, router) -> WeightRule:
    target = getattr(fn, "func", fn)  # functools.partial
    key = (getattr(target, "__module__", None), getattr(target, "__qualname__", None))
    known = CUSTOM_ROUTING.get(key)
    if known is None or target is not fn:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: {type(router).__name__} with custom routing function {key[0]}.{key[1]} is not supported "
            f"(known: {', '.join(f'{m}.{q}' for m, q in CUSTOM_ROUTING)})")
    kind, uses_renormalize = known
    return WeightRule(kind, renormalize=uses_renormalize and bool(getattr(router, "renormalize", False)))


def _refuse_extras(router, kind: str) -> None:
    extras = [name for name in ("_hash_indices_table", "bias_vl") if getattr(router, name, None) is not None]
    if extras:
        raise UnsupportedModelError(f"lynx_hf.vllm: {kind} with {extras} is not supported")
    shared = int(getattr(router, "num_fused_shared_experts", 0) or 0)
    if shared > 0:
        # GroupedTopKRouter hands them to rocm_aiter_grouped_topk (grouped_topk_router.py), FusedTopKBiasRouter appends
        # them itself (fused_topk_bias_router.py): the routing has k + s columns whose shared ids are N .. N + s - 1
        raise UnsupportedModelError(
            f"lynx_hf.vllm: {kind} with num_fused_shared_experts={shared} (ROCm AITER fuses the shared experts into "
            f"the routing: {getattr(router, 'top_k', '?')} + {shared} columns, the shared experts' ids after the "
            "routed ones) is not supported: the policy remaps the routed experts only. Start vLLM without the fused "
            "shared experts (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0) or without the plugin's configuration.")


def _grouped(router, num_experts: int, scoring: str, bias: bool, one_group: bool = False) -> BiasedSelection | None:
    """The grouped / biased selection rule (``None``: plain top-k). ``n_group`` 1 with a bias: no groups.
    ``one_group``: the router's path groups nothing whatever its ``num_expert_group`` says."""
    groups = 1 if one_group else int(getattr(router, "num_expert_group", None) or 1)
    topk_group = int(getattr(router, "topk_group", None) or 1)
    if groups <= 1 or num_experts <= groups or num_experts % groups:
        groups, topk_group = 1, 1  # vLLM's one-group / invalid grouping: every expert allowed
    if groups == 1 and not bias:
        return None
    return BiasedSelection(scoring, "router" if bias else "none", "e_score_correction_bias", groups, topk_group,
                           "top2_sum" if bias else "max")


def derive(router, num_experts: int | None = None) -> RouterRule:
    """The :class:`RouterRule` of a vLLM router instance over ``num_experts`` logical experts (the router logits'
    width; ``None``: the router's ``global_num_experts``, which also counts EPLB's redundant slots:
    :func:`lynx_hf.vllm.layers.logical_experts`); raises :class:`~lynx_hf.UnsupportedModelError` for routing the
    plugin cannot reproduce."""
    kind = type(router).__name__
    if kind not in ROUTERS:
        raise UnsupportedModelError(f"lynx_hf.vllm: router {kind} is not supported ({', '.join(ROUTERS)})")
    _refuse_extras(router, kind)
    top_k = int(router.top_k)
    num_experts = int(router.global_num_experts) if num_experts is None else int(num_experts)
    scoring = getattr(router, "scoring_func", "softmax")
    renormalize = bool(getattr(router, "renormalize", False))
    scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
    bias = getattr(router, "e_score_correction_bias", None) is not None
    custom = getattr(router, "custom_routing_function", None)
    if kind == "CustomRoutingRouter":
        return RouterRule(kind, _custom_rule(custom, router), None, False, top_k, num_experts)
    if scoring not in ("softmax", "sigmoid"):
        raise UnsupportedModelError(f"lynx_hf.vllm: {kind} with scoring_func {scoring!r} is not supported "
                                    "(softmax, sigmoid)")
    rule_kind = "softmax_all" if scoring == "softmax" else "sigmoid"
    if kind == "CPURouter":
        if getattr(router, "use_grouped_topk", False):  # cpu_router._grouped_topk
            return RouterRule(kind, WeightRule(rule_kind, renormalize, scale), _grouped(router, num_experts, scoring,
                                                                                        bias), bias, top_k,
                              num_experts)
        if custom is not None:
            return RouterRule(kind, _custom_rule(custom, router), None, False, top_k, num_experts)
        if scoring == "sigmoid":
            # vLLM >= 0.34 (0.32 / 0.33 assert softmax here): cpu_router._grouped_topk with one group: top-k of
            # sigmoid(logits) + bias, weights the unbiased sigmoid, renormalized iff renormalize, x routed_scaling_factor
            return RouterRule(kind, WeightRule("sigmoid", renormalize, scale),
                              _grouped(router, num_experts, scoring, bias, one_group=True), bias, top_k, num_experts)
        # cpu_router._softmax_topk: softmax top-k of the logits; no bias, no scaling factor in this path
        return RouterRule(kind, WeightRule("softmax_all", renormalize, 1.0), None, False, top_k, num_experts)
    if kind == "GroupedTopKRouter":
        groups = int(getattr(router, "num_expert_group", None) or 0)
        valid = num_experts > groups and groups > 0 and num_experts % groups == 0  # its valid_grouping()
        if not valid and not bias:  # its fallback fused_topk(): softmax (whatever scoring_func says), no scaling
            return RouterRule(kind, WeightRule("softmax_all", renormalize, 1.0), None, False, top_k, num_experts)
        # grouped_topk and the biased fallback fused_topk_bias() both scale
        return RouterRule(kind, WeightRule(rule_kind, renormalize, scale), _grouped(router, num_experts, scoring, bias),
                          bias, top_k, num_experts)
    if kind == "FusedTopKBiasRouter":
        return RouterRule(kind, WeightRule(rule_kind, renormalize, scale), _grouped(router, num_experts, scoring, bias),
                          bias, top_k, num_experts)
    return RouterRule(kind, WeightRule(rule_kind, renormalize, 1.0), None, False, top_k, num_experts)  # FusedTopK


def selection_scores_fn(rule: RouterRule, router):
    """``scores(router_logits [T, N]) -> [T, N]`` fp32 for the policies (``-inf`` outside the allowed groups);
    the bias is read from ``router`` (held weakly) at each call. ``None`` where the scores are the fp32 logits
    (``lynx_hf.core.StepInputs.scores``: the weight rule then reuses that one cast)."""
    selection = rule.selection
    if selection is None:
        return None
    ref = weakref.ref(router)

    def scores(router_logits: torch.Tensor) -> torch.Tensor:
        if rule.bias:  # patches/deepseek_v3.py: log(c - min(bias)), -inf outside the allowed groups
            return selection.selection_scores(router_logits, selection.bias(ref(), None))
        logits = router_logits.float()  # patches/deepseek_v2.py: the logits, -inf outside the allowed groups
        allowed = selection.allowed(selection.corrected(logits, torch.zeros((), device=logits.device)))
        return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))

    return scores


def check_groups(rule: RouterRule, remaps: bool, name: str) -> None:
    """A policy that remaps needs ``k`` allowed experts per token: when ``topk_group`` groups hold fewer than
    ``k``, vLLM itself fills the slots with forbidden experts, which a remap cannot reproduce (the HF path's
    rule, ``patches/deepseek_v2.check_groups``). Raises :class:`~lynx_hf.UnsupportedModelError`."""
    if remaps and rule.allowed_experts < rule.top_k < rule.num_experts:
        raise UnsupportedModelError(
            f"lynx_hf.vllm: MoE layer {name}: {rule.describe()} allows only {rule.allowed_experts} experts per token "
            f"for top_k={rule.top_k}; vLLM then picks forbidden experts, which a remap cannot reproduce. Use policy "
            "'none' for this model.")


__all__ = ["RouterRule", "derive", "selection_scores_fn", "check_groups", "ROUTERS", "CUSTOM_ROUTING"]
