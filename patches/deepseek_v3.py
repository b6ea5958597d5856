"""DeepSeek-V3 (``DeepseekV3MoE``, transformers 5.23): fp32 sigmoid router with a selection-only
``e_score_correction_bias`` and group-limited top-k.

The model's own rule (``DeepseekV3TopkRouter.forward``):

- ``p = sigmoid(logits)`` (fp32); ``c = p + e_score_correction_bias`` (the *corrected* scores);
- group score = sum of the top-2 corrected scores of each of ``n_group`` groups; a token may use only
  the experts of its ``topk_group`` best groups (the others are masked with ``-inf``, so a masked
  expert never wins, even when every corrected score is negative);
- top-k of the masked corrected scores selects the experts;
- weights = the *unbiased* ``p`` of the chosen experts, divided by their sum (+1e-20) iff
  ``norm_topk_prob``, times ``routed_scaling_factor``; fp32. The bias never enters the weights.

A remap reproduces it with ``WeightRule("sigmoid", renormalize=norm_topk_prob,
scale=routed_scaling_factor)`` on the router logits: ``routing_weights`` already applies
sigmoid to the logits of the new set, renormalizes over the chosen k, then scales (the model's
``+1e-20`` in the denominator is below one fp32 ulp of any sum larger than ~1e-13, i.e. of any sum
not made of underflowed sigmoids). Shared experts untouched; ``first_k_dense_replace`` layers are
``DeepseekV3MLP`` and never patched.

Selection scores handed to the policy (our choice, the paper is silent on bias-corrected routers):
``s = log(c - min(e_score_correction_bias))`` (fp32, clamped at the smallest normal fp32 so every
allowed expert is finite), ``-inf`` outside the token's allowed groups (same group ops as the model,
so the same groups). Why:

1. *Order*: ``s`` is a strictly increasing function of ``c``, the quantity the model ranks by, so a
   remap restricted to the critical set picks what the model itself would pick there (no swap that
   saves nothing), and with ``B = 1`` the routing is unchanged.
2. *Defined everywhere*: ``c - min(bias) = p + (bias - min(bias)) >= p > 0``, so the log exists for
   any bias sign, including the all-negative corrected scores of a strongly negative bias (where
   ``log c`` or ``logit c`` would be undefined).
3. *Meaning of the gap*: with zero bias (or a bias that is the same for every expert: a uniform
   offset cancels) ``s = log p`` and the affinity gap is ``log(p_e / p_top1)``, the log ratio of the
   two experts' routing weights before renormalization -- exactly the quantity the bins of ``docs/design.md`` are
   defined on ("an expert votes iff its probability is at least k/N of the token's top-1"). Using
   the corrected scores themselves would measure gaps in probability units (all <= 1 + bias spread),
   so with bins of width ``ln(N/k)/beta`` (0.58 for V3's N 256, k 8) nearly every expert would sit
   in bin 0 or -1 and LYNX would remap far too aggressively. The pre-sigmoid logit that ``docs/design.md``
   uses for bias-free sigmoid routers (Llama-4) cannot express the bias at all; ``log p = logit -
   softplus(logit)`` equals the logit for the unconfident experts (``p`` small) LYNX remaps, and
   unlike the logit it does not call two saturated experts (``p`` ~ 1, equal weights) far apart.
   The bias spread (``bias - min(bias)``) shifts experts the load balancer favours up, as it does
   in the model's own selection.
"""

from __future__ import annotations

import torch

from ..errors import ModelConfigError
from ..selection import BiasedSelection
from .base import FamilySpec, WeightRule
from .deepseek_v2 import check_groups


def _check(block, gate, name, config):
    num_experts, n_group = gate.num_experts, gate.num_group
    check_groups(name, num_experts, gate.top_k, n_group, gate.topk_group, config,
                 ("n_group", "topk_group", "n_routed_experts", "num_experts_per_tok"))
    if num_experts // n_group < 2:
        raise ModelConfigError(
            f"{name}: n_group={n_group} leaves {num_experts // n_group} expert per group; the group score "
            f"(sum of the top-2 corrected scores) needs n_routed_experts/n_group >= 2"
        )
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None or tuple(bias.shape) != (num_experts,):
        raise ModelConfigError(
            f"{name}: e_score_correction_bias must have shape ({num_experts},), got "
            f"{None if bias is None else tuple(bias.shape)}"
        )


def selection_rule(gate) -> BiasedSelection:
    """The model's selection as the shared selection-bias rule (``lynx_hf/selection.py``)."""
    return BiasedSelection("sigmoid", "router", "e_score_correction_bias", int(gate.num_group), int(gate.topk_group),
                           "top2_sum")


def allowed_mask(gate, scores_for_choice: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` bool: the experts of each token's ``topk_group`` best groups (the model's ops)."""
    allowed = selection_rule(gate).allowed(scores_for_choice)
    return torch.ones_like(scores_for_choice, dtype=torch.bool) if allowed is None else allowed


def selection_scores(gate, router_logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``log(c - min(bias))`` with ``c`` the corrected scores, ``-inf`` outside allowed groups
    (:meth:`BiasedSelection.selection_scores`). ``router_logits [T, N]`` -> ``[T, N]`` fp32."""
    rule = selection_rule(gate)
    return rule.selection_scores(router_logits, rule.bias(gate, None))  # the live bias (accelerate offload: C39)


SPEC = FamilySpec(
    family="deepseek_v3",
    block_classes=(("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),),
    weight_rule_of=lambda gate, block: WeightRule("sigmoid", renormalize=bool(gate.norm_topk_prob),
                                                  scale=float(gate.routed_scaling_factor)),
    selection_scores=selection_scores,
    selection_rule_of=selection_rule,
    fused_selection_of=selection_rule,
    check=_check,
)
