"""Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): softmax router over all N, top-k, renormalized iff
``norm_topk_prob``, weights cast to the logits dtype; sigmoid-gated shared expert (untouched).
Dense layers (``mlp_only_layers`` / ``decoder_sparse_step``) are ``Qwen2MoeMLP`` and never patched."""

from .base import FamilySpec, WeightRule

SPEC = FamilySpec(
    family="qwen2_moe",
    block_classes=(("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),),
    weight_rule_of=lambda router, block: WeightRule("softmax_all", renormalize=bool(router.norm_topk_prob)),
)
