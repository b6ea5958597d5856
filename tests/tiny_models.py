"""Tiny random-weight models of each supported family, built from configs (no hub access)."""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen2_moe(norm_topk_prob=False, **kw):
    # 3 layers, layer 1 dense (mlp_only_layers): dense layers must stay untouched.
    cfg = Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_hidden_layers=3, num_experts=12, num_experts_per_tok=3, decoder_sparse_step=1,
                         mlp_only_layers=[1], norm_topk_prob=norm_topk_prob, **kw)
    return Qwen2MoeForCausalLM(cfg)


def mixtral(**kw):
    cfg = MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8,
                        num_experts_per_tok=2, **kw)
    return MixtralForCausalLM(cfg)


def deepseek_v2(topk_method="group_limited_greedy", **kw):
    # 16 experts in 4 groups of 4, 2 groups allowed -> 8 allowed experts per token, k=3; layer 0 dense.
    params = dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=16,
                  num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, topk_method=topk_method,
                  routed_scaling_factor=1.5, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    params.update(kw)
    cfg = DeepseekV2Config(**{**COMMON, "num_key_value_heads": 4}, **params)  # MLA: kv heads == heads
    return DeepseekV2ForCausalLM(cfg)


def llama4(**kw):
    # N = 6 experts, T in tests != 6 so a transposed [T, N] / [N, T] layout shows (CASES C5).
    params = dict(intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=2, num_local_experts=6,
                  num_experts_per_tok=1, head_dim=8, interleave_moe_layer_step=1, attention_chunk_size=64,
                  no_rope_layers=[1, 1])
    params.update(kw)
    cfg = Llama4TextConfig(**COMMON, **params)
    return Llama4ForCausalLM(cfg)


FAMILIES = {"qwen2_moe": qwen2_moe, "mixtral": mixtral, "deepseek_v2": deepseek_v2, "llama4": llama4}


def build(family: str, seed: int = 0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    model = FAMILIES[family](**kw).to(dtype).eval()
    # Random init leaves routers near-uniform; scale them so routing has realistic confidence.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] > 1:
                p.mul_(20.0)
    return model


def prompts(batch: int, length: int, seed: int = 0, left_pad: bool = True):
    """Random token ids ``[batch, length]`` and an attention mask with left padding on odd rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if left_pad:
        for row in range(1, batch, 2):
            pad = min(row % 4 + 1, length - 1)
            ids[row, :pad] = COMMON["pad_token_id"]
            mask[row, :pad] = 0
    return ids, mask


def tokenizer():
    """A word-level fast tokenizer over the tiny vocabulary ("w5 w9" -> [5, 9]); left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.padding_side = "left"
    return fast


def save_checkpoint(family: str, path, **kw):
    """Save a tiny model of ``family`` plus the word-level tokenizer as a local HF checkpoint."""
    build(family, **kw).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path
