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


def random_block(seed=0):
    """One random dense SwiGLU FFN and a carve of it, for a single student block: ``gate, up [INTER, H]``, ``down [H,
    INTER]``, input ``x [3, 20, H]``, ``perm [INTER]``, ``router [N, H]``, ``scale [N]``, ``shared_gate [1, H]``
    (a dict, drawn in that order from one generator)."""
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(INTER, H, generator=g) / H**0.5, torch.randn(INTER, H, generator=g) / H**0.5
    down = torch.randn(H, INTER, generator=g) / INTER**0.5
    x = torch.randn(3, 20, H, generator=g)
    perm = torch.randperm(INTER, generator=g)
    router, scale = torch.randn(N, H, generator=g), torch.rand(N, generator=g) + 1.5
    shared_gate = torch.randn(1, H, generator=g) * 0.3
    return dict(gate=gate, up=up, down=down, x=x, perm=perm, router=router, scale=scale, shared_gate=shared_gate)


def assert_block_is_transformers_block(blk, p, ffn) -> None:
    """``blk`` (a ``lab.distill_fixture_d.DistillMoE`` built from :func:`random_block`'s ``p``) gives transformers'
    own ``Qwen2MoeSparseMoeBlock`` loaded with the carve of ``ffn = (gate, up, down)`` (``p``'s, or with a LoRA
    merged), and in teacher mode ``p``'s dense FFN (``lab.build_fixture_d.dense_mlp``), each within 1e-5. Leaves
    ``blk.teacher`` True."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from lab.build_fixture_d import carve_mlp, dense_mlp, moe_layer_params

    cfg = Qwen2MoeConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, num_experts=N,
                         num_experts_per_tok=K, moe_intermediate_size=(INTER - SHARED) // N,
                         shared_expert_intermediate_size=SHARED, norm_topk_prob=True, hidden_act="silu")
    ref = Qwen2MoeSparseMoeBlock(cfg)
    ref.load_state_dict(moe_layer_params(carve_mlp(*ffn, p["perm"], SHARED, N), p["router"], p["scale"],
                                         p["shared_gate"]), strict=True)
    x = p["x"]
    with torch.no_grad():
        got, want = blk(x), ref(x)
        want = want[0] if isinstance(want, tuple) else want
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        blk.teacher = True   # the teacher is the dense FFN (without any LoRA)
        torch.testing.assert_close(blk(x), dense_mlp(x, p["gate"], p["up"], p["down"]), rtol=1e-5, atol=1e-5)
