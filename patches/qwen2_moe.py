"""Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): softmax router over all N, top-k, renormalize iff
``norm_topk_prob``, weights cast to the logits dtype; sigmoid-gated shared expert (untouched).
Dense layers (``mlp_only_layers`` / ``decoder_sparse_step``) are ``Qwen2MoeMLP`` and never patched."""

from __future__ import annotations

import torch.nn.functional as F

from .base import MoEAdapter, WeightRule


class Qwen2MoeAdapter(MoEAdapter):
    family = "qwen2_moe"
    block_class_paths = (("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),)

    def experts_and_top_k(self, block):
        return block.gate.num_experts, block.gate.top_k

    def forward(self, block, hidden_states, lynx):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_dim)
        shared_expert_output = block.shared_expert(hidden)
        router_logits, routing_weights, selected_experts = block.gate(hidden)
        rule = WeightRule("softmax_all", renormalize=bool(block.gate.norm_topk_prob), dtype=router_logits.dtype)
        selected_experts, routing_weights, changed = lynx.route(
            router_logits, lambda: router_logits.float(), selected_experts, routing_weights, rule
        )
        expert_output = lynx.run_experts(block.experts, hidden, selected_experts, routing_weights, changed,
                                         lambda: block.experts(hidden, selected_experts, routing_weights))
        shared_expert_output = F.sigmoid(block.shared_expert_gate(hidden)) * shared_expert_output
        expert_output = expert_output + shared_expert_output
        return expert_output.reshape(batch_size, sequence_length, hidden_dim)
