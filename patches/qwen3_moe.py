"""Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): the Qwen2-MoE router rule (softmax over all N in fp32, top-k,
renormalized iff ``norm_topk_prob``, True in Qwen3-30B-A3B / 235B-A22B; weights in the logits dtype);
no shared expert. Dense layers (``mlp_only_layers``) are ``Qwen3MoeMLP`` and never patched."""

from .base import FamilySpec, WeightRule

SPEC = FamilySpec(
    family="qwen3_moe",
    block_classes=(("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),),
    weight_rule_of=lambda router, block: WeightRule("softmax_all", renormalize=bool(router.norm_topk_prob)),
)
