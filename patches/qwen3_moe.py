"""Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): router logits in the model dtype, softmax over all N in
fp32, top-k, renormalized over the chosen k iff ``norm_topk_prob`` (True in Qwen3-30B-A3B /
235B-A22B), weights cast to the logits dtype; no shared expert. Dense layers (``mlp_only_layers`` /
``decoder_sparse_step``) are ``Qwen3MoeMLP`` and never patched. Selection scores: the fp32 logits
(pre-softmax, DESIGN.md)."""

from __future__ import annotations

from .base import MoEAdapter, WeightRule


class Qwen3MoeAdapter(MoEAdapter):
    family = "qwen3_moe"
    block_class_paths = (("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),)

    def experts_and_top_k(self, block):
        return block.gate.num_experts, block.gate.top_k

    def forward(self, block, hidden_states, lynx):
        # Mirrors Qwen3MoeSparseMoeBlock.forward (transformers 5.23) with the routing handed to lynx.
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_dim)
        router_logits, routing_weights, selected_experts = block.gate(hidden)
        rule = WeightRule("softmax_all", renormalize=bool(block.gate.norm_topk_prob), dtype=router_logits.dtype)
        selected_experts, routing_weights, changed = lynx.route(
            router_logits, lambda: router_logits.float(), selected_experts, routing_weights, rule
        )
        out = lynx.run_experts(block.experts, hidden, selected_experts, routing_weights, changed,
                               lambda: block.experts(hidden, selected_experts, routing_weights))
        return out.reshape(batch_size, sequence_length, hidden_dim)
