"""The cost gate in the vLLM plugin (``LynxConfig.gate``, ``lynx_hf.gate``): the op asks the same ``PlanGate`` as the
HF path; gated off it returns vLLM's routing unchanged and the snapshot says so per layer. No engine: the op is
called on a fake layer, the measurement replaced by fixed decisions (no timed assertion). vLLM environment only."""

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf import gate  # noqa: E402
from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.vllm import _config, _hooks  # noqa: E402


@pytest.fixture
def layer(monkeypatch):
    state = _hooks.STATE
    saved = (state.config, state.layers, state.step, state.capacity, state.resolved)

    def make(options, on):
        monkeypatch.setattr(gate, "measure", lambda plan, shape, num_tokens, telemetry=True, extra_expert_ms=0.0, expert_fn=None:
                            gate.decide(1.0, 4.0 if on else 0.0, 1.0))
        state.config = _config.parse({"phase": "decode", **options})
        state.resolved = True
        state.step = _hooks._StepBuffer()
        state.capacity = 16
        one = _hooks._Layer(index=0, name="fake", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True))
        one.gathered = False
        one.gate_shape = gate.LayerShape(8, 2, 32, 16)  # what _attach reads from the runner's FusedMoEConfig
        state.layers = [one]
        return one

    yield make
    state.config, state.layers, state.step, state.capacity, state.resolved = saved


def _routing(t=8, n=8, k=2):
    logits = torch.randn(t, n, generator=torch.Generator().manual_seed(0)) * 3
    vals, ids = torch.topk(logits, k, dim=-1)
    return logits, torch.softmax(vals, -1), ids.to(torch.int32)


def test_gated_off_op_keeps_vllm_routing_and_reports_it(layer):
    one = layer({"policy": "lynx", "gate": "auto"}, on=False)
    logits, weights, ids = _routing()
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(new_ids, ids) and torch.equal(new_w, weights)
    snap = _hooks.snapshot()
    entry = snap["layers"][0]["gate"]
    assert entry["by_tokens"][8]["on"] is False and entry["steps_skipped"] == 1
    assert snap["summary"]["gate_steps_skipped"] == 1 and snap["layers"][0]["decode_steps"] == 0
    assert one.plan.gate is not None
    _hooks.reset()
    assert _hooks.snapshot()["layers"][0]["gate"]["steps_skipped"] == 0


def test_gate_on_equals_always(layer):
    logits, weights, ids = _routing()
    layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "always"}, on=True)
    ref = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert _hooks.snapshot()["layers"][0]["gate"]["gate"] == "always"
    layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on=True)
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(out[1], ref[1]) and torch.equal(out[0], ref[0])
    assert not torch.equal(out[1], ids)  # the policy ran
    assert _hooks.snapshot()["layers"][0]["gate"]["by_tokens"][8]["on"] is True


def test_op_times_its_body_and_the_gate_switches_off_when_it_costs_more_than_measured(layer, monkeypatch):
    """The patch-time decision is on (cost 1 ms, saving 4 x 1 ms). On CPU the op body's wall time is the served
    cost: with a clock that advances 5 ms per reading, two served steps cost 5 ms each, 4 <= 1.25 x 5: off, and the
    next step keeps vLLM's routing."""
    monkeypatch.setattr(gate, "OBSERVE_STEPS", 2)
    one = layer({"policy": "lynx", "mass_price": "None", "tau": "1000", "gate": "auto"}, on=True)
    logits, weights, ids = _routing()
    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(_hooks.time, "perf_counter", lambda: next(clock) / 1e3)
    for _ in range(2):
        out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        assert not torch.equal(out[1], ids)  # on while observed
    d = one.plan.gate.decision(8)
    assert not d.on and d.cost_ms == 5.0 and "2 served steps" in d.reason
    out = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(out[1], ids) and torch.equal(out[0], weights)
