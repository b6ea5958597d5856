"""OLMoE (``OlmoeSparseMoeBlock``; OLMoE-1B-7B: 64 experts, top-8): the Qwen3-MoE router rule —
softmax over all N in fp32, top-k, renormalized iff ``norm_topk_prob`` (False in the released
checkpoints), weights cast to the logits dtype; no shared expert; every layer is MoE. The block's
forward (transformers 5.23) is the same flatten -> gate -> experts -> reshape as Qwen3-MoE's, so the
adapter reuses that forward; only the block class differs."""

from __future__ import annotations

from .qwen3_moe import Qwen3MoeAdapter


class OlmoeAdapter(Qwen3MoeAdapter):
    family = "olmoe"
    block_class_paths = (("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),)
