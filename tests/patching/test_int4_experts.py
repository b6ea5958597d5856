"""4-bit experts (``lab/int4_experts.py``, ``docs/expert-storage.md`` "4-bit experts"): LYNX over int4 experts runs
the quantized experts' own compute, on the remapped routing, and that compute reads fewer experts.

``Int4Experts`` replaces each fused experts module by int4 weights in PyTorch's own tinygemm layout, computed by
``torch.ops.aten._weight_int4pack_mm_for_cpu`` (no quantization package: no library on this CPU stack quantizes
transformers 5's fused 3-D experts with a 4-bit compute path, see the module's docstring). Per family (Qwen2-MoE,
Mixtral, DeepSeek-V2), through the storage matrix's cells (``test_storage_matrix.check_cells``): prefill and policy
``none`` decode bit-identical to the unpatched quantized model; LYNX / OEA equal to the same remap replayed through
the unpatched quantized block; the sparse kernel never reads the packed weights, and the patch-time reason names
why. Then: each decode call of the quantized experts computes exactly the unique experts of the routing it was
given, and under LYNX those are fewer than unpatched.
"""

from __future__ import annotations

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lab.int4_experts import Int4Experts, quantize_experts
from test_storage_matrix import BATCH, PROMPT, check_cells, moe_blocks, run

GROUP = 32  # the CPU int4 kernel's smallest group (32, 64, 128 or 256; output rows a multiple of 16)


def _qwen2_moe():
    # helpers.families' Qwen2-MoE (3 layers, layer 1 dense) with expert I 32: a multiple of the group
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **fam.COMMON, intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=24,
        num_hidden_layers=3, num_experts=12, num_experts_per_tok=3, decoder_sparse_step=1, mlp_only_layers=[1],
        norm_topk_prob=False))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**fam.COMMON, intermediate_size=32, num_hidden_layers=2,
                                            num_local_experts=8, num_experts_per_tok=2))


# the families whose blocks call experts(hidden, ids, weights) in the fused gated layout (Llama-4's block calls
# experts(x) on dense scores: not this module's signature); each tiny model with expert sizes the kernel takes.
# GraniteMoE is a generic-spec family: its probe learns the layer's sizes from the config, the router and the hidden
# states, never from the packed weights (patches/generic.py); on a release whose GraniteMoE router returns another
# layout (transformers 5.19) the generic spec refuses the block whatever its experts hold
FAMILIES = {
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "deepseek_v2": lambda: fam.deepseek_v2(moe_intermediate_size=32),
    "granitemoe": lambda: fam.granitemoe(intermediate_size=32),
}
GENERIC_ON_THIS_RELEASE = {"granitemoe": fam.FAMILIES["granitemoe"].kind == "generic"}


def dense_model(family: str):
    """The tiny model, routers scaled as ``helpers.families.build`` scales them (realistic confidence)."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] > 1:
                p.mul_(20.0)
    return model


def int4_model(family: str):
    if not GENERIC_ON_THIS_RELEASE.get(family, True):
        pytest.skip(f"{family}: the generic spec refuses this release's router layout (helpers.families)")
    model = dense_model(family)
    assert quantize_experts(model, GROUP) == len(moe_blocks(model))
    return model


def test_int4_experts_compute_the_dequantized_weights():
    """The kernel computes the int4 weights: equal to the eager loop on the dequantized weights (fp32), and not to
    the original weights (the storage really is 4-bit)."""
    model = dense_model("qwen2_moe")
    block = moe_blocks(model)[0][0]
    dense = block.experts
    quant = Int4Experts.from_experts(dense, GROUP)
    assert {b.dtype for b in quant.buffers()} >= {torch.uint8} and not list(quant.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, dense.gate_up_proj.shape[-1], generator=g)
    ids = torch.stack([torch.randperm(dense.num_experts, generator=g)[:3] for _ in range(6)])
    w = torch.rand(6, 3, generator=g)
    reference = type(dense)(dense.config).eval()
    with torch.no_grad():
        for e in range(dense.num_experts):
            reference.gate_up_proj[e], reference.down_proj[e] = quant.dequantized(e)
        got, want, original = quant(x, ids, w), reference(x, ids, w), dense(x, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert quant.last_experts == int(torch.unique(ids).numel())
    assert not torch.allclose(got, original, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int4_experts_cells(family, monkeypatch, one_thread):
    """Storage-matrix cells on int4 experts (module docstring), policies none / LYNX / OEA, torch backend."""
    check_cells(int4_model(family), monkeypatch, kernel_ok=False, reason_words=("experts interface",),
                backends=("torch",))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lynx_reduces_the_int4_experts_computed(family, one_thread):
    """Each decode call of the int4 experts computes the unique experts of the (remapped) routing it receives, and
    LYNX's remap makes that fewer than the unpatched model's (the 4-bit weights read per step)."""
    model = int4_model(family)
    blocks = [b for b, _ in moe_blocks(model)]
    seen = []

    def spy(module, args, output):
        if args[0].shape[0] == BATCH:  # decode calls: one token per row
            seen.append((module.last_experts, int(torch.unique(args[1]).numel())))

    handles = [b.experts.register_forward_hook(spy) for b in blocks]
    ids, mask = fam.prompts(BATCH, PROMPT, seed=3)
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, fam.VOCAB, (BATCH, 1), generator=g) for _ in range(3)]
    try:
        run(model, ids, mask, tokens)
        unpatched = list(seen)
        seen.clear()
        lynx_hf.patch(model, policy="lynx")
        run(model, ids, mask, tokens)
        summary = lynx_hf.stats(model).summary()
        lynx_hf.unpatch(model)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(unpatched) == len(tokens) * len(blocks)
    assert all(ran == unique for ran, unique in seen + unpatched)
    assert sum(ran for ran, _ in seen) < sum(ran for ran, _ in unpatched)
    assert summary["unique_experts_after"] < summary["unique_experts_before"]


# -- Llama-4 under transformers' quantized-experts path ------------------------------------------------------------
def sequential_llama4():
    """Tiny Llama-4 (k = 2 so LYNX has something to cut) whose experts are transformers' own
    ``SequentialLlama4TextExperts`` (one ``Llama4TextMLP`` per expert), the module a pre-quantized bitsandbytes or
    compressed-tensors Llama-4 checkpoint loads into (``transformers.quantizers.base.MODULES_TO_PATCH_FOR_QUANTIZATION``;
    there each ``nn.Linear`` is then a ``Linear4bit``). Here the linears stay fp32: the test needs no bitsandbytes
    (not a dependency of this project), and what it checks, which per-expert modules run, does not depend on them."""
    from transformers.quantizers.base import SequentialLlama4TextExperts

    model = fam.build("llama4", num_experts_per_tok=2)
    for block, _ in moe_blocks(model):
        fused = block.experts
        seq = SequentialLlama4TextExperts(model.config)
        inter = fused.down_proj.shape[1]
        with torch.no_grad():
            for e, mlp in enumerate(seq):
                gate_up = fused.gate_up_proj[e]  # [H, 2I], weight on the input side
                mlp.gate_proj.weight.copy_(gate_up[:, :inter].T)
                mlp.up_proj.weight.copy_(gate_up[:, inter:].T)
                mlp.down_proj.weight.copy_(fused.down_proj[e].T)
        block.experts = seq.eval()
    return model


def test_llama4_sequential_experts_cells(monkeypatch, one_thread):
    """Storage-matrix cells on Llama-4 with ``SequentialLlama4TextExperts``: none bit-identical, LYNX / OEA equal to
    the remap replayed through the unpatched block (which runs every expert on dense scores)."""
    check_cells(sequential_llama4(), monkeypatch, kernel_ok=False, reason_words=("besides the dense weights",),
                backends=("torch",))


def test_llama4_sequential_experts_run_only_the_remapped_experts(one_thread):
    """With a remapping policy the patched Llama-4 block runs only the per-expert modules its decode tokens are routed
    to (the 4-bit weights of the others are not read); unpatched and policy ``none``, transformers runs all N."""
    model = sequential_llama4()
    blocks = [b for b, _ in moe_blocks(model)]
    num_experts = len(blocks[0].experts)
    calls = []
    handles = [mlp.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
               for b in blocks for mlp in b.experts]
    ids, mask = fam.prompts(BATCH, PROMPT, seed=3)
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, fam.VOCAB, (BATCH, 1), generator=g) for _ in range(3)]
    per_step = {}
    try:
        for policy in ("unpatched", "none", "lynx"):
            if policy != "unpatched":
                lynx_hf.patch(model, policy=policy)
            run(model, ids, mask, [])  # prefill alone
            prefill = len(calls)
            calls.clear()
            run(model, ids, mask, tokens)
            per_step[policy] = (len(calls) - prefill) / (len(tokens) * len(blocks))
            calls.clear()
            if policy == "lynx":
                summary = lynx_hf.stats(model).summary()
            lynx_hf.unpatch(model)
    finally:
        for h in handles:
            h.remove()
    assert per_step["unpatched"] == per_step["none"] == num_experts
    assert per_step["lynx"] == pytest.approx(summary["unique_experts_after"]) and per_step["lynx"] < num_experts
