"""Per-model and per-MoE-layer patch state (plain Python objects, never modules: state_dict and
module tree of the user's model are untouched)."""

from __future__ import annotations

import types

import torch

from . import policy
from .config import LynxConfig
from .phase import DECODE, PhaseTracker
from .telemetry import LayerTelemetry

LAYER_ATTR = "_lynx_layer"
MODEL_ATTR = "_lynx_state"


class ModelState:
    """Everything ``patch`` attached to one model; removed whole by ``unpatch``."""

    def __init__(self, config: LynxConfig) -> None:
        self.config = config
        self.tracker = PhaseTracker(self)
        self.layers: list[LynxLayer] = []

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The patched MoE blocks, in module order."""
        return [layer.block for layer in self.layers]


class LynxLayer:
    """The state of one patched MoE block; its ``route`` is what adapters call in decode."""

    def __init__(self, owner: ModelState, adapter, name: str, block: torch.nn.Module) -> None:
        self.owner = owner
        self.adapter = adapter
        self.name = name
        self.block = block
        self.num_experts, self.top_k = adapter.experts_and_top_k(block)
        self.telemetry = LayerTelemetry()
        self._installed = None  # (attribute, had_instance_value, previous_value, our_method)
        self.original_forward = None

    # -- installation (HF kernels' _replace_forward style: swap only ``forward``) -----------------
    def install(self) -> None:
        block = self.block
        # accelerate hooks wrap ``forward`` and call ``_old_forward``: swap that one so hooks stay.
        attr = "_old_forward" if hasattr(block, "_hf_hook") and "_old_forward" in block.__dict__ else "forward"
        had = attr in block.__dict__
        previous = block.__dict__.get(attr)
        self.original_forward = getattr(block, attr)
        ours = types.MethodType(_patched_forward, block)
        self._installed = (attr, had, previous, ours)
        object.__setattr__(block, attr, ours)
        object.__setattr__(block, LAYER_ATTR, self)

    def uninstall(self) -> None:
        block = self.block
        attr, had, previous, ours = self._installed
        for where in ("forward", "_old_forward"):
            if block.__dict__.get(where) is not ours:
                continue
            if where != attr:  # accelerate wrapped our forward after patch: put the original under it
                object.__setattr__(block, where, self.original_forward)
            elif had:
                object.__setattr__(block, where, previous)
            else:
                del block.__dict__[where]
            break
        block.__dict__.pop(LAYER_ATTR, None)

    # -- decode-time routing -----------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.owner.tracker.phase == DECODE

    def route(self, router_logits, scores_fn, topk_idx, topk_weights, rule):
        """Return ``(topk_idx, topk_weights, changed)`` for one decode step.

        ``router_logits [T, N]`` (model dtype or fp32), ``scores_fn()`` -> fp32 selection scores
        ``[T, N]`` (``-inf`` = forbidden), ``topk_idx``/``topk_weights [T, k]`` the model's own.
        Policy ``"none"`` and non-finite router logits (NaN/inf: counted as a fallback) return the
        model's own routing unchanged (``changed=False``). Otherwise the policy's remap with weights
        recomputed by the family ``rule`` (fp32 math, cast to ``rule.dtype``).
        """
        cfg = self.owner.config
        telemetry = cfg.telemetry
        if cfg.policy == "none":
            if telemetry:
                self.telemetry.record(self.num_experts, topk_idx, topk_weights, None)
            return topk_idx, topk_weights, False
        if not bool(torch.isfinite(router_logits).all()):
            if telemetry:
                self.telemetry.record(self.num_experts, topk_idx, topk_weights, None, fallback=True)
            return topk_idx, topk_weights, False
        new_idx, weights = policy.remap(cfg, scores_fn(), topk_idx, router_logits, rule.rule, rule.renormalize,
                                        rule.scale, topk_weights=topk_weights)
        if rule.dtype is not None:
            weights = weights.to(rule.dtype)
        if telemetry:
            self.telemetry.record(self.num_experts, topk_idx, topk_weights, new_idx)
        return new_idx, weights, True

    def run_experts(self, experts, hidden, topk_idx, topk_weights, changed, default, *, transposed=False,
                    weight_on_input=False):
        """Routed-expert output ``[T, H]`` of a decode step.

        When the policy changed the routing and the Triton backend is in use (CUDA tensors, or
        ``backend="triton"`` under ``TRITON_INTERPRET=1``), runs the sparse decode kernel
        :func:`lynx_hf.kernels.moe.sparse_moe` on the experts' stacked weights (``gate_up_proj``,
        ``down_proj``; SiLU-gated experts only); otherwise ``default()`` (the model's own experts or
        the adapter's torch path). Policy ``"none"`` always takes ``default()`` (bit-identical).
        """
        cfg = self.owner.config
        if not changed or not policy.use_triton(cfg.backend, hidden.device) or not _is_silu(experts):
            return default()
        from .kernels.moe import sparse_moe

        return sparse_moe(hidden, topk_idx, topk_weights, experts.gate_up_proj, experts.down_proj,
                          transposed=transposed, weight_on_input=weight_on_input)


def _is_silu(experts) -> bool:
    act = getattr(experts, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _patched_forward(self, *args, **kwargs):
    layer: LynxLayer = self.__dict__[LAYER_ATTR]
    if not layer.active:  # prefill is never touched: the block's own forward, bit-identical
        return layer.original_forward(*args, **kwargs)
    return layer.adapter.forward(self, *args, lynx=layer, **kwargs)
