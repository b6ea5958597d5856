"""OLMoE (``OlmoeSparseMoeBlock``; OLMoE-1B-7B: 64 experts, top-8): the Qwen3-MoE router rule
(``norm_topk_prob`` False in the released checkpoints); no shared expert; every layer is MoE."""

from .base import FamilySpec, WeightRule

SPEC = FamilySpec(
    family="olmoe",
    block_classes=(("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),),
    weight_rule_of=lambda router, block: WeightRule("softmax_all", renormalize=bool(router.norm_topk_prob)),
)
