"""What ``lynx-hf`` runs, installed as ``lynx_hf.eval`` (source folder ``eval/``): the accuracy harness, the sweeps,
the latency benchmark and the router report, with their package data: the committed fixtures (``fixtures/``), the
held-out text (``data/``) and the local lm-eval tasks (``tasks/``). They run from a source checkout or an installed
wheel, as ``lynx-hf`` subcommands or as modules::

    python -m lynx_hf.eval.harness        # lynx-hf eval     accuracy harness (lynx_hf.eval.evaluation)
    python -m lynx_hf.eval.sweep          # lynx-hf sweep    Pareto sweep LYNX vs OEA (--model PATH: model_sweep)
    python -m lynx_hf.eval.bench          # lynx-hf bench    decode latency benchmark
    python -m lynx_hf.eval.router_report  # lynx-hf report   router statistics
    python -m lynx_hf.eval.slo            # throughput under a TPOT SLO (transformers continuous batching; tables)

The project's other scripts (benchmarks, reports, the GPU check, the family census, the fixture builders, the
mutation probe) are not installed: ``lab/`` of the source checkout, ``python -m lab.<script>``.

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
#: fixture A, the default model of ``lynx-hf generate``
DEFAULT_FIXTURE = FIXTURES_DIR / "qwen2moe-tiny"
PROMPTS_FILE = DATA_DIR / "prompts.txt"


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


def command(module: str, argv=None, package: str = "lynx_hf.eval") -> str:
    """The command that reproduces a run, as results files record it: ``python -m <package>.<module> ARGS``
    (``argv`` as passed to the script's ``main``; ``None`` = ``sys.argv[1:]``; ``package``: ``lynx_hf.eval``, or
    ``lab`` for the checkout's scripts)."""
    import shlex
    import sys

    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return " ".join([f"python -m {package}.{module}", *map(shlex.quote, args)])
