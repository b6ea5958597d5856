"""What a family spec declares (the only tier that knows HF class names; ``docs/design.md`` tiers).

A family is a :class:`FamilySpec`: the HF block class(es), which child is the router and which the
experts, how to read N and k, how to turn the router's logits into fp32 selection scores, the weight
rule a remap must reproduce, and what it refuses at patch time (with the reason). No forward bodies:
the HF block state (``lynx_hf.block``) intercepts the router's output, and the block's own forward runs.
Llama-4 alone declares ``decode_forward`` (HF computes its experts densely).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..core import WeightRule
from ..errors import ModelConfigError

__all__ = ["BlockRule", "FamilySpec", "WeightRule", "fp32_logits"]


def fp32_logits(router, logits: torch.Tensor) -> torch.Tensor:
    """Default selection scores: the router logits in fp32 (pre-softmax / pre-sigmoid, ``docs/design.md``)."""
    return logits.float()


@dataclass(frozen=True)
class BlockRule:
    """The routing rule of one MoE block, as :meth:`FamilySpec.validate` resolves it at patch time and passes on to
    the HF block state (``lynx_hf.block.BlockRouting``).

    ``num_experts`` (N) and ``top_k`` (k) of the router; ``weight``: the :class:`WeightRule` a remap reproduces, or
    ``None`` when verification is deferred (the generic spec on a router not materialized at patch time: verified on
    its first call of at least ``probe_tokens`` tokens, :meth:`GenericSpec.deferred_rule`); ``selection``: the
    block's selection-bias rule (``lynx_hf.selection.BiasedSelection``) that replaces the spec's
    :attr:`FamilySpec.selection_scores`, or ``None``.
    """

    num_experts: int
    top_k: int
    weight: WeightRule | None
    selection: object = None
    #: why verification is deferred though the router is materialized (``None``: it is not, or nothing is deferred):
    #: the probe could not tell candidate rules apart (``docs/cases.md`` C42)
    pending_reason: str | None = None
    #: ``(module, dotted path)`` of the tensors that ambiguity depends on (a selection bias): the block verifies again
    #: once one of them changes (``lynx_hf.block.BlockRouting``)
    watch: tuple = ()


@dataclass(frozen=True)
class FamilySpec:
    """One model family (see the module docstring). ``check(block, router, name, config)`` raises
    :class:`lynx_hf.ModelConfigError` for settings it refuses; ``weight_rule_of(router, block)`` gives the
    :class:`WeightRule` a remap reproduces."""

    family: str
    block_classes: tuple[tuple[str, str], ...]
    weight_rule_of: Callable[[torch.nn.Module, torch.nn.Module], WeightRule]
    router: str = "gate"
    experts: str = "experts"
    selection_scores: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = fp32_logits
    #: what :attr:`selection_scores` reads of the router besides the logits (its grouping, its method), as a value the
    #: cost gate's key describes (``lynx_hf.gate.key``): two routers with equal values select with the same work
    selection_rule_of: Callable[[torch.nn.Module], object] | None = None
    #: :attr:`selection_scores` as data for the fused device step (``lynx_hf.core.device_step``), from the router: a
    #: ``lynx_hf.kernels.step_spec.FusedSelection`` or a ``lynx_hf.selection.BiasedSelection`` (its live bias is read
    #: by the kernel), or ``None`` (the step computes the scores with :attr:`selection_scores`). ``None`` here: only
    #: the default :attr:`selection_scores` (the fp32 logits) is described
    fused_selection_of: Callable[[torch.nn.Module], object] | None = None
    check: Callable | None = None
    decode_forward: Callable | None = None

    def classes(self) -> tuple[type, ...]:
        found = []
        for module_path, name in self.block_classes:
            try:
                found.append(getattr(importlib.import_module(module_path), name))
            except (ImportError, AttributeError):
                continue  # this transformers build lacks the family
        return tuple(found)

    def matches(self, module: torch.nn.Module) -> bool:
        classes = self.classes()
        return bool(classes) and isinstance(module, classes)

    def router_of(self, block) -> torch.nn.Module:
        return getattr(block, self.router)

    def experts_of(self, block) -> torch.nn.Module:
        return getattr(block, self.experts)

    def shape(self, block) -> tuple[int, int]:
        """``(N, k)``: the router's ``num_experts`` and ``top_k``."""
        router = self.router_of(block)
        return int(router.num_experts), int(router.top_k)

    def validate(self, block, name: str, config) -> BlockRule:
        """Patch-time checks of ``block`` (named ``name`` in messages) under ``config`` (a ``LynxConfig``) and its
        routing rule: N and k (:meth:`shape`), k in 1..N and the family's own :attr:`check` (raise
        ``lynx_hf.ModelConfigError``), then the weight rule (:attr:`weight_rule_of`). A dedicated spec states no
        selection rule of its own (its :attr:`selection_scores` apply). Returns the :class:`BlockRule`."""
        num_experts, top_k = self.shape(block)
        self.check_routing(block, name, config, num_experts, top_k)
        return BlockRule(num_experts, top_k, self.weight_rule_of(self.router_of(block), block))

    def check_routing(self, block, name: str, config, num_experts: int, top_k: int) -> None:
        """k in 1..N, then the family's own :attr:`check`; raises ``lynx_hf.ModelConfigError``."""
        if not 1 <= top_k <= num_experts:
            raise ModelConfigError(
                f"{name} ({type(block).__name__}): num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}"
            )
        if self.check is not None:
            self.check(block, self.router_of(block), name, config)

    # The router output contract (router_logits, routing_weights, selected_experts).
    @staticmethod
    def unpack(output):
        return output[0], output[1], output[2]

    @staticmethod
    def repack(output, logits, weights, idx):
        new = (logits, weights, idx, *output[3:])
        return list(new) if isinstance(output, list) else new
