"""The cost gate as a stage of a layer's plan (``lynx_hf.core.Stage``): one :class:`PlanGate` per layer and device.

When composed into the plan (:meth:`PlanGate.bind`: patch time in HF, before the first forward in vLLM) it gets its
decisions once, per bucket, from the decision store (``lynx_hf.gate.table``: a table, the per-user cache, or a
measurement stored there), and never changes them afterwards except by :meth:`PlanGate.adopt` (the vLLM plugin:
the decisions of rank 0 of the ranks that route the same rows). Per layer-step it asks :meth:`PlanGate.on`, a
host-side lookup on the static T (and the host-known count of decode rows, ``Step.decode_rows``): no device read, no
data-dependent shape, so CUDA graphs and ``torch.compile`` see a Python branch. Off, the step returns the model's
own routing with ``Routed.gated_off`` set.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from ..core import Routed, RoutePlan, Runner, StageBase, StepInputs
from .decision import TUNING, GateDecision, Tuning, always_on, bucket_of, decide
from .key import GateKey, make_key
from .measure import cannot_measure, measure_layer, rule_at, rule_layer
from .table import STORE, DecisionStore

#: :attr:`PlanGate.name`: how ``RoutePlan.stage`` finds the gate (:func:`of`)
NAME = "gate"

#: most decisions a gate keeps derived at once (:meth:`PlanGate.decision`): the ones above the largest bucket (one per
#: step size) and mixed steps with a side above it; least recently used first out (a long-running server's steps take
#: many distinct sizes: ``docs/cases.md`` C64). Mixed steps within the buckets are keyed by their two buckets.
DERIVED_MAX = 256


@dataclass(frozen=True)
class LayerShape:
    """What the gate measures a layer at: ``num_experts`` (N), ``top_k`` (k), ``hidden`` (H) and ``intermediate``
    (I, one expert's intermediate size) or ``None`` where unknown, the router logits' ``dtype``, the expert
    weights' ``expert_dtype``, ``mixed_steps`` (the engine's steps carry per-token masks, so the routing cost is
    measured on that path), ``ep_size`` (expert-parallel ranks: the saving counts this rank's experts) and
    ``captured`` (the engine replays its decode forward from CUDA graphs, so on CUDA the routing cost is timed as a
    graph replay: no per-kernel launch on the host). Each is a field of the decision key (``GateKey``)."""

    num_experts: int
    top_k: int
    hidden: int | None
    intermediate: int | None
    dtype: torch.dtype = torch.float32
    expert_dtype: torch.dtype | None = None
    mixed_steps: bool = False
    captured: bool = False
    #: expert-parallel ranks the layer's experts are split over (vLLM under EP: each rank runs N / ``ep_size`` of
    #: them), so a rank saves the avoided experts that are its own: ``1 / ep_size`` of them in expectation
    ep_size: int = 1


@dataclass(eq=False)  # identity: a RoutePlan holding it stays hashable
class PlanGate(StageBase):
    """The gate of one plan (one MoE layer on one device).

    Given by the engine: ``shape``; ``telemetry`` (``LynxConfig.telemetry``: the mode the cost is timed in);
    ``extra_expert_ms`` (a further cost per expert read, e.g. an offloaded expert's transfer: ms, or a function
    returning it, called only when the gate measures or uses its rule: :meth:`extra_ms`); ``expert_fn`` (the
    layer's own experts implementation ``fn(hidden [T, H], idx [T, k], weights [T, k])``, timed for the saving per
    expert; ``None``: a batched-MLP model); ``kernel_fn`` (the same over the layer's experts through the sparse Triton
    kernel, timed instead at the step sizes where the plan runs it: ``RoutePlan.uses_kernel``; ``None``: none);
    ``route_fn`` (the engine's per-step routing path ``fn(run, inputs)``,
    timed for the cost; ``None``: the step below the gate alone); ``selection`` (the layer's selection scores
    ``fn(logits [T, N]) -> [T, N]`` fp32, ``-inf`` where its routing forbids an expert, so the synthetic routing
    measured is one the model could produce; ``None``: the logits); ``step_key`` (the engine's description of what
    else its step runs: selection and weight rule, experts implementation and storage; part of the key);
    ``table`` (``LynxConfig.gate_table``: a user's decision table, or ``None``); ``tuning``; ``store``; ``carried``
    (a copied model's ``(GateKey, decisions, source)`` from the layer it was copied from, or ``None``: taken instead of
    any lookup where this gate's key differs from that key at most in the thread count, so a copy made or used at
    another thread count decides as the original; ``docs/cases.md`` C59).

    Set when bound: ``plan`` (a view of the plan whose runner is the step below the gate), ``key``
    (``lynx_hf.gate.key.GateKey``), ``decisions`` (bucket -> :class:`GateDecision`) and ``source`` (where they came
    from). Counters (eager steps only): ``seen`` (step size -> steps asked), ``skipped`` (step size -> decode steps the
    gate kept the model's own routing on).
    """

    #: how ``RoutePlan.stage`` finds it (:func:`of`)
    name: ClassVar[str] = NAME

    shape: LayerShape
    telemetry: bool | str = True
    extra_expert_ms: object = 0.0
    expert_fn: object = None
    kernel_fn: object = None
    route_fn: object = None
    selection: object = None
    step_key: object = None
    table: str | None = None
    tuning: Tuning = TUNING
    store: DecisionStore = field(default=STORE, repr=False)
    carried: tuple | None = field(default=None, repr=False)
    plan: object = None
    inner: object = None
    key: GateKey | None = None
    decisions: dict = field(default_factory=dict)
    source: str = ""
    seen: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    #: on CUDA, for an engine that steps eagerly (``shape.captured`` False, no mixed steps: transformers), and for an
    #: engine that says it :attr:`replays`, the same layer's gate timed as a CUDA-graph replay
    #: (``LayerShape.captured``): the decisions a step traced by ``torch.compile`` or captured (:attr:`replay_now`)
    #: takes (transformers' compiled static-cache ``generate`` replays its decode step from CUDA graphs, where the
    #: routing step costs no per-launch host time; vLLM's captured sizes); ``None`` elsewhere
    replayed: "PlanGate | None" = field(default=None, repr=False)
    #: the engine also replays this layer's step from CUDA graphs while stepping eagerly at other steps (vLLM's
    #: captured engines: a size above the largest graph, a mixed step outside the graphs): :meth:`resolve` then holds
    #: the replay-timed decisions in :attr:`replayed` as well, on any device, and the eager ones are this gate's own
    replays: bool = False
    #: ``fn() -> bool``: whether the current call is being captured for replay (vLLM: a CUDA-graph capture of the
    #: op's body), so it takes :attr:`replayed`'s decisions; ``None``: while ``torch.compile`` traces it
    replay_now: object = field(default=None, repr=False)
    #: decisions derived on first use: above the largest bucket (by rule), mixed steps (by their buckets within the
    #: largest; by (T, decode rows) above it); at most :data:`DERIVED_MAX`, least recently used dropped first
    _derived: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: object = field(default_factory=threading.Lock, repr=False)

    def extra_ms(self) -> float:
        """:attr:`extra_expert_ms` in ms (called once where it is a function)."""
        if callable(self.extra_expert_ms):
            self.extra_expert_ms = float(self.extra_expert_ms())
        return float(self.extra_expert_ms)

    # -- composition ------------------------------------------------------------------------------------------
    def bind(self, plan: RoutePlan, inner: Runner) -> Runner | None:
        """Compose the gate into ``plan`` (``lynx_hf.core.make_plan``, which binds it to plans that remap only): the
        decisions are got now (:meth:`resolve`) and the returned runner asks the gate once per layer-step: a step the plan keeps (one token) runs ``inner`` with ``gated_off`` from the bucket's decision;
        off, the model's own routing (the same objects, nothing recorded, counted as skipped, ``gated_off``); on,
        ``inner``."""
        self.plan, self.inner = replace(plan, runner=inner), inner
        self.resolve()
        return self._run

    def resolve(self) -> "PlanGate":
        """Get every bucket's decision: without H and I, on everywhere (nothing to weigh); else from the store
        (``DecisionStore.decisions``: a table or the cache, else measured now and stored), or, where no table has
        the key and measuring is impossible now (``measure.cannot_measure``), by the closed-form rule (not stored).
        Raises ``FileNotFoundError`` / ``ValueError`` for a missing or malformed user table."""
        shape, tuning = self.shape, self.tuning
        self._derived.clear()
        if shape.hidden is None or shape.intermediate is None:
            self.key = None
            d = always_on("not measured: the layer's hidden / intermediate size is unknown")
            self.decisions, self.source = {b: d for b in tuning.buckets}, "sizes unknown"
            return self
        self.key = make_key(self.plan, shape, self.step_key, self.telemetry, tuning)
        if self.carried is not None and replace(self.key, threads=self.carried[0].threads) == self.carried[0]:
            suffix = " (carried by a copy)"
            source = self.carried[2] if self.carried[2].endswith(suffix) else self.carried[2] + suffix
            self.decisions, self.source = dict(self.carried[1]), source
            return self
        found = self.store.lookup(self.key, self.table)
        if found is None:
            why = cannot_measure(self.plan.device)
            if why is not None:
                found = rule_layer(self, why, tuning), f"rule ({why})"
            else:
                found = self.store.decisions(
                    self.key, lambda: measure_layer(self, self.store.expert_times, tuning), self.table)
        self.decisions, self.source = dict(found[0]), found[1]
        self.replayed = None
        if not shape.captured and (self.replays or (not shape.mixed_steps and
                                                    torch.device(self.plan.device).type == "cuda")):
            twin = PlanGate(replace(shape, captured=True), telemetry=self.telemetry,
                            extra_expert_ms=self.extra_expert_ms, expert_fn=self.expert_fn, kernel_fn=self.kernel_fn,
                            route_fn=self.route_fn, selection=self.selection, step_key=self.step_key, table=self.table,
                            tuning=tuning, store=self.store, plan=self.plan, inner=self.inner)
            self.replayed = twin.resolve()
        return self

    def adopt(self, decisions: dict, source: str) -> None:
        """Take ``decisions`` (bucket -> :class:`GateDecision`) from elsewhere: the vLLM plugin's agreement across the
        ranks that route the same rows (rank 0's)."""
        with self._lock:
            self.decisions, self.source = dict(decisions), source
            self._derived.clear()

    def replaying(self) -> bool:
        """Whether the current call is recorded for replay (:attr:`replay_now`, else ``torch.compile`` tracing)."""
        return bool(self.replay_now()) if self.replay_now is not None else torch.compiler.is_compiling()

    def _run(self, plan: RoutePlan, inputs: StepInputs) -> Routed:
        if self.replayed is not None and self.replaying():  # traced / captured: replayed from a CUDA graph
            return self.replayed._run(plan, inputs)
        num_tokens = inputs.idx.shape[0]  # a static shape: the gate's branch is host-side, no sync
        if plan.keeps(num_tokens):  # a lone token keeps its routing; the bucket's figure says whose experts run
            out = self.inner(plan, inputs)
            return out if self.decision(num_tokens).on else out._replace(gated_off=True)
        d = self.decision(num_tokens, inputs.step.decode_rows)
        if not torch.compiler.is_compiling():
            self.account(num_tokens, d.on)
        if not d.on:
            return Routed(inputs.weights, inputs.idx, None, True)
        return self.inner(plan, inputs)

    # -- decisions --------------------------------------------------------------------------------------------
    def decision(self, num_tokens: int, decode_rows: int | None = None) -> GateDecision:
        """The :class:`GateDecision` of a step of ``num_tokens`` tokens of which ``decode_rows`` decode (``None``: all).

        Up to the largest bucket: that bucket's decision. Above it: the closed-form rule at ``num_tokens``
        (``decision.by_rule``; the layer's sizes known, else on). A mixed step (fewer decode rows than tokens): the
        routing cost of its ``num_tokens`` bucket against the saving of its ``decode_rows`` bucket (:func:`decide`
        with ``tuning.margin``): the policy runs over every row, and only the decode rows' experts are saved."""
        if decode_rows is not None and decode_rows < num_tokens:
            return self._mixed(num_tokens, max(int(decode_rows), 0))
        top = self.tuning.buckets[-1]
        if num_tokens <= top:
            d = self.decisions.get(bucket_of(num_tokens, self.tuning.buckets))
            return d if d is not None else always_on("not decided yet")
        d = self._cached(num_tokens)
        if d is None:
            d = always_on("not measured: the layer's hidden / intermediate size is unknown") \
                if self.shape.hidden is None or self.shape.intermediate is None or self.plan is None else \
                rule_at(self, num_tokens, f"above the largest measured step, {top} tokens", self.tuning)
            self._store(num_tokens, d)
        return d

    def _cached(self, key) -> GateDecision | None:
        with self._lock:
            d = self._derived.get(key)
            if d is not None:
                self._derived.move_to_end(key)
            return d

    def _store(self, key, d: GateDecision) -> None:
        with self._lock:
            self._derived[key] = d
            self._derived.move_to_end(key)
            while len(self._derived) > DERIVED_MAX:
                self._derived.popitem(last=False)

    def _mixed(self, num_tokens: int, decode_rows: int) -> GateDecision:
        """A mixed step's decision: the routing cost of its ``num_tokens`` against the saving of its ``decode_rows``.
        Within the largest bucket both sides are their buckets' figures, so the decision is the buckets' (keyed by
        them: at most one per pair of buckets); above it, by (T, decode rows), among the :data:`DERIVED_MAX`
        derived decisions kept."""
        buckets = self.tuning.buckets
        top = buckets[-1]
        within = num_tokens <= top and decode_rows <= top
        tokens = bucket_of(num_tokens, buckets) if within else num_tokens
        rows_key = (bucket_of(decode_rows, buckets) if decode_rows else 0) if within else decode_rows
        key = ("mixed", tokens, rows_key)
        d = self._cached(key)
        if d is not None:
            return d
        whole, rows = self.decision(num_tokens), self.decision(decode_rows) if decode_rows else None
        if rows is None or not all(math.isfinite(x) for x in (whole.cost_ms, rows.experts_saved, rows.expert_ms)):
            d = whole if rows is None or not math.isfinite(whole.cost_ms) else rows
            if decode_rows == 0:
                d = replace(d, on=False, reason="no decode rows")
        else:
            new = decide(whole.cost_ms, rows.experts_saved, rows.expert_ms, rows.extra_expert_ms,
                         margin=self.tuning.margin)
            where = (f"cost at the {tokens}-token bucket, saving at the {rows_key}-row bucket" if within else
                     f"cost at {num_tokens} tokens, saving at {decode_rows} decode rows")
            d = replace(new, experts_before=rows.experts_before, experts_after=rows.experts_after,
                        reason=f"{new.reason} (mixed step: {where})")
        self._store(key, d)
        return d

    def on(self, num_tokens: int, decode_rows: int | None = None) -> bool:
        """Whether the policy runs on a decode step of ``num_tokens`` tokens (a static shape) of which ``decode_rows``
        decode (``None``: all): a host-side lookup, no device read. Counts the step size (eager only)."""
        d = self.decision(num_tokens, decode_rows)
        if not torch.compiler.is_compiling():
            self.seen[num_tokens] += 1
        return d.on

    def replay_decision(self, num_tokens: int) -> GateDecision:
        """The decision a step of ``num_tokens`` tokens replayed from a CUDA graph takes: :attr:`replayed`'s where
        this gate holds replay-timed decisions, else its own (no decode-row count: a capture knows none)."""
        return (self.replayed or self).decision(num_tokens)

    def account(self, num_tokens: int, on: bool, steps: int = 1) -> bool:
        """The gate's one accounting path: ``steps`` decode steps of ``num_tokens`` tokens seen, and skipped where the
        decision taken for them was off (``on`` False). The gate's own steps (:meth:`_run`) and the steps that did not
        run through it (:meth:`count`) both count here. Returns ``on``."""
        self.seen[num_tokens] += steps
        if not on:
            self.skipped[num_tokens] += steps
        return on

    def count(self, num_tokens: int, decode_rows: int | None = None, steps: int = 1, replay: bool = False) -> bool:
        """Count ``steps`` decode steps of ``num_tokens`` tokens (``decode_rows`` decoding) that did not run through
        the gate (a layer the engine bypasses, a CUDA-graph replay: ``replay``, which takes
        :meth:`replay_decision`), with the decision such a step takes (:meth:`account`). Returns the decision's
        ``on``."""
        d = self.replay_decision(num_tokens) if replay else self.decision(num_tokens, decode_rows)
        return self.account(num_tokens, d.on, steps)

    def note(self, num_tokens: int, decode_rows: int | None = None, steps: int = 1) -> None:
        """:meth:`count` (``lynx_hf.core.StageBase.note``): decode steps that ran without the gate."""
        self.count(num_tokens, decode_rows, steps)

    def skip(self, num_tokens: int) -> None:
        """Count one decode step the gate kept the model's routing on (eager only)."""
        if not torch.compiler.is_compiling():
            self.skipped[num_tokens] += 1

    # -- report -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the counters (the decisions stay)."""
        self.seen.clear()
        self.skipped.clear()

    def summary(self) -> dict:
        """``{"gate": "auto", "source": where the decisions came from, "by_tokens": {T: {"on", "cost_ms",
        "saving_ms", "experts_before", "experts_after", "expert_ms", "extra_expert_ms", "steps_skipped", "reason"}},
        "steps_skipped": total}`` per step size seen (ms per layer-step; ``None`` where not measured, so the dict is
        plain JSON)."""
        by_tokens = {}
        for t in sorted(self.seen):
            d = self.decision(t).to_dict()
            by_tokens[int(t)] = {k: d[k] for k in ("on", "cost_ms", "saving_ms", "experts_before", "experts_after",
                                                  "expert_ms", "extra_expert_ms")}
            by_tokens[int(t)].update(steps_skipped=int(self.skipped.get(t, 0)), reason=d["reason"])
            if self.replays and self.replayed is not None:  # the decision a replay of this size takes
                by_tokens[int(t)]["replayed_on"] = self.replayed.decision(t).on
        return {"gate": "auto", "source": self.source, "by_tokens": by_tokens,
                "steps_skipped": int(sum(self.skipped.values()))}


@dataclass(frozen=True)
class LayerFacts:
    """What an engine knows of one MoE layer that the cost gate weighs: one frozen value, built by the engine's adapter
    (HF: ``lynx_hf.facts.layer_facts``; vLLM: ``lynx_hf.vllm``'s plan making) and read by :func:`plan_stage`.

    - ``shape``: the :class:`LayerShape` the gate measures at;
    - ``step``: the engine's description of what else its step runs, plain data for the key (``GateKey.engine``);
    - ``expert_fn``: the layer's own experts path ``fn(hidden [T, H], idx [T, k] int64, weights [T, k])``, timed for
      the saving per avoided expert (``None``: the batched-MLP model of it);
    - ``kernel_fn``: the same through the sparse Triton kernel, timed at the step sizes where the plan runs it
      (``RoutePlan.uses_kernel``; ``None``: none);
    - ``route_fn``: the engine's per-step routing path ``fn(run, inputs)``, timed for the cost (``None``: the step
      below the gate alone);
    - ``selection``: the layer's selection scores ``fn(logits [T, N]) -> [T, N]`` fp32 (``-inf``: forbidden; ``None``:
      the logits);
    - ``extra_expert_ms``: a further cost per expert read (ms; e.g. an offloaded expert's transfer), or a function
      returning it, called only when the gate measures or uses its rule;
    - ``carried``: a copied model's ``(GateKey, decisions, source)`` from the layer it was copied from, or ``None``;
    - ``replays``: the engine also replays this layer's step from CUDA graphs while stepping eagerly at other steps
      (a vLLM engine with CUDA graphs): the gate holds eager and replay prices apart (:attr:`PlanGate.replays`);
    - ``replay_now``: ``fn() -> bool``, whether the current call is being captured (``None``: ``torch.compile``
      tracing says so; :attr:`PlanGate.replay_now`).
    """

    shape: LayerShape
    step: object = None
    expert_fn: object = None
    kernel_fn: object = None
    route_fn: object = None
    selection: object = None
    extra_expert_ms: object = 0.0
    carried: tuple | None = None
    replays: bool = False
    replay_now: object = None


def plan_stage(facts, config) -> PlanGate | None:
    """The cost gate to hand to ``lynx_hf.core.make_plan`` (``stages=``) for ``config`` (a ``LynxConfig``): the one
    reader of ``config.gate`` and the one constructor of a gate, for every engine. ``None`` unless ``config.gate ==
    "auto"``; else a :class:`PlanGate` of the layer ``facts`` describe (a :class:`LayerFacts`, or a function returning
    one, called only here when the gate is on), reading ``config.gate_table`` first, timing in the mode
    ``config.telemetry``. It gets its decisions when bound (:meth:`PlanGate.bind`)."""
    if config.gate != "auto":
        return None
    if not isinstance(facts, LayerFacts):
        facts = facts()
    return PlanGate(facts.shape, telemetry=config.telemetry, extra_expert_ms=facts.extra_expert_ms,
                    expert_fn=facts.expert_fn, kernel_fn=facts.kernel_fn, route_fn=facts.route_fn,
                    selection=facts.selection, step_key=facts.step, table=config.gate_table, tuning=TUNING,
                    carried=facts.carried, replays=facts.replays, replay_now=facts.replay_now)


def report_without_gate(config) -> dict:
    """The ``"gate"`` entry of the stats of a layer whose plan has no gate: ``{"gate": "always", ...}`` under
    ``config.gate == "always"``, else ``"auto (policy does not remap)"`` (a plan that keeps the routing), with no step
    sizes and no skipped steps (plain JSON, the shape of :meth:`PlanGate.summary`)."""
    return {"gate": "always" if config.gate == "always" else "auto (policy does not remap)", "by_tokens": {},
            "steps_skipped": 0}


def of(plan: RoutePlan | None) -> PlanGate | None:
    """The cost gate composed into ``plan`` (a ``lynx_hf.core.RoutePlan``), or ``None`` (no gate, or no plan)."""
    return None if plan is None else plan.stage(NAME)
