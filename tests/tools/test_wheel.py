"""The installed package works without the source checkout: a wheel built from the working tree, installed
without dependencies into a temporary folder (the test venv provides torch, transformers, ...), imported from
that folder rather than the editable install, run from a directory outside the checkout: the ``lynx-hf``
console script runs ``generate`` on the packaged fixture, ``sweep --help`` and ``bench --quick``, and writes
nothing into the installed package.

A fresh venv with dependencies from PyPI is the manual version of this check (see ``lynx_hf.eval``'s docstring).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: what the build reads; copied so the checkout gets no build/ folder or egg-info from this test
SOURCES = ("pyproject.toml", "README.md", "lynx_hf", "patches", "eval")


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    for name in ("results", "work"):  # not package data; skip copying ~MBs the build would ignore anyway
        shutil.rmtree(src / "eval" / name, ignore_errors=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
                            str(base / "whl"), str(src)], env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (base / "whl").glob("lynx_hf-*.whl")
    site = base / "site"
    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return wheel, site, elsewhere


def _run(cmd, site: Path, cwd: Path, timeout: int = 240):
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _listing(site: Path) -> list:
    """Files under ``site`` but bytecode / numba caches (``__pycache__``: Python's and numba's own business)."""
    return sorted(p.relative_to(site) for p in site.rglob("*") if "__pycache__" not in p.parts)


def test_wheel_contents(wheel_site):
    wheel, _, _ = wheel_site
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("lynx_hf/cli.py", "lynx_hf/kernels/routing.py", "lynx_hf/patches/base.py",
                   "lynx_hf/eval/__init__.py", "lynx_hf/eval/bench.py", "lynx_hf/eval/data/prompts.txt",
                   "lynx_hf/eval/tasks/lynx_utils.py", "lynx_hf/eval/tasks/lynx_code_next_line_mc.yaml",
                   "lynx_hf/eval/tasks/data/code_next_line_mc.jsonl"):
        assert needed in names, needed
    for fixture in ("qwen2moe-tiny", "mixtral-tiny", "deepseekv2-tiny"):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert f"lynx_hf/eval/fixtures/{fixture}/{name}" in names, (fixture, name)
    shipped = sorted(p.name for p in (ROOT / "lynx_hf" / "gate" / "tables").glob("*.json"))
    assert shipped and all(f"lynx_hf/gate/tables/{name}" in names for name in shipped), shipped  # the gate's tables
    assert not [n for n in names if n.startswith(("lynx_hf/eval/results/", "lynx_hf/eval/work/", "tests/", "lab/",
                                                   "lynx_hf/eval/fixtures/qwen2moe-deep/",
                                                   "lynx_hf/eval/fixtures/smollm2-d3/"))]  # E, D3: checkout only
    # what lynx-hf runs is installed; the checkout's scripts (lab/) are not
    assert {"lynx_hf/eval/harness.py", "lynx_hf/eval/sweep.py", "lynx_hf/eval/model_sweep.py", "lynx_hf/eval/pareto.py",
            "lynx_hf/eval/router_report.py"} <= names
    assert not {f"lynx_hf/eval/{n}.py" for n in ("gpu_check", "family_matrix", "train_fixture", "mutants")} & names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "lynx-hf = lynx_hf.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_package_runs_outside_the_checkout(wheel_site):
    _, site, elsewhere = wheel_site
    before = _listing(site)
    probe = _run([sys.executable, "-c",
                  "import sys, lynx_hf, lynx_hf.cli, lynx_hf.eval.bench, lynx_hf.eval.evaluation, lynx_hf.kernels, "
                  "lynx_hf.patches\nfrom lynx_hf import eval as e\n"
                  "print(e.CHECKOUT, e.RESULTS_DIR, e.DEFAULT_FIXTURE.is_dir())\n"
                  "print('\\n'.join(m.__file__ for n, m in sys.modules.items() "
                  "if n.startswith('lynx_hf') and getattr(m, '__file__', None)))"], site, elsewhere)
    assert probe.returncode == 0, probe.stderr[-3000:]
    first, *files = probe.stdout.split("\n")
    assert first == "None lynx_hf_results True", first  # not a checkout: results go to ./lynx_hf_results
    files = [f for f in files if f]
    assert files and all(Path(f).resolve().is_relative_to(site.resolve()) for f in files), files

    script = site / "bin" / "lynx-hf"  # the console script of the wheel's entry point
    gen = _run([str(script), "generate", "--max-new-tokens", "4", "--batch-size", "4", "--quiet"], site, elsewhere)
    assert gen.returncode == 0, gen.stdout[-2000:] + gen.stderr[-3000:]
    assert "qwen2moe-tiny" in gen.stdout and "token agreement with unpatched greedy decode" in gen.stdout

    helped = _run([str(script), "sweep", "--help"], site, elsewhere)
    assert helped.returncode == 0 and "usage: lynx-hf sweep" in helped.stdout, helped.stderr[-2000:]
    assert "lynx_hf_results" in helped.stdout  # the documented default output folder

    bench = _run([str(script), "bench", "--quick"], site, elsewhere)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-3000:]
    assert "| variant | TPOT (ms) | ratio to HF |" in bench.stdout
    assert (elsewhere / "lynx_hf_results" / "bench_quick_layer.csv").is_file()
    assert _listing(site) == before  # no output written into the installed package
