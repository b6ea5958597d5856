"""Torch reference of the sparse decode expert computation and of the vLLM-style block alignment.

These are the definitions the Triton kernels in :mod:`kernels.moe` are tested against
(``docs/design.md``, "Kernels"). They favour clarity over speed: a loop over the experts the
batch actually touches, fp32 accumulation, output cast back to the hidden dtype.

Weight layouts (transformers 5.x fused expert parameters):

- ``transposed=False`` (Qwen2-MoE, Mixtral, DeepSeek-V2): ``w_gate_up [N, 2I, H]``,
  ``w_down [N, H, I]``; an expert computes ``down @ (act(gate) * up)`` with
  ``gate, up = (gate_up @ x).chunk(2)`` (first half is the gate).
- ``transposed=True`` (Llama-4 text): ``w_gate_up [N, H, 2I]``, ``w_down [N, I, H]``; same chunk
  order, ``x @ gate_up`` and ``h @ down``.

``weight_on_input=True`` (Llama-4) multiplies the expert's *input* by the routing weight; otherwise
the expert *output* is multiplied by it. The per-token output is the sum over its ``k`` slots.
"""

from __future__ import annotations

import torch

#: activations the expert kernels support.
ACTIVATIONS = ("silu",)


def _check_moe_args(hidden, topk_idx, topk_weights, w_gate_up, w_down, transposed, activation):
    """Validate shapes/dtypes shared by the naive and the Triton expert functions; return (T, H, N, I, k)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; expected one of {ACTIVATIONS}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating tensor, got {hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must be [T={num_tokens}, k], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_idx must be int64 (or int32), got {topk_idx.dtype}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must have the shape of topk_idx {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("w_gate_up and w_down must be 3-d [N, ., .] expert tensors")
    num_experts = w_gate_up.shape[0]
    if transposed:
        if w_gate_up.shape[1] != hidden_size or w_gate_up.shape[2] % 2:
            raise ValueError(f"transposed w_gate_up must be [N, H={hidden_size}, 2I], got {tuple(w_gate_up.shape)}")
        inter = w_gate_up.shape[2] // 2
        expect_down = (num_experts, inter, hidden_size)
    else:
        if w_gate_up.shape[2] != hidden_size or w_gate_up.shape[1] % 2:
            raise ValueError(f"w_gate_up must be [N, 2I, H={hidden_size}], got {tuple(w_gate_up.shape)}")
        inter = w_gate_up.shape[1] // 2
        expect_down = (num_experts, hidden_size, inter)
    if tuple(w_down.shape) != expect_down:
        raise ValueError(f"w_down must be {expect_down} for this w_gate_up, got {tuple(w_down.shape)}")
    return num_tokens, hidden_size, num_experts, inter, topk_idx.shape[1]


def naive_sparse_moe(
    hidden: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    transposed: bool = False,
    weight_on_input: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """Routed experts of one MoE layer, computed sparsely. Returns ``[T, H]`` in ``hidden.dtype``.

    ``hidden [T, H]``, ``topk_idx [T, k]`` int64, ``topk_weights [T, k]`` float, expert weights per
    the module docstring. Every (token, slot) pair contributes
    ``w * down(act(gate(x)) * up(x))`` (or ``down(act(gate(w x)) * up(w x))`` with
    ``weight_on_input``); all matmuls and the sum over slots are in fp32, the intermediate is fp32.
    Raises ``ValueError`` for inconsistent shapes, non-float inputs or an unknown activation, and
    ``IndexError`` for an expert id outside ``0..N-1``.
    """
    num_tokens, hidden_size, num_experts, inter, top_k = _check_moe_args(
        hidden, topk_idx, topk_weights, w_gate_up, w_down, transposed, activation
    )
    idx = topk_idx.long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):
        raise IndexError(f"topk_idx holds an expert id outside 0..{num_experts - 1}")
    x32 = hidden.float()
    w32 = topk_weights.float()
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        x = x32[tok]
        w = w32[tok, slot][:, None]
        if weight_on_input:
            x = x * w
        gu = w_gate_up[e].float()
        gate_up = x @ gu if transposed else x @ gu.t()
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        dn = w_down[e].float()
        y = h @ dn if transposed else h @ dn.t()
        if not weight_on_input:
            y = y * w
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


def max_num_tokens_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the aligned length: every touched expert pads at most ``block_m - 1`` slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def naive_moe_align_block_size(
    topk_idx: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM-style alignment of (token, slot) pairs to expert blocks.

    ``topk_idx [T, k]`` int -> ``(sorted_token_slot_ids, expert_ids_per_block, num_tokens_post_padded)``:

    - ``sorted_token_slot_ids`` int64 ``[max_num_tokens_padded(T*k, N, block_m)]``: flat pair ids
      ``t * k + slot`` grouped by expert (experts ascending, pairs ascending inside a group), each
      group padded to a multiple of ``block_m`` with the sentinel ``T * k``; the tail after
      ``num_tokens_post_padded`` is sentinel too;
    - ``expert_ids_per_block`` int64 ``[max_num_tokens_padded // block_m]``: the expert of each block
      (one expert per block), ``-1`` for blocks past ``num_tokens_post_padded``;
    - ``num_tokens_post_padded`` int64 ``[1]``: sum over touched experts of the padded group sizes.

    Experts with zero pairs get no block. Buffers have a data-independent size so a GPU caller
    needs no host sync. Raises ``ValueError`` for a non-2-d ``topk_idx``, ``block_m < 1`` or an
    expert id outside ``0..num_experts-1``.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, k], got shape {tuple(topk_idx.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    flat = topk_idx.reshape(-1).long().cpu().tolist()
    num_pairs = len(flat)
    if any(e < 0 or e >= num_experts for e in flat):
        raise ValueError(f"topk_idx holds an expert id outside 0..{num_experts - 1}")
    max_len = max_num_tokens_padded(num_pairs, num_experts, block_m)
    max_blocks = max_len // block_m
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(num_experts):
        group = [p for p, pe in enumerate(flat) if pe == e]
        if not group:
            continue
        padded = -(-len(group) // block_m) * block_m
        sorted_ids += group + [num_pairs] * (padded - len(group))
        expert_ids += [e] * (padded // block_m)
    num_post = len(sorted_ids)
    sorted_ids += [num_pairs] * (max_len - num_post)
    expert_ids += [-1] * (max_blocks - len(expert_ids))
    dev = topk_idx.device
    return (
        torch.tensor(sorted_ids, dtype=torch.int64, device=dev),
        torch.tensor(expert_ids, dtype=torch.int64, device=dev),
        torch.tensor([num_post], dtype=torch.int64, device=dev),
    )
