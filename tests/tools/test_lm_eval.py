"""lm-eval over a patched model (CASES C17): HFLM(pretrained=<patched model object>, tokenizer,
batch_size=N) runs the local tasks in eval/tasks end to end, offline, with a fixed batch size; the
loglikelihood task (prefill only) gives results bit-identical to the unpatched model.

Uses the committed fixture eval/fixtures/qwen2moe-tiny: missing is a failure, never a skip
(``LYNX_FIXTURES_DIR`` may point at another folder, development only).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import lynx_hf
from lynx_hf import LynxConfig
from lynx_hf.eval import evaluation as ev
from test_cli import NON_DEFAULT, NON_DEFAULT_CONFIG

FIXTURE = Path(os.environ.get("LYNX_FIXTURES_DIR", ev.FIXTURES_DIR)) / "qwen2moe-tiny"
GEN_TASK, LL_TASK = "lynx_code_line_completion", "lynx_code_next_line_mc"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def model_and_tok():
    assert (FIXTURE / "config.json").is_file() and any(FIXTURE.glob("*.safetensors")), (
        f"committed fixture {FIXTURE} is missing: train it with python -m lab.train_fixture and commit it")
    return ev.load_model(FIXTURE)


def test_local_tasks_are_indexed_and_data_is_what_build_tasks_writes():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(ev.TASKS_DIR), include_defaults=False)
    assert {GEN_TASK, LL_TASK} <= set(tm.all_tasks)
    from lab import build_tasks
    docs = [json.loads(line) for line in build_tasks.SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    for name, rows in (("code_line_completion.jsonl", build_tasks.build_generation(docs)),
                       ("code_next_line_mc.jsonl", build_tasks.build_multiple_choice(docs))):
        committed = [json.loads(line) for line in (ev.TASKS_DIR / "data" / name).read_text().splitlines()]
        assert committed == rows and len(rows) >= 150
    assert all(r["target"].startswith(" ") and not r["prompt"][-1].isspace() for r in committed_gen())


def committed_gen():
    return [json.loads(line) for line in (ev.TASKS_DIR / "data" / "code_line_completion.jsonl").read_text().splitlines()]


def test_generate_until_task_end_to_end_on_patched_model(model_and_tok):
    model, tok = model_and_tok
    out = ev.run_lm_eval(model, tok, [GEN_TASK], batch_size=8, config=LynxConfig(policy="lynx"), limit=16)
    metrics = out["results"][GEN_TASK]
    samples = out["samples"][GEN_TASK]
    assert len(samples) == 16
    # the metric recomputed by hand from each sample's generation and target (eval/tasks/lynx_utils.py's rule)
    preds = [s["filtered_resps"][0].split("\n")[0].rstrip() for s in samples]
    exact = [float(p == s["doc"]["target"].rstrip()) for p, s in zip(preds, samples)]
    assert metrics["exact_match,none"] == pytest.approx(sum(exact) / len(exact))
    stats = out["stats"]  # generate_until decodes in batches: the patch acted
    assert stats["decode_steps"] > 0 and stats["unique_experts_after"] < stats["unique_experts_before"]
    assert not lynx_hf.is_patched(model)


def test_C17_loglikelihood_task_bit_identical_to_unpatched(model_and_tok):
    model, tok = model_and_tok
    ref = ev.run_lm_eval(model, tok, [LL_TASK], batch_size=8, limit=24)
    ref_resps = ev.sample_responses(ref["samples"][LL_TASK])
    assert len(ref_resps) == 24 and all(len(r) == 4 for r in ref_resps)
    for cfg in (LynxConfig(policy="lynx"), LynxConfig(policy="oea", oea_k0=1), LynxConfig(policy="lynx", tau=8.0)):
        out = ev.run_lm_eval(model, tok, [LL_TASK], batch_size=8, config=cfg, limit=24)
        assert ev.sample_responses(out["samples"][LL_TASK]) == ref_resps, cfg  # exact floats
        assert out["results"][LL_TASK] == ref["results"][LL_TASK]
        assert out["stats"]["decode_steps"] == 0  # loglikelihood is prefill only: the policy never ran


def test_fixed_batch_size_required(model_and_tok):
    model, tok = model_and_tok
    for bad in ("auto", "auto:4", 0, True):
        with pytest.raises(ValueError, match="batch_size"):
            ev.run_lm_eval(model, tok, [LL_TASK], batch_size=bad)


def test_registered_lynx_model_via_simple_evaluate_and_cli(model_and_tok, tmp_path):
    """The lm-eval model type ``lynx`` (lynx_hf/lm_eval.py): model_args carry the LYNX options, a
    fixed batch size is required, and lm-eval's own CLI runs it through ``python -m lynx_hf.lm_eval``.
    Loglikelihood (prefill) results equal the unpatched model's."""
    import subprocess

    import lm_eval
    from lm_eval.tasks import TaskManager

    import lynx_hf.lm_eval as lynx_lm_eval

    tasks = TaskManager(include_path=str(ev.TASKS_DIR), include_defaults=False)
    args = f"pretrained={FIXTURE},policy=lynx,mass_price=0.25,routing_backend=torch"
    out = lm_eval.simple_evaluate(model="lynx", model_args=args, tasks=[LL_TASK], batch_size=8, limit=8,
                                  task_manager=tasks)
    model, tok = model_and_tok
    ref = ev.run_lm_eval(model, tok, [LL_TASK], batch_size=8, config=None, limit=8)
    assert out["results"][LL_TASK]["acc,none"] == ref["results"][LL_TASK]["acc,none"]
    with pytest.raises(ValueError, match="fixed batch_size"):
        lynx_lm_eval.LynxLM(pretrained=str(FIXTURE), batch_size="auto")
    with pytest.raises(lynx_hf.LynxConfigError, match="tau"):
        lynx_lm_eval.LynxLM(pretrained=str(FIXTURE), tau=-1.0, batch_size=8)
    res = subprocess.run(
        [sys.executable, "-m", "lynx_hf.lm_eval", "run", "--model", "lynx", "--model_args",
         f"pretrained={FIXTURE},policy=oea,oea_k0=1", "--tasks", LL_TASK, "--include_path", str(ev.TASKS_DIR),
         "--batch_size", "8", "--limit", "4", "--output_path", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert LL_TASK in res.stdout and "acc" in res.stdout


# a non-default value for every LynxConfig field (tools/test_cli.py), as model_args spell it
MODEL_ARGS = dict(NON_DEFAULT)
WANT = LynxConfig(**NON_DEFAULT_CONFIG)


def _lynx_lm(args: str):
    """The registered ``lynx`` model built the way ``simple_evaluate`` builds it from a model_args string."""
    import lynx_hf.lm_eval as lynx_lm_eval

    return lynx_lm_eval.LynxLM.create_from_arg_string(f"pretrained={FIXTURE},{args}", {"batch_size": 8})


def test_model_args_reach_the_patched_config():
    """Every LynxConfig field given in model_args reaches the config the loaded model is patched with."""
    from dataclasses import fields

    names = {f.name for f in fields(LynxConfig)}
    assert set(MODEL_ARGS) == names  # a new field needs a value here
    assert all(getattr(WANT, n) != getattr(LynxConfig(), n) for n in names)  # every value differs from the default
    lm = _lynx_lm(",".join(f"{k}={v}" for k, v in MODEL_ARGS.items()))
    assert lynx_hf.is_patched(lm.model)
    assert lynx_hf.config_of(lm.model) == WANT


def test_model_args_mass_price_none_runs_the_papers_rule(model_and_tok):
    """model_args ``mass_price=None``: the lm-eval model decodes with the paper's rule: its telemetry and outputs
    equal those of the same model patched directly with ``LynxConfig(mass_price=None)`` and differ from the
    default (mass price 0.5) run: the comparison can tell the two rules apart."""
    _, tok = model_and_tok
    lm = _lynx_lm("policy=lynx,mass_price=None")
    assert lynx_hf.config_of(lm.model) == LynxConfig(mass_price=None, gate="always")  # the accuracy entry point's gate
    tok.padding_side = "left"
    batch = tok(ev.prompts_from_file(count=16), return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, output_scores=True,
               return_dict_in_generate=True)

    def run():
        lynx_hf.reset_stats(lm.model)
        with torch.inference_mode():
            out = lm.model.generate(**batch, **gen)
        return out, lynx_hf.stats(lm.model).summary()

    via_args, stats_args = run()
    lynx_hf.unpatch(lm.model)
    runs = {}
    for name, cfg in (("paper", LynxConfig(mass_price=None, gate="always")), ("default", LynxConfig(gate="always"))):
        with lynx_hf.patched(lm.model, cfg):
            runs[name] = run()
    paper, stats_paper = runs["paper"]
    default, stats_default = runs["default"]
    assert stats_args["decode_steps"] == 5 and stats_args["per_layer"] == stats_paper["per_layer"]
    assert all(torch.equal(a, b) for a, b in zip(via_args.scores, paper.scores))
    assert stats_default["per_layer"] != stats_paper["per_layer"]
