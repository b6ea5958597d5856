"""Where the cost gate keeps vLLM's routing without the op, and how those steps are counted (imports no vLLM): the
plugin's bypass concern, apart from the plans (:mod:`lynx_hf.vllm.plans`) and the rows (:mod:`lynx_hf.vllm.rows`).

- A layer the gate keeps off at every step size this engine can run (:func:`gated_off_everywhere`: eager and, on a
  captured engine, replayed steps) is *bypassed*: its router returns vLLM's routing without calling the op
  (:func:`lynx_hf.vllm.layers.attach`), so vLLM's compiled mode, which traces the forward once in its first profiling
  / warm-up run, compiles vLLM's own routing there. The bypass is decided once, from the agreed decisions
  (:func:`settle_bypass`); a compiled or captured forward keeps it. Its skipped steps are counted once per step
  (:func:`skip_bypassed`) and into the gates when read (:func:`flush_skips`), bounded.
- A layer the gate keeps off at this call's size (:func:`gated_off_call`): no op in that graph or eager step.
- A step whose forward ran no op body on a captured engine was a replay (:func:`mark_calls`, :func:`count_replays`).

Every count goes through the gate's one accounting path (``PlanGate.count`` / ``PlanGate.account``), the same one the
gate's own stage counts its steps with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..gate import BUCKETS, bucket_of
from ..gate import of as gate_of
from .rows import unmasked
from .state import STATE, Layer, target_layers

if TYPE_CHECKING:
    from ..core import RoutePlan

__all__ = ["step_buckets", "gated_off_everywhere", "set_bypass", "settle_bypass", "skip_bypassed", "PENDING_MAX",
           "flush_skips", "mark_calls", "count_replays", "gate_summary", "capturing", "capturing_on",
           "gated_off_call"]


def step_buckets() -> tuple:
    """The gate's buckets (``lynx_hf.gate.BUCKETS``) a step of this engine can fall in: up to the bucket of
    ``max_num_batched_tokens`` (every bucket when it is not known)."""
    top = bucket_of(STATE.capacity) if STATE.capacity > 0 else BUCKETS[-1]
    return tuple(b for b in BUCKETS if b <= top)


def gated_off_everywhere(plan: RoutePlan) -> bool:
    """Whether ``plan``'s cost gate (``LynxConfig.gate="auto"``) keeps vLLM's routing at every step size this engine
    can run (:func:`step_buckets`), from its decisions. False without a gate (``gate="always"``, a policy that never
    remaps), or where a bucket was not decided from the layer's sizes (the gate keeps the policy on there)."""
    gate = gate_of(plan)
    if gate is None:
        return False
    for one in (gate, gate.replayed):  # eager and, on a captured engine, replayed steps
        for b in () if one is None else step_buckets():
            decision = one.decision(b)
            if decision.on or not decision.measured:
                return False
    return True


def set_bypass(layer: Layer, bypass: bool) -> None:
    """Set ``layer``'s ``bypass``: bypassed, its router and runner run vLLM's own methods, the plugin's wrappers taken
    off (``Layer.rehook``: :func:`lynx_hf.vllm.layers.hook_layer`; issue 54 item 7); not bypassed, they are put back
    (the liveness rule starts afresh on it). Updates ``STATE.bypassed`` / ``STATE.all_bypassed``."""
    flush_skips()  # the steps skipped so far belong to the layers bypassed so far
    if layer.bypass and not bypass:  # the liveness rule starts afresh on a layer that calls the op again
        layer.seen_calls, layer.seen_runs, layer.misses = layer.calls, layer.runs or 0, 0
    layer.bypass = bool(bypass)
    if layer.rehook is not None:
        layer.rehook(layer, not layer.bypass)
    targets = target_layers()
    STATE.bypassed = tuple(one for one in targets if one.bypass)
    # no op reads the step buffer (the drafter's layers never call the op)
    STATE.all_bypassed = bool(targets) and len(STATE.bypassed) == len(targets)


def settle_bypass() -> None:
    """Each layer's ``bypass`` from its plan (:func:`gated_off_everywhere`), unless the forward is frozen
    (``STATE.start.frozen``: the bypass a compiled / captured forward was traced with stays)."""
    if STATE.start.frozen:
        return
    for layer in target_layers():
        if layer.plan is not None:
            set_bypass(layer, gated_off_everywhere(layer.plan))


def skip_bypassed(num_tokens: int, decode_rows: int | None = None) -> None:
    """A step of ``num_tokens`` tokens of which ``decode_rows`` decode (> 0): each bypassed layer's gate counts it
    as a step it kept vLLM's routing on (the step size seen, one step skipped), as the op body does for a step the
    gate skips. Counted once per step here (``STATE.pending_skips``) and into each bypassed layer's gate when read
    (:func:`flush_skips`): a per-layer gate call per step cost ~8 us per layer. Bounded: past
    :data:`PENDING_MAX` distinct (tokens, decode rows) the pending steps are counted into the gates at once (a
    long-running server's steps take many distinct shapes: ``docs/cases.md`` C64)."""
    if STATE.bypassed:
        pending = STATE.pending_skips
        pending[(num_tokens, decode_rows)] += 1
        if len(pending) > PENDING_MAX:
            flush_skips()


#: most distinct (tokens, decode rows) :func:`skip_bypassed` keeps pending before counting them into the gates
PENDING_MAX = 64


def flush_skips() -> None:
    """Count the pending skipped steps (:func:`skip_bypassed`) into each bypassed layer's gate (``PlanGate.count``)."""
    pending = STATE.pending_skips
    if not pending:
        return
    for layer in STATE.bypassed:
        gate = gate_of(layer.plan)
        if gate is not None:
            for (num_tokens, decode_rows), steps in pending.items():
                gate.count(num_tokens, decode_rows, steps)
    pending.clear()


def mark_calls() -> None:
    """At a step's input preparation, in an engine whose forward is captured in CUDA graphs: each layer's op call
    count now, for :func:`count_replays` after the forward."""
    for layer in target_layers():
        layer.step_calls = layer.calls


def count_replays(num_tokens: int) -> None:
    """After a forward of ``num_tokens`` tokens with decode tokens, in an engine whose forward is captured in CUDA
    graphs (``STATE.start.captured``): a layer whose op body did not run in it (:func:`mark_calls`; bypassed layers
    aside, :func:`skip_bypassed` counts those) was replayed, and a replay repeats what the body did at capture, the
    gate's decision included (a host-side branch on the static T, the replay's price: ``PlanGate.replay_decision``;
    the decode rows are not known at capture); its gate counts the step as the body would have (``PlanGate.count``
    with ``replay``: the gate's one accounting path): the step size seen and, where the gate is off there, one step
    skipped. The telemetry needs nothing here: its device accumulators are added into by the replay
    itself."""
    for layer in target_layers():  # the drafter's layers run after the step, with no plan (no gate to count)
        if not layer.bypass and layer.plan is not None and layer.calls == layer.step_calls:
            gate = gate_of(layer.plan)
            if gate is not None:
                gate.count(num_tokens, replay=True)


def gate_summary(layer: Layer) -> dict:
    """The layer's gate for the telemetry: ``PlanGate.summary()`` (or the configured gate with no decision yet),
    plus ``bypassed``."""
    flush_skips()
    gate = gate_of(layer.plan)
    if gate is not None:
        entry = gate.summary()
    else:
        entry = {"gate": STATE.config.lynx.gate if STATE.config else "always", "by_tokens": {}, "steps_skipped": 0}
    entry["bypassed"] = layer.bypass
    return entry


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def capturing_on(device: torch.device):
    """``fn() -> bool``: :func:`capturing` on ``device`` (looked up at each call), the gate's ``replay_now``."""
    return lambda: capturing(device)


def gated_off_call(layer: Layer, router_logits) -> bool:
    """Whether this router call of ``layer`` keeps vLLM's routing by its cost gate, known on the host before the op
    (issue 54 N10): the router wrapper then returns vLLM's routing without calling the op, so a step the gate keeps
    off runs no kernel of the plugin (no masks, no copies of vLLM's tensors). Asked outside ``torch.compile`` tracing
    only (a traced branch on T would be frozen for every size; on CPU vLLM traces the MoE layer, on a GPU its
    ``moe_forward`` op is opaque and runs the router in Python). Under a CUDA-graph capture: the gate's decision at the
    static T at a replay's price (``PlanGate.replay_decision``; no decode-row count), frozen into that graph as the
    op's own branch would be (a size it keeps off adds no op to that graph), and counted per replay by
    :func:`count_replays`; in an eager step the host describes (every row the step's, >= 1 decode row): the decision
    on its decode rows, counted as the op's gate counts it. Else (no plan yet, no gate, a step the host does not
    describe) the op decides. The layer's op call is counted all the same (``Layer.calls``: it was routed through the
    plugin)."""
    plan = layer.plan
    gate = gate_of(plan)
    if gate is None or STATE.config is None or STATE.config.lynx.phase == "decode" or unmasked(layer):
        return False
    num_tokens = int(router_logits.shape[0])
    if plan.keeps(num_tokens):  # a lone token: the step below the gate runs (its telemetry) whatever it decides
        return False
    if capturing(router_logits.device):
        if gate.replay_decision(num_tokens).on:  # the price of a replay (the capture's graph is replayed)
            return False
    else:
        step = STATE.step
        if not step.active or step.num_decode == 0 or num_tokens != step.num_tokens:
            return False
        if gate.decision(num_tokens, step.num_decode).on:
            return False  # the op's gate decides and counts the step
        gate.count(num_tokens, step.num_decode)  # seen, and skipped: as the op's gate counts a step it keeps off
    layer.calls += 1
    return True
