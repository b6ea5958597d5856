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
