"""``torch.compile`` on CPU: a plan's eager decode step as one opaque op, a stage of the plan (``lynx_hf.core.Stage``).

Traced by ``torch.compile`` on CPU, the sync-free device path of a decode step unrolls into the graph (the
mass-greedy loop's min(N, T k) rounds: ~950 ops per layer-step, measured slower than the experts it saves on small
models, ``lab/bench_compile.py``). :class:`CompiledCpuStep` makes it one opaque custom op instead,
``torch.ops.lynx_hf.cpu_decode_step``: the selection scores are traced, the rest (the plan's eager step below this
stage: the policy's one-call path or the host ops, the remap, the weight rule, the telemetry row) runs in the op, on
the host, so a compiled step runs the same code and gives the same integers as an eager one. The op calls the runner
*below* the stage (``lynx_hf.core.decode_step``), never the stage itself.

The stage applies to plans on CPU whose kernel remaps; per step it takes the op only while ``torch.compile`` traces,
outside ``kernels.routing_torch.strict_sync_free``, without autograd, on a step the plan does not keep
(``RoutePlan.keeps``); otherwise it calls the runner below. A step whose device decode mask (``StaticCache`` length
on the device) is all True with every row live runs as a plain decode step inside the op (read on the host there).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from .core import DECODE, MIXED, Routed, RoutePlan, Runner, StageBase, Step, StepInputs, WeightRule
from .kernels import telemetry_slots as slots
from .kernels.routing_torch import in_strict_sync_free
from .telemetry import BlockTelemetry

#: :attr:`CompiledCpuStep.name`
NAME = "compiled_cpu"


class _Bound:
    """One plan's step below the stage, held by the stage's runner; :data:`_STEPS` refers to it weakly (a compiled
    graph carries an int, not the plan)."""

    __slots__ = ("plan", "inner", "__weakref__")

    def __init__(self, plan: RoutePlan, inner: Runner) -> None:
        self.plan, self.inner = plan, inner


#: handle -> the step below the stage of one plan (weak: it dies with the plan's runner)
_STEPS: "weakref.WeakValueDictionary[int, _Bound]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


class CompiledCpuStep(StageBase):
    """The compiled-CPU stage (module docstring). Stateless: one instance may be handed to any number of plans."""

    name = NAME

    def bind(self, plan: RoutePlan, inner: Runner) -> Optional[Runner]:
        """``None`` off CPU; else the runner that takes the op while traced (``lynx_hf.core.make_plan`` binds it to
        plans that remap only)."""
        if plan.device.type != "cpu":
            return None
        bound = _Bound(plan, inner)
        handle = next(_HANDLES)
        _STEPS[handle] = bound

        def run(plan: RoutePlan, inputs: StepInputs) -> Routed:
            if inputs.host or not torch.compiler.is_compiling() or in_strict_sync_free() \
                    or inputs.logits.requires_grad or plan.keeps(inputs.idx.shape[0]):
                return bound.inner(plan, inputs)
            return compiled_step(handle, inputs)

        return run


def plan_stage(block, config) -> CompiledCpuStep:
    """The stage of every patched block's plan (``lynx_hf.patcher.PLAN_STAGES``); it binds to CPU plans only."""
    return _STAGE


_STAGE = CompiledCpuStep()


def compiled_step(handle: int, inputs: StepInputs) -> Routed:
    """The decode step as ``torch.compile`` sees it on CPU: the selection scores traced, then the op; the telemetry
    row the op returns is added to ``inputs.telemetry`` in the graph. ``handle``: the plan's, from :meth:`bind`."""
    same = inputs.scores is None
    logits = inputs.logits
    scores = logits.float() if same else inputs.scores(logits)
    telemetry, step, rule = inputs.telemetry, inputs.step, inputs.rule
    new_weights, new_idx, finite, row = torch.ops.lynx_hf.cpu_decode_step(
        handle, step.kind, step.decode, step.live, scores, scores if same else logits, same, inputs.weights,
        inputs.idx, rule.kind, bool(rule.renormalize), float(rule.scale), float(rule.renorm_eps),
        "" if telemetry is None else telemetry.mode, inputs.seed)
    if telemetry is not None:
        telemetry.add(row)
    return Routed(new_weights, new_idx, finite)


@torch.library.custom_op("lynx_hf::cpu_decode_step", mutates_args=(), device_types="cpu")
def _cpu_decode_step(handle: int, kind: str, decode: Optional[torch.Tensor], live: Optional[torch.Tensor],
                     scores: torch.Tensor, logits: torch.Tensor, same_scores: bool, weights: torch.Tensor,
                     idx: torch.Tensor, rule_kind: str, renormalize: bool, scale: float, renorm_eps: float,
                     telemetry: str, seed: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager CPU decode step below the stage of plan ``handle`` (:func:`compiled_step`); ``scores [T, N]`` fp32,
    ``logits [T, N]`` (``scores`` itself when ``same_scores``), ``weights`` / ``idx [T, k]``, the weight rule's
    fields, ``telemetry`` the ``BlockTelemetry`` mode (``""``: none), ``seed [N]`` bool or ``None``. Returns ``(weights
    [T, k], idx [T, k], finite [T] bool, telemetry row fp64 [NUM_SLOTS])``, new tensors."""
    bound = _STEPS[handle]
    rule = WeightRule(rule_kind, renormalize, scale, renorm_eps)
    if decode is not None and bool(decode.all()) and (live is None or bool(live.all())):
        decode = live = None  # every row a live decode token (read on the host here): the plain step, one call
        kind = DECODE if kind == MIXED else kind
    scratch = BlockTelemetry(telemetry) if telemetry else None
    inputs = StepInputs(Step(kind, decode, live), logits, weights, idx, rule, True,
                        None if same_scores else (lambda _logits: scores), scratch, seed)
    new_weights, new_idx, finite, _ = bound.inner(bound.plan, inputs)
    if finite is None:
        finite = torch.ones(idx.shape[0], dtype=torch.bool)
    row = scratch.acc if scratch is not None and scratch.acc is not None else \
        torch.zeros(slots.NUM_SLOTS, dtype=torch.float64)
    return (new_weights.clone() if new_weights is weights else new_weights,
            new_idx.clone() if new_idx is idx else new_idx, finite, row)


@_cpu_decode_step.register_fake
def _cpu_decode_step_fake(handle, kind, decode, live, scores, logits, same_scores, weights, idx, rule_kind,
                          renormalize, scale, renorm_eps, telemetry, seed):
    return (torch.empty_like(weights), torch.empty_like(idx), idx.new_empty(idx.shape[0], dtype=torch.bool),
            idx.new_empty(slots.NUM_SLOTS, dtype=torch.float64))


__all__ = ["NAME", "CompiledCpuStep", "plan_stage", "compiled_step"]
