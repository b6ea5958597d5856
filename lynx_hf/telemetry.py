"""Per-layer decode telemetry: unique experts before/after, remapped fraction, routing mass kept.

Accumulators are small tensors on the layer's device (no host sync in the decode step); they are
read only by :func:`lynx_hf.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# accumulator slots
_STEPS, _BEFORE, _AFTER, _REMAPPED, _ASSIGNMENTS, _MASS, _TOKENS, _FALLBACKS = range(8)


class LayerTelemetry:
    """Sums over the decode steps one MoE layer has seen."""

    def __init__(self) -> None:
        self.acc: torch.Tensor | None = None

    def reset(self) -> None:
        self.acc = None

    def _buf(self, device) -> torch.Tensor:
        if self.acc is None or self.acc.device != device:
            self.acc = torch.zeros(8, dtype=torch.float64, device=device)
        return self.acc

    def record(
        self,
        num_experts: int,
        orig_idx: torch.Tensor,
        orig_weights: torch.Tensor,
        new_idx: torch.Tensor | None,
        fallback: bool = False,
    ) -> None:
        """One decode step. ``orig_idx``/``new_idx [T, k]`` int, ``orig_weights [T, k]`` (the model's)."""
        acc = self._buf(orig_idx.device)
        num_tokens, top_k = orig_idx.shape
        before = torch.zeros(num_experts, dtype=torch.bool, device=orig_idx.device)
        before[orig_idx.reshape(-1)] = True
        row = torch.zeros(8, dtype=torch.float64, device=acc.device)
        row[_STEPS] = 1
        row[_BEFORE] = before.sum()
        row[_ASSIGNMENTS] = num_tokens * top_k
        row[_TOKENS] = num_tokens
        row[_FALLBACKS] = float(fallback)
        if new_idx is None:
            row[_AFTER] = row[_BEFORE]
            row[_MASS] = num_tokens
        else:
            after = torch.zeros(num_experts, dtype=torch.bool, device=orig_idx.device)
            after[new_idx.reshape(-1)] = True
            kept = (orig_idx[:, :, None] == new_idx[:, None, :]).any(-1)  # [T, k] orig slot still used
            w = orig_weights.float()
            row[_AFTER] = after.sum()
            row[_REMAPPED] = (~kept).sum()
            row[_MASS] = ((w * kept).sum(-1) / w.sum(-1).clamp_min(1e-30)).sum()
        acc += row

    def summary(self) -> dict:
        if self.acc is None:
            return {"decode_steps": 0, "unique_experts_before": 0.0, "unique_experts_after": 0.0,
                    "remapped_fraction": 0.0, "routing_mass_kept": 1.0, "fallbacks": 0}
        a = self.acc.tolist()
        steps = max(a[_STEPS], 1.0)
        return {
            "decode_steps": int(a[_STEPS]),
            "unique_experts_before": a[_BEFORE] / steps,
            "unique_experts_after": a[_AFTER] / steps,
            "remapped_fraction": a[_REMAPPED] / max(a[_ASSIGNMENTS], 1.0),
            "routing_mass_kept": a[_MASS] / max(a[_TOKENS], 1.0),
            "fallbacks": int(a[_FALLBACKS]),
        }


@dataclass
class LynxStats:
    """What :func:`lynx_hf.stats` returns: per-layer summaries plus model-level means."""

    policy: str
    layers: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """Means over MoE layers of the per-layer means per decode step.

        Keys: ``decode_steps`` (decode forwards seen by the model), ``unique_experts_before`` /
        ``unique_experts_after`` (distinct experts per layer per decode step), ``ratio``
        (after/before), ``remapped_fraction`` (share of token→expert assignments changed),
        ``routing_mass_kept`` (mean over tokens of the original top-k weight still used, 1 = all),
        ``fallbacks`` (steps that used the model's own routing because router scores were not
        finite), ``num_moe_layers``, ``policy`` and ``per_layer`` (list of per-layer dicts).
        """
        seen = [layer for layer in self.layers if layer["decode_steps"] > 0]
        n = max(len(seen), 1)
        before = sum(layer["unique_experts_before"] for layer in seen) / n
        after = sum(layer["unique_experts_after"] for layer in seen) / n
        return {
            "policy": self.policy,
            "decode_steps": max((layer["decode_steps"] for layer in self.layers), default=0),
            "num_moe_layers": len(self.layers),
            "unique_experts_before": before,
            "unique_experts_after": after,
            "ratio": after / before if before else 1.0,
            "remapped_fraction": sum(layer["remapped_fraction"] for layer in seen) / n,
            "routing_mass_kept": (sum(layer["routing_mass_kept"] for layer in seen) / n) if seen else 1.0,
            "fallbacks": sum(layer["fallbacks"] for layer in self.layers),
            "per_layer": self.layers,
        }
