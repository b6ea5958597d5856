"""Evaluation and benchmark tools of lynx_hf, installed as ``lynx_hf.eval`` (source folder ``eval/``).

Package data: the committed fixtures (``fixtures/``), the held-out text (``data/``) and the local lm-eval
tasks (``tasks/``). The scripts run as modules, from a source checkout or an installed wheel::

    python -m lynx_hf.eval.harness        # lynx-hf eval     accuracy harness
    python -m lynx_hf.eval.sweep          # lynx-hf sweep    Pareto sweep LYNX vs OEA (--model PATH: on your checkpoint)
    python -m lynx_hf.eval.bench          # lynx-hf bench    decode latency benchmark
    python -m lynx_hf.eval.router_report  # lynx-hf report   router statistics
    python -m lynx_hf.eval.serving_report | kernel_report | bench_compile | gpu_check
    python -m lynx_hf.eval.serve_bench    # in the vLLM environment (.ci/vllm_env.sh)
    python -m lynx_hf.eval.build_corpus | train_fixture | mutants | tasks.build_tasks   # source checkout only

Where outputs go by default (every script also takes ``--out``): ``eval/results`` of the source checkout when
this package is the checkout's ``eval/`` folder (editable install), else ``./lynx_hf_results`` under the
working directory; never into the installed package.

This module only defines paths (no torch import): ``lynx_hf.cli`` reads the default fixture from it.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
#: the source checkout (the folder holding pyproject.toml and lynx_hf/) when this package is its ``eval/``
#: folder, else None (an installed wheel)
CHECKOUT: Path | None = (PACKAGE_DIR.parent if PACKAGE_DIR.name == "eval" and (PACKAGE_DIR.parent / "pyproject.toml").is_file()
                         and (PACKAGE_DIR.parent / "lynx_hf").is_dir() else None)
FIXTURES_DIR = PACKAGE_DIR / "fixtures"
DATA_DIR = PACKAGE_DIR / "data"
TASKS_DIR = PACKAGE_DIR / "tasks"
#: default output folder of the scripts (relative = under the working directory)
RESULTS_DIR = PACKAGE_DIR / "results" if CHECKOUT is not None else Path("lynx_hf_results")
#: scratch folder of the fixture rebuild (build_corpus, train_fixture); not shipped
WORK_DIR = PACKAGE_DIR / "work" if CHECKOUT is not None else Path("lynx_hf_work")
#: fixture A, the default model of ``lynx-hf generate``
DEFAULT_FIXTURE = FIXTURES_DIR / "qwen2moe-tiny"
PROMPTS_FILE = DATA_DIR / "prompts.txt"


def require_checkout(script: str) -> Path:
    """The source checkout; ``SystemExit`` with one line when run from an installed wheel (``script`` rewrites
    committed files of the checkout or needs its git tree)."""
    if CHECKOUT is None:
        raise SystemExit(f"{script} works on a source checkout of lynx_hf (it rewrites committed files or needs git); "
                         f"this lynx_hf.eval is installed at {PACKAGE_DIR}")
    return CHECKOUT


def results_folder(out) -> Path | None:
    """``--out`` of the scripts is the results folder the tables are written into: ``SystemExit`` (one line) before
    any work when it names a file (an existing file, or a name ending in .json / .md / .csv / .txt / .png, which
    would become a folder); ``None`` passes through (the script's default)."""
    if out is None:
        return None
    path = Path(out)
    if (path.exists() and not path.is_dir()) or path.suffix.lower() in (".json", ".md", ".csv", ".txt", ".png"):
        raise SystemExit(f"--out is the results folder the tables are written into, got a file name: {out}")
    return path


def command(module: str, argv=None) -> str:
    """The command that reproduces a run, as results files record it: ``python -m lynx_hf.eval.<module> ARGS``
    (``argv`` as passed to the script's ``main``; ``None`` = ``sys.argv[1:]``)."""
    import shlex
    import sys

    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return " ".join([f"python -m lynx_hf.eval.{module}", *map(shlex.quote, args)])
