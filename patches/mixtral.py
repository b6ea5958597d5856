"""Mixtral (``MixtralSparseMoeBlock``): softmax in fp32 over all N, top-k, renormalized over the
chosen k (= softmax over the chosen logits), fp32 weights; no shared experts. (``router_jitter_noise``
acts only in training, which never reaches a decode step.)"""

from .base import FamilySpec, WeightRule

SPEC = FamilySpec(
    family="mixtral",
    block_classes=(("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),),
    weight_rule_of=lambda router, block: WeightRule("softmax_all", renormalize=True),
)
