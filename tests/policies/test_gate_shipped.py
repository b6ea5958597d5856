"""The shipped decision tables (``lynx_hf/gate/tables``) are found by the keys a patch makes today.

A key is a set of declared, readable fields (``lynx_hf.gate.key.GateKey``); a field added to one of them changes every
digest and the shipped tables silently miss: every process then measures at patch time again (``lab.bench_gate``: 18 s
at a Qwen2-57B layer shape, once per machine and cache). This test rebuilds the keys of the fixture-A entries (``python
-m lab.bench_gate --ship``) on any machine: the entry's device kind and thread count, with what ``patch`` describes
here for the rest. (The key of format 1 described the plan's objects by reflection; it caught
``RoutePlan.kernel_min_tokens`` moving every digest.) Each shipped file is named as what it holds."""

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
            if entry["source"].startswith("fixture-a") and entry["key"]["device"].startswith("cpu"):
                yield path.name, digest, entry  # a CPU plan: what a patch here makes (a GPU's is another backend)


#: what numba decides in a CPU key: the one-call decode step and the host ops (the shipped machines have numba)
NUMBA_FIELDS = ("step", "host_ops")


def test_stale_shipped_tables_are_named_as_what_they_hold():
    """Every shipped file is ``<device kind>.<what it holds>.json``, every entry's key of this build's format and
    measuring code (none is served stale), and a cut of a real model's shape says so in its file name and source (a
    1-layer Qwen2-57B-A14B is no checkpoint: the 28-layer model's remaps are priced by depth, another key)."""
    assert TABLES
    for path in TABLES:
        data = json.loads(path.read_text())
        assert data["format"] == gate.FORMAT
        kinds = {gate.table.slug(e["key"]["device"]) for e in data["entries"].values()}
        assert len(kinds) == 1 and path.name.startswith(kinds.pop() + "."), path.name
        for digest, entry in data["entries"].items():
            key = gate.GateKey.from_dict(entry["key"])
            assert key.measure == gate.MEASURE_VERSION and key.digest() == digest, (path.name, digest)
            cut = "1-layer-cut" in path.name
            assert cut == ("1-layer cut" in entry["source"]), (path.name, entry["source"])
            assert cut or entry["source"].startswith("fixture-a"), (path.name, entry["source"])


@pytest.mark.parametrize("numba", ["as_installed", "absent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixture_a_keys_of_today_find_the_shipped_entries(dtype, numba, monkeypatch):
    """On an install with numba the whole key and its digest; without it (and with numba hidden here, ``absent``, so
    the branch runs on every install) every field but :data:`NUMBA_FIELDS`: a new field anywhere else still shows."""
    entries = [(name, digest, entry) for name, digest, entry in _fixture_entries()
               if entry["key"]["dtype"] == str(dtype)]
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
        mine, shipped = there.to_dict(), entry["key"]
        if with_numba:
            assert mine == shipped and there.digest() == digest, name
        else:
            assert (mine["step"], mine["host_ops"]) == ("remap", "torch") != (shipped["step"], shipped["host_ops"])
            assert {k: v for k, v in mine.items() if k not in NUMBA_FIELDS} == \
                {k: v for k, v in shipped.items() if k not in NUMBA_FIELDS}, name


def test_a_captured_step_is_its_own_key_and_off_cuda_is_timed_eagerly(monkeypatch):
    """``LayerShape.captured`` (a CUDA-graph engine: the vLLM plugin sets it from the engine's mode) is a field of the
    key -- its decisions come from a graph replay's routing cost, not the launch-bound eager one. Off CUDA there is no
    graph to time: the eager timing, whatever ``captured`` says."""
    from lynx_hf import LynxConfig
    from lynx_hf.core import MoELayer, make_plan
    from lynx_hf.gate import measure as gm

    plan = make_plan(LynxConfig(gate="always"), MoELayer(16, 4, "cpu"))
    eager = gate.LayerShape(16, 4, 64, 32)
    captured = dataclasses.replace(eager, captured=True)
    k_eager, k_captured = (gate.make_key(plan, shape, None, True) for shape in (eager, captured))
    assert k_eager.digest() != k_captured.digest()
    assert (k_eager.captured, k_captured.captured) == (False, True)
    assert dataclasses.replace(k_captured, captured=False) == k_eager

    def no_graph(*args, **kwargs):
        raise AssertionError("a CUDA graph was timed off CUDA")

    monkeypatch.setattr(gm, "_time_captured_ms", no_graph)
    cost, before, after = gm.measure_routing(plan, 8, captured=True, tuning=gate.Tuning(time_budget_s=0.01))
    assert cost > 0 and before >= after >= 4
