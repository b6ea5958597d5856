"""Llama-4 text (``Llama4TextMoe``): top-k (k=1) over raw logits, weight = sigmoid(logit) applied to the
*input* of the expert; the router returns dense ``scores [T, N]`` (0 off the chosen experts) and
``logits``; shared MLP untouched (``docs/cases.md`` C5).

HF computes every expert for every token (``routed_in = hidden.repeat(N, 1) * scores``), so a remap
alone would save nothing: this is the one family whose block forward changes in decode. With a policy
that remaps, the routed experts run sparsely (each unique expert's weights read once): the Triton
kernel with ``expert_path="triton"``, transformers' grouped matmul otherwise, both only when the experts are HF's
own plain dense tensors on the compute device (:func:`kernel_storage` at patch time, a cheap device check
per call); other experts (PEFT LoRA on the expert parameters, quantized, offloaded, replaced) run their
own forward inside HF's dense computation, with the remapped dense scores (never silently wrong: a sparse
path reads the weights only when they are the plain expert weights). One exception to that last rule: experts held as
one module per expert (transformers' ``SequentialLlama4TextExperts``, what a pre-quantized bitsandbytes /
compressed-tensors Llama-4 checkpoint loads into, each ``nn.Linear`` a 4-bit one) run only the modules of the experts
the remapped routing uses, each its own forward (:func:`per_expert_modules`): no weight is read by lynx_hf, and the
others' weights are not read at all. With policy ``none`` the block's computation is HF's, bit-identical.
"""

from __future__ import annotations

import torch

from ..core import WeightRule
from ..experts import storage_reason, weights_ready
from .base import FamilySpec


def _dense(block, hidden, scores):
    """HF's ``Llama4TextMoe`` computation for given dense router scores ``[T, N]`` (its own experts module)."""
    routed_in = hidden.repeat(scores.shape[1], 1)
    routed_in = routed_in * scores.transpose(0, 1).reshape(-1, 1)
    routed_out = block.experts(routed_in)
    out = block.shared_expert(hidden)
    out.add_(routed_out.reshape(scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
    return out


def kernel_storage(experts) -> str | None:
    """``None`` if the sparse paths (Triton kernel, :func:`sparse_experts`) may read ``experts``' weights, else
    the reason (checked at patch time by ``lynx_hf.experts.install``; ``weights_ready`` per call).

    The weights must be HF's own ``Llama4TextExperts`` tensors in plain dense storage
    (``lynx_hf.experts.storage_reason``: no PEFT wrapper / parametrization, quantization, offload, tensor
    subclass), laid out ``gate_up_proj [N, H, 2I]`` (gate first), ``down_proj [N, I, H]``, with SiLU.
    """
    reason = storage_reason(experts, names=("gate_up_proj", "down_proj"))
    if reason is not None:
        return reason
    if type(experts).__name__ != "Llama4TextExperts":
        return f"experts module is a {type(experts).__name__}, not Llama4TextExperts (wrapped or replaced)"
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[-1] % 2 or \
            tuple(down.shape) != (gate_up.shape[0], gate_up.shape[-1] // 2, gate_up.shape[1]):
        return f"shapes gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} are not [N, H, 2I] / [N, I, H]"
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")):
        return "activation is not SiLU"
    return None


def sparse_experts(experts, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Routed output of ``Llama4TextExperts`` for the chosen experts only, sync-free (grouped matmul).

    ``hidden [T, H]``, ``topk_idx [T, k]`` int, ``topk_weights [T, k]`` -> ``[T, H]`` in ``hidden.dtype``.
    Layout: ``gate_up_proj [N, H, 2I]`` (gate first), ``down_proj [N, I, H]``; weight on the input.
    """
    from transformers.integrations.moe import _grouped_linear

    num_tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    tokens = order // top_k
    x = hidden[tokens] * topk_weights.reshape(-1)[order, None].to(hidden.dtype)
    hist = flat.float() if hidden.device.type in ("cpu", "mps") else flat.int()
    counts = torch.histc(hist, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = _grouped_linear(x, experts.gate_up_proj, offsets, is_transposed=True).chunk(2, dim=-1)
    y = _grouped_linear(up * experts.act_fn(gate), experts.down_proj, offsets, is_transposed=True)
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tokens, y.float())
    return out.to(hidden.dtype)


def per_expert_modules(experts) -> bool:
    """Whether ``experts`` holds one module per expert that maps ``[rows, H] -> [rows, H]`` (transformers'
    ``SequentialLlama4TextExperts``, a ``ModuleList`` of ``Llama4TextMLP``: ``docs/expert-storage.md``)."""
    return type(experts).__name__ == "SequentialLlama4TextExperts" and isinstance(experts, torch.nn.ModuleList)


def sequential_experts(experts, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """Routed output of per-expert modules (:func:`per_expert_modules`) for the chosen experts only: each used expert's
    own module on its tokens' inputs times their weights (Llama-4 weighs the input), summed per token. The host reads
    the experts used (one sync on an accelerator, as the module's own loop over every expert does not need; it reads
    the weights of every expert instead)."""
    out = torch.zeros(hidden.shape[0], hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    for e in torch.unique(topk_idx).tolist():  # the host sync
        token, slot = torch.where(topk_idx == e)
        x = hidden[token] * topk_weights[token, slot, None].to(hidden.dtype)
        out.index_add_(0, token, experts[e](x).float())
    return out.to(hidden.dtype)


def decode_forward(state, step, hidden_states):
    block = state.block
    hidden = hidden_states.reshape(-1, block.hidden_dim)
    scores, logits = block.router(hidden)
    idx = torch.topk(logits, block.top_k, dim=1).indices  # the router's own selection
    weights = scores.gather(1, idx)
    new_weights, new_idx = state.route(step, logits, weights, idx)
    if new_idx is idx:  # policy none: HF's computation
        return _dense(block, hidden, scores), logits
    experts = block.experts
    if per_expert_modules(experts):  # e.g. 4-bit linears per expert: run the used experts' own modules only
        out = block.shared_expert(hidden)
        out.add_(sequential_experts(experts, hidden, new_idx, new_weights))
        return out, logits
    if not state.kernel_allowed or not weights_ready(experts, hidden):
        # the experts module's own forward (PEFT-wrapped, quantized, offloaded...), with the remapped dense scores
        dense = torch.zeros_like(scores).scatter_(1, new_idx, new_weights.to(scores.dtype))
        return _dense(block, hidden, dense), logits
    if state.plan.expert_kernel:  # expert_path="triton" chosen explicitly
        routed = state.plan.sparse_moe(hidden, new_idx, new_weights, experts.gate_up_proj, experts.down_proj,
                                           transposed=True, weight_on_input=True, exact_grid=False)
    else:
        routed = sparse_experts(experts, hidden, new_idx, new_weights)
    out = block.shared_expert(hidden)
    out.add_(routed)
    return out, logits


class _Llama4Spec(FamilySpec):
    def shape(self, block):
        return int(block.num_experts), int(block.top_k)

    @staticmethod
    def kernel_storage(experts) -> str | None:
        return kernel_storage(experts)


SPEC = _Llama4Spec(
    family="llama4",
    block_classes=(("transformers.models.llama4.modeling_llama4", "Llama4TextMoe"),),
    router="router",
    weight_rule_of=lambda router, block: WeightRule("sigmoid"),
    decode_forward=decode_forward,
)
