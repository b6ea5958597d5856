"""DeepSeek-V2 (``DeepseekV2Moe``): fp32 softmax router, ``greedy`` or ``group_limited_greedy``
top-k (a token may only use experts of its ``topk_group`` best groups, group score = max prob in
the group), weights = softmax over all N picked x ``routed_scaling_factor`` (no renormalization);
``n_shared_experts`` shared experts untouched; ``first_k_dense_replace`` dense layers never patched.
A remap stays inside the token's allowed groups: forbidden experts get selection score ``-inf``."""

from __future__ import annotations

import torch

from ..errors import ModelConfigError
from .base import MoEAdapter, WeightRule


class DeepseekV2Adapter(MoEAdapter):
    family = "deepseek_v2"
    block_class_paths = (("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe"),)

    def experts_and_top_k(self, block):
        return block.gate.num_experts, block.gate.top_k

    def check_block(self, block, name):
        super().check_block(block, name)
        gate = block.gate
        if gate.topk_method not in ("greedy", "group_limited_greedy"):
            raise ModelConfigError(f"{name}: topk_method={gate.topk_method!r} is not supported (greedy, group_limited_greedy)")
        if gate.topk_method == "group_limited_greedy":
            n_group, topk_group, num_experts = gate.num_group, gate.topk_group, gate.num_experts
            if not n_group or num_experts % n_group:
                raise ModelConfigError(
                    f"{name}: n_group={n_group} must divide num_experts (n_routed_experts)={num_experts}"
                )
            if not 1 <= topk_group <= n_group:
                raise ModelConfigError(f"{name}: topk_group={topk_group} must be in 1..n_group={n_group}")
            allowed = topk_group * (num_experts // n_group)
            if allowed < gate.top_k:
                raise ModelConfigError(
                    f"{name}: group routing cannot supply num_experts_per_tok={gate.top_k} experts: topk_group="
                    f"{topk_group} groups of num_experts/n_group={num_experts}/{n_group} experts allow only {allowed}"
                )

    @staticmethod
    def selection_scores(gate, router_logits):
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

    def forward(self, block, hidden_states, lynx):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        router_logits, topk_weights, topk_indices = block.gate(hidden_states)
        rule = WeightRule("softmax_all", scale=float(block.gate.routed_scaling_factor))
        topk_indices, topk_weights, changed = lynx.route(
            router_logits, lambda: self.selection_scores(block.gate, router_logits), topk_indices, topk_weights, rule
        )
        hidden = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = lynx.run_experts(block.experts, hidden, topk_indices, topk_weights, changed,
                                         lambda: block.experts(hidden, topk_indices, topk_weights)).view(*orig_shape)
        return hidden_states + block.shared_experts(residuals)
