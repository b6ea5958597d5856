"""The plugin's telemetry in one process: :func:`snapshot` (what ``lynx_hf.vllm.stats(llm)`` returns per worker and
``stats_path`` holds), :func:`reset`, :func:`write_stats`, and the ``stats_every`` writes of a serving step
(:func:`request_write`, :func:`flush_write`: the accumulators reach the host by an asynchronous copy, never by a read
that waits for the device inside the step). The numbers mean what ``lynx_hf.stats(model)`` means in the HF path
(:class:`lynx_hf.telemetry.BlockTelemetry`, :class:`lynx_hf.LynxStats`). Imports no vLLM."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..core import host_reads_allowed
from ..telemetry import BlockTelemetry, LynxStats, mode_of
from . import plans
from .state import STATE, target_layers

__all__ = ["snapshot", "reset", "stats_path", "write_stats", "request_write", "flush_write", "PendingWrite"]


def _layer_entry(layer, telemetry: BlockTelemetry) -> dict:
    entry = {"name": layer.name, "index": layer.index, "num_experts": layer.num_experts, "top_k": layer.top_k,
             "rule": {"rule": layer.rule.kind, "renormalize": layer.rule.renormalize, "scale": layer.rule.scale},
             "skipped_calls": layer.skipped, "gathered": bool(layer.gathered),
             "sequence_parallel": bool(layer.sequence_parallel)}
    entry.update(telemetry.summary())
    entry.update(plans.stage_summaries(layer))
    loaded = telemetry.loaded()
    entry["loaded_experts_before"], entry["loaded_experts_after"] = (None, None) if loaded is None else loaded
    return entry


def snapshot(host: dict | None = None) -> dict:
    """This process's telemetry (one host read of each layer's accumulators).

    ``{"rank", "pid", "config", "steps", "decode_steps", "mixed_steps", "layers": [...], "summary"}``:
    ``steps`` / ``decode_steps`` / ``mixed_steps``: model steps this worker prepared / with decode
    tokens / with decode and prefill tokens. Each layer: ``name``, ``index``, ``num_experts``,
    ``top_k``, ``rule``, ``skipped_calls`` (calls whose rows the step mask does not describe, left
    untouched), ``gathered``, the keys of :meth:`lynx_hf.telemetry.BlockTelemetry.summary` (unique
    experts per decode step over the live decode tokens before / after, remapped fraction, routing
    mass kept, decode tokens, prefill tokens in mixed steps, fallbacks), ``sequence_parallel``, ``gate`` (the cost
    gate's decisions and
    where they came from, ``source``: with several tensor-parallel ranks rank 0's; ``bypassed``), what any other stage
    of the layer's plan reports (``Stage.summary``, under its name) and ``loaded_experts_before`` /
    ``loaded_experts_after`` (distinct experts of all the step's live tokens, prefill included: what the experts
    kernel reads, per step with decode tokens; ``BlockTelemetry.loaded``). ``layers`` are the served model's; the
    drafter's MoE layers (MTP / EAGLE / a draft model: they keep vLLM's routing, ``Layer.drafter``) are listed apart in
    ``drafter_layers`` (``name``, ``index``, ``calls``: their own router calls). ``summary``: the means over ``layers``
    (:meth:`lynx_hf.LynxStats.summary`, the keys ``lynx_hf.stats(model).summary()`` has in HF).

    ``host``: layer index -> its accumulators copied to the host (:func:`request_write`), read instead of the
    device's; ``None``: the live accumulators (one host read each: what ``lynx_hf.vllm.stats(llm)`` asks).
    """
    layers = []
    for layer in target_layers():
        telemetry = layer.telemetry
        if host is not None:  # the accumulators as copied to the host (request_write): read there, no device wait
            telemetry = BlockTelemetry(layer.telemetry.mode)
            telemetry.acc = host.get(layer.index)
        layers.append(_layer_entry(layer, telemetry))
    drafters = [{"name": layer.name, "index": layer.index, "calls": layer.calls}
                for layer in STATE.layers if layer.drafter]
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
            "layers": layers, "drafter_layers": drafters, "summary": summary}


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


def write_stats(host: dict | None = None) -> str | None:
    """Write :func:`snapshot` (of ``host`` copies, else the live accumulators) to :func:`stats_path` (atomically);
    returns the path, or ``None`` when not configured."""
    path = stats_path()
    if path is None:
        return None
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(snapshot(host), fh, indent=1)
    os.replace(tmp, path)
    return path


@dataclass
class PendingWrite:
    """A ``stats_every`` write whose accumulators are on their way to the host: ``host`` (layer index -> a host tensor
    the copy lands in; pinned on CUDA, reused), ``event`` (recorded on the device stream after the copies; ``None``:
    the copies are done, e.g. on CPU)."""

    host: dict
    event: object = None

    def done(self) -> bool:
        """Whether the copies have landed (``event.query()``: never waits)."""
        return self.event is None or bool(self.event.query())


#: layer index -> the host tensor its accumulators are copied into (kept: a pinned buffer is costly to allocate)
_HOST: dict = {}


def _device_copies() -> bool:
    """Whether reading some layer's accumulators on the host would wait for a device (``lynx_hf.core.host_reads_allowed``
    is False: they live on a device, or the accelerator path is forced on CPU, ``strict_sync_free``)."""
    return any(layer.telemetry.acc is not None and not host_reads_allowed(layer.telemetry.acc)
               for layer in target_layers())


def request_write() -> None:
    """A ``stats_every`` step has ended (``lynx_hf.vllm.steps.end_step``, inside the runner's ``execute_model``): write
    the telemetry to ``stats_path`` without a host read of a device tensor. CPU accumulators are written at once (no
    device to wait for). Device ones are copied to host buffers with ``non_blocking`` copies on the current stream
    (after the step's kernels, which they follow in stream order) and an event is recorded; the file is written by
    :func:`flush_write` once the event has completed (the next step's end, the next ``stats`` call), never by waiting
    for it. A write still in flight when the next is due is written first if done, else the new one is dropped (the
    next due step asks again): under Model Runner V2's asynchronous scheduling the step never stalls."""
    if stats_path() is None:
        return
    if not _device_copies():
        write_stats()
        return
    flush_write()
    if STATE.pending_write is not None:
        return  # the previous copy is still in flight: its file comes first
    host = {}
    event = None
    for layer in target_layers():
        acc = layer.telemetry.acc
        if acc is None:
            continue
        buf = _HOST.get(layer.index)
        if buf is None or buf.shape != acc.shape or buf.dtype != acc.dtype:
            buf = torch.empty(acc.shape, dtype=acc.dtype, pin_memory=acc.device.type == "cuda")
            _HOST[layer.index] = buf
        buf.copy_(acc, non_blocking=True)
        host[layer.index] = buf
        if acc.device.type == "cuda":
            event = torch.cuda.Event()
        elif acc.device.type == "xpu" and hasattr(torch, "xpu"):
            event = torch.xpu.Event()
    if event is not None:
        event.record()
    STATE.pending_write = PendingWrite(host, event)
    flush_write()


def flush_write() -> bool:
    """Write a pending ``stats_every`` write (:func:`request_write`) whose copies have landed; never waits. Returns
    whether one was written."""
    pending = STATE.pending_write
    if pending is None or not pending.done():
        return False
    STATE.pending_write = None
    write_stats(pending.host)
    return True
