"""The shipped decision tables (``lynx_hf/gate/tables``) are found by the keys a patch makes today.

A key is the plan, shape, step and telemetry described field by field (``lynx_hf.gate.key.describe``), so any new field
of ``RoutePlan`` (or of what it holds) changes every digest and the shipped tables silently miss: every process then
measures at patch time again (``lab.bench_gate``: 18 s at a Qwen2-57B layer shape, once per machine and cache). This
test rebuilds the keys of the fixture-A entries (``python -m lab.bench_gate --ship``) on any machine: the entry's
device kind and thread count, with what ``patch`` describes here for the rest. (It caught ``RoutePlan.kernel_min_tokens``,
now left out of the key while it holds its default.)"""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import lynx_hf
import lynx_hf.state
from lynx_hf import gate
from lynx_hf.eval import FIXTURES_DIR
from lynx_hf.kernels import backend, routing_cpu

TABLES = sorted(gate.SHIPPED_DIR.glob("*.json"))


def _fixture_entries():
    for path in TABLES:
        for digest, entry in json.loads(path.read_text())["entries"].items():
            if entry["source"].startswith("fixture-a"):
                yield path.name, digest, entry


#: what numba decides in a CPU plan's key: its one-call decode step, the kernel that runs it and its host ops (the shipped
#: machines have numba)
NUMBA_FIELDS = ("fused", "kernel", "host_ops")


def _without_numba(parts: dict) -> dict:
    return {**parts, "plan": {k: v for k, v in parts["plan"].items() if k not in NUMBA_FIELDS}}


@pytest.mark.parametrize("numba", ["as_installed", "absent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixture_a_keys_of_today_find_the_shipped_entries(dtype, numba, monkeypatch):
    """On an install with numba the whole key and its digest; without it (and with numba hidden here, ``absent``, so
    the branch runs on every install) every part but :data:`NUMBA_FIELDS`: a new field anywhere else still shows
    (issue 56: without numba the test used to compare no key at all)."""
    entries = [(name, digest, entry) for name, digest, entry in _fixture_entries()
               if entry["key"]["parts"]["shape"]["dtype"] == str(dtype)]
    assert entries, "no shipped fixture-A entry for this dtype"
    if numba == "absent":
        monkeypatch.setattr(routing_cpu, "AVAILABLE", False)
    backend.routing_ops.cache_clear()  # the namespaces are cached per backend: made again with or without numba
    try:
        model = AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / "qwen2moe-tiny", dtype=dtype).eval()
        # the gate of the default config; its decisions are not the subject (table or measurement, either is fine)
        lynx_hf.patch(model)
        key = gate.of(lynx_hf.state.state_of(model).blocks[0].plan).key
        lynx_hf.unpatch(model)
    finally:
        backend.routing_ops.cache_clear()
    with_numba = numba == "as_installed" and routing_cpu.AVAILABLE
    for name, digest, entry in entries:
        there = dataclasses.replace(key, device=entry["key"]["device"], threads=entry["key"]["threads"])
        parts, shipped = json.loads(there.parts), entry["key"]["parts"]
        assert there.tuning == entry["key"]["tuning"], name
        if with_numba:
            assert parts == shipped and there.digest() == digest, name
        else:
            assert parts["plan"]["fused"] is None and shipped["plan"]["fused"] is not None
            assert _without_numba(parts) == _without_numba(shipped), name


def test_a_captured_step_is_its_own_key_and_off_cuda_is_timed_eagerly(monkeypatch):
    """``LayerShape.captured`` (a CUDA-graph engine: the vLLM plugin sets it from the engine's mode) is part of the key
    when True -- its decisions come from a graph replay's routing cost, not the launch-bound eager one -- and left out
    while False (the keys above). Off CUDA there is no graph to time: the eager timing, whatever ``captured`` says."""
    from lynx_hf import LynxConfig
    from lynx_hf.core import MoELayer, make_plan
    from lynx_hf.gate import measure as gm

    plan = make_plan(LynxConfig(gate="always"), MoELayer(16, 4, "cpu"))
    eager = gate.LayerShape(16, 4, 64, 32)
    captured = dataclasses.replace(eager, captured=True)
    k_eager, k_captured = (gate.make_key(plan, shape, None, True) for shape in (eager, captured))
    assert k_eager.digest() != k_captured.digest()
    assert "captured" not in json.loads(k_eager.parts)["shape"]
    assert json.loads(k_captured.parts)["shape"]["captured"] is True

    def no_graph(*args, **kwargs):
        raise AssertionError("a CUDA graph was timed off CUDA")

    monkeypatch.setattr(gm, "_time_captured_ms", no_graph)
    cost, before, after = gm.measure_routing(plan, 8, captured=True, tuning=gate.Tuning(time_budget_s=0.01))
    assert cost > 0 and before >= after >= 4
