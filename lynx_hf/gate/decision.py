"""The gate's decision: a pure function of measured (or modelled) figures, and the one frozen value of its constants.

Engine-independent, no transformers import. Units: milliseconds per layer-step throughout.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tuning:
    """Every constant of the cost gate, one frozen value (:data:`TUNING`). Its digest is part of every decision
    table key (``lynx_hf.gate.key``), so a change here makes stored decisions miss instead of being reused.

    Measurement (``lynx_hf.gate.measure``):

    - ``buckets``: step sizes (tokens) measured per layer; a step of T tokens uses the smallest bucket >= T; above
      the largest, :func:`by_rule` decides (``docs/policies.md#the-cost-gate``).
    - ``logit_std``: std of the i.i.d. normal synthetic router logits the experts before / after are estimated on.
    - ``draws``: synthetic draws per bucket that estimate is averaged over.
    - ``pool_bytes``: bytes of expert weights the batched-MLP expert timing cycles through (at most N experts), so a
      large layer reads them from memory as a decode step does.
    - ``time_budget_s``: wall-clock budget of one timing (at least 3 and at most 25 calls).
    - ``confirm``: further timings of the figure that decided a bucket (the smallest counts), while it flips.
    - ``confirm_max_s``: a figure whose timing took this long (s) is not timed again.
    - ``margin``: the saving must exceed ``margin x cost``: synthetic i.i.d. logits overestimate the experts a real
      batch saves (fixture A, B = 16: 10.6 saved for real, 13.25 synthetic: 1.25x; ``docs/policies.md``).

    Closed-form rule (:func:`by_rule`; where measuring is impossible, and steps above the largest bucket):

    - ``rule_gb_per_s``: device type -> memory bandwidth (GB/s) an expert's weights are read at.
    - ``rule_step_ms``: device type -> fixed routing cost of one layer-step (ms: the policy's ops, launches).
    - ``rule_ns_per_score``: routing cost per router score (T x N) on top (ns).
    """

    buckets: tuple = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    logit_std: float = 2.0
    draws: int = 4
    pool_bytes: int = 96 << 20
    time_budget_s: float = 0.05
    confirm: int = 2
    confirm_max_s: float = 0.5
    margin: float = 1.25
    rule_gb_per_s: tuple = (("cpu", 20.0), ("cuda", 2000.0), ("xpu", 500.0), ("other", 100.0))
    rule_step_ms: tuple = (("cpu", 0.05), ("cuda", 0.15), ("xpu", 0.15), ("other", 0.15))
    rule_ns_per_score: float = 2.0

    def digest(self) -> str:
        """A short stable hash of every field (hex, 12 characters)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def per_device(self, table: tuple, device_type: str) -> float:
        values = dict(table)
        return float(values.get(device_type, values["other"]))


#: the gate's constants (``Tuning``); a test or a lab script passes its own ``Tuning`` instead of editing this
TUNING = Tuning()


@dataclass(frozen=True)
class GateDecision:
    """One gate decision (ms per layer-step).

    ``on``: the policy runs; ``cost_ms``: added time of the decode-step routing work; ``saving_ms``: expected
    experts saved x (``expert_ms`` + ``extra_expert_ms``); ``experts_before`` / ``experts_after``: expected
    distinct experts per step without / with the policy (``nan`` when not estimated); ``reason``: one line.
    """

    on: bool
    cost_ms: float
    saving_ms: float
    experts_saved: float
    expert_ms: float
    extra_expert_ms: float = 0.0
    experts_before: float = float("nan")
    experts_after: float = float("nan")
    reason: str = ""

    @property
    def measured(self) -> bool:
        """Whether the decision rests on figures (measured, a table's, or the closed-form rule's): False for
        :func:`always_on`'s, taken without any (the layer's sizes unknown, a bucket not decided yet)."""
        return math.isfinite(self.cost_ms)

    def to_dict(self) -> dict:
        """Plain JSON (``None`` for a non-finite figure)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict) -> "GateDecision":
        """The inverse of :meth:`to_dict`, checked field by field: ``on`` a JSON boolean; ``cost_ms``, ``saving_ms``,
        ``experts_saved`` and ``expert_ms`` present, each a number or ``null`` (``nan``), as the optional
        ``extra_expert_ms`` (default 0), ``experts_before`` / ``experts_after`` (default ``nan``); ``reason`` a string
        (default empty). Raises ``KeyError`` for a missing field, ``TypeError`` for a value of another type (a hand
        edit's ``"on": 1``, ``"cost_ms": "3"``, ``"cost_ms": true``), ``ValueError`` for a non-number."""
        if not isinstance(values, dict):
            raise TypeError(f"gate decision: expected an object, got {type(values).__name__}")
        nan = float("nan")
        fields = {k: values[k] for k in ("on", "cost_ms", "saving_ms", "experts_saved", "expert_ms")}
        fields.update({k: values.get(k, d) for k, d in (("extra_expert_ms", 0.0), ("experts_before", nan),
                                                        ("experts_after", nan), ("reason", ""))})
        if not isinstance(fields["on"], bool):
            raise TypeError(f"gate decision: 'on' must be true or false, got {fields['on']!r}")
        if not isinstance(fields["reason"], str):
            raise TypeError(f"gate decision: 'reason' must be a string, got {fields['reason']!r}")
        floats = {}
        for k, v in fields.items():
            if k in ("on", "reason"):
                continue
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"gate decision: {k!r} must be a number or null, got {v!r}")
            floats[k] = nan if v is None else float(v)
        return cls(fields["on"], reason=fields["reason"], **floats)


def decide(cost_ms: float, experts_saved: float, expert_ms: float, extra_expert_ms: float = 0.0,
           margin: float = 1.0) -> GateDecision:
    """The gate's rule, a pure function of its figures.

    ``cost_ms`` (>= 0 after clamping: a negative measurement is timing noise and counts as 0): what the policy adds
    to one layer-step; ``experts_saved``: expected distinct experts per step the policy avoids (clamped to >= 0);
    ``expert_ms``: what one expert costs in the experts path at this step size; ``extra_expert_ms``: any further
    cost per expert read (e.g. the transfer of an offloaded expert, >= 0); ``margin`` (> 0): the saving must
    exceed ``margin x cost``. saving = experts_saved x (expert_ms + extra_expert_ms); ``on`` iff saving > margin x
    cost (strict: with nothing saved the policy never runs). Raises ``ValueError`` for a non-finite input, a
    negative ``expert_ms`` / ``extra_expert_ms`` or a ``margin`` <= 0.
    """
    for name, value in (("cost_ms", cost_ms), ("experts_saved", experts_saved), ("expert_ms", expert_ms),
                        ("extra_expert_ms", extra_expert_ms), ("margin", margin)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"gate.decide: {name} must be a finite number, got {value!r}")
    if expert_ms < 0 or extra_expert_ms < 0:
        raise ValueError(f"gate.decide: expert_ms and extra_expert_ms must be >= 0, got {expert_ms}, {extra_expert_ms}")
    if margin <= 0:
        raise ValueError(f"gate.decide: margin must be > 0, got {margin}")
    cost = max(float(cost_ms), 0.0)
    saved = max(float(experts_saved), 0.0)
    saving = saved * (float(expert_ms) + float(extra_expert_ms))
    on = saving > margin * cost
    reason = (f"expected saving {saving:.3g} ms {'>' if on else '<='} "
              f"{'' if margin == 1 else f'{margin:g} x '}cost {cost:.3g} ms per layer-step")
    return GateDecision(on, cost, saving, saved, float(expert_ms), float(extra_expert_ms), reason=reason)


def always_on(reason: str) -> GateDecision:
    """A decision that keeps the policy on without a figure (``reason`` says why: the layer's sizes are unknown)."""
    nan = float("nan")
    return GateDecision(True, nan, nan, nan, nan, reason=reason)


def expected_unique(num_experts: int, picks_per_token: int, num_tokens: int) -> float:
    """Expected distinct experts when ``num_tokens`` tokens each pick ``picks_per_token`` of ``num_experts``
    uniformly: ``N (1 - (1 - p/N)^T)``."""
    n = float(num_experts)
    return n * (1.0 - (1.0 - min(picks_per_token, num_experts) / n) ** max(num_tokens, 0))


def by_rule(num_experts: int, top_k: int, hidden: int, intermediate: int, expert_bytes: int, num_tokens: int,
            device_type: str, extra_expert_ms: float = 0.0, why: str = "", tuning: Tuning = TUNING,
            ep_size: int = 1) -> GateDecision:
    """The closed-form decision, where measuring is impossible (``torch.compile`` tracing, CUDA-graph capture, a
    ``meta`` device) and for steps above the largest bucket. A model, documented in ``docs/policies.md``:

    - experts before = ``N (1 - (1 - k/N)^T)`` (uniform routing, :func:`expected_unique`);
    - experts after = ``max(k, N (1 - (1 - 1/N)^T))``: a cover policy keeps one expert per token (its top-1), so at
      most the distinct top-1 experts plus growth to k;
    - one expert = ``3 H I`` weights of ``expert_bytes`` bytes read at ``tuning.rule_gb_per_s`` of the device type,
      plus ``extra_expert_ms``;
    - cost = ``tuning.rule_step_ms`` + ``T N x tuning.rule_ns_per_score``;
    - under expert parallelism over ``ep_size`` ranks a rank saves its own experts only: ``1 / ep_size`` of them.

    On iff saving > ``tuning.margin`` x cost (:func:`decide`). ``device_type``: ``"cpu"``, ``"cuda"``, ...;
    ``why`` is prepended to the reason."""
    before = expected_unique(num_experts, top_k, num_tokens)
    after = min(before, max(float(top_k), expected_unique(num_experts, 1, num_tokens)))
    gb_per_s = tuning.per_device(tuning.rule_gb_per_s, device_type)
    expert_ms = 3.0 * hidden * intermediate * expert_bytes / (gb_per_s * 1e6)
    cost = tuning.per_device(tuning.rule_step_ms, device_type) + num_tokens * num_experts * \
        tuning.rule_ns_per_score * 1e-6
    d = decide(cost, (before - after) / max(1, int(ep_size)), expert_ms, extra_expert_ms, margin=tuning.margin)
    reason = f"rule ({why}): {d.reason}" if why else f"rule: {d.reason}"
    return GateDecision(d.on, d.cost_ms, d.saving_ms, d.experts_saved, d.expert_ms, d.extra_expert_ms, before, after,
                        reason)


def bucket_of(num_tokens: int, buckets=TUNING.buckets) -> int:
    """The measured step size a step of ``num_tokens`` tokens uses: the smallest bucket >= it, else the largest."""
    for b in buckets:
        if num_tokens <= b:
            return b
    return buckets[-1]
