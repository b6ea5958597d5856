"""The plugin's telemetry in one process: :func:`snapshot` (what ``lynx_hf.vllm.stats(llm)`` returns per worker and
``stats_path`` holds), :func:`reset`, :func:`write_stats`. The numbers mean what ``lynx_hf.stats(model)`` means in
the HF path (:class:`lynx_hf.telemetry.BlockTelemetry`, :class:`lynx_hf.LynxStats`). Imports no vLLM."""

from __future__ import annotations

import json
import os

from ..telemetry import LynxStats, mode_of
from . import plans
from .state import STATE

__all__ = ["snapshot", "reset", "stats_path", "write_stats"]


def snapshot() -> dict:
    """This process's telemetry (one host read of each layer's accumulators).

    ``{"rank", "pid", "config", "steps", "decode_steps", "mixed_steps", "layers": [...], "summary"}``:
    ``steps`` / ``decode_steps`` / ``mixed_steps``: model steps this worker prepared / with decode
    tokens / with decode and prefill tokens. Each layer: ``name``, ``index``, ``num_experts``,
    ``top_k``, ``rule``, ``skipped_calls`` (calls whose rows the step mask does not describe, left
    untouched), ``gathered``, the keys of :meth:`lynx_hf.telemetry.BlockTelemetry.summary` (unique
    experts per decode step over the live decode tokens before / after, remapped fraction, routing
    mass kept, decode tokens, prefill tokens in mixed steps, fallbacks), ``gate`` (the cost gate's decisions and
    where they came from, ``source``: with several tensor-parallel ranks rank 0's; ``bypassed``), what any other stage
    of the layer's plan reports (``Stage.summary``, under its name) and ``loaded_experts_before`` /
    ``loaded_experts_after`` (distinct experts of all the step's live tokens, prefill included: what the experts
    kernel reads, per step with decode tokens; ``BlockTelemetry.loaded``). ``summary``: the means over layers
    (:meth:`lynx_hf.LynxStats.summary`, the keys ``lynx_hf.stats(model).summary()`` has in HF).
    """
    layers = []
    for layer in STATE.layers:
        entry = {"name": layer.name, "index": layer.index, "num_experts": layer.num_experts, "top_k": layer.top_k,
                 "rule": {"rule": layer.rule.kind, "renormalize": layer.rule.renormalize, "scale": layer.rule.scale},
                 "skipped_calls": layer.skipped, "gathered": bool(layer.gathered)}
        entry.update(layer.telemetry.summary())
        entry.update(plans.stage_summaries(layer))
        loaded = layer.telemetry.loaded()
        entry["loaded_experts_before"], entry["loaded_experts_after"] = (None, None) if loaded is None else loaded
        layers.append(entry)
    cfg = STATE.config
    summary = LynxStats(cfg.lynx.policy if cfg else "off", layers,
                        telemetry=mode_of(cfg.lynx.telemetry) if cfg else None).summary()
    summary.pop("per_layer")
    seen = [entry for entry in layers if entry["loaded_experts_before"] is not None]
    for key in ("loaded_experts_before", "loaded_experts_after"):
        summary[key] = sum(entry[key] for entry in seen) / len(seen) if seen else None
    summary["skipped_calls"] = sum(entry["skipped_calls"] for entry in layers)
    summary["gate_steps_skipped"] = sum(entry["gate"]["steps_skipped"] for entry in layers)
    summary["gate_bypassed_layers"] = len(STATE.bypassed)
    counts = STATE.counts
    return {"rank": STATE.rank, "pid": os.getpid(), "config": cfg.to_dict() if cfg else None,
            "steps": counts.steps, "decode_steps": counts.decode_steps, "mixed_steps": counts.mixed_steps,
            "layers": layers, "summary": summary}


def reset() -> None:
    """Zero the telemetry of every layer and the step counters (the liveness rule's count stays)."""
    for layer in STATE.layers:
        plans.reset_layer(layer)
    counts = STATE.counts
    counts.steps = counts.decode_steps = counts.mixed_steps = 0


def stats_path() -> str | None:
    """Where this worker writes its telemetry: ``stats_path`` with ``{rank}`` replaced by the rank (without it,
    ranks > 0 append ``.rank<r>``); ``None`` when not configured."""
    cfg = STATE.config
    if cfg is None or not cfg.stats_path:
        return None
    path = cfg.stats_path
    if "{rank}" in path:
        return path.replace("{rank}", str(STATE.rank))
    return path if STATE.rank == 0 else f"{path}.rank{STATE.rank}"


def write_stats() -> str | None:
    """Write :func:`snapshot` to :func:`stats_path` (atomically); returns the path, or ``None`` when not configured."""
    path = stats_path()
    if path is None:
        return None
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(snapshot(), fh, indent=1)
    os.replace(tmp, path)
    return path
