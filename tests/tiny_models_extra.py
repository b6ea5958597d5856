"""Tiny random-weight models of the families added in issue 7 (dedicated: Qwen3-MoE, OLMoE,
DeepSeek-V3; generic-adapter: GraniteMoE, FlexOlmo, HunYuan-V1-MoE; refused by the generic adapter:
PhiMoE), built from configs (no hub access). Same conventions as ``tiny_models``."""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    FlexOlmoConfig,
    FlexOlmoForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    HunYuanMoEV1Config,
    HunYuanMoEV1ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tiny_models import COMMON, prompts  # noqa: F401  (re-exported for the tests)


def qwen3_moe(norm_topk_prob=True, **kw):
    # 3 layers, layer 1 dense (mlp_only_layers): dense layers stay untouched.
    params = dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_experts=12,
                  num_experts_per_tok=3, decoder_sparse_step=1, mlp_only_layers=[1], head_dim=8,
                  norm_topk_prob=norm_topk_prob)
    params.update(kw)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, **params))


def olmoe(norm_topk_prob=False, **kw):
    # Real OLMoE-1B-7B: 64 experts, top-8 (N/k = 8); tiny: 16 experts, top-4 (N/k = 4).
    params = dict(intermediate_size=16, num_hidden_layers=2, num_experts=16, num_experts_per_tok=4,
                  norm_topk_prob=norm_topk_prob)
    params.update(kw)
    return OlmoeForCausalLM(OlmoeConfig(**COMMON, **params))


def deepseek_v3(**kw):
    # 16 experts in 4 groups of 4, 2 groups allowed -> 8 allowed experts per token, k=3; layer 0 dense.
    params = dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=16,
                  num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    params.update(kw)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, **params))


def granitemoe(**kw):
    params = dict(intermediate_size=16, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)
    params.update(kw)
    return GraniteMoeForCausalLM(GraniteMoeConfig(**COMMON, **params))


def flex_olmo(**kw):
    params = dict(intermediate_size=16, num_hidden_layers=2, num_experts=10, num_experts_per_tok=3,
                  norm_topk_prob=False)
    params.update(kw)
    return FlexOlmoForCausalLM(FlexOlmoConfig(**COMMON, **params))


def hunyuan_v1_moe(**kw):
    # sigmoid-free softmax router with renormalization, a shared MLP beside the routed experts.
    params = dict(intermediate_size=16, num_hidden_layers=2, num_experts=8, moe_topk=2, head_dim=8)
    params.update(kw)
    return HunYuanMoEV1ForCausalLM(HunYuanMoEV1Config(**COMMON, **params))


def phimoe(**kw):
    # sparsemixer routing: not a softmax/sigmoid top-k rule; the generic adapter must refuse it.
    params = dict(intermediate_size=16, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2)
    params.update(kw)
    return PhimoeForCausalLM(PhimoeConfig(**COMMON, **params))


DEDICATED = {"qwen3_moe": qwen3_moe, "olmoe": olmoe, "deepseek_v3": deepseek_v3}
GENERIC = {"granitemoe": granitemoe, "flex_olmo": flex_olmo, "hunyuan_v1_moe": hunyuan_v1_moe}
FAMILIES = {**DEDICATED, **GENERIC, "phimoe": phimoe}

_ROUTER_WEIGHTS = ("gate.weight", "router.weight", "gate.wg.weight")


def build(family: str, seed: int = 0, dtype=torch.float32, router_scale: float = 20.0, **kw):
    torch.manual_seed(seed)
    model = FAMILIES[family](**kw).to(dtype).eval()
    # Random init leaves routers near-uniform; scale them so routing has realistic confidence.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_ROUTER_WEIGHTS) and p.dim() == 2 and p.shape[0] > 1:
                p.mul_(router_scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only bias: make it matter
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + 7)) * 0.1)
    return model
