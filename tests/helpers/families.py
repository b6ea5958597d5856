"""The family registry: one tiny random-weight model per MoE family the project knows, built from configs (no hub
access), and what each family is to lynx_hf.

``FAMILIES[name]`` is a :class:`Family`: ``kind`` is ``"dedicated"`` (its own spec in ``patches/``), ``"generic"``
(``patches/generic.py`` infers the weight rule and verifies it against the router) or ``"refused"`` (the generic
spec must refuse it with ``UnsupportedModelError``); ``rule(config)`` is the weight rule a remap must reproduce
(``docs/design.md`` "Family rules"), read from the tiny model's config. Tests parametrise over the name tuples
below instead of hand lists:

- ``PATCHABLE``: every family lynx_hf patches (dedicated + generic);
- ``DEDICATED`` / ``GENERIC`` / ``REFUSED``: by kind;
- ``CONFIGS``: ``(family, config overrides)`` for every patchable family and each of its variants (the config
  fields that change its routing or weight rule);
- ``REPRESENTATIVE``: one family per router shape (softmax over N with a shared expert and dense layers; softmax over
  the chosen k; group-limited with a routed scaling factor; sigmoid applied to the expert input with a block
  forward): the per-family tests too slow for every family run on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    FlexOlmoConfig,
    FlexOlmoForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    HunYuanMoEV1Config,
    HunYuanMoEV1ForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lynx_hf.core import WeightRule

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# -- the tiny models (random init, routers not yet scaled: use ``build``) -----------------------------------------
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
    # sparsemixer routing: not a softmax/sigmoid top-k rule; the generic spec must refuse it.
    params = dict(intermediate_size=16, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2)
    params.update(kw)
    return PhimoeForCausalLM(PhimoeConfig(**COMMON, **params))


def _granitemoe_kind() -> str:
    """``"generic"`` where GraniteMoE's router returns ``(logits [T, N], weights [T, k], ids [T, k])``, the generic
    contract (transformers 5.24); ``"refused"`` on a release whose router returns another layout (5.19: weights,
    ids, logits), which the generic spec refuses with a typed error naming the layout."""
    with torch.random.fork_rng(), torch.no_grad():  # the global RNG is left as it was
        torch.manual_seed(0)
        model = granitemoe()
        block = model.model.layers[0].block_sparse_moe
        router = getattr(block, "router", None) or block.gate
        out = router(torch.randn(3, COMMON["hidden_size"]))
    return "generic" if out[0].shape[-1] == model.config.num_local_experts else "refused"


_GRANITE = _granitemoe_kind()


# -- the registry ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One family: ``make(**config_overrides)`` builds its tiny model (routers unscaled; tests call :func:`build`);
    ``kind``: ``"dedicated"``, ``"generic"`` or ``"refused"``; ``rule(config)``: the weight rule a remap must
    reproduce on the chosen experts (``None`` for a refused family); ``routing``: what the router does, in words."""

    name: str
    make: Callable
    kind: str
    rule: Callable | None
    routing: str
    variants: tuple = ()  # config overrides that change the routing or weight rule (tests run each)


_REGISTRY = (
    Family("qwen2_moe", qwen2_moe, "dedicated", lambda c: WeightRule("softmax_all", bool(c.norm_topk_prob)),
           "softmax over N, picked, renormalised iff norm_topk_prob; gated shared expert; layer 1 dense",
           ({"norm_topk_prob": True},)),
    Family("mixtral", mixtral, "dedicated", lambda c: WeightRule("softmax_all", True),
           "softmax over the chosen k"),
    Family("deepseek_v2", deepseek_v2, "dedicated",
           lambda c: WeightRule("softmax_all", False, float(c.routed_scaling_factor)),
           "softmax over N, picked, x routed_scaling_factor, group-limited; shared experts; layer 0 dense",
           ({"topk_method": "greedy"},)),
    Family("llama4", llama4, "dedicated", lambda c: WeightRule("sigmoid"),
           "sigmoid of the chosen logit applied to the expert input (k = 1); shared MLP; the block forward is ours"),
    Family("qwen3_moe", qwen3_moe, "dedicated", lambda c: WeightRule("softmax_all", bool(c.norm_topk_prob)),
           "softmax over N, picked, renormalised iff norm_topk_prob; layer 1 dense", ({"norm_topk_prob": False},)),
    Family("olmoe", olmoe, "dedicated", lambda c: WeightRule("softmax_all", bool(c.norm_topk_prob)),
           "softmax over N, picked, renormalised iff norm_topk_prob", ({"norm_topk_prob": True},)),
    Family("deepseek_v3", deepseek_v3, "dedicated",
           lambda c: WeightRule("sigmoid", bool(c.norm_topk_prob), float(c.routed_scaling_factor)),
           "sigmoid + correction bias selects (grouped); the unbiased sigmoid weights, renormalised, scaled",
           ({"norm_topk_prob": False},)),
    Family("granitemoe", granitemoe, _GRANITE,
           (lambda c: WeightRule("softmax_all", True)) if _GRANITE == "generic" else None,
           "softmax over the chosen k (no attribute says so: inferred)" if _GRANITE == "generic" else
           "transformers < 5.24: the router returns (weights, ids, logits), not the generic contract"),
    Family("flex_olmo", flex_olmo, "generic", lambda c: WeightRule("softmax_all", bool(c.norm_topk_prob)),
           "softmax over N, picked (norm_topk_prob=False stated)"),
    Family("hunyuan_v1_moe", hunyuan_v1_moe, "generic", lambda c: WeightRule("softmax_all", True),
           "softmax over N, always renormalised; shared MLP"),
    Family("phimoe", phimoe, "refused", None, "sparsemixer: not a softmax / sigmoid top-k rule"),
)
FAMILIES: dict[str, Family] = {family.name: family for family in _REGISTRY}

DEDICATED = tuple(name for name, f in FAMILIES.items() if f.kind == "dedicated")
GENERIC = tuple(name for name, f in FAMILIES.items() if f.kind == "generic")
REFUSED = tuple(name for name, f in FAMILIES.items() if f.kind == "refused")
PATCHABLE = DEDICATED + GENERIC
REPRESENTATIVE = ("qwen2_moe", "mixtral", "deepseek_v2", "llama4")
# every patchable family with its own config, then each variant: (family, config overrides)
CONFIGS = tuple((name, {}) for name in PATCHABLE) + tuple((name, v) for name in PATCHABLE
                                                          for v in FAMILIES[name].variants)

_ROUTER_WEIGHTS = ("gate.weight", "router.weight", "gate.wg.weight")


def build(family: str, seed: int = 0, dtype=torch.float32, router_scale: float = 20.0, **kw):
    """The tiny model of ``family`` (config overrides ``kw``), in eval mode, routers scaled by ``router_scale``."""
    torch.manual_seed(seed)
    model = FAMILIES[family].make(**kw).to(dtype).eval()
    # Random init leaves routers near-uniform; scale them so routing has realistic confidence.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_ROUTER_WEIGHTS) and p.dim() == 2 and p.shape[0] > 1:
                p.mul_(router_scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only bias: make it matter
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + 7)) * 0.1)
    return model


def rule_weights(rule: WeightRule, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The weight rule written out (``docs/design.md`` "Family rules"): the fp32 weights of experts ``idx``
    ``[T, k]`` from the router logits ``[T, N]``."""
    x = logits.float()
    if rule.kind == "softmax_all":
        w = torch.softmax(x, -1).gather(1, idx)
    elif rule.kind == "softmax_chosen":
        w = torch.softmax(x.gather(1, idx), -1)
    else:
        w = torch.sigmoid(x.gather(1, idx))
    if rule.renormalize:
        w = w / (w.sum(-1, keepdim=True) + rule.renorm_eps)
    return w * rule.scale


def cache_kw(model, cache) -> dict:
    """The forward keyword that passes the KV ``cache``: ``cache`` from transformers 5.24 (``past_key_values``
    warns there), ``past_key_values`` before (5.19 would take ``cache=`` into ``**kwargs`` and run without it)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache}


def cache_of(out):
    """The KV cache a forward returned: ``out.cache`` from transformers 5.24, ``out.past_key_values`` before."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


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


def teacher_forced(model, ids, mask, tokens, recorder=None):
    """Prefill ``ids`` / ``mask [B, P]``, then one teacher-forced decode step per ``tokens[i] [B, 1]`` through the KV
    cache; the logits of each forward (prefill first). ``recorder``: an object whose ``decode`` flag is True during
    the decode forwards (hooks that record only decode calls)."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for tok in tokens:
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            if recorder is not None:
                recorder.decode = True
            out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
            if recorder is not None:
                recorder.decode = False
            logits.append(out.logits)
            cache = out.past_key_values
    return logits
