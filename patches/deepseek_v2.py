"""DeepSeek-V2 (``DeepseekV2Moe``): fp32 softmax router, ``greedy`` or ``group_limited_greedy`` top-k (a
token may only use experts of its ``topk_group`` best groups, group score = max prob in the group),
weights = softmax over all N picked x ``routed_scaling_factor`` (no renormalization);
``n_shared_experts`` shared experts untouched; ``first_k_dense_replace`` dense layers never patched.
A remap stays inside the token's allowed groups: forbidden experts get selection score ``-inf``."""

from __future__ import annotations

import torch

from ..errors import ModelConfigError
from ..kernels.step_spec import LOGITS, FusedSelection
from ..policies import get as get_policy
from .base import FamilySpec, WeightRule


def check_groups(name, num_experts, top_k, n_group, topk_group, config, fields) -> None:
    """C10 / C26: group settings. ``fields`` names the config fields ``(n_group, topk_group, N, k)``.

    Malformed groups (``n_group`` not dividing N, ``topk_group`` outside ``1..n_group``) are refused.
    When the allowed groups cannot supply k experts the model itself picks forbidden experts to fill
    its k slots; a remap inside the allowed groups cannot reproduce that, so policies that remap are
    refused (policy ``none`` patches, and ``k == N`` is the identity for every policy)."""
    f_group, f_topk_group, f_experts, f_k = fields
    if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ModelConfigError(f"{name}: {f_group}={n_group} must be a positive divisor of {f_experts}={num_experts}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ModelConfigError(f"{name}: {f_topk_group}={topk_group} must be in 1..{f_group}={n_group}")
    allowed = topk_group * (num_experts // n_group)
    if allowed < top_k < num_experts and _remaps(config):
        raise ModelConfigError(
            f"{name}: group routing cannot supply {f_k}={top_k} experts: {f_topk_group}={topk_group} groups of "
            f"{f_experts}/{f_group}={num_experts}/{n_group} experts allow only {allowed}; the model then fills its "
            f"slots with forbidden experts, which a remap cannot reproduce. Policy {config.policy!r} is refused "
            f"for this model; policy 'none' patches it."
        )


def _remaps(config) -> bool:
    return get_policy(config.policy).remaps


def _check(block, gate, name, config):
    if gate.topk_method not in ("greedy", "group_limited_greedy"):
        raise ModelConfigError(f"{name}: topk_method={gate.topk_method!r} is not supported (greedy, group_limited_greedy)")
    if gate.topk_method == "group_limited_greedy":
        check_groups(name, gate.num_experts, gate.top_k, gate.num_group, gate.topk_group, config,
                     ("n_group", "topk_group", "n_routed_experts", "num_experts_per_tok"))


def selection_scores(gate, router_logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits, ``-inf`` outside the token's allowed groups (same ops as the HF router)."""
    logits = router_logits.float()
    if gate.topk_method != "group_limited_greedy":
        return logits
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    group_scores = scores.view(-1, gate.num_group, gate.num_experts // gate.num_group).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    allowed = group_mask.repeat_interleave(gate.num_experts // gate.num_group, dim=-1)
    return logits.masked_fill(~allowed, float("-inf"))


def fused_selection(gate) -> FusedSelection:
    """:func:`selection_scores` as data for the fused device step: the logits, or (``group_limited_greedy``) the logits
    outside the token's ``topk_group`` best groups by the max of ``softmax(logits)`` masked."""
    if gate.topk_method != "group_limited_greedy":
        return LOGITS
    return FusedSelection("group_softmax_max", n_group=int(gate.num_group), topk_group=int(gate.topk_group))


SPEC = FamilySpec(
    family="deepseek_v2",
    block_classes=(("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe"),),
    weight_rule_of=lambda gate, block: WeightRule("softmax_all", scale=float(gate.routed_scaling_factor)),
    selection_scores=selection_scores,
    fused_selection_of=fused_selection,
    selection_rule_of=lambda gate: {name: getattr(gate, name, None) for name in ("topk_method", "num_group",
                                                                                 "topk_group")},
    check=_check,
)
