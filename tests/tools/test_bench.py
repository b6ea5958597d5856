"""Smoke test of the latency benchmark (python -m lynx_hf.eval.bench --quick). Asserts no timing."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_quick_runs_and_prints_tables(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "lynx_hf.eval.bench", "--quick", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| shape | routing | B |" in out          # the layer table
    assert "| variant | slope (ms / expert) |" in out  # the T fit
    assert "| variant | TPOT (ms) |" in out           # the TPOT table
    # the price each LYNX row ran (--full-layers real): DeepSeek-V2-Lite's 26 MoE layers, Qwen2-57B-A14B's 28 (TPOT)
    assert "| price 0.0168269 (at 26 MoE layers) |" in out and "| price 0.015625 (at 28 MoE layers) |" in out
    for name in ("bench_quick_layer.csv", "bench_quick_layer.md", "bench_quick_latency_vs_T.png",
                 "bench_quick_tpot.md"):
        assert (tmp_path / name).is_file(), name
    # structural facts, not timings: policy none never changes the unique-expert count
    rows = (tmp_path / "bench_quick_layer.csv").read_text().splitlines()
    header = rows[0].split(",")
    for line in rows[1:]:
        row = dict(zip(header, line.split(",")))
        if row["variant"] == "none":
            assert row["T_before"] == row["T_after"]


def test_sparse_experts_torch_matches_hf_experts():
    import torch
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    from lynx_hf.eval.sparse_torch import sparse_experts_torch

    torch.manual_seed(0)
    cases = [
        (Qwen2MoeExperts(Qwen2MoeConfig(hidden_size=48, moe_intermediate_size=24, num_experts=13,
                                        num_experts_per_tok=4)), 13, 4),
        (MixtralExperts(MixtralConfig(hidden_size=40, intermediate_size=24, num_local_experts=8,
                                      num_experts_per_tok=2)), 8, 2),
    ]
    for experts, n, k in cases:
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.1)
        for tokens in (1, 3, 16):  # T=1, odd T, all tokens on few experts below
            hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1])
            idx = torch.stack([torch.randperm(n)[:k] for _ in range(tokens)])
            if tokens == 16:
                idx = torch.stack([torch.arange(k)] * tokens)  # every token on the same k experts
            w = torch.rand(tokens, k)
            for impl in ("eager", "grouped_mm"):
                experts.config._experts_implementation = impl
                ref = experts(hidden, idx, w)
                got = sparse_experts_torch(experts, hidden, idx, w)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            experts.to(torch.bfloat16)
            got = sparse_experts_torch(experts, hidden.bfloat16(), idx, w.bfloat16())
            experts.config._experts_implementation = "grouped_mm"
            ref = experts(hidden.bfloat16(), idx, w.bfloat16())
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            experts.float()


# ------------------------------------------------------------------ --full-layers (issue 52 item 4)
def _recording_patch(monkeypatch):
    """``lynx_hf.patch`` recording the routing-mass price every LYNX-patched MoE layer's plan runs."""
    import lynx_hf

    real, prices = lynx_hf.patch, []

    def patch(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        config = lynx_hf.config_of(model)
        if config.policy == "lynx":
            prices.append([b.plan.params.mass_price for b in lynx_hf.patcher._state(model).blocks])
        return out

    monkeypatch.setattr(lynx_hf, "patch", patch)
    return prices


def test_full_layers_option_and_the_configs_it_builds():
    import pytest

    from lynx_hf.eval import bench

    assert bench.parse_args([]).full_layers == "real"
    assert bench.parse_args(["--full-layers", "28"]).full_layers == 28
    assert bench.parse_args(["--full-layers", "cut"]).full_layers == "cut"
    for bad in ("0", "-2", "2.5", "deep"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--full-layers", bad])
    # by hand: 7/64 x 4 / 28 = 1/64 (Qwen2-57B-A14B), 7/64 x 4 / 26 (DeepSeek-V2-Lite), 7/64 x 4 / 32 = 7/512
    real = {name: bench.layer_configs("real", name) for name in bench.SHAPES}
    assert real["qwen2-57b-a14b"]["lynx"].mass_price == 1 / 64
    assert real["deepseek-v2-lite"]["lynx"].mass_price == pytest.approx(7 / 64 * 4 / 26)
    assert real["mixtral-8x7b"]["lynx"].mass_price == 7 / 512
    assert all(c["lynx"].price_ref_layers is None for c in real.values())
    assert bench.layer_configs(48, "mixtral-8x7b")["lynx"].mass_price == pytest.approx(7 / 64 * 4 / 48)
    cut = bench.layer_configs("cut", "qwen2-57b-a14b")["lynx"]
    assert (cut.mass_price, cut.price_ref_layers) == (0.109375, 4)
    assert real["qwen2-57b-a14b"]["oea"] == bench.layer_configs("cut", "qwen2-57b-a14b")["oea"]
    assert bench.tpot_config("lynx", "real").mass_price == 1 / 64


def test_tpot_section_patches_the_cut_with_the_full_models_price(monkeypatch, tmp_path):
    """Section 3 on a 1/16-scaled 2-layer cut: every layer of the LYNX-patched model runs 1/64 (the 28-layer price),
    not the 7/64 a 2-layer model gets; ``--full-layers cut`` gives 7/64; the rows say which."""
    import dataclasses

    from lynx_hf.eval import bench

    prices = _recording_patch(monkeypatch)
    built = bench.tpot_config  # the gate forced on: its patch-time timing is not this test's subject (minutes here)
    monkeypatch.setattr(bench, "tpot_config", lambda *a, **k: dataclasses.replace(built(*a, **k), gate="always"))
    kw = bench.scaled_shapes(16)["qwen2-57b-a14b"][1]
    for option, want in ((None, 1 / 64), ("cut", 0.109375)):
        prices.clear()
        args = bench.parse_args(["--quick", "--out", str(tmp_path)] + ([] if option is None else ["--full-layers", option]))
        args.tpot_new_tokens, args.tpot_batch = 2, 4
        rows = {r["variant"]: r for r in bench.bench_tpot(args, kw, log=lambda *_: None)}
        assert prices and all(p == [want, want] for p in prices), prices
        assert rows["lynx"]["mass_price"] == want and rows["lynx"]["full_layers"] == (28 if option is None else "cut")
        assert rows["oea"]["mass_price"] == ""


def test_layer_section_patches_the_block_with_the_full_models_price(monkeypatch, tmp_path):
    """Section 1 on the 1/16-scaled DeepSeek-V2-Lite block: the LYNX-patched one-block holder runs 7/64 x 4 / 26 (the
    26-MoE-layer price; as given it would be 7/64) and its rows record it."""
    import dataclasses

    import pytest

    from lynx_hf.eval import bench

    prices = _recording_patch(monkeypatch)
    built = bench.layer_configs  # the gate forced on, as above
    monkeypatch.setattr(bench, "layer_configs", lambda *a: {p: dataclasses.replace(c, gate="always")
                                                            for p, c in built(*a).items()})
    args = bench.parse_args(["--quick", "--out", str(tmp_path), "--batches", "4", "--shapes", "deepseek-v2-lite"])
    args.remap_reps = 1
    rows = []
    bench.bench_layer(args, {"deepseek-v2-lite": bench.scaled_shapes(16)["deepseek-v2-lite"]}, rows, lambda *_: None)
    want = pytest.approx(7 / 64 * 4 / 26)
    assert prices and all(p == [want] for p in prices), prices
    lynx = [r for r in rows if r["variant"] in ("lynx", "lynx+sparse")]
    assert lynx and all(r["mass_price"] == want and r["full_layers"] == 26 for r in lynx)
    assert "(at 26 MoE layers)" in bench.layer_markdown(rows, "# t")
