"""A tiny random dense Llama and a random carve of its FFNs (the form of fixtures D / D2 / D3's ``carve.safetensors``),
shared by the distillation tests (tests/tools/test_distill_fixture_d*.py): no wheel, no GGUF."""

import torch

H, INTER, SHARED, N, K = 32, 96, 32, 8, 2   # 8 routed experts of 8 neurons + a 32-neuron shared expert, top-2


def dense_model(seed=0):
    """A 2-layer ``LlamaForCausalLM`` (hidden ``H``, FFN ``INTER``), eval mode, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                      initializer_range=0.3)   # large weights: the FFNs move the logits
    return LlamaForCausalLM(cfg).eval()


def carve(model, seed=1, shared_gate=False):
    """Per layer: ``perm [INTER]`` int16, ``router [N, H]``, ``scale [N]`` and, with ``shared_gate``, a non-zero
    ``shared_gate [1, H]`` (D2-like)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, _ in enumerate(model.model.layers):
        out[f"layers.{i}.perm"] = torch.randperm(model.config.intermediate_size, generator=g).to(torch.int16)
        out[f"layers.{i}.router"] = torch.randn(N, H, generator=g)
        out[f"layers.{i}.scale"] = torch.rand(N, generator=g) + K - 0.5
        if shared_gate:
            out[f"layers.{i}.shared_gate"] = torch.randn(1, H, generator=g) * 0.3
    return out
