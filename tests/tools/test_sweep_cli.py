"""``lynx-hf sweep --model``: the sweep on a user's checkpoint and data (lynx_hf.eval.model_sweep), run as the CLI
from a working directory outside the checkout on a copy of fixture B, then its lynx_config.json carried into
``lynx-hf generate --config`` and the lm-eval ``lynx`` model; bad inputs; the data readers and the choice rule.
Fixture sizes: 16 windows of 13 tokens, B = 8 and 16, the sqrt and OEA series (a few seconds)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

from lynx_hf import LynxConfig
from lynx_hf.eval import DATA_DIR, FIXTURES_DIR
from lynx_hf.eval import evaluation as ev
from lynx_hf.eval import model_sweep as ms

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ["--sequences", "16", "--prefill", "4", "--decode", "8", "--threads", "1"]


def run(*args, cwd, timeout=300):
    """The console entry point in a fresh interpreter (what an installed ``lynx-hf`` runs)."""
    return subprocess.run([sys.executable, "-m", "lynx_hf", *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=timeout)


def cli(capsys, monkeypatch, cwd, *args) -> tuple[int, str, str]:
    """``lynx_hf.cli.main(args)`` in this process from ``cwd`` (no interpreter start): ``(status, stdout, stderr)``."""
    from lynx_hf.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the CLI names the subcommand in sys.argv[0]
    capsys.readouterr()
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def _docs(n: int) -> str:
    return "\n\n".join(ev.read_texts(DATA_DIR / "valid_docs.jsonl")[:n])


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Fixture B copied outside the checkout, a .txt data file, one sweep run at B = 8, 16."""
    base = tmp_path_factory.mktemp("user")
    ckpt = base / "my-moe"
    shutil.copytree(FIXTURES_DIR / "mixtral-tiny", ckpt)
    data = base / "corpus.txt"
    data.write_text(_docs(3)[:4000])
    res = run("sweep", "--model", ckpt, "--data", data, "--batch-sizes", "8,16", "--max-minutes", "5", "--series",
              "sqrt,oea", "--out", "out", *SMALL, cwd=base)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return base, ckpt, data, base / "out", res


def test_sweep_writes_frontier_png_and_lynx_config(swept):
    base, ckpt, _, out, res = swept
    for name in ("sweep.json", "sweep.md", "sweep.points.jsonl", "lynx_config.json"):
        assert (out / name).is_file(), name
    assert (out / "sweep_pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "sweep.json").read_text())
    assert report["settings"]["batch_sizes"] == [8, 16] and report["settings"]["sequences"] == 16
    assert [r["batch_size"] for r in report["runs"]] == [8, 16]
    for run_ in report["runs"]:
        names = {r["name"] for r in run_["results"]}
        assert {"unpatched", "none", ms.DEFAULT_NAME, "oea k0=1"} <= names  # tier 0 at every B
        assert next(r for r in run_["results"] if r["name"] == "none")["bit_identical"]
        assert run_["frontier"] and run_["comparisons"]
    assert report["points"]["trimmed"] == 0 and report["points"]["measured"] == report["points"]["planned"]
    choice = report["choice"]
    cfg = LynxConfig.from_file(out / "lynx_config.json")
    about = json.loads((out / "lynx_config.json").read_text())["_about"]
    assert about["choice"] == choice["name"] and about["within_budget"] == choice["within_budget"]
    assert [c["batch_size"] for c in about["per_batch_size"]] == [8, 16]
    if choice["within_budget"]:
        assert all(c["delta_ce_rel"] <= 0.01 for c in choice["cells"])
    assert cfg.policy in ("lynx", "oea")
    assert f"lynx_config.json: `{choice['name']}`" in res.stdout
    md = (out / "sweep.md").read_text()
    assert "## lynx_config.json" in md and "Pareto frontier at B = 16" in md


SMALL_IN_PROCESS = SMALL[:-2]  # no --threads: leave this process's torch threads alone


def test_rerun_resumes_without_measuring_again(swept, capsys, monkeypatch):
    base, ckpt, data, out, _ = swept
    lines = (out / "sweep.points.jsonl").read_text().splitlines()
    status, _, err = cli(capsys, monkeypatch, base, "sweep", "--model", ckpt, "--data", data, "--batch-sizes", "8,16",
                         "--series", "sqrt,oea", "--out", "out", *SMALL_IN_PROCESS)
    assert status == 0, err[-3000:]
    assert f"resuming: {len(lines)} points already in" in err and "0 to run" in err
    assert (out / "sweep.points.jsonl").read_text().splitlines() == lines


class FakeClock:
    """``model_sweep``'s ``time.perf_counter``: seconds advance only by what the faked runs below say each pass
    costs."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _slow_machine(monkeypatch, seconds_per_window: float) -> FakeClock:
    """The real teacher-forced runs (fast on fixture B), each charged ``seconds_per_window`` per window decoded on a
    fake clock, and reported so (``seconds``): a busy machine without timing anything."""
    clock = FakeClock()
    real_ref, real_score = ev.reference_run, ev.score_policy

    def reference_run(model, windows, batch_size, prefill):
        ref = real_ref(model, windows, batch_size, prefill)
        ref.row["seconds"] = seconds_per_window * windows.shape[0]
        clock.t += ref.row["seconds"]
        return ref

    def score_policy(model, ref, name, cfg):
        row = real_score(model, ref, name, cfg)
        row["seconds"] = seconds_per_window * sum(b.shape[0] for b in ref.batches)
        clock.t += row["seconds"]
        return row

    monkeypatch.setattr(ms, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(ev, "reference_run", reference_run)
    monkeypatch.setattr(ev, "score_policy", score_policy)
    return clock


BUDGETED = ["--sequences", "64", "--prefill", "4", "--decode", "8", "--series", "sqrt,oea"]


def test_C46_max_minutes_sizes_the_windows_and_measures_none_and_the_default_first(swept, capsys, monkeypatch):
    """CASES C46: 3 s per window (64 windows: 192 s per pass at B = 8) and --max-minutes 4. Before, the reference and
    policy none alone took 384 s, the rest was trimmed and no lynx_config.json was written. Now one batch is timed,
    the windows are cut to 8 (none, the default and the reference in at most half the budget), none and the default
    run first, further points fill the budget, lynx_config.json is written and the report states the windows and
    each dCE's standard error."""
    base, ckpt, data, _, _ = swept
    clock = _slow_machine(monkeypatch, 3.0)
    status, out, err = cli(capsys, monkeypatch, base, "sweep", "--model", ckpt, "--data", data, "--batch-sizes", "8",
                           "--max-minutes", "4", "--out", "budgeted", *BUDGETED)
    assert status == 0, err[-3000:]
    assert (base / "budgeted" / "lynx_config.json").is_file(), out + err[-2000:]
    report = json.loads((base / "budgeted" / "sweep.json").read_text())
    assert report["settings"]["sequences"] == 8 and report["settings"]["requested_sequences"] == 64
    assert "8 of 64 windows, sized to the budget" in err
    names = [r["name"] for r in report["runs"][0]["results"]]
    assert names[:1] == ["unpatched"] and {"none", ms.DEFAULT_NAME} <= set(names)
    # 24 s probe + 24 s per pass (reference, none, default, ...) within 240 s: 8 passes after the probe
    assert report["points"]["measured"] == 8 and report["points"]["trimmed"] > 0
    assert clock.t <= 240.0
    assert "+-" in out  # the chosen configuration's dCE with its standard error


def test_C46_max_minutes_too_short_refuses_at_once_naming_the_time_needed(swept, capsys, monkeypatch):
    """10 s per window: the probe (8 windows, 80 s) leaves 160 s, and none + the default + the reference at B = 8 on
    the fewest windows need 240 s: refused with status 2 after the probe alone, naming the minutes to give
    ((80 + 240 / 0.5) / 60 = 9.33 -> 9.4); nothing else measured, no file written. The trimming itself: above."""
    base, ckpt, data, _, _ = swept
    clock = _slow_machine(monkeypatch, 10.0)
    status, _, err = cli(capsys, monkeypatch, base, "sweep", "--model", ckpt, "--data", data, "--batch-sizes", "8",
                         "--max-minutes", "4", "--out", "refused", *BUDGETED)
    assert status == 2
    assert "--max-minutes 4 is too short" in err and "need about 4.00 min" in err and "--max-minutes 9.4" in err
    assert clock.t == 80.0 and not (base / "refused" / "lynx_config.json").exists()
    assert err.strip().splitlines()[-1].startswith("lynx-hf sweep: error: --max-minutes 4 is too short")


def test_generate_uses_the_config_file_and_options_override_it(swept, capsys, monkeypatch):
    base, ckpt, _, out, _ = swept
    cfg = LynxConfig.from_file(out / "lynx_config.json")
    prompts = base / "prompts.txt"
    prompts.write_text("The module\nimport os\n")
    stats = base / "stats.json"
    status, stdout, err = cli(capsys, monkeypatch, base, "generate", "--model", ckpt, "--config",
                              out / "lynx_config.json", "--prompts", prompts, "--batch-size", "4", "--max-new-tokens",
                              "3", "--quiet", "--stats-json", stats)
    assert status == 0, err[-3000:]
    assert f"policy: {cfg.policy}" in stdout and json.loads(stats.read_text())["policy"] == cfg.policy
    status, stdout, _ = cli(capsys, monkeypatch, base, "generate", "--model", ckpt, "--config",
                            out / "lynx_config.json", "--policy", "none", "--prompts", prompts, "--batch-size", "4",
                            "--max-new-tokens", "3", "--quiet")
    assert status == 0 and "policy: none" in stdout
    assert "token agreement with unpatched greedy decode: 1.000" in stdout
    status, _, err = cli(capsys, monkeypatch, base, "generate", "--model", ckpt, "--config", base / "missing.json")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "missing.json" in err


def test_lm_eval_model_uses_the_config_file(swept):
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    import lynx_hf
    import lynx_hf.lm_eval  # noqa: F401  (registers "lynx")

    _, ckpt, _, out, _ = swept
    # the file is the configuration to deploy (the cost gate on: "auto"); the lm-eval model runs its accuracy work with
    # the policy on every decode step unless model_args ask for gate=auto
    cfg = dataclasses.replace(LynxConfig.from_file(out / "lynx_config.json"), gate="always")
    lm = get_model("lynx").create_from_arg_string(f"pretrained={ckpt},lynx_config={out / 'lynx_config.json'}",
                                                  {"batch_size": 4, "device": "cpu"})
    assert lm.lynx_config == cfg and lynx_hf.config_of(lm.model) == cfg
    lm = get_model("lynx").create_from_arg_string(
        f"pretrained={ckpt},lynx_config={out / 'lynx_config.json'},telemetry=false", {"batch_size": 4, "device": "cpu"})
    assert lynx_hf.config_of(lm.model) == LynxConfig.from_dict({**cfg.to_dict(), "telemetry": False})


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """A dense Llama with fixture B's tokenizer: no MoE block of a supported family."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("dense") / "llama"
    vocab = json.loads((FIXTURES_DIR / "mixtral-tiny" / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(FIXTURES_DIR / "mixtral-tiny" / name, path / name)
    return path


@pytest.mark.parametrize("case,message", [
    ("missing model", "no local checkpoint at"),
    ("empty data", "no text in"),
    ("too little data", "windows of 13 tokens; the batch sizes [8, 16] need at least 16"),
    ("missing data", "no data at"),
    ("budget 0", "--budget must be > 0"),
    ("budget < 0", "--budget must be > 0"),
    ("unsupported family", "no MoE block of a supported family"),
    ("bad batch sizes", "--batch-sizes must be comma-separated positive ints"),
])
def test_bad_inputs_are_one_line_errors_with_status_2(swept, dense_checkpoint, tmp_path, capsys, monkeypatch, case,
                                                      message):
    _, ckpt, data, _, _ = swept
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    short = tmp_path / "short.txt"
    short.write_text("Just a few words of text.")
    model, budget, sizes = ckpt, "0.01", "8,16"
    if case == "missing model":
        model = tmp_path / "no-such-model"
    elif case == "empty data":
        data = empty
    elif case == "too little data":
        data = short
    elif case == "missing data":
        data = tmp_path / "nothing.jsonl"
    elif case == "budget 0":
        budget = "0"
    elif case == "budget < 0":
        budget = "-0.5"
    elif case == "unsupported family":
        model = dense_checkpoint
    elif case == "bad batch sizes":
        sizes = "8,zero"
    status, stdout, err = cli(capsys, monkeypatch, tmp_path, "sweep", "--model", model, "--data", data, "--budget",
                              budget, "--batch-sizes", sizes, "--out", "out", *SMALL_IN_PROCESS)
    assert status == 2, stdout[-2000:] + err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lynx-hf sweep: error: ") and message in lines[0], err
    assert not (tmp_path / "out" / "lynx_config.json").exists()


def test_bad_input_from_a_fresh_interpreter_is_one_line(tmp_path):
    res = run("sweep", "--model", tmp_path / "no-such-model", "--budget", "0.01", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == (f"lynx-hf sweep: error: no local checkpoint at "
                                                          f"{tmp_path / 'no-such-model'} (a folder with config.json is "
                                                          "expected)"), res.stderr


def test_fixture_sweep_options_need_no_model_and_user_options_need_one(tmp_path):
    from lynx_hf.eval import sweep

    with pytest.raises(SystemExit) as info:
        sweep.main(["--data", "x.txt"])
    assert info.value.code == 2


def test_data_files_and_windows(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(_docs(2))
    (folder / "sub" / "b.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in ev.read_texts(
        DATA_DIR / "valid_code.jsonl")[:3]) + "\n")
    (folder / "notes.md").write_text("ignored")
    files = ev.data_files(folder)
    assert [f.name for f in files] == ["a.txt", "b.jsonl"]
    assert ev.read_texts(files[0]) == [_docs(2)]
    with pytest.raises(ValueError, match=r"b.jsonl:1: expected a JSON object with a string 'text' field"):
        ev.read_texts(files[1])
    _, tok = ev.load_model(FIXTURES_DIR / "mixtral-tiny")
    every = ev.heldout_windows(tok, 13, None, files, field="body")
    assert every.shape[1] == 13 and len(every) > 8
    assert torch.equal(ev.heldout_windows(tok, 13, 8, files, field="body"), every[:8])  # count=c is a prefix
    with pytest.raises(ValueError, match="data must be a .jsonl file"):
        ev.data_files(folder / "notes.md")


def _run(b, rows):
    none = {"name": "none", "policy": "none", "unique_experts_before": 10.0, "unique_experts_after": 10.0,
            "delta_ce_rel": 0.0, "delta_ce_rel_se": 0.0}
    out = [{"name": "unpatched", "policy": None, "delta_ce_rel": 0.0}, none]
    for name, policy, after, delta in rows:
        out.append({"name": name, "policy": policy, "mass_price": 0.1 if policy == "lynx" else None,
                    "price_unit": "sqrt" if policy == "lynx" else None, "unique_experts_after": after,
                    "delta_ce_rel": delta, "delta_ce_rel_se": 0.001})
    ev.add_unique_ratios(out)
    return {"batch_size": b, "results": out}


def test_choice_rule_within_budget_everywhere_else_closest_flagged():
    runs = [_run(8, [("a", "lynx", 4.0, 0.005), ("b", "oea", 3.0, 0.02), ("c", "xshare", 5.0, 0.001)]),
            _run(16, [("a", "lynx", 5.0, 0.009), ("b", "oea", 4.0, 0.004), ("c", "xshare", 6.0, 0.001)])]
    choice = ms.choose_config(runs, 0.01)  # b has the fewest experts but misses the budget at B = 8
    assert choice["name"] == "a" and choice["within_budget"] and [c["batch_size"] for c in choice["cells"]] == [8, 16]
    choice = ms.choose_config(runs, 0.0005)  # nothing within: the smallest worst-case dCE, flagged
    assert choice["name"] == "c" and not choice["within_budget"]
    assert ms.choose_config([runs[0], _run(16, [])], 0.01) is None  # nothing measured at every B


def test_lynx_config_json_of_a_mass_price_choice_stores_the_default_tau():
    """The price series run with tau = 1e6 (unused under a mass price); lynx_config.json stores the documented default
    instead, so a later ``mass_price=None`` override gives the paper's tau; same routing either way. Other choices
    are stored as they ran."""
    from lynx_hf.eval import pareto

    cat = pareto.catalog(32, 4)
    priced = next(c for s, c in cat.values() if s == "token")
    assert priced.tau == 1e6 and priced.mass_price is not None
    stored = ms.config_for_file(priced)
    assert stored.tau == LynxConfig().tau == 1.0
    assert stored == LynxConfig.from_dict({**priced.to_dict(), "tau": 1.0})
    paper = next(c for s, c in cat.values() if s == "paper" and c.tau != 1.0)
    oea = cat["oea k0=1"][1]
    assert ms.config_for_file(paper) is paper and ms.config_for_file(oea) is oea
