"""Cases from ../shared/CASES.md that concern patching and the adapters (policy-level cases are in
test_policy_properties.py, kernel cases in test_kernels_*.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import lynx_hf
import tiny_models as tm
from lynx_hf.block import BlockRouting
from lynx_hf.patches.llama4 import sparse_experts

FAMILIES = list(tm.FAMILIES)


def _run_or_error(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - we compare failure modes
        return None, type(exc)


@pytest.mark.parametrize("family", FAMILIES)
def test_C1_router_logits_requested_in_decode(family):
    """C1: with a cache and output_router_logits=True the block keeps its contract in prefill and
    decode; generate(output_router_logits=True) fails no worse patched than unpatched."""
    model = tm.build(family)
    ids, mask = tm.prompts(4, 6)
    pre = model(input_ids=ids, attention_mask=mask, use_cache=True, output_router_logits=True)
    step = ids[:, -1:]
    mask2 = torch.cat([mask, torch.ones_like(step)], dim=1)
    ref, ref_err = _run_or_error(lambda: model(
        input_ids=step, attention_mask=mask2, past_key_values=pre.past_key_values, use_cache=True,
        output_router_logits=True))
    nomask = model(input_ids=step, past_key_values=model(input_ids=ids, use_cache=True).past_key_values,
                   use_cache=True, output_router_logits=True)
    gen_ref, gen_ref_err = _run_or_error(lambda: model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_router_logits=True))
    for policy in ("none", "lynx"):
        with lynx_hf.patched(model, policy=policy):
            pre_p = model(input_ids=ids, attention_mask=mask, use_cache=True, output_router_logits=True)
            out, err = _run_or_error(lambda: model(
                input_ids=step, attention_mask=mask2, past_key_values=pre_p.past_key_values, use_cache=True,
                output_router_logits=True))
            out_nomask = model(input_ids=step, past_key_values=model(input_ids=ids, use_cache=True).past_key_values,
                               use_cache=True, output_router_logits=True)
            assert lynx_hf.stats(model).summary()["decode_steps"] == 2  # both steps seen as decode, not by mask
            gen, gen_err = _run_or_error(lambda: model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_router_logits=True))
        assert err == ref_err and gen_err == gen_ref_err  # patched fails no worse (same outcome) than unpatched
        pairs = [(out_nomask, nomask)] + ([(out, ref)] if ref_err is None else [])
        for got, want in pairs:
            assert len(got.router_logits) == len(want.router_logits)
            for layer, (a, b) in enumerate(zip(got.router_logits, want.router_logits)):
                assert a.shape == b.shape
                if policy == "none" or layer == 0:  # the model's own logits (later layers see remapped inputs)
                    assert torch.equal(a, b)
            if policy == "none":
                assert torch.equal(got.logits, want.logits)
        for a, b in zip(pre_p.router_logits, pre.router_logits):
            assert torch.equal(a, b)
        if gen_ref_err is None and policy == "none":
            assert torch.equal(gen, gen_ref)


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
    tm.build("qwen2_moe").save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  "model.layers.0": "cpu", "model.layers.1": "cpu", "model.layers.2": "disk"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                 offload_folder=str(tmp_path / "off"))
    assert model.model.layers[2].mlp.experts.gate_up_proj.device.type == "meta"  # really offloaded
    hooked = {n: (m.__dict__.get("forward"), m.__dict__.get("_old_forward"), m._hf_hook)
              for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    ids, mask = tm.prompts(4, 6)
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
    model = tm.build("llama4")
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
    model = tm.build("deepseek_v2", n_routed_experts=8, num_experts_per_tok=2, n_group=8, topk_group=1)
    with pytest.raises(lynx_hf.ModelConfigError) as info:
        lynx_hf.patch(model)
    for field in ("n_group", "topk_group", "num_experts_per_tok"):
        assert field in str(info.value)
    assert not lynx_hf.is_patched(model) and all("forward" not in vars(m) for m in model.modules())
    model = tm.build("deepseek_v2", n_routed_experts=12, n_group=5)
    with pytest.raises(lynx_hf.ModelConfigError, match="n_group"):
        lynx_hf.patch(model)


@pytest.mark.parametrize("family,kw", [("qwen2_moe", {}), ("qwen2_moe", {"norm_topk_prob": True}), ("mixtral", {}),
                                       ("deepseek_v2", {}), ("deepseek_v2", {"topk_method": "greedy"}), ("llama4", {})])
def test_remapped_weights_follow_the_family_rule(family, kw, monkeypatch):
    """Where the remap keeps a token's expert set, the recomputed weights equal the model's own
    (same rule, same dtype); every row uses k distinct experts the model's routing allows, and its weights
    are the family's formula (DESIGN.md table) on its new set; some rows are remapped, some are not."""
    model = tm.build(family, **kw)
    seen = []
    real_route = BlockRouting.route

    seen_logits = []

    def spy(self, step, router_logits, topk_weights, topk_idx):
        new_w, new_idx = real_route(self, step, router_logits, topk_weights, topk_idx)
        seen.append((self.spec.selection_scores(self.router, router_logits), topk_idx, topk_weights, new_idx, new_w))
        seen_logits.append(router_logits)
        return new_w, new_idx

    monkeypatch.setattr(BlockRouting, "route", spy)
    ids, mask = tm.prompts(16, 6)
    # a config that remaps on these tiny batches: the paper's rule without consensus (S = cover + grow to k);
    # Llama-4 has k = 1 (every cover keeps the token's top-1): XShare with a one-expert budget there
    config = (dict(policy="xshare", xshare_budget=1, xshare_warmup=0) if family == "llama4"
              else dict(policy="lynx", mass_price=None, tau=1000.0))
    with lynx_hf.patched(model, **config):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert seen
    unchanged_rows = changed_rows = 0
    for (scores, idx, w, new_idx, new_w), logits in zip(seen, seen_logits):
        assert new_w.dtype == w.dtype and new_idx.shape == idx.shape
        assert bool(torch.isfinite(scores.gather(1, new_idx)).all())  # never a forbidden expert
        assert bool((new_idx.sort(dim=-1).values.diff(dim=-1) != 0).all())  # k distinct
        torch.testing.assert_close(new_w.float(), _family_formula(family, kw, logits, new_idx), rtol=1e-5, atol=1e-6)
        for t in range(idx.shape[0]):
            if set(idx[t].tolist()) == set(new_idx[t].tolist()):
                unchanged_rows += 1
                own = dict(zip(idx[t].tolist(), w[t].float().tolist()))
                ours = dict(zip(new_idx[t].tolist(), new_w[t].float().tolist()))
                for e in own:
                    assert ours[e] == pytest.approx(own[e], rel=1e-5, abs=1e-7)
            else:
                changed_rows += 1
    assert unchanged_rows > 0 and changed_rows > 0


def _family_formula(family, kw, logits, idx):
    """DESIGN.md "Family rules", written out: the weights of experts ``idx`` from the router logits."""
    x = logits.float()
    if family == "mixtral":
        return torch.softmax(x.gather(1, idx), -1)
    if family == "llama4":
        return torch.sigmoid(x.gather(1, idx))
    w = torch.softmax(x, -1).gather(1, idx)
    if family == "qwen2_moe" and kw.get("norm_topk_prob"):
        w = w / w.sum(-1, keepdim=True)
    return w * 1.5 if family == "deepseek_v2" else w  # tiny_models: routed_scaling_factor=1.5


def test_nan_router_logits_fall_back_to_model_routing():
    """Non-finite router logits at decode: the step uses the model's own routing, counted as a fallback."""
    model = tm.build("mixtral")
    ids, mask = tm.prompts(4, 6)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[3, 0] = float("nan")  # last MoE layer: NaN cannot spread further
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with lynx_hf.patched(model, policy="lynx"):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        per_layer = lynx_hf.stats(model).summary()["per_layer"]
    assert per_layer[0]["fallbacks"] == 0 and per_layer[1]["fallbacks"] == 2
    assert per_layer[1]["remapped_fraction"] == 0.0 and per_layer[1]["unique_experts_before"] > 0
    assert out.shape == ref.shape
