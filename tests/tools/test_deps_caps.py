"""``.ci/deps.py caps``: every upper bound of pyproject.toml with the release above it that would resolve were the caps
lifted (printed by CI, so an expired reason shows on the next run), and a ``<`` cap refused unless its comment names
the failing test. pip's dry-run report is replaced by a fixed one: no network, no resolver."""

import importlib.util
import json
import subprocess
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def deps(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ci_deps", ROOT / ".ci" / "deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    resolved = {}  # what the dry run "would install"
    asked = []

    def run(cmd, **kw):
        asked.append(Path(cmd[cmd.index("-r") + 1]).read_text())
        report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in resolved.items()]}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(report), "")

    monkeypatch.setattr(module.subprocess, "run", run)
    return types.SimpleNamespace(module=module, root=tmp_path, resolved=resolved, asked=asked)


def _pyproject(root: Path, deps_lines: str) -> None:
    (root / "pyproject.toml").write_text(f'[project]\nname = "x"\ndependencies = [\n{deps_lines}]\n'
                                         '[project.optional-dependencies]\ntest = ["ruff==0.17.6"]\n')


def test_a_cap_with_a_newer_release_is_named_and_one_without_a_test_fails(deps, capsys):
    _pyproject(deps.root, '    # 5.25 needs kernels, not on the index\n    "transformers>=5.19,<5.25",\n'
                          '    "torch>=2.13",\n')
    deps.resolved.update({"transformers": "5.25.0", "torch": "2.15.0", "ruff": "0.17.6"})
    assert deps.module.main(["caps", "test"]) == 1
    out = capsys.readouterr().out
    assert "transformers>=5.19,<5.25" in out and "ABOVE THE CAP, resolves: 5.25.0" in out
    assert "names no failing test" in out and "ruff==0.17.6" in out and "nothing above it resolves (0.17.6)" in out
    assert "transformers>=5.19\n" in deps.asked[0] and "<5.25" not in deps.asked[0]  # every cap lifted in the dry run


def test_a_cap_naming_its_failing_test_passes_and_still_reports_what_resolves(deps, capsys):
    _pyproject(deps.root, '    # 2.15: tests/accelerator/test_compile.py::test_x fails (graph break)\n'
                          '    "torch>=2.13,<2.15",\n')
    deps.resolved.update({"torch": "2.15.0", "ruff": "0.17.6"})
    assert deps.module.main(["caps", "test"]) == 0
    assert "ABOVE THE CAP, resolves: 2.15.0" in capsys.readouterr().out


def test_no_cap_no_resolve(deps, capsys):
    (deps.root / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch>=2.13"]\n')
    assert deps.module.main(["caps"]) == 0
    assert "no requirement has an upper bound" in capsys.readouterr().out and not deps.asked


def test_the_project_has_no_cap_without_its_test():
    """The shipped pyproject.toml: every ``<`` cap names its failing test (today there is none)."""
    spec = importlib.util.spec_from_file_location("ci_deps_real", ROOT / ".ci" / "deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, req, op, comment in module.capped(["eval", "test", "vllm-cpu", "fixtures"]):
        assert op == "==" or "tests/" in comment, (req, comment)
