"""On CUDA, a layer's cost gate also holds its decisions timed as a CUDA-graph replay (``PlanGate.replayed``), and a
decode step traced by ``torch.compile`` takes those (transformers' compiled static-cache ``generate``, its default on a
GPU, replays the decode step from CUDA graphs, where the routing step costs no per-launch host time); an eager step
takes the eager ones. Checked without a GPU: the plan is made for a CUDA device (nothing runs there), the decisions
come from a store that answers by the key's ``captured`` field (eager: off, replay: on)."""

from dataclasses import replace

import pytest
import torch

from lynx_hf import core
from lynx_hf.config import LynxConfig
from lynx_hf.gate import LayerShape
from lynx_hf.gate.decision import TUNING, always_on
from lynx_hf.gate.stage import PlanGate


class KeyedStore:
    """A decision store answering every key by its ``captured`` part: off for eager, on for a replay."""

    expert_times: dict = {}

    def __init__(self):
        self.asked = []

    def lookup(self, key, table):
        captured = key.captured
        self.asked.append(captured)
        decision = always_on("replay") if captured else replace(always_on("eager"), on=False)
        return {b: decision for b in TUNING.buckets}, "keyed store"


def _gate(device, mixed=False):
    store = KeyedStore()
    shape = LayerShape(16, 2, 32, 16, mixed_steps=mixed)
    gate = PlanGate(shape, store=store)
    plan = core.make_plan(LynxConfig(routing_backend="torch"), core.MoELayer(16, 2, device), stages=[gate])
    return gate, plan, store


def _inputs():
    logits = torch.randn(8, 16)
    weights, idx = torch.softmax(logits, -1).topk(2)
    return core.StepInputs(core.Step(core.DECODE), logits, weights, idx, core.WeightRule("softmax_all"), False)


def test_a_traced_step_on_cuda_takes_the_replayed_decisions(monkeypatch):
    gate, plan, store = _gate("cuda")
    assert store.asked == [False, True] and gate.replayed is not None
    assert gate.replayed.shape.captured and gate.replayed.key.digest() != gate.key.digest()
    ran = []
    monkeypatch.setattr(gate, "inner", lambda p, i: ran.append(True) or core.Routed(i.weights, i.idx))
    monkeypatch.setattr(gate.replayed, "inner", gate.inner)
    assert plan.run(_inputs()).gated_off and not ran  # eager: the eager decision (off)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = plan.run(_inputs())
    assert ran and not out.gated_off  # traced: the replayed decision (on)


@pytest.mark.parametrize("device,mixed", [("cpu", False), ("cuda", True)], ids=["cpu", "cuda-mixed-steps"])
def test_no_replayed_decisions_off_cuda_or_for_engines_with_mixed_steps(device, mixed, monkeypatch):
    """CPU: nothing is replayed from a CUDA graph; an engine whose steps carry per-token masks (vLLM) states whether it
    captures (``PlanGate.replays``: tests/vllm_plugin/test_gate_plugin.py ``test_n10_*``) and is measured once where it
    does not."""
    gate, plan, store = _gate(device, mixed)
    assert gate.replayed is None and store.asked == [False]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert plan.run(_inputs()).gated_off
