"""The lynx-hf CLI driven as a subprocess: outputs and exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import families as fam

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lynx_hf", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "qwen2moe"
    fam.save_checkpoint("qwen2_moe", path)
    prompts = path.parent / "prompts.txt"
    prompts.write_text("w5 w9 w11\nw7 w3\nw12 w13 w14 w15\nw50\n")
    return path, prompts


def test_generate_prints_per_layer_table_and_writes_stats(checkpoint, tmp_path):
    path, prompts = checkpoint
    stats = tmp_path / "stats.json"
    res = run("generate", "--model", str(path), "--prompts", str(prompts), "--batch-size", "8",
              "--max-new-tokens", "4", "--stats-json", str(stats), "--gate", "always")  # every decode step counted
    assert res.returncode == 0, res.stderr
    assert "experts before" in res.stdout and "model.layers.0.mlp" in res.stdout and "model.layers.2.mlp" in res.stdout
    assert "token agreement" in res.stdout
    assert "batch: 8 (4 distinct prompts, repeated)" in res.stdout  # the 4 prompts fill the batch of 8
    summary = json.loads(stats.read_text())
    assert summary["decode_steps"] == 3 and summary["num_moe_layers"] == 2
    assert summary["unique_experts_after"] <= summary["unique_experts_before"]
    png = tmp_path / "stats.png"
    res = run("plot", str(stats), "--out", str(png))
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_policy_none_agrees_fully(checkpoint):
    path, prompts = checkpoint
    res = run("generate", "--model", str(path), "--prompts", str(prompts), "--batch-size", "4",
              "--max-new-tokens", "3", "--policy", "none", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "token agreement with unpatched greedy decode: 1.000; identical continuations: 1.000" in res.stdout


@pytest.mark.parametrize("args,message", [
    (["generate", "--model", "/no/such/dir"], "no local checkpoint"),
    (["generate", "--tau", "-1"], "tau"),
    (["plot", "/no/such.json"], "no stats JSON"),
])
def test_errors_are_one_line_and_nonzero(args, message, checkpoint):
    path, prompts = checkpoint
    if args[0] == "generate" and "--model" not in args:
        args = args + ["--model", str(path), "--prompts", str(prompts)]
    res = run(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_dense_model_is_refused_with_one_line(tmp_path):
    cfg = LlamaConfig(vocab_size=fam.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    fam.tokenizer().save_pretrained(tmp_path)
    res = run("generate", "--model", str(tmp_path))
    assert res.returncode == 2 and "no MoE block of a supported family" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_help_of_each_subcommand():
    for sub in ("generate", "plot", "eval", "sweep", "bench", "report"):
        res = run(sub, "--help")
        assert res.returncode == 0 and f"usage: lynx-hf {sub}" in res.stdout, (sub, res.stdout[:200], res.stderr)


def test_eval_subcommand_on_a_tiny_local_task(tmp_path):
    """`lynx-hf eval` (lynx_hf.eval.harness) end to end on the committed fixture with tiny settings: teacher-forced
    decode, generation agreement and the local lm-eval tasks; its built-in checks must all PASS."""
    from lynx_hf.eval import DEFAULT_FIXTURE

    # the user's default gate (no LYNX_HF_GATE: "auto"); the harness runs its accuracy checks with the gate forced on
    # and its report records the configuration that ran
    env = {k: v for k, v in ENV.items() if k != "LYNX_HF_GATE"}
    res = subprocess.run([sys.executable, "-m", "lynx_hf", "eval", "--model", str(DEFAULT_FIXTURE), "--sequences", "8",
                          "--batch-size", "8", "--decode", "4", "--gen-prompts", "4", "--gen-tokens", "4",
                          "--lm-limit", "4", "--lm-batch-size", "4", "--oea-k0", "1", "--threads", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "FAIL" not in res.stdout and res.stdout.count("PASS") >= 4
    report = json.loads((tmp_path / "harness_qwen2moe-tiny.json").read_text())
    assert report["lynx_config"]["gate"] == "always" and report["lynx_config"]["policy"] == "lynx"
    assert {"teacher_forced", "generation", "lm_eval", "checks"} <= set(report)
    assert len(report["checks"]) >= 4 and all(report["checks"].values()), report["checks"]


# a non-default value for every LynxConfig field, as a user types it (strings; None and booleans as words);
# also lm-eval's model_args (tools/test_lm_eval.py)
#: a decision table with no entry (``LynxConfig.gate_table`` must name a readable table at patch time)
EMPTY_TABLE = Path(__file__).resolve().parents[1] / "helpers" / "empty_gate_table.json"
NON_DEFAULT = {"policy": "oea", "phase": "decode", "alpha": "2.5", "beta": "3", "tau": "2.0",
               "mass_price": "None", "price_unit": "batch", "price_ref_layers": "None", "oea_k0": "2",
               "xshare_budget": "3", "xshare_fraction": "0.3",
               "xshare_warmup": "2", "q_max": "2", "verify": "false", "routing_backend": "torch", "expert_path": "model",
               "telemetry": "false", "offload_path": "module", "expert_cache_bytes": "4096",
               "gate": "always", "gate_table": str(EMPTY_TABLE)}
NON_DEFAULT_CONFIG = dict(policy="oea", phase="decode", alpha=2.5, beta=3, tau=2.0, mass_price=None,
                          price_unit="batch", price_ref_layers=None, oea_k0=2, xshare_budget=3, xshare_fraction=0.3,
                          xshare_warmup=2, q_max=2,
                          verify=False, routing_backend="torch", expert_path="model", telemetry=False,
                          offload_path="module", expert_cache_bytes=4096, gate="always",
                          gate_table=str(EMPTY_TABLE))


def test_every_option_reaches_the_config(checkpoint, monkeypatch):
    """Each LynxConfig field has a `generate` option, and its value reaches the config `generate` patches
    with (in-process, the real command path; `--mass-price None` selects the paper's rule)."""
    from dataclasses import fields

    import lynx_hf
    from lynx_hf import cli

    names = {f.name for f in fields(lynx_hf.LynxConfig)}
    assert set(NON_DEFAULT) == set(NON_DEFAULT_CONFIG) == names  # a new field needs a value here
    want = lynx_hf.LynxConfig(**NON_DEFAULT_CONFIG)
    assert all(getattr(want, n) != getattr(lynx_hf.LynxConfig(), n) for n in names)  # every value non-default
    path, prompts = checkpoint
    seen = []
    real_patch = lynx_hf.patch
    monkeypatch.setattr(lynx_hf, "patch",
                        lambda model, config=None, **kw: seen.append(config) or real_patch(model, config, **kw))
    options = [x for name, value in NON_DEFAULT.items() for x in (f"--{name.replace('_', '-')}", value)]
    argv = ["generate", "--model", str(path), "--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "2",
            "--quiet", *options]
    assert cli.main(argv) == 0
    assert seen == [want]
    seen.clear()
    assert cli.main(argv[:9] + ["--mass-price", "0.75", "--tau", "3"]) == 0  # the others keep their defaults
    assert seen == [lynx_hf.LynxConfig(mass_price=0.75, tau=3.0)]


def test_layer_table_says_gate_off_instead_of_zero_experts(capsys):
    """A layer the cost gate kept on the model's own routing on every step has no counts: the table says so (it
    printed 0.00 experts before / after, which reads as a layer that used no expert)."""
    from lynx_hf.cli import print_layer_table

    on = {"layer": "model.layers.0.mlp", "num_experts": 32, "top_k": 4, "decode_steps": 31,
          "unique_experts_before": 20.0, "unique_experts_after": 10.0, "routing_mass_kept": 0.9,
          "gate": {"steps_skipped": 0}}
    off = {"layer": "model.layers.1.mlp", "num_experts": 32, "top_k": 4, "decode_steps": 0,
           "unique_experts_before": 0.0, "unique_experts_after": 0.0, "routing_mass_kept": 1.0,
           "gate": {"steps_skipped": 31}}
    print_layer_table({"unique_experts_before": 20.0, "unique_experts_after": 10.0, "ratio": 0.5,
                       "routing_mass_kept": 0.9}, [on, off])
    rows = capsys.readouterr().out.splitlines()
    on_row = next(r for r in rows if r.startswith("model.layers.0"))
    off_row = next(r for r in rows if r.startswith("model.layers.1"))
    assert "20.00" in on_row and "10.00" in on_row and "0.500" in on_row and "gate off" not in on_row
    assert "0.00" not in off_row and "gate off (31 steps" in off_row


def test_eval_out_must_be_a_folder(tmp_path):
    """`--out` names the results folder; a file name is refused before anything loads (it became a folder)."""
    target = tmp_path / "results.json"
    res = run("eval", "--out", str(target))
    assert res.returncode != 0 and "results folder" in res.stderr and "results.json" in res.stderr, res.stderr[-800:]
    assert not target.exists()


def test_layer_table_dashes_when_nothing_was_counted(capsys):
    """telemetry off (or every step gated off): no layer counted a decode step, so the table prints '-' for the
    means instead of the summary's placeholders (0.00 experts, ratio 1.000)."""
    from lynx_hf.cli import print_layer_table

    layer = {"layer": "model.layers.0.mlp", "num_experts": 32, "top_k": 4, "decode_steps": 0,
             "unique_experts_before": 0.0, "unique_experts_after": 0.0, "routing_mass_kept": 1.0, "gate": None}
    print_layer_table({"decode_steps": 0, "unique_experts_before": 0.0, "unique_experts_after": 0.0, "ratio": 1.0,
                       "routing_mass_kept": 1.0}, [layer])
    out = capsys.readouterr().out
    assert "no decode step counted" in out and "0.00" not in out and "1.000" not in out


@pytest.mark.parametrize("sub, extra", [("sweep", ["--model", "x"]), ("bench", ["--quick"])])
def test_sweep_and_bench_out_must_be_a_folder(sub, extra, tmp_path):
    """--out of sweep / bench is a results folder too: an existing file or a file name is refused before any work."""
    existing = tmp_path / "plainfile"
    existing.write_text("")
    for out in (existing, tmp_path / "s.json"):
        res = run(sub, *extra, "--out", str(out))
        assert res.returncode != 0 and "results folder" in res.stderr, (sub, out, res.stderr[-800:])
    assert not (tmp_path / "s.json").exists() and existing.is_file()


@pytest.mark.parametrize("argv,usage", [(["generate", "--bogus"], "usage: lynx-hf generate"),
                                        (["tune", "--model", "x", "--bogus"], "usage: lynx-hf tune")])
def test_an_unknown_option_shows_the_subcommands_usage(argv, usage, capsys):
    """A typo in a subcommand's options prints that subcommand's usage (its options), not the top level's list of
    subcommands (a fresh-user trial), and exits 2 as argparse does."""
    from lynx_hf import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(usage) and "unrecognized arguments: --bogus" in err
