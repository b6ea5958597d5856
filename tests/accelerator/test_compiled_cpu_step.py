"""``torch.compile`` on CPU: the decode step is one opaque custom op (``torch.ops.lynx_hf.cpu_decode_step``,
``lynx_hf.compiled_cpu``, a stage of each CPU plan) running the eager code, so a compiled step gives the eager step's
routing and telemetry exactly, and the sync-free device path (what CUDA compiles) is still what is traced under
``strict_sync_free``. Each case compiles ``BlockRouting.route`` with ``fullgraph=True`` and compares it with the
same call in eager mode, on hand-made steps: plain decode, a device decode mask that is all True (the StaticCache
step outside ``generate``), a mixed step with prefill and finished rows, a non-finite row (the one-call path's
fallback); a fused plan (default LYNX), a general one (OEA) and a family whose selection scores are not the logits
(DeepSeek-V3: group limit + selection bias)."""

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf.core import DECODE, MIXED, Step
from lynx_hf.kernels.routing_torch import strict_sync_free

OP = torch.ops.lynx_hf.cpu_decode_step
T = 8


class Recorder:
    """A ``torch.compile`` backend that keeps the FX graphs and runs them as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [OP if n.target is OP.default else n.target
                for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def _routing(block, seed, nonfinite=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, block.num_experts, generator=g) * 3
    if nonfinite:
        logits[2, 1] = float("nan")
    idx = torch.sort(logits.nan_to_num(-1e9), dim=-1, descending=True, stable=True).indices[:, :block.top_k]
    weights = torch.softmax(logits.nan_to_num(-1e9), -1).gather(1, idx)
    return logits, weights, idx


STEPS = {
    "decode": lambda: Step(DECODE),
    "device-mask-all-true": lambda: Step(DECODE, decode=torch.ones(T, dtype=torch.bool)),
    "mixed": lambda: Step(MIXED, decode=torch.tensor([1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool),
                          live=torch.tensor([1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)),
}


def _eager_and_compiled(model, block, step, inputs, strict=False):
    block.telemetry.reset()
    eager = block.route(step, *inputs)
    eager_stats = block.telemetry.summary()
    block.telemetry.reset()
    backend = Recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda lg, w, i: block.route(step, lg, w, i), fullgraph=True, backend=backend)
    if strict:
        with strict_sync_free():
            compiled = fn(*inputs)
    else:
        compiled = fn(*inputs)
    return eager, eager_stats, compiled, block.telemetry.summary(), backend


@pytest.mark.parametrize("step_name", sorted(STEPS))
@pytest.mark.parametrize("family,policy", [("qwen2_moe", dict(policy="lynx")),
                                           ("qwen2_moe", dict(policy="oea", oea_k0=1)),
                                           ("deepseek_v3", dict(policy="lynx"))], ids=["lynx", "oea", "dsv3-lynx"])
def test_compiled_step_is_the_eager_step(family, policy, step_name):
    model = fam.build(family)
    with lynx_hf.patched(model, gate="always", **policy):
        block = model.__dict__["_lynx_state"].blocks[0]
        inputs = _routing(block, seed=3)
        eager, eager_stats, compiled, stats, backend = _eager_and_compiled(model, block, STEPS[step_name](), inputs)
    assert backend.targets().count(OP) == 1  # one opaque call, not the traced policy
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[0], eager[0])
    assert not torch.equal(eager[1], inputs[2])  # the step remaps
    assert stats == eager_stats and stats["decode_steps"] == 1


def test_compiled_step_with_a_nonfinite_row_keeps_its_routing_like_eager():
    model = fam.build("qwen2_moe")
    with lynx_hf.patched(model, policy="lynx", gate="always"):
        block = model.__dict__["_lynx_state"].blocks[0]
        inputs = _routing(block, seed=5, nonfinite=True)
        eager, eager_stats, compiled, stats, _ = _eager_and_compiled(model, block, Step(DECODE), inputs)
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[0], eager[0])
    assert torch.equal(compiled[1][2], inputs[2][2])  # the non-finite row keeps the model's routing
    assert stats == eager_stats and stats["fallbacks"] == 1


@pytest.mark.parametrize("telemetry", ["counts", False])
def test_compiled_step_honours_the_telemetry_mode(telemetry):
    model = fam.build("qwen2_moe")
    with lynx_hf.patched(model, policy="lynx", gate="always", telemetry=telemetry):
        block = model.__dict__["_lynx_state"].blocks[0]
        inputs = _routing(block, seed=7)
        eager, eager_stats, compiled, stats, _ = _eager_and_compiled(model, block, Step(DECODE), inputs)
    assert torch.equal(compiled[1], eager[1])
    assert stats == eager_stats
    assert stats["decode_steps"] == (1 if telemetry else 0)


def test_strict_sync_free_traces_the_device_path_instead():
    """The accelerator path stays what a CPU trace under ``strict_sync_free`` compiles (no opaque op): the tests of
    sync-free code keep testing it, and it gives the same routing."""
    model = fam.build("qwen2_moe")
    with lynx_hf.patched(model, policy="lynx", gate="always"):
        block = model.__dict__["_lynx_state"].blocks[0]
        inputs = _routing(block, seed=3)
        eager, _, compiled, _, backend = _eager_and_compiled(model, block, Step(DECODE), inputs, strict=True)
    assert OP not in backend.targets() and len(backend.targets()) > 20
    assert torch.equal(compiled[1], eager[1])
