"""Every Triton kernel of the project compiles to real GPU code for sm_80 and sm_90, on a
machine without a GPU, with no register spill.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit``
functions, and the test session sets it): ``python -m lab.kernel_report`` runs the real launchers on meta
tensors at the shapes of Qwen2-57B-A14B, DeepSeek-V2-Lite, Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3
(plus the expert kernels in Llama-4 Scout's transposed layout) for decode batches 1 / 16 / 64 (block
sizes from the launch sites' own functions), specialises each
launch with Triton's binder for the target and compiles it with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))``; identical combinations compile once. The detector of spills is
itself tested on a kernel built to spill.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("Qwen2-57B-A14B", "DeepSeek-V2-Lite", "Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V3")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.kernel_report", "--json", str(out), "--no-markdown", "--self-check",
         "--jobs", str(min(2, os.cpu_count() or 1))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    if not out.exists():
        pytest.fail(f"kernel_report.py produced no report (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), proc


def test_every_kernel_compiles_without_spill(report):
    data, proc = report
    rows = data["rows"]
    errors = [(r["kernel"], r["arch"], r.get("error")) for r in rows if not r["ok"]]
    assert not errors, errors[:5]
    spills = [(r["kernel"], r["arch"], r["model"], r["T"], r["dtype"], r["registers"], r["stack"], r["local"])
              for r in rows if r["spill"]]
    assert not spills, spills[:10]
    assert all(not r["ptx_local"] for r in rows)
    assert all(0 < r["registers"] <= 255 for r in rows)
    assert proc.returncode == 0, proc.stdout


def test_matrix_covers_every_kernel_arch_dtype_and_shape(report):
    data, _ = report
    rows = data["rows"]
    # every @triton.jit kernel of lynx_hf.kernels is launched by some recorded call (a new kernel that no
    # launch site of the matrix reaches fails here)
    assert data["kernels"] and {r["kernel"] for r in rows} == set(data["kernels"])
    for kernel in data["kernels"]:
        mine = [r for r in rows if r["kernel"] == kernel]
        assert {r["arch"] for r in mine} == {"sm_80", "sm_90"}, kernel
        assert {r["model"] for r in mine} >= set(MODELS), kernel
        assert {r["T"] for r in mine} == {1, 16, 64}, kernel
    expert_dtypes = {r["dtype"] for r in rows if r["kernel"] in ("_gate_up_act_kernel", "_down_kernel")}
    assert expert_dtypes == {"fp32", "fp16", "bf16"}
    assert any(r["constexprs"].get("WEIGHT_ON_INPUT") for r in rows)  # Llama-4's expert layout too
    # deduplicated: fewer compiles than (launch, arch) rows
    assert data["unique_compiles"] < data["launch_rows"]


def test_spill_detector_sees_a_spilling_kernel(report):
    data, _ = report
    probe = data["spill_self_check"]
    assert probe["ok"], probe
    assert probe["spill"] and (probe["stack"] > 0 or probe["local"] > 0 or probe["ptx_local"]), probe


def test_cuobjdump_reading_is_kept_per_cubin(tmp_path, monkeypatch):
    """lab.kernel_report reads each cubin's resources once (kept under Triton's cache dir, keyed by the cubin's bytes):
    the same bytes again are not re-read and give the same reading, other bytes are read; the cache can be turned off."""
    import lab.kernel_report as kr

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    calls = []

    def read(cubin, name):
        calls.append((cubin, name))
        return {"registers": len(cubin), "stack": 0, "local": 0, "shared_static": 0, "spill_insts": 0}

    monkeypatch.setattr(kr, "_read_resource_usage", read)
    first, again, other = kr.resource_usage(b"x" * 5, "k"), kr.resource_usage(b"x" * 5, "k"), kr.resource_usage(b"y" * 6, "k")
    assert calls == [(b"x" * 5, "k"), (b"y" * 6, "k")]
    assert first == again == {**first, "registers": 5} and other["registers"] == 6
    assert len(list((tmp_path / "lynx_hf_cuobjdump").glob("*.json"))) == 2
    monkeypatch.setenv("LYNX_KERNEL_REPORT_NO_CACHE", "1")
    assert kr.resource_usage(b"x" * 5, "k") == first and len(calls) == 3
