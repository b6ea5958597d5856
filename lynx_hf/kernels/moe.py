"""Sparse decode expert kernel (Triton), vLLM style (``docs/design.md`` "Kernels").

Decode MoE is memory-bandwidth bound: its cost is the weights of the distinct experts the batch
touches. :func:`sparse_moe` sorts the (token, slot) pairs by expert, pads each expert's group to a
multiple of ``BLOCK_M`` (:func:`moe_align_block_size`), and runs one program per (block, tile of
output columns); a block holds one expert, so each touched expert's weight tile is streamed once
per block (once in total when an expert has at most ``BLOCK_M`` pairs, the decode case). This is
what turns LYNX's smaller expert set (arXiv 2411.08982, Sec. 4-5) into lower latency.

Two kernels, deterministic (no atomics):

1. ``gate_up`` GEMM + ``silu(gate) * up`` -> intermediate ``[T*k, I]`` (hidden dtype, fp32 accumulate);
2. ``down`` GEMM (fp32 accumulate, routing weight applied unless ``weight_on_input``) -> one fp32
   row per (token, slot) ``[T*k, H]``; the sum over the k slots is done in torch (fixed order),
   then cast to the hidden dtype.

Weight layouts are those of :mod:`.moe_naive` (``transposed`` selects Llama-4's); strides are passed
to the kernels, so non-contiguous expert tensors work too. All offsets are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .moe_naive import _check_moe_args, max_num_tokens_padded

#: the interpreter (CPU tests) is chosen when triton is first imported; read once, like triton does.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def moe_block_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                     dtype: torch.dtype) -> dict:
    """Launch configuration of both expert kernels for one decode step (one source of truth: the
    launcher :func:`sparse_moe`, the AOT compile test and ``lab/kernel_report.py`` call it).

    ``T`` tokens, ``k`` slots, ``N`` experts, hidden ``H``, intermediate ``I``, expert ``dtype`` ->
    ``{"block_m", "block_n", "block_k", "num_warps", "num_stages"}``. ``block_m`` is the smallest power
    of two >= 16 (``tl.dot``'s minimum) that holds the average number of (token, slot) pairs per expert,
    ``T*k/N``, at most 64, so a touched expert is usually one block. ``block_n`` / ``block_k`` follow
    vLLM's untuned fused-MoE defaults (``fused_moe.get_default_config``: 32 / 64 for small M, 64 / 32
    otherwise); ``num_warps`` 4 and ``num_stages`` 3 are Triton's defaults. ``H`` and ``I`` only bound
    the tiles (never above the next power of two of the dimension, at least 16). Not tuned on a GPU
    yet: ``lab/gpu_check.py`` measures it against transformers' ``grouped_mm``.
    """
    pairs_per_expert = -(-num_tokens * top_k // max(num_experts, 1))
    block_m = min(64, max(16, triton.next_power_of_2(max(pairs_per_expert, 1))))
    block_n, block_k = (32, 64) if block_m == 16 else (64, 32)
    block_n = max(16, min(block_n, triton.next_power_of_2(max(min(hidden, inter), 1))))
    block_k = max(16, min(block_k, triton.next_power_of_2(max(min(hidden, inter), 1))))
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 3}


def moe_align_block_size(
    topk_idx: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align (token, slot) pairs to expert blocks; same contract and values as
    :func:`.moe_naive.naive_moe_align_block_size` (vLLM ``moe_align_block_size``).

    Implemented with a handful of torch ops (stable sort, scatter-add, cumsum, searchsorted) rather
    than a Triton kernel: at decode sizes (``T*k`` <= a few thousand) it is a few tiny launches, all
    on the device and with no host sync, and a Triton version would not pay for its complexity.
    ``topk_idx [T, k]`` int -> ``(sorted_token_slot_ids int64 [max_num_tokens_padded(T*k, N, block_m)],
    expert_ids_per_block int64 [that // block_m], num_tokens_post_padded int64 [1])``; sentinel
    ``T*k`` pads each expert group and the tail, ``-1`` marks unused blocks. Raises ``ValueError`` for
    a non-2-d ``topk_idx`` or ``block_m < 1``. Expert ids must lie in ``0..num_experts-1``
    (not checked here: it would cost a device sync).
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, k], got shape {tuple(topk_idx.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    dev = topk_idx.device
    flat = topk_idx.reshape(-1).long()
    num_pairs = flat.numel()
    max_len = max_num_tokens_padded(num_pairs, num_experts, block_m)
    max_blocks = max_len // block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    group_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    rank = torch.arange(num_pairs, device=dev) - group_start[sorted_e]
    sorted_ids = torch.full((max_len,), num_pairs, dtype=torch.int64, device=dev)
    sorted_ids[padded_start[sorted_e] + rank] = order
    block_start = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, torch.full_like(expert_ids, -1))
    num_post = padded_end[-1:].clone() if num_experts else torch.zeros(1, dtype=torch.int64, device=dev)
    return sorted_ids, expert_ids, num_post


@triton.jit
def _gate_up_act_kernel(
    x_ptr, w_ptr, rw_ptr, sorted_ptr, expert_ptr, npost_ptr, h_ptr,
    num_pairs, top_k, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_hp, stride_hi,
    WEIGHT_ON_INPUT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    tok = pair // top_k
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < I
    if WEIGHT_ON_INPUT:
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + e * stride_we
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        kmask = offs_k < H
        x = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh,
                    mask=valid[:, None] & kmask[None, :], other=0.0)
        if WEIGHT_ON_INPUT:
            x = (x.to(tl.float32) * rw[:, None]).to(x.dtype)
        wmask = kmask[:, None] & nmask[None, :]
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=wmask, other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + I) * stride_wn + offs_k[:, None] * stride_wk, mask=wmask, other=0.0)
        x = x.to(wg.dtype)
        if IEEE:
            acc_g = tl.dot(x, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(x, wg, acc_g)
            acc_u = tl.dot(x, wu, acc_u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + pair[:, None] * stride_hp + offs_n[None, :] * stride_hi,
             h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, rw_ptr, sorted_ptr, expert_ptr, npost_ptr, y_ptr,
    num_pairs, H, I,
    stride_hp, stride_hi, stride_we, stride_wn, stride_wk, stride_yp, stride_yh,
    WEIGHT_ON_INPUT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + e * stride_we
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        kmask = offs_k < I
        h = tl.load(h_ptr + pair[:, None] * stride_hp + offs_k[None, :] * stride_hi,
                    mask=valid[:, None] & kmask[None, :], other=0.0)
        wd = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                     mask=kmask[:, None] & nmask[None, :], other=0.0)
        h = h.to(wd.dtype)
        if IEEE:
            acc = tl.dot(h, wd, acc, input_precision="ieee")
        else:
            acc = tl.dot(h, wd, acc)
    if WEIGHT_ON_INPUT == 0:
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    tl.store(y_ptr + pair[:, None] * stride_yp + offs_n[None, :] * stride_yh, acc,
             mask=valid[:, None] & nmask[None, :])


def sparse_moe(
    hidden: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    transposed: bool = False,
    weight_on_input: bool = False,
    activation: str = "silu",
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    exact_grid: bool | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer, sparse Triton decode kernel. Returns ``[T, H]`` in ``hidden.dtype``.

    Same arguments and result as :func:`.moe_naive.naive_sparse_moe` (layouts, ``weight_on_input``,
    fp32 accumulation); the gate/up intermediate is stored in ``hidden.dtype`` (exact for fp32; one
    rounding for bf16/fp16, as the model's own bf16 expert does). fp32/fp16/bf16 on CUDA; under the
    interpreter (``TRITON_INTERPRET=1``, CPU) non-fp32 inputs are upcast to fp32 (the interpreter's
    bf16 ``tl.dot`` is unusable) and the result is cast back to ``hidden.dtype``. Block sizes default
    to :func:`moe_block_config` (each given one overrides it): ``block_m`` >= 16 (``tl.dot``),
    ``block_n`` / ``block_k`` powers of two >= 16. ``exact_grid`` (default: on non-CUDA devices)
    launches exactly the used blocks (one host sync); otherwise the grid is the data-independent upper
    bound and programs past ``num_tokens_post_padded`` exit at once (no sync, CUDA-graph friendly;
    the decode path passes ``False``).

    Raises ``ValueError`` for inconsistent shapes or dtypes (see :func:`.moe_naive.naive_sparse_moe`),
    mixed devices, or bad block sizes. Expert ids are not range-checked (that would need a sync).
    Implements the expert side of LYNX's decode speed-up (arXiv 2411.08982, Sec. 5, latency).
    """
    num_tokens, hidden_size, num_experts, inter, top_k = _check_moe_args(
        hidden, topk_idx, topk_weights, w_gate_up, w_down, transposed, activation
    )
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"hidden must be fp32/fp16/bf16, got {hidden.dtype}")
    if w_gate_up.dtype != w_down.dtype or not w_gate_up.is_floating_point():
        raise ValueError(f"expert weights must share one float dtype, got {w_gate_up.dtype} / {w_down.dtype}")
    cfg = moe_block_config(num_tokens, top_k, num_experts, hidden_size, inter, w_gate_up.dtype)
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = cfg["block_n"] if block_n is None else block_n
    block_k = cfg["block_k"] if block_k is None else block_k
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    dev = hidden.device
    num_pairs = num_tokens * top_k
    out_dtype = hidden.dtype
    if _INTERPRET and (hidden.dtype != torch.float32 or w_gate_up.dtype != torch.float32):
        # the interpreter's bf16/fp16 tl.dot is unusable: compute in fp32, return hidden's dtype
        hidden, w_gate_up, w_down = hidden.float(), w_gate_up.float(), w_down.float()
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden_size, dtype=out_dtype, device=dev)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_idx, num_experts, block_m)
    if exact_grid is None:
        exact_grid = dev.type != "cuda"
    num_blocks = int(num_post.item()) // block_m if exact_grid else expert_ids.numel()
    rw = topk_weights.reshape(-1).contiguous()
    x = hidden
    h = torch.empty(num_pairs, inter, dtype=out_dtype, device=dev)
    y = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=dev)
    ieee = hidden.dtype == torch.float32 and w_gate_up.dtype == torch.float32
    if transposed:  # gate_up [N, H, 2I], down [N, I, H]
        gu_strides = (w_gate_up.stride(0), w_gate_up.stride(2), w_gate_up.stride(1))
        dn_strides = (w_down.stride(0), w_down.stride(2), w_down.stride(1))
    else:  # gate_up [N, 2I, H], down [N, H, I]
        gu_strides = (w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2))
        dn_strides = (w_down.stride(0), w_down.stride(1), w_down.stride(2))
    if num_blocks > 0:
        _gate_up_act_kernel[(num_blocks, triton.cdiv(inter, block_n))](
            x, w_gate_up, rw, sorted_ids, expert_ids, num_post, h,
            num_pairs, top_k, hidden_size, inter,
            x.stride(0), x.stride(1), *gu_strides, h.stride(0), h.stride(1),
            WEIGHT_ON_INPUT=bool(weight_on_input), IEEE=ieee,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
            h, w_down, rw, sorted_ids, expert_ids, num_post, y,
            num_pairs, hidden_size, inter,
            h.stride(0), h.stride(1), *dn_strides, y.stride(0), y.stride(1),
            WEIGHT_ON_INPUT=bool(weight_on_input), IEEE=ieee,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return y.view(num_tokens, top_k, hidden_size).sum(dim=1).to(out_dtype)
