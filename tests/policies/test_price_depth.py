"""The routing-mass price scaled with the model's depth (``LynxConfig.price_ref_layers``; issue 45 item 3): worked by
hand, through ``make_plan`` and through ``patch`` (each layer's plan knows its model's MoE layers); the identity on
models no deeper than the reference (fixtures A, B, C: their default unchanged, same tokens)."""

import pytest
import torch

import lynx_hf
from lynx_hf import LynxConfig, LynxConfigError
from lynx_hf.core import MoELayer, make_plan
from lynx_hf.policies.lynx import layer_price
from tests.helpers import families as fam


def test_layer_price_by_hand():
    cfg = LynxConfig()   # mass_price 7/64, price_ref_layers 4
    assert layer_price(cfg, 30) == pytest.approx(0.109375 * 4 / 30)   # 0.0145833...
    assert layer_price(cfg, 8) == pytest.approx(0.109375 / 2)
    assert layer_price(cfg, 4) == layer_price(cfg, 3) == layer_price(cfg, 1) == 0.109375
    assert layer_price(LynxConfig(price_ref_layers=None), 30) == 0.109375
    assert layer_price(LynxConfig(price_ref_layers=10), 30) == pytest.approx(0.109375 / 3)
    assert layer_price(LynxConfig(mass_price=None), 30) is None   # the paper's rule has no price


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_price_ref_layers_is_validated(bad):
    with pytest.raises(LynxConfigError, match="price_ref_layers"):
        LynxConfig(price_ref_layers=bad)


def test_make_plan_scales_the_lynx_price_only():
    deep = make_plan(LynxConfig(), MoELayer(32, 8, "cpu", moe_layers=30))
    shallow = make_plan(LynxConfig(), MoELayer(32, 8, "cpu", moe_layers=4))
    assert deep.params.mass_price == pytest.approx(0.109375 * 4 / 30)
    assert shallow.params.mass_price == 0.109375 == make_plan(LynxConfig(), MoELayer(32, 8, "cpu")).params.mass_price
    oea = LynxConfig(policy="oea", oea_k0=3)
    assert make_plan(oea, MoELayer(32, 8, "cpu", moe_layers=30)).params == make_plan(oea, MoELayer(32, 8, "cpu")).params


def _deep_model(moe_layers):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**fam.COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_hidden_layers=moe_layers, num_experts=12, num_experts_per_tok=3, decoder_sparse_step=1,
                         mlp_only_layers=[])
    model = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(3.0)
    return model


def _generate(model, config):
    ids, mask = fam.prompts(8, 6, left_pad=False)
    with lynx_hf.patched(model, config):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        plans = [b.plan for b in lynx_hf.patcher._state(model).blocks]
        summary = lynx_hf.stats(model).summary()
    return out, plans, summary


def test_patch_gives_every_layer_its_models_depth():
    model = _deep_model(8)
    _, plans, summary = _generate(model, LynxConfig(gate="always"))
    assert len(plans) == 8 and all(p.params.mass_price == pytest.approx(0.109375 / 2) for p in plans)
    # the deeper model's lower price keeps more experts than the price as given (same model, same prompts)
    _, _, as_given = _generate(model, LynxConfig(gate="always", price_ref_layers=None))
    assert summary["unique_experts_after"] > as_given["unique_experts_after"]


def test_models_no_deeper_than_the_reference_keep_the_price_as_given():
    model = fam.build("qwen2_moe")   # 2 MoE layers (fixtures A, B: 4; C: 3)
    out, plans, summary = _generate(model, LynxConfig(gate="always"))
    ref, _, ref_summary = _generate(model, LynxConfig(gate="always", price_ref_layers=None))
    assert all(p.params.mass_price == 0.109375 for p in plans)
    assert torch.equal(out, ref) and summary["unique_experts_after"] == ref_summary["unique_experts_after"]


def test_at_depth_fixes_the_full_models_price_on_any_cut():
    """``lynx_hf.at_depth`` (issue 52 item 4): the price of a 28-layer model (7/64 x 4 / 28 = 1/64, by hand) on every
    layer of a model of any depth, including the 2-layer cut a benchmark runs; other configs unchanged."""
    deep = lynx_hf.at_depth(LynxConfig(), 28)
    assert deep.mass_price == 0.015625 == 7 / 64 * 4 / 28 and deep.price_ref_layers is None
    for cut in (1, 2, 4, 28, 60):
        assert layer_price(deep, cut) == 0.015625
    assert lynx_hf.at_depth(LynxConfig(), 26).mass_price == pytest.approx(0.109375 * 4 / 26)   # DeepSeek-V2-Lite
    assert lynx_hf.at_depth(LynxConfig(), 3).mass_price == 0.109375   # no deeper than the reference: as given
    assert lynx_hf.at_depth(LynxConfig(price_ref_layers=None), 28).mass_price == 0.109375
    assert lynx_hf.at_depth(LynxConfig(mass_price=0.5, price_unit="token"), 8) == \
        LynxConfig(mass_price=0.25, price_unit="token", price_ref_layers=None)
    for other in (LynxConfig(mass_price=None), LynxConfig(policy="oea"), LynxConfig(policy="none")):
        assert lynx_hf.at_depth(other, 28) is other
    plan = make_plan(deep, MoELayer(32, 8, "cpu", moe_layers=2))
    assert plan.params.mass_price == 0.015625


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "28", None])
def test_at_depth_refuses_a_depth_that_is_no_positive_int(bad):
    with pytest.raises(LynxConfigError, match="moe_layers"):
        lynx_hf.at_depth(LynxConfig(), bad)
