"""The accuracy harness on the committed trained fixtures: a small teacher-forced sweep in
which policy none reproduces the unpatched model exactly and LYNX touches no more experts than the
model's own routing; router statistics, generation agreement, held-out windows, sweep helpers.

The fixtures are committed under eval/fixtures/: a missing fixture is a failure, never a skip.
``LYNX_FIXTURES_DIR`` may point the tests at another folder of fixtures (development only).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import lynx_hf
from lynx_hf import LynxConfig
from lynx_hf.eval import evaluation as ev

FIXTURES = Path(os.environ.get("LYNX_FIXTURES_DIR", ev.FIXTURES_DIR))
NAMES = ["qwen2moe-tiny", "mixtral-tiny"]
B, PREFILL, DECODE = 16, 8, 12
_CACHE: dict = {}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (tests/conftest.py)."""


def fixture(name: str):
    """(model, tokenizer) of a committed fixture, loaded once per session; fails if it is missing."""
    path = FIXTURES / name
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors")), (
        f"committed fixture {path} is missing: train it with python -m lab.train_fixture and commit it")
    if name not in _CACHE:
        _CACHE[name] = ev.load_model(path)
    model, tok = _CACHE[name]
    assert not lynx_hf.is_patched(model)
    return model, tok


@pytest.mark.parametrize("name", NAMES)
def test_teacher_forced_none_is_exact_and_lynx_touches_fewer_experts(name):
    model, tok = fixture(name)
    num_experts, top_k = ev.moe_shape(model)
    windows = ev.heldout_windows(tok, PREFILL + DECODE + 1, B)
    run = ev.teacher_forced(model, windows, B, PREFILL, [
        ("none", LynxConfig(policy="none")),
        ("lynx", LynxConfig(policy="lynx")),
        ("oea", LynxConfig(policy="oea", oea_k0=1)),
    ])
    res = {r["name"]: r for r in run["results"]}
    assert run["scored_tokens"] == B * DECODE and run["decode_steps_per_policy"] == DECODE
    # policy none: every decode-step logit equal to the unpatched model run the same way
    assert res["none"]["bit_identical"]
    assert res["none"]["ce"] == res["unpatched"]["ce"] and res["none"]["acc"] == res["unpatched"]["acc"]
    assert res["none"]["delta_ce_rel"] == 0.0 and res["none"]["kl"] == 0.0
    none_before = res["none"]["unique_experts_before"]  # (after == before for none holds by construction)
    assert top_k < none_before <= num_experts
    for policy in ("lynx", "oea"):
        r = res[policy]
        assert r["decode_steps"] == DECODE, "the patch must act on every teacher-forced step"
        assert r["unique_experts_after"] <= r["unique_experts_before"]
        assert r["unique_experts_after"] <= none_before
        for layer, base in zip(r["per_layer"], res["none"]["per_layer"]):
            assert layer["unique_experts_after"] <= layer["unique_experts_before"]
            assert top_k <= layer["unique_experts_after"] <= num_experts
        assert math.isfinite(r["ce"]) and r["routing_mass_kept"] < 1.0  # some routing mass was given up
        assert not r["bit_identical"]  # the remap acted (telemetry agrees: fewer experts)
    assert res["lynx"]["unique_experts_after"] < none_before
    assert not lynx_hf.is_patched(model)


def test_teacher_forced_reference_matches_full_sequence_forward():
    """The decode emulation is right: cached one-token steps give the full forward's cross-entropy."""
    model, tok = fixture(NAMES[0])
    windows = ev.heldout_windows(tok, PREFILL + DECODE + 1, 4)
    logits = ev.decode_logits(model, windows, PREFILL)
    with torch.inference_mode():
        full = model(input_ids=windows, use_cache=False).logits[:, PREFILL:-1].float()
    target = windows[:, PREFILL + 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    ce_full = torch.nn.functional.cross_entropy(full.reshape(-1, full.shape[-1]), target.reshape(-1))
    assert abs(float(ce) - float(ce_full)) < 1e-3
    assert 1.0 < float(ce) < 6.0, "a trained fixture predicts held-out text far better than chance (ln 4096 = 8.3)"


def test_harness_refuses_a_patched_model_and_leaves_models_unpatched():
    model, tok = fixture(NAMES[0])
    windows = ev.heldout_windows(tok, PREFILL + 4, B)
    with lynx_hf.patched(model):
        with pytest.raises(ValueError, match="unpatched"):
            ev.teacher_forced(model, windows, B, PREFILL, [])
    with pytest.raises(ValueError, match="multiple"):
        ev.teacher_forced(model, windows[:5], B, PREFILL, [])
    assert not lynx_hf.is_patched(model)


def test_router_statistics():
    model, tok = fixture(NAMES[0])
    num_experts, top_k = ev.moe_shape(model)
    report = ev.router_statistics(model, ev.heldout_windows(tok, 24, 16), batch_sizes=(1, 8, 16))
    assert len(report["layers"]) == model.config.num_hidden_layers
    for layer in report["layers"]:
        u = layer["unique_experts_per_batch"]
        assert u["1"]["mean"] == top_k  # one token: exactly its k experts
        assert u["1"]["mean"] <= u["8"]["mean"] <= u["16"]["mean"] <= num_experts
        assert layer["prob_by_rank"] == sorted(layer["prob_by_rank"], reverse=True)
        assert abs(sum(layer["topk_share_by_rank"]) - 1) < 1e-5
        gaps = layer["gap_rank0_to_rank"]
        assert all(gaps[str(r)]["q50"] <= gaps[str(r + 1)]["q50"] for r in range(1, top_k - 1))
        assert layer["below_vote_cutoff_by_rank"][0] == 0.0
        assert layer["load_max_over_mean"] > 1.0 and 0 < layer["load_entropy_norm"] < 1  # not perfectly balanced


def test_generation_agreement_policy_none_identical():
    model, tok = fixture(NAMES[0])
    out = ev.generation_agreement(model, tok, ev.prompts_from_file(count=4),
                                  [("none", LynxConfig(policy="none")), ("lynx", LynxConfig())], max_new_tokens=6)
    res = {r["name"]: r for r in out["results"]}
    assert res["none"]["token_agreement"] == 1.0 and res["none"]["exact_match"] == 1.0
    # the agreement figures are consistent with the texts (exact match 1 iff every continuation is the same)
    same = [a == b for a, b in zip(out["texts"]["lynx"], out["texts"]["unpatched"])]
    assert res["lynx"]["exact_match"] == sum(same) / len(same)
    assert (res["lynx"]["token_agreement"] == 1.0) == all(same)
    assert res["lynx"]["unique_experts_after"] <= res["lynx"]["unique_experts_before"]
    assert out["texts"]["none"] == out["texts"]["unpatched"]


def test_heldout_windows_are_deterministic_interleaved_and_unpadded():
    _, tok = fixture(NAMES[0])
    a = ev.heldout_windows(tok, 32, 8)
    b = ev.heldout_windows(tok, 32, 8)
    assert a.shape == (8, 32) and torch.equal(a, b)
    assert not torch.equal(a, ev.heldout_windows(tok, 32, 8, seed=1))
    docs_only = ev.heldout_windows(tok, 32, 4, files=[ev.HELDOUT_FILES[0]])
    assert torch.equal(a[0::2][:4], docs_only)  # even rows docs, odd rows code
    with pytest.raises(ValueError):
        ev.heldout_windows(tok, 4096, 10_000)


def test_sweep_frontier_comparison_and_default_rule():
    from lynx_hf.eval import pareto

    assert pareto.frontier([(10, 0.0), (8, 0.01), (9, 0.02), (6, 0.03), (6, 0.05)]) == [(6, 0.03), (8, 0.01), (10, 0.0)]
    front = [(6, 0.03), (8, 0.01), (10, 0.0)]
    assert pareto.interpolate(front, 7) == pytest.approx(0.02) and pareto.interpolate(front, 5) is None
    results = [
        {"name": "none", "policy": "none", "unique_experts_after": 10.0, "delta_ce_rel": 0.0, "delta_ce_rel_se": 0.0},
        {"name": "l1", "policy": "lynx", "tau": 1.0, "unique_experts_after": 7.0, "delta_ce_rel": 0.006,
         "delta_ce_rel_se": 0.001},
        {"name": "l2", "policy": "lynx", "tau": 2.0, "unique_experts_after": 5.0, "delta_ce_rel": 0.02,
         "delta_ce_rel_se": 0.001},
        {"name": "o1", "policy": "oea", "k0": 1, "unique_experts_after": 6.0, "delta_ce_rel": 0.008,
         "delta_ce_rel_se": 0.001},
    ]
    assert pareto.choose_default(results, 0.01)["name"] == "l1"
    assert pareto.choose_default(results, 0.001) is None
    rows = {r["at"]: r for r in pareto.compare(results)["rows"]}
    assert rows["o1"]["lynx_delta"] == pytest.approx(0.013) and rows["o1"]["winner"] == "oea"
    assert rows["l1"]["oea_delta"] == pytest.approx(0.006) and rows["l1"]["winner"] == "tie"  # within se
    assert rows["l2"]["oea_delta"] is None and rows["l2"]["winner"] is None
