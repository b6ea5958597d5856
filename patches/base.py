"""What every family adapter provides (the only tier that knows HF class names).

An adapter names the HF MoE block class(es) of one family, validates a block's routing settings at
patch time, and implements ``forward(block, hidden_states, lynx)``: the HF block's forward with the
routing step handed to ``lynx.route`` (decode only; prefill never reaches an adapter).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightRule:
    """How a family weights its chosen experts (DESIGN.md "Family rules").

    ``rule``: one of ``kernels.routing_naive.WEIGHT_RULES``; ``renormalize`` over the chosen k;
    ``scale`` (``routed_scaling_factor``); ``dtype``: cast of the final weights (``None`` keeps fp32).
    """

    rule: str
    renormalize: bool = False
    scale: float = 1.0
    dtype: torch.dtype | None = None


class MoEAdapter:
    """Base class; subclasses set ``family``, ``block_class_paths`` and implement the methods."""

    family: str = ""
    #: ``(module path, class name)`` of the HF MoE block(s) this adapter patches.
    block_class_paths: tuple[tuple[str, str], ...] = ()

    def block_classes(self) -> tuple[type, ...]:
        classes = []
        for module_path, name in self.block_class_paths:
            try:
                classes.append(getattr(importlib.import_module(module_path), name))
            except (ImportError, AttributeError):
                continue  # this transformers build lacks the family
        return tuple(classes)

    def matches(self, module: torch.nn.Module) -> bool:
        classes = self.block_classes()
        return bool(classes) and isinstance(module, classes)

    def experts_and_top_k(self, block) -> tuple[int, int]:
        raise NotImplementedError

    def check_block(self, block, name: str) -> None:
        """Raise :class:`lynx_hf.ModelConfigError` when the block's routing settings are inconsistent."""
        from ..errors import ModelConfigError

        num_experts, top_k = self.experts_and_top_k(block)
        if not 1 <= top_k <= num_experts:
            raise ModelConfigError(
                f"{name} ({type(block).__name__}): num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}"
            )

    def forward(self, block, hidden_states: torch.Tensor, lynx):
        raise NotImplementedError
