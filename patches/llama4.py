"""Llama-4 text (``Llama4TextMoe``): top-k (k=1) over raw logits, weight = sigmoid(logit) applied to
the *input* of the expert; the router returns dense ``scores [T, N]`` (0 off the chosen experts) and
``logits``; shared MLP untouched. HF computes every expert for every token; the patched block, when
the policy acts in decode, runs only the chosen experts (sparse dispatch), reading each unique
expert's weights once. With policy ``"none"`` it runs HF's dense computation (bit-identical)."""

from __future__ import annotations

import torch

from .base import MoEAdapter, WeightRule


def sparse_experts(experts, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Routed output of ``Llama4TextExperts`` for the chosen experts only.

    ``hidden [T, H]``, ``topk_idx [T, k]`` int64, ``topk_weights [T, k]`` (model dtype) -> ``[T, H]``.
    Layout: ``gate_up_proj [N, H, 2I]`` (gate first), ``down_proj [N, I, H]``; weight on the input.
    """
    out = torch.zeros_like(hidden)
    num_tokens, top_k = topk_idx.shape
    flat_expert = topk_idx.reshape(-1)
    flat_token = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
    flat_weight = topk_weights.reshape(-1)
    for expert in flat_expert.unique().tolist():
        sel = flat_expert == expert
        tokens = flat_token[sel]
        x = hidden[tokens] * flat_weight[sel, None]
        gate, up = (x @ experts.gate_up_proj[expert]).chunk(2, dim=-1)
        out.index_add_(0, tokens, (up * experts.act_fn(gate)) @ experts.down_proj[expert])
    return out


class Llama4Adapter(MoEAdapter):
    family = "llama4"
    block_class_paths = (("transformers.models.llama4.modeling_llama4", "Llama4TextMoe"),)

    def experts_and_top_k(self, block):
        return block.num_experts, block.top_k

    def forward(self, block, hidden_states, lynx):
        hidden_states = hidden_states.reshape(-1, block.hidden_dim)
        router_scores, router_logits = block.router(hidden_states)
        topk_idx = torch.topk(router_logits, block.top_k, dim=1).indices  # the router's own selection
        rule = WeightRule("sigmoid", dtype=router_scores.dtype)
        new_idx, new_weights, changed = lynx.route(
            router_logits, lambda: router_logits.float(), topk_idx, router_scores.gather(1, topk_idx), rule
        )
        if not changed:  # HF's dense computation, unchanged
            routed_in = hidden_states.repeat(router_scores.shape[1], 1)
            routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)
            routed_out = block.experts(routed_in)
            out = block.shared_expert(hidden_states)
            out.add_(routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
            return out, router_logits
        out = block.shared_expert(hidden_states)
        out.add_(lynx.run_experts(block.experts, hidden_states, new_idx, new_weights, changed,
                                  lambda: sparse_experts(block.experts, hidden_states, new_idx, new_weights),
                                  transposed=True, weight_on_input=True))
        return out, router_logits
