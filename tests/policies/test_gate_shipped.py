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
from lynx_hf.kernels import routing_cpu

TABLES = sorted(gate.SHIPPED_DIR.glob("*.json"))


def _fixture_entries():
    for path in TABLES:
        for digest, entry in json.loads(path.read_text())["entries"].items():
            if entry["source"].startswith("fixture-a"):
                yield path.name, digest, entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixture_a_keys_of_today_find_the_shipped_entries(dtype):
    entries = [(name, digest, entry) for name, digest, entry in _fixture_entries()
               if entry["key"]["parts"]["shape"]["dtype"] == str(dtype)]
    assert entries, "no shipped fixture-A entry for this dtype"
    model = AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / "qwen2moe-tiny", dtype=dtype).eval()
    # the gate of the default config; its decisions are not the subject (table or measurement, either is fine)
    lynx_hf.patch(model)
    key = gate.of(lynx_hf.state.state_of(model).blocks[0].plan).key
    lynx_hf.unpatch(model)
    for name, digest, entry in entries:
        if not routing_cpu.AVAILABLE:  # the shipped machines have numba: their plan holds the fused CPU step
            assert entry["key"]["parts"]["plan"]["fused"] is not None
            continue
        there = dataclasses.replace(key, device=entry["key"]["device"], threads=entry["key"]["threads"])
        assert json.loads(there.parts) == entry["key"]["parts"], name
        assert there.tuning == entry["key"]["tuning"] and there.digest() == digest, name
