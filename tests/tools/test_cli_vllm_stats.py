"""`lynx-hf vllm-stats`: the vLLM plugin's telemetry file printed by the CLI. The file
is the dict ``lynx_hf.vllm.telemetry.snapshot()`` writes; the printed table must carry its values."""

import json

import pytest

from lynx_hf import cli


def _snapshot():
    layers = [
        {"name": "model.layers.0.mlp.experts", "index": 0, "num_experts": 32, "top_k": 4, "decode_steps": 31,
         "unique_experts_before": 18.25, "unique_experts_after": 7.5, "routing_mass_kept": 0.875},
        {"name": "model.layers.1.mlp.experts", "index": 1, "num_experts": 32, "top_k": 4, "decode_steps": 31,
         "unique_experts_before": 20.0, "unique_experts_after": 10.0, "routing_mass_kept": 0.8125},
    ]
    summary = {"unique_experts_before": 19.125, "unique_experts_after": 8.75, "ratio": 8.75 / 19.125,
               "routing_mass_kept": 0.84375}
    return {"rank": 0, "pid": 1, "config": {"policy": "lynx"}, "steps": 40, "decode_steps": 31, "mixed_steps": 2,
            "layers": layers, "summary": summary}


def test_vllm_stats_prints_each_layer_and_the_means(tmp_path, capsys):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(_snapshot()))
    assert cli.main(["vllm-stats", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rank 0  policy: lynx  steps: 40  decode steps: 31  mixed steps: 2")
    row0 = out[2].split()
    assert row0[0] == "model.layers.0.mlp.experts" and row0[1:] == ["32", "4", "18.25", "7.50", f"{7.5 / 18.25:.3f}", "0.875"]
    assert out[4].split() == ["mean", "19.12", "8.75", f"{8.75 / 19.125:.3f}", "0.844"]


def test_vllm_stats_refuses_a_generate_stats_file(tmp_path, capsys):
    path = tmp_path / "generate.json"
    path.write_text(json.dumps({"per_layer": [], "decode_steps": 3}))
    assert cli.main(["vllm-stats", str(path)]) == 2
    assert "not a lynx_hf.vllm stats file" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--batch-size", "--max-new-tokens"])
def test_generate_refuses_non_positive_sizes_in_one_line(option, capsys):
    assert cli.main(["generate", option, "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{option} must be >= 1, got 0" in err
