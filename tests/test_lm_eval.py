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
import evaluation as ev  # eval/evaluation.py (conftest puts eval/ on sys.path)

FIXTURE = Path(os.environ.get("LYNX_FIXTURES_DIR", ev.FIXTURES_DIR)) / "qwen2moe-tiny"
GEN_TASK, LL_TASK = "lynx_code_line_completion", "lynx_code_next_line_mc"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def model_and_tok():
    assert (FIXTURE / "config.json").is_file() and any(FIXTURE.glob("*.safetensors")), (
        f"committed fixture {FIXTURE} is missing: train it with eval/train_fixture.py and commit it")
    return ev.load_model(FIXTURE)


def test_local_tasks_are_indexed_and_data_is_what_build_tasks_writes():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(ev.TASKS_DIR), include_defaults=False)
    assert {GEN_TASK, LL_TASK} <= set(tm.all_tasks)
    sys.path.insert(0, str(ev.TASKS_DIR))
    try:
        import build_tasks
    finally:
        sys.path.pop(0)
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
    assert 0.0 <= metrics["exact_match,none"] <= 1.0 and 0.0 <= metrics["prefix_match,none"] <= 1.0
    assert len(out["samples"][GEN_TASK]) == 16
    stats = out["stats"]  # generate_until decodes in batches: the patch acted
    assert stats["decode_steps"] > 0 and stats["unique_experts_after"] < stats["unique_experts_before"]
    assert not lynx_hf.is_patched(model)


def test_C17_loglikelihood_task_bit_identical_to_unpatched(model_and_tok):
    model, tok = model_and_tok
    ref = ev.run_lm_eval(model, tok, [LL_TASK], batch_size=8, limit=24)
    ref_resps = ev.sample_responses(ref["samples"][LL_TASK])
    assert len(ref_resps) == 24 and all(len(r) == 4 for r in ref_resps)
    for cfg in (LynxConfig(policy="lynx"), LynxConfig(policy="oea", k0=1), LynxConfig(policy="lynx", tau=8.0)):
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
    args = f"pretrained={FIXTURE},policy=lynx,mass_price=0.25,lynx_backend=torch"
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
         f"pretrained={FIXTURE},policy=oea,k0=1", "--tasks", LL_TASK, "--include_path", str(ev.TASKS_DIR),
         "--batch_size", "8", "--limit", "4", "--output_path", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert LL_TASK in res.stdout and "acc" in res.stdout
