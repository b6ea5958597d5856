"""Fixture D's carving (lab/build_fixture_d.py), on a tiny random dense Llama MLP: no wheel, no GGUF.

- the carved parts are exact: shared expert + every routed expert at weight 1 = the dense SwiGLU FFN;
- the partition is a permutation with the shared neurons first and equal experts;
- the Qwen2-MoE layout is exact too: transformers' own ``Qwen2MoeSparseMoeBlock`` holding the carved parameters,
  with every expert selected (k = N, ``norm_topk_prob`` false, router zero: weight 1/N each, expert scale N) and the
  shared gate at sigmoid(0), returns the dense FFN's output;
- the fitted router and scales keep the top-k output close to the dense one on the data it was fitted on."""

import pytest
import torch

from lab.build_fixture_d import (
    carve_mlp,
    carved_sum,
    dense_mlp,
    expert_outputs,
    fit_router,
    moe_layer_params,
    neuron_activations,
    partition,
    topk_combine,
)

H, INTER, SHARED, N = 24, 96, 32, 8  # 8 routed experts of 8 neurons + a 32-neuron shared expert


def _dense(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(INTER, H, generator=g) / H**0.5, torch.randn(INTER, H, generator=g) / H**0.5
    down = torch.randn(H, INTER, generator=g) / INTER**0.5
    x = torch.randn(256, H, generator=g)
    return x.double(), gate.double(), up.double(), down.double()


def test_partition_is_a_balanced_permutation():
    x, gate, up, _ = _dense()
    perm = partition(neuron_activations(x, gate, up), SHARED, N, mark_frac=0.1)
    assert sorted(perm.tolist()) == list(range(INTER))
    routed = perm[SHARED:].view(N, -1)
    assert routed.shape == (N, (INTER - SHARED) // N)
    assert all(torch.equal(r, r.sort().values) for r in routed)  # each expert's neurons ascending


def test_carved_parts_sum_to_the_dense_ffn():
    x, gate, up, down = _dense()
    perm = partition(neuron_activations(x, gate, up), SHARED, N, mark_frac=0.1)
    parts = carve_mlp(gate, up, down, perm, SHARED, N)
    torch.testing.assert_close(carved_sum(x, parts), dense_mlp(x, gate, up, down), rtol=1e-12, atol=1e-12)


def test_qwen2moe_block_with_every_expert_is_the_dense_ffn():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    x, gate, up, down = _dense(1)
    x, gate, up, down = x.float(), gate.float(), up.float(), down.float()
    perm = torch.randperm(INTER, generator=torch.Generator().manual_seed(3))
    parts = carve_mlp(gate, up, down, perm, SHARED, N)
    cfg = Qwen2MoeConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, num_experts=N,
                         num_experts_per_tok=N, moe_intermediate_size=(INTER - SHARED) // N,
                         shared_expert_intermediate_size=SHARED, norm_topk_prob=False, hidden_act="silu")
    block = Qwen2MoeSparseMoeBlock(cfg)
    block.load_state_dict(moe_layer_params(parts, torch.zeros(N, H), torch.full((N,), float(N))), strict=True)
    with torch.no_grad():
        out = block(x[None])[0]
    torch.testing.assert_close(out, dense_mlp(x, gate, up, down), rtol=1e-5, atol=1e-5)


def test_fitted_router_beats_a_uniform_one():
    x, gate, up, down = (t.float() for t in _dense(2))
    perm = partition(neuron_activations(x, gate, up), SHARED, N, mark_frac=0.1)
    parts = carve_mlp(gate, up, down, perm, SHARED, N)
    outs = expert_outputs(x, parts)
    k = 4
    router, scale, stats = fit_router(x, outs, k, steps=60)
    target = outs.sum(1)
    err = lambda o: float((o - target).pow(2).sum(-1).mean() / target.pow(2).sum(-1).mean())  # noqa: E731
    fitted = err(topk_combine(x @ router.T, outs, scale, k))
    uniform = err(topk_combine(torch.zeros(len(x), N), outs, torch.full((N,), float(k)), k))
    assert fitted == pytest.approx(stats["rel_err"], rel=1e-4)
    assert fitted < uniform
