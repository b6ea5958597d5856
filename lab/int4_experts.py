"""4-bit routed experts that run on this CPU: int4 weights, groupwise asymmetric, in the layout of PyTorch's own
"tinygemm" int4 matmul (``torch.ops.aten._weight_int4pack_mm_for_cpu``; on CUDA ``_weight_int4pack_mm``), one
2-D weight per expert, computing only the experts a call routes to (transformers' ``eager`` experts loop).

Why this module exists (``docs/expert-storage.md``, "4-bit experts"): transformers 5 stores a layer's experts fused
(``gate_up_proj [N, 2I, H]``, ``down_proj [N, H, I]``), and no quantizer that runs on this CPU stack quantizes those
3-D parameters with a 4-bit compute path: bitsandbytes, HQQ and quanto replace ``nn.Linear`` modules only (the
experts stay in 16/32-bit), torchao's int4 configs refuse 3-D weights on CPU (``Int4WeightOnlyConfig`` plain: "Requires
mslk >= 1.0.0"; tile-packed: CUDA only; ``IntxWeightOnlyConfig``: "only works for 2-d and 4-d Tensors"), its CPU int4
tensor (``Int4OpaqueTensor``) is 2-D ``nn.Linear`` only, and compressed-tensors dequantizes packed experts at load.
torchao's CPU int4 path is PyTorch's tinygemm CPU kernel on a 2-D weight; this module applies that kernel per
expert, without torchao (the packing below is the tinygemm layout written out), so the benchmark and the tests need
no extra package. transformers does the same for Llama-4 under bitsandbytes (``SequentialLlama4TextExperts``: a
``Linear4bit`` per expert), but bitsandbytes' 4-bit matmul on this CPU is ~20x slower than bf16, which would hide
every expert-count effect.

Quantization (per expert, per output row, per group of ``group_size`` input columns): ``scale = (max - min) / 15``,
``zero = min + 8 * scale``, ``q = round((w - min) / scale)`` in 0..15; dequantized ``w' = (q - 8) * scale + zero``
(:meth:`Int4Experts.dequantized`, the reference the tests compare the kernel with).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
_INNER_K_TILES = 8  # CUDA tinygemm: K must be a multiple of 16 * inner_k_tiles


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q int32 [N, K] in 0..15, scale [N, K / g], zero [N, K / g])`` of a 2-D weight ``[N, K]`` (fp32 math)."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"input size {cols} is not a multiple of group_size {group_size}")
    g = weight.float().reshape(rows, cols // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(rows, cols)
    return q, scale, lo + 8 * scale


def _pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    byte = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # CUDA tinygemm: two int4 per byte, even index high
    return torch.ops.aten._convert_weight_to_int4pack(byte, _INNER_K_TILES)


def _matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group_size, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scales_zeros)


class Int4Experts(torch.nn.Module):
    """Routed experts in int4 (module docstring), built from a transformers experts module in the fused, gated,
    untransposed layout (``gate_up_proj [N, 2I, H]`` gate first, ``down_proj [N, H, I]``, no bias), e.g.
    ``Qwen2MoeExperts``, ``MixtralExperts``, ``DeepseekV2Experts``: :meth:`from_experts`. ``forward(hidden [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, the experts interface's signature, so it replaces the
    experts child of a block in place. Buffers ``gate_up_qweight`` / ``down_qweight`` (packed int4, per expert) and
    ``gate_up_scales`` / ``down_scales`` (``[N, K / g, out, 2]`` scale and zero, in the compute dtype). Each call runs
    only the experts with a routed token; ``last_experts`` is how many it ran (the experts whose 4-bit weights it
    read)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, group_size: int, act_fn,
                 dtype: torch.dtype, gate_up_q, gate_up_sz, down_q, down_sz):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.group_size, self.act_fn, self.dtype = group_size, act_fn, dtype
        self.register_buffer("gate_up_qweight", gate_up_q)
        self.register_buffer("gate_up_scales", gate_up_sz)
        self.register_buffer("down_qweight", down_q)
        self.register_buffer("down_scales", down_sz)
        self.last_experts = 0

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: torch.nn.Module, group_size: int = GROUP_SIZE, device=None) -> Int4Experts:
        """Quantize ``experts``' weights (module docstring) for ``device`` (default: where they are). The compute dtype
        is theirs on CPU (fp32 / bf16 / fp16), bf16 on CUDA (the CUDA kernel's only one)."""
        if getattr(experts, "is_transposed", False) or not getattr(experts, "has_gate", True) \
                or getattr(experts, "has_bias", False):
            raise ValueError(f"{type(experts).__name__}: only gate_up [N, 2I, H] / down [N, H, I] without bias")
        gate_up, down = experts.gate_up_proj, experts.down_proj
        num_experts, two_i, hidden = gate_up.shape
        device = torch.device(device) if device is not None else gate_up.device
        dtype = gate_up.dtype if device.type == "cpu" else torch.bfloat16
        packed = {"gate_up": ([], []), "down": ([], [])}
        for e in range(num_experts):
            for name, w in (("gate_up", gate_up[e]), ("down", down[e])):
                q, scale, zero = quantize(w.detach().to(device), group_size)
                packed[name][0].append(_pack(q, device))
                packed[name][1].append(torch.stack([scale, zero], -1).transpose(0, 1).to(device, dtype).contiguous())
        stacked = [torch.stack(packed[n][i]) for n in ("gate_up", "down") for i in (0, 1)]
        return cls(int(num_experts), int(hidden), int(two_i) // 2, group_size, experts.act_fn, dtype, *stacked)

    def dequantized(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [2I, H], down [H, I])`` of ``expert`` dequantized in fp32 (CPU layout only): the reference."""
        out = []
        for qw, sz, rows, cols in ((self.gate_up_qweight, self.gate_up_scales, 2 * self.intermediate_dim,
                                    self.hidden_dim),
                                   (self.down_qweight, self.down_scales, self.hidden_dim, self.intermediate_dim)):
            eye = torch.eye(cols, dtype=torch.float32)
            # the kernel applied to the identity reads the dequantized weight back exactly (fp32 activations)
            sz32 = sz[expert].float()
            out.append(_matmul(eye, qw[expert], self.group_size, sz32).T[:rows].contiguous())
        return out[0], out[1]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros(hidden_states.shape[0], self.hidden_dim, dtype=torch.float32, device=hidden_states.device)
        x_all = hidden_states.to(self.dtype)
        hit = torch.unique(top_k_index).tolist()  # the host reads the routing, as transformers' eager loop does
        self.last_experts = len(hit)
        for e in hit:
            token, slot = torch.where(top_k_index == e)
            x = x_all[token]
            gate, up = _matmul(x, self.gate_up_qweight[e], self.group_size, self.gate_up_scales[e]).chunk(2, dim=-1)
            y = _matmul(self.act_fn(gate) * up, self.down_qweight[e], self.group_size, self.down_scales[e])
            out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
        return out.to(hidden_states.dtype)


def quantize_experts(model: torch.nn.Module, group_size: int = GROUP_SIZE, device=None) -> int:
    """Replace the ``experts`` child of every MoE block of ``model`` whose experts have the fused gated layout by an
    :class:`Int4Experts` (in place, before ``lynx_hf.patch``); returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        experts = module._modules.get("experts")
        if experts is None or isinstance(experts, Int4Experts) or not hasattr(experts, "gate_up_proj"):
            continue
        module.experts = Int4Experts.from_experts(experts, group_size, device)
        count += 1
    return count
