"""Mixtral (``MixtralSparseMoeBlock``): softmax in fp32, top-k, renormalized over the chosen k, fp32
weights; no shared experts."""

from __future__ import annotations

import torch

from .base import MoEAdapter, WeightRule


class MixtralAdapter(MoEAdapter):
    family = "mixtral"
    block_class_paths = (("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),)

    def experts_and_top_k(self, block):
        return block.gate.num_experts, block.gate.top_k

    def forward(self, block, hidden_states, lynx):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if block.training and block.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
        hidden = hidden_states.view(-1, hidden_dim)
        router_logits, top_k_weights, top_k_index = block.gate(hidden)
        rule = WeightRule("softmax_all", renormalize=True)
        top_k_index, top_k_weights, changed = lynx.route(
            router_logits, lambda: router_logits.float(), top_k_index, top_k_weights, rule
        )
        out = lynx.run_experts(block.experts, hidden, top_k_index, top_k_weights, changed,
                               lambda: block.experts(hidden, top_k_index, top_k_weights))
        return out.reshape(batch_size, sequence_length, hidden_dim)
