"""Fixture D3 (``eval/fixtures/smollm2-d3``, issue 52 item 2): the committed parts are what
``python -m lab.build_fixture_d --fixture eval/fixtures/smollm2-d3`` assembles from: D2's carve (the same neuron
permutation per layer, the same config) with the distilled routing and, per layer, a LoRA on the dense FFN's gate /
up / down projections (``delta W = B @ A``, ``A [r, in]``, ``B [out, r]``, the rank the metadata records), trained
(not D2's zero ``B``), and ``lab.build_fixture_d.merge_lora`` adds exactly ``B @ A`` to a weight (fp64, rounded once).
The assembly from the registry wheel itself is tested on a tiny carved Llama (``test_distill_fixture_d3.py``): the
real wheel is not downloaded in tests. Reads ~15 MB of safetensors; < 1 s."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lab.build_fixture_d import merge_lora
from lynx_hf.eval import FIXTURES_DIR

D2, D3 = FIXTURES_DIR / "smollm2-d2", FIXTURES_DIR / "smollm2-d3"
PROJ = ("gate", "up", "down")


@pytest.fixture(scope="module")
def parts():
    with safe_open(D3 / "carve.safetensors", "pt") as f:
        meta = f.metadata()
    return load_file(D3 / "carve.safetensors"), meta, json.loads((D3 / "config.json").read_text())


def test_d3_is_d2s_carve_with_trained_lora_factors(parts):
    carve, meta, config = parts
    d2 = load_file(D2 / "carve.safetensors")
    assert config == json.loads((D2 / "config.json").read_text())  # the same carve, the same Qwen2-MoE config
    assert meta["experts"] == "lora"
    if meta["source_fixture"] != "smollm2-d2":   # a second stage, started from the first (recorded in init_meta)
        first = json.loads(meta["init_meta"])
        assert meta["source_fixture"] == "smollm2-d3" and first["source_fixture"] == "smollm2-d2"
        # a larger dense rank, or (what D3 is now) per-expert factors added to the first stage's rank
        assert first["experts"] == "lora" and (int(first["rank"]) < int(meta["rank"])
                                               or int(meta.get("expert_rank", 0)) > 0)
    r, hidden, inter = int(meta["rank"]), config["hidden_size"], config["intermediate_size"]
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}  # nn.Linear [out, in]
    for i in range(config["num_hidden_layers"]):
        assert torch.equal(carve[f"layers.{i}.perm"], d2[f"layers.{i}.perm"]), i
        assert carve[f"layers.{i}.router"].shape == (config["num_experts"], hidden)
        assert carve[f"layers.{i}.scale"].shape == (config["num_experts"],)
        for n in PROJ:
            a, b = carve[f"layers.{i}.{n}_lora_A"], carve[f"layers.{i}.{n}_lora_B"]
            out_f, in_f = shapes[n]
            assert a.shape == (r, in_f) and b.shape == (out_f, r), (i, n, a.shape, b.shape)
            assert b.abs().max() > 0, (i, n)  # trained: D2 is B = 0
        re, e, m = int(meta.get("expert_rank", 0)), config["num_experts"], config["moe_intermediate_size"]
        expert_shapes = {"gate": (m, hidden), "up": (m, hidden), "down": (hidden, m)}   # each expert's [out, in]
        for n in PROJ if re else ():
            a, b = carve[f"layers.{i}.expert_{n}_lora_A"], carve[f"layers.{i}.expert_{n}_lora_B"]
            out_f, in_f = expert_shapes[n]
            assert a.shape == (e, re, in_f) and b.shape == (e, out_f, re), (i, n, a.shape, b.shape)
            assert (b.flatten(1).abs().amax(1) > 0).all(), (i, n)   # every expert's own factor trained
    moved = sum(int(not torch.equal(carve[f"layers.{i}.router"], d2[f"layers.{i}.router"]))
                for i in range(config["num_hidden_layers"]))
    assert moved == config["num_hidden_layers"]  # the routing kept training from D2's


def test_merge_adds_exactly_b_at_a_in_float64(parts):
    carve = parts[0]
    a, b = carve["layers.0.up_lora_A"], carve["layers.0.up_lora_B"]
    w = torch.randn(b.shape[0], a.shape[1], generator=torch.Generator().manual_seed(0))
    merged = merge_lora(w, a, b)
    x = torch.randn(a.shape[1], 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # the merged weight applies W, then the LoRA path B (A x) on the side (LoRA section 4.1): the same to fp32 rounding
    side = w.double() @ x + b.double() @ (a.double() @ x)
    assert merged.dtype == torch.float32 and torch.allclose(merged.double() @ x, side, rtol=1e-6, atol=1e-5)
    assert not torch.equal(merged, w)
    assert torch.equal(merge_lora(w, None, None), w)  # a layer without factors: unchanged


def test_d3_card_states_its_held_out_ce():
    card = (D3 / "CARD.md").read_text().lower()
    assert "held-out" in card and "lab.build_fixture_d" in card and "smollm2-d3" in card
    size = sum(f.stat().st_size for f in D3.iterdir() if f.is_file())
    assert size <= 20 * 2**20, size
