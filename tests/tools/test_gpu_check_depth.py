"""``lab.gpu_check --full-layers`` (issue 52 item 4): the sections' 2-layer cuts of real shapes run LYNX at the price the
default gives the full model, in the HF patches and in the vLLM plugin's step configs alike. Driven in-process on the
dry run's tiny CPU shapes (the whole dry run: tests/kernels/test_kernels_moe.py), every price the plans run recorded
and compared with ``layer_price`` worked by hand: Qwen2-57B-A14B 7/64 x 4 / 28 = 1/64, DeepSeek-V2-Lite 7/64 x 4 / 26."""

import importlib.util

import pytest

import lynx_hf
from lynx_hf.vllm import plans

QWEN, DSV2 = 1 / 64, 7 / 64 * 4 / 26


def _load_gpu_check():
    path = importlib.util.find_spec("lab.gpu_check").origin  # a fresh module object (SUMMARY, argument defaults)
    spec = importlib.util.spec_from_file_location("lab.gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(monkeypatch) -> dict:
    """The routing-mass price of every LYNX plan made: HF patches (each MoE layer's plan) and the plugin's plans."""
    seen = {"hf": [], "vllm": []}
    patch, plan_for = lynx_hf.patch, plans.plan_for

    def recording_patch(model, *args, **kwargs):
        out = patch(model, *args, **kwargs)
        if lynx_hf.config_of(model).policy == "lynx":
            seen["hf"] += [b.plan.params.mass_price for b in lynx_hf.patcher._state(model).blocks]
        return out

    def recording_plan_for(layer, device, dtype, config):
        plan = plan_for(layer, device, dtype, config)
        if config.policy == "lynx":
            seen["vllm"].append(plan.params.mass_price)
        return plan

    monkeypatch.setattr(lynx_hf, "patch", recording_patch)
    monkeypatch.setattr(plans, "plan_for", recording_plan_for)
    return seen


def test_sections_run_the_full_models_price(monkeypatch, capsys):
    seen = _record(monkeypatch)
    assert _load_gpu_check().main(["--dry-run", "--sections", "vllm,sync", "--budget", "600"]) == 0
    out = capsys.readouterr().out
    # the paper's rule (mass_price None) has no price; every routing-mass plan runs the full model's
    assert {p for p in seen["hf"] if p is not None} == {QWEN}
    vllm = [p for p in seen["vllm"] if p is not None]
    assert vllm and all(p == pytest.approx(DSV2) for p in vllm)
    assert "| sync | Qwen2-57B-A14B (2 layers): LYNX routing-mass price | info | price 0.015625 (at 28 MoE layers) |" in out
    assert "| vllm | vllm: LYNX routing-mass price | info | price 0.0168269 (at 26 MoE layers) |" in out


def test_full_layers_cut_and_n_and_the_gate_section(monkeypatch, capsys):
    seen = _record(monkeypatch)
    assert _load_gpu_check().main(["--dry-run", "--sections", "sync", "--full-layers", "cut"]) == 0
    assert {p for p in seen["hf"] if p is not None} == {0.109375}  # the price as given on the 2-layer cut
    # the gate section's decisions are measured for the price of the depth asked (here 8: 7/64 / 2 for every shape)
    import lab.gate_table

    configs = []
    monkeypatch.setattr(lab.gate_table, "table", lambda names, batches, dev, config, **kw: configs.append(config) or [])
    module = _load_gpu_check()
    module.main(["--dry-run", "--sections", "gate", "--full-layers", "8"])
    assert [(c.mass_price, c.price_ref_layers, c.gate) for c in configs] == [(7 / 128, None, "auto")]
    out = capsys.readouterr().out
    assert "fixture-a: LYNX routing-mass price | info | price 0.0546875 (at 8 MoE layers)" in out
    args = type("Args", (), {"full_layers": "real"})()
    assert module.at_full_depth(args, "compiled", {"policy": "lynx"}) == {"policy": "lynx"}  # no real model's cut
    assert module.at_full_depth(args, "DeepSeek-V2-Lite (2 layers)", {"policy": "lynx"})["mass_price"] == \
        pytest.approx(DSV2)
