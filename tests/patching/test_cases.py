"""Cases from docs/cases.md that concern patching and the family specs (policy-level cases are in
policies/test_policy_properties.py, kernel cases in kernels/test_kernels_*.py, the per-family C1 in
families/test_every_family.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import lynx_hf
from helpers import families as fam
from lynx_hf.patches.llama4 import sparse_experts


def test_C1_decode_detection_ignores_attention_mask_length():
    from transformers import DynamicCache

    from lynx_hf.detection import detect_step

    def detect_phase(args, kwargs, q_max):
        return detect_step(args, kwargs, lynx_hf.LynxConfig(q_max=q_max), None).kind

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), 0)
    one = torch.zeros(2, 1, dtype=torch.long)
    assert detect_phase((), dict(input_ids=one, past_key_values=cache, attention_mask=torch.ones(2, 99)), 1) == "decode"
    assert detect_phase((), dict(input_ids=one, past_key_values=cache, use_cache=False), 1) == "prefill"
    assert detect_phase((), dict(input_ids=torch.zeros(2, 3, dtype=torch.long), past_key_values=cache), 1) == "prefill"
    assert detect_phase((), dict(input_ids=torch.zeros(2, 3, dtype=torch.long), past_key_values=cache), 4) == "decode"
    assert detect_phase((), dict(input_ids=one, past_key_values=DynamicCache()), 1) == "prefill"  # empty cache
    assert detect_phase((one,), dict(attention_mask=torch.ones(2, 1)), 1) == "prefill"  # no cache


def test_C4_accelerate_device_map_with_disk_offload(tmp_path):
    """C4: a model loaded with a CPU/disk offload device_map keeps its accelerate hooks working after
    patch, and after unpatch is exactly as before."""
    fam.build("qwen2_moe").save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  "model.layers.0": "cpu", "model.layers.1": "cpu", "model.layers.2": "disk"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                 offload_folder=str(tmp_path / "off"))
    assert model.model.layers[2].mlp.experts.gate_up_proj.device.type == "meta"  # really offloaded
    hooked = {n: (m.__dict__.get("forward"), m.__dict__.get("_old_forward"), m._hf_hook)
              for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    ids, mask = fam.prompts(4, 6)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    lynx_hf.patch(model, policy="none")
    assert model.model.layers[2].mlp.forward is hooked["model.layers.2.mlp"][0]  # accelerate's wrapper kept
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert lynx_hf.stats(model).summary()["decode_steps"] == 3
    assert torch.equal(out, ref)
    lynx_hf.patch(model, policy="xshare", xshare_budget=1, xshare_warmup=0)  # every step shares k experts
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    per_layer = {layer["layer"]: layer for layer in lynx_hf.stats(model).summary()["per_layer"]}
    offloaded = per_layer["model.layers.2.mlp"]  # the disk-offloaded layer remaps: k experts per step
    assert offloaded["decode_steps"] == 3 and offloaded["remapped_fraction"] > 0
    assert offloaded["unique_experts_after"] == offloaded["top_k"] < offloaded["unique_experts_before"]
    lynx_hf.unpatch(model)
    after = {n: (m.__dict__.get("forward"), m.__dict__.get("_old_forward"), m._hf_hook)
             for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert after.keys() == hooked.keys()
    for name, (fwd, old, hook) in hooked.items():
        assert after[name][0] is fwd and after[name][2] is hook
        assert after[name][1] == old  # the same bound original forward
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)


def test_C5_llama4_sparse_experts_match_dense_with_t_not_n():
    """C5: Llama-4 router returns [T, N] scores; weights applied to the input; T != N so a transposed
    layout would show. The sparse dispatch equals HF's dense computation."""
    model = fam.build("llama4")
    block = model.model.layers[0].feed_forward
    hidden = torch.randn(5, block.hidden_dim)  # T = 5, N = 6
    scores, logits = block.router(hidden)
    assert scores.shape == (5, block.num_experts)
    idx = torch.topk(logits, block.top_k, dim=1).indices
    dense_in = hidden.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
    dense = block.experts(dense_in).reshape(scores.shape[1], 5, -1).sum(0)
    sparse = sparse_experts(block.experts, hidden, idx, scores.gather(1, idx))
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    # module detection is by class: the router (an nn.Linear subclass) is not taken for a block
    lynx_hf.patch(model)
    assert [n for n, m in model.named_modules() if "forward" in vars(m)] == [
        "model.layers.0.feed_forward", "model.layers.1.feed_forward"]
    lynx_hf.unpatch(model)


def test_C10_deepseek_inconsistent_group_routing_rejected_at_patch_time():
    model = fam.build("deepseek_v2", n_routed_experts=8, num_experts_per_tok=2, n_group=8, topk_group=1)
    with pytest.raises(lynx_hf.ModelConfigError) as info:
        lynx_hf.patch(model)
    for field in ("n_group", "topk_group", "num_experts_per_tok"):
        assert field in str(info.value)
    assert not lynx_hf.is_patched(model) and all("forward" not in vars(m) for m in model.modules())
    model = fam.build("deepseek_v2", n_routed_experts=12, n_group=5)
    with pytest.raises(lynx_hf.ModelConfigError, match="n_group"):
        lynx_hf.patch(model)


def test_nan_router_logits_fall_back_to_model_routing():
    """Non-finite router logits at decode: the step uses the model's own routing, counted as a fallback."""
    model = fam.build("mixtral")
    ids, mask = fam.prompts(4, 6)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[3, 0] = float("nan")  # last MoE layer: NaN cannot spread further
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with lynx_hf.patched(model, policy="lynx", gate="always"):  # the fallback is counted on a remapped step
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        per_layer = lynx_hf.stats(model).summary()["per_layer"]
    assert per_layer[0]["fallbacks"] == 0 and per_layer[1]["fallbacks"] == 2
    assert per_layer[1]["remapped_fraction"] == 0.0 and per_layer[1]["unique_experts_before"] > 0
    assert out.shape == ref.shape
