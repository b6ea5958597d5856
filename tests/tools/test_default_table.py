"""``python -m lab.default_table``: the library default's saving and dCE per fixture, one command. The depth rules'
prices are checked against values worked by hand; the table's rows against the same windows scored directly through
:func:`lynx_hf.eval.evaluation.teacher_forced` (an 8-MoE-layer random Qwen2-MoE, word-level data, a few seconds)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from lab import default_table as dt
from lynx_hf import LynxConfig
from lynx_hf.eval import evaluation as ev
from lynx_hf.policies.lynx import layer_price
from tests.helpers.families import COMMON, tokenizer


def test_rule_prices_by_hand():
    p = 7 / 64
    assert layer_price(dt.RULES["default"](16), 16) == p * 4 / 16
    assert layer_price(dt.RULES["sqrt"](16), 16) == pytest.approx(p / 2)
    assert layer_price(dt.RULES["sqrt"](36), 36) == pytest.approx(p / 3)
    assert layer_price(dt.RULES["none4"](16), 16) == p
    assert layer_price(dt.rule("law0.75")(16), 16) == pytest.approx(p * 0.25 ** 0.75)
    assert layer_price(dt.rule("law1")(16), 16) == pytest.approx(layer_price(dt.RULES["default"](16), 16))
    assert layer_price(dt.rule("law0")(30), 30) == p
    for rule in [*dt.RULES.values(), dt.rule("law0.75")]:  # no scaling at the depth the price was chosen on
        assert layer_price(rule(4), 4) == p
    for bad in ("law", "law-1", "lawx", "pow2"):
        with pytest.raises(ValueError, match="unknown rule"):
            dt.rule(bad)


def test_table_matches_a_direct_run(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_hidden_layers=8, num_experts=12, num_experts_per_tok=3, mlp_only_layers=[])
    model = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                w.mul_(20.0)  # realistic router confidence (random init is near-uniform)
    path = tmp_path / "m"
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    data = tmp_path / "d.txt"
    data.write_text(" ".join(f"w{int(i)}" for i in torch.randint(3, 96, (200,), generator=g)))
    out = tmp_path / "table"
    assert dt.main(["--models", str(path), "--batch-sizes", "8", "--sequences", "8", "--prefill", "2", "--decode", "3",
                    "--rules", "default,none4", "--data", str(data), "--threads", "1", "--out", str(out)]) == 0
    rows = {r["rule"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["default"]["moe_layers"] == 8
    assert rows["default"]["layer_price"] == pytest.approx(7 / 64 * 4 / 8)
    assert rows["none4"]["layer_price"] == 7 / 64
    # the oracle: the same windows scored directly
    m, tok = ev.load_model(path)
    windows = ev.heldout_windows(tok, 6, 8, [data])
    res = ev.teacher_forced(m, windows, 8, 2, [("none", LynxConfig(policy="none")), ("d", LynxConfig())])
    by = {r["name"]: r for r in res["results"]}
    assert rows["default"]["unique_before"] == by["none"]["unique_experts_before"]
    assert rows["default"]["unique_after"] == by["d"]["unique_experts_after"]
    assert rows["default"]["delta_ce_rel"] == pytest.approx(by["d"]["delta_ce_rel"])
    assert rows["default"]["saving"] == pytest.approx(1 - by["d"]["unique_experts_after"] / by["none"]["unique_experts_before"])
    assert "| m (8) | 8 |" in out.with_suffix(".md").read_text()
