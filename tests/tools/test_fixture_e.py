"""Fixture E (``eval/fixtures/qwen2moe-deep``, issue 52 item 1): the committed checkpoint is what the issue asks for
(a Qwen2-MoE trained from scratch with at least 16 MoE layers and a fine-grained router) and the default patch runs
on it as on any model: every layer at the price the depth rule gives its 16 layers (7/64 x 4 / 16, by hand), the policy
remaps some assignments when forced on, and unpatch gives back the unpatched model's logits exactly. Loads offline in ~1 s."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lynx_hf
from lynx_hf import LynxConfig
from lynx_hf.eval import FIXTURES_DIR
from lynx_hf.eval import evaluation as ev

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FIXTURE_E = FIXTURES_DIR / "qwen2moe-deep"


@pytest.fixture(scope="module")
def fixture_e():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE_E, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(FIXTURE_E)
    return model, tok


def test_fixture_e_is_a_deep_fine_grained_qwen2_moe(fixture_e):
    model, _ = fixture_e
    cfg = model.config
    assert cfg.model_type == "qwen2_moe" and len(ev.moe_block_names(model)) == cfg.num_hidden_layers >= 16
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (64, 8) and cfg.shared_expert_intermediate_size > 0
    size = sum(f.stat().st_size for f in FIXTURE_E.iterdir() if f.is_file())
    assert size <= 26 * 2**20, size  # committed within ~25 MB
    assert "held-out" in (FIXTURE_E / "CARD.md").read_text()


@pytest.mark.filterwarnings("ignore:lynx_hf. the cost gate")  # on this CPU the gate may keep the routing off: expected
def test_the_default_on_fixture_e(fixture_e):
    model, tok = fixture_e
    tok.padding_side = "left"
    batch = tok(["def main(", "The module", "import os", "class A:"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**batch).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with lynx_hf.patched(model):  # the default: gate "auto", the routing-mass greedy
        plans = [b.plan for b in lynx_hf.patcher._state(model).blocks]
        assert len(plans) == 16
        assert all(p.params.mass_price == pytest.approx(7 / 64 * 4 / 16) for p in plans)
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
        assert out.shape == (4, batch["input_ids"].shape[1] + 4)
    with lynx_hf.patched(model, LynxConfig(gate="always")):  # the policy on every step: fewer experts
        model.generate(**batch, max_new_tokens=4, do_sample=False)
        summary = lynx_hf.stats(model).summary()
    assert summary["unique_experts_after"] < summary["unique_experts_before"]
    assert 0 < summary["remapped_fraction"] < 1 and summary["routing_mass_kept"] < 1
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
