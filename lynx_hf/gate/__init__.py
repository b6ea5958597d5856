"""The cost gate: run the policy on a decode step only where it pays (``LynxConfig.gate="auto"``, the default).

The paper's phase-aware optimizer (Gupta et al., arXiv 2411.08982, Sec. 4: "LYNX is bypassed when an iteration is
not memory bound", i.e. prefill) extended from phase to *cost*: per MoE layer and decode step size, the policy runs
only where the expert reads it is expected to save outweigh the routing work it adds.

Decisions are data, like vLLM's tuned fused-MoE configurations and Triton's autotune cache: keyed by everything the
timed step depends on, stored, and read by every process, rank and run that has the same key. Four parts:

- :mod:`.decision`: :class:`GateDecision`, the pure rule :func:`decide`, the closed-form :func:`by_rule`, and
  :data:`TUNING`, every constant as one frozen :class:`Tuning`;
- :mod:`.key`: :func:`make_key` / :class:`GateKey`, declared readable fields of the plan, the layer shape, the
  engine's step description and the device (:func:`device_kind`), plus the measuring code's :data:`MEASURE_VERSION`;
- :mod:`.table`: :class:`DecisionTable` files and the process's :class:`DecisionStore` (:data:`STORE`: a user
  table, the shipped tables, the per-user cache, else a measurement written to that cache);
- :mod:`.measure`: the measurement itself (private generators, no global state touched);
- :mod:`.stage`: :class:`LayerFacts` (what an engine knows of a layer), :func:`plan_stage` (the one reader of
  ``LynxConfig.gate``) and :class:`PlanGate`, the stage of a layer's plan (``lynx_hf.core.Stage``); :mod:`.report`.

Engine-independent (no transformers import). Units: milliseconds per layer-step throughout.
"""

from ..config import GATE_ENV as ENV
from .decision import TUNING, GateDecision, Tuning, always_on, bucket_of, by_rule, decide, expected_unique
from .key import FORMAT, GateKey, device_kind, make_key, readable
from .measure import (
    MEASURE_VERSION,
    cannot_measure,
    measure_bucket,
    measure_expert_ms,
    measure_layer,
    measure_module_expert_ms,
    measure_routing,
    synthetic_routing,
)
from .report import off_line, patch_note
from .stage import NAME, LayerFacts, LayerShape, PlanGate, of, plan_stage, report_without_gate
from .table import CACHE_ENV, SHIPPED_DIR, STORE, DecisionStore, DecisionTable, ForeignTableError, cache_dir, cache_name

#: the step sizes (tokens) measured per layer (``TUNING.buckets``)
BUCKETS = TUNING.buckets

__all__ = ["ENV", "NAME", "BUCKETS", "TUNING", "Tuning", "GateDecision", "LayerShape", "PlanGate", "GateKey",
           "DecisionTable", "DecisionStore", "ForeignTableError", "STORE", "CACHE_ENV", "SHIPPED_DIR", "cache_dir",
           "cache_name", "decide", "always_on", "by_rule", "expected_unique", "bucket_of", "readable", "device_kind",
           "make_key", "FORMAT", "MEASURE_VERSION", "cannot_measure",
           "measure_bucket", "measure_layer", "measure_routing", "measure_expert_ms", "measure_module_expert_ms",
           "synthetic_routing", "off_line", "patch_note", "LayerFacts", "plan_stage", "report_without_gate", "of"]
