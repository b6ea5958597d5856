"""Family specs: which module is the MoE block and how its routing works (``docs/design.md`` tiers).

A new family = a short family spec module (a :class:`FamilySpec`) + one line in :data:`SPECS`.
"""

from __future__ import annotations

import re

import torch

from . import deepseek_v2, deepseek_v3, llama4, mixtral, olmoe, qwen2_moe, qwen3_moe
from .base import FamilySpec, WeightRule
from .generic import GenericSpec

_DEDICATED: tuple[FamilySpec, ...] = (qwen2_moe.SPEC, mixtral.SPEC, deepseek_v2.SPEC, llama4.SPEC, qwen3_moe.SPEC,
                                      olmoe.SPEC, deepseek_v3.SPEC)
# The generic spec comes last and never claims a block a dedicated spec matches.
SPECS: tuple[FamilySpec, ...] = (*_DEDICATED, GenericSpec(exclude=_DEDICATED))

_MOE_NAME = re.compile(r"moe|mixture|sparse.*block|expert", re.IGNORECASE)


def supported_families() -> dict[str, list[str]]:
    """``{family: [HF block class names]}`` of the specs shipped."""
    return {s.family: [name for _, name in s.block_classes] for s in SPECS}


def find_spec(module: torch.nn.Module) -> FamilySpec | None:
    """The spec whose HF block class ``module`` is an instance of, or ``None``."""
    for spec in SPECS:
        if spec.matches(module):
            return spec
    return None


def looks_like_moe(module: torch.nn.Module) -> bool:
    """Heuristic for error messages only: an unsupported block that resembles an MoE layer."""
    children = dict(module.named_children())
    has_experts = "experts" in children
    has_router = any(name in children for name in ("gate", "router"))
    return (has_experts and has_router) or (has_experts and bool(_MOE_NAME.search(type(module).__name__)))


__all__ = ["SPECS", "FamilySpec", "WeightRule", "find_spec", "looks_like_moe", "supported_families"]
