"""Sparse torch decode path for HF stacked-expert modules (CPU / no-Triton fallback).

``sparse_experts_torch(experts, hidden, topk_idx, topk_weights)`` computes what the HF experts module
(``gate_up_proj [N, 2I, H]``, ``down_proj [N, H, I]``, gated activation) returns for a decode step,
touching only the experts the step uses: the (token, slot) pairs are sorted by expert once, each
unique expert's two matrices are read once (one ``linear`` per projection on that expert's rows),
and the weighted rows are summed per token in fp32. Layouts it does not handle (transposed weights,
biases, ungated experts, post-expert norm) fall back to the module's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` has the plain HF layout this path implements."""
    return (
        isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
        and getattr(experts, "has_gate", True)
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "has_post_expert_norm", False)
        and getattr(experts, "is_concatenated", True)
        and experts.gate_up_proj.dim() == 3
    )


def _gate(experts, gate_up: torch.Tensor) -> torch.Tensor:
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def sparse_experts_torch(
    experts: torch.nn.Module, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` (dtype of ``hidden``) of one step.

    ``hidden [T, H]``, ``topk_idx [T, k]`` int (k distinct experts per row), ``topk_weights [T, k]``.
    Equal to ``experts(hidden, topk_idx, topk_weights)`` within floating-point tolerance (the
    per-token sum over slots is accumulated in fp32).
    """
    if not supports(experts):
        return experts(hidden, topk_idx, topk_weights)
    num_tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    unique, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // top_k
    rows = hidden.index_select(0, token_of)                               # [T*k, H], grouped by expert
    weights = topk_weights.reshape(-1).index_select(0, order).to(torch.float32)
    gate_up_proj, down_proj = experts.gate_up_proj, experts.down_proj
    pieces = []
    start = 0
    for expert, count in zip(unique.tolist(), counts.tolist()):
        x = rows[start:start + count]
        h = _gate(experts, F.linear(x, gate_up_proj[expert]))
        pieces.append(F.linear(h, down_proj[expert]))
        start += count
    out_sorted = torch.cat(pieces, dim=0).to(torch.float32) * weights.unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token_of, out_sorted)
    return out.to(hidden.dtype)


__all__ = ["sparse_experts_torch", "supports"]
