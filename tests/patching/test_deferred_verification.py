"""Generic routers that are not materialized at patch time (accelerate disk offload) are verified on their
real output later. The verification must be as strong as the patch-time probe (a one-token call
proves nothing: a group-limited router agrees with plain top-k on one token by chance), and a refusal must
keep the model's own routing on every later step (never crash, never remap)."""

import tempfile
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lynx_hf

DISK = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "disk", "model.norm": "cpu",
        "model.rotary_emb": "cpu", "lm_head": "cpu"}


def _offloaded(cfg, scale_router=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if scale_router:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.mul_(scale_router)
    d, off = tempfile.mkdtemp(), tempfile.mkdtemp()
    model.save_pretrained(d)
    mem = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    disk = AutoModelForCausalLM.from_pretrained(d, device_map=DISK, offload_folder=off, dtype=torch.float32).eval()
    return mem, disk


def _glm_grouped():
    cfg = AutoConfig.for_model("glm4_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=32,
                               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
                               topk_group=1, first_k_dense_replace=0, vocab_size=128, pad_token_id=0,
                               eos_token_id=2, tie_word_embeddings=False)
    return _offloaded(cfg, scale_router=30)


def _expert_ids(model):
    """Hook recording the top-k ids each MoE block's experts receive."""
    seen, hooks = [], []
    for module in model.modules():
        if type(module).__name__ == "Glm4MoeMoE":
            hooks.append(module.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())))
    return seen, hooks


def test_one_token_calls_never_verify_a_group_limited_router():
    mem, disk = _glm_grouped()
    with lynx_hf.patched(mem):  # in memory the probe verifies its selection-bias rule (lynx_hf/selection.py)
        assert all(b.selection is not None and b.selection.n_group > 1 for b in mem.__dict__["_lynx_state"].blocks)
    lynx_hf.patch(disk, policy="lynx")
    blocks = disk.__dict__["_lynx_state"].blocks
    assert blocks and all(b.rule is None and b.rule_status == "pending" for b in blocks)  # deferred
    one = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(23))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        disk.generate(one, max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert all(b.rule_status == "pending" for b in blocks)  # 4 prefill tokens and 1 decode token: not enough to verify
    # a batch of 8 x 4 prompt tokens: the prefill call verifies (32 tokens) the selection-bias rule (the bias buffer
    # stays in memory under accelerate's offload), with no warning
    eight = torch.randint(3, 128, (8, 4), generator=torch.Generator().manual_seed(100))
    seen, hooks = _expert_ids(disk)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        disk.generate(eight, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    for h in hooks:
        h.remove()
    assert all(b.rule is not None and b.rule_status == "verified" and b.selection is not None for b in blocks)
    # every row's experts (remapped ones included) lie in one group of 2 (topk_group=1), as the model's routing requires
    assert seen and all(bool(((r // 2) == (r[:, :1] // 2)).all()) for r in seen)
    lynx_hf.unpatch(disk)


def test_a_refused_deferred_router_keeps_its_routing_on_every_later_step():
    cfg = AutoConfig.for_model("phimoe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, num_local_experts=8,
                               num_experts_per_tok=2, vocab_size=128)
    _, disk = _offloaded(cfg)
    ids = torch.randint(3, 128, (4, 5), generator=torch.Generator().manual_seed(0))
    ref = disk.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    lynx_hf.patch(disk)  # sparsemixer routing: refused once its output is seen
    with pytest.warns(UserWarning, match="keeps the model's own routing"):
        out = disk.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert lynx_hf.stats(disk).summary()["decode_steps"] == 0
