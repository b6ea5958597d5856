"""Per-family adapters: which module is the MoE block and how it routes (DESIGN.md tiers)."""

from __future__ import annotations

import re

import torch

from .base import MoEAdapter, WeightRule
from .deepseek_v2 import DeepseekV2Adapter
from .deepseek_v3 import DeepseekV3Adapter
from .generic import GenericAdapter
from .llama4 import Llama4Adapter
from .mixtral import MixtralAdapter
from .olmoe import OlmoeAdapter
from .qwen2_moe import Qwen2MoeAdapter
from .qwen3_moe import Qwen3MoeAdapter

_DEDICATED: tuple[MoEAdapter, ...] = (Qwen2MoeAdapter(), MixtralAdapter(), DeepseekV2Adapter(), Llama4Adapter(),
                                      Qwen3MoeAdapter(), OlmoeAdapter(), DeepseekV3Adapter())
# The generic adapter comes last and never claims a block a dedicated adapter matches.
ADAPTERS: tuple[MoEAdapter, ...] = (*_DEDICATED, GenericAdapter(exclude=_DEDICATED))

_MOE_NAME = re.compile(r"moe|mixture|sparse.*block|expert", re.IGNORECASE)


def supported_families() -> dict[str, list[str]]:
    """``{family: [HF block class names]}`` of the adapters shipped."""
    return {a.family: [name for _, name in a.block_class_paths] for a in ADAPTERS}


def find_adapter(module: torch.nn.Module) -> MoEAdapter | None:
    """The adapter whose HF block class ``module`` is an instance of, or ``None``."""
    for adapter in ADAPTERS:
        if adapter.matches(module):
            return adapter
    return None


def looks_like_moe(module: torch.nn.Module) -> bool:
    """Heuristic for error messages only: an unsupported block that resembles an MoE layer."""
    children = dict(module.named_children())
    has_experts = "experts" in children
    has_router = any(name in children for name in ("gate", "router"))
    return (has_experts and has_router) or (has_experts and bool(_MOE_NAME.search(type(module).__name__)))


__all__ = ["ADAPTERS", "MoEAdapter", "WeightRule", "find_adapter", "looks_like_moe", "supported_families"]
