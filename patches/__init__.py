"""Family specs: which module is the MoE block and how its routing works (``docs/design.md`` tiers).

A new family = a short family spec module (a :class:`FamilySpec`) + one line in :data:`SPECS`.
"""

from __future__ import annotations

import re

import torch

from . import deepseek_v2, deepseek_v3, llama4, mixtral, olmoe, qwen2_moe, qwen3_moe
from .base import FamilySpec, WeightRule
from .generic import GenericSpec, _is_standard_experts, block_parts

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
    """Heuristic for error messages only: an unsupported block that resembles an MoE layer (an ``experts`` child,
    or a class name that says so and a router-like child)."""
    children = dict(module.named_children())
    if "experts" in children:
        return True
    return bool(_MOE_NAME.search(type(module).__name__)) and any(
        name in children for name in ("gate", "router", "router_gate"))


def why_unsupported(module: torch.nn.Module) -> str:
    """Why no family spec claims an MoE-looking ``module``, and what would be needed (for error messages)."""
    children = dict(module.named_children())
    name = type(module).__name__
    router = next((children[n] for n in ("gate", "router") if n in children), None)
    where = f"{name}" + (f" (router {type(router).__name__})" if router is not None else "")
    experts = children.get("experts")
    if experts is None:
        own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n in children]
        return (f"{where}: no `experts` child (it holds {own}); the generic family spec needs stacked experts called "
                f"as experts(hidden, top_k_index, top_k_weights) (per-token expert embeddings, mixture-of-attention "
                f"or per-expert modules need a dedicated family spec)")
    if isinstance(experts, torch.nn.ModuleList):
        return (f"{where}: its experts are a ModuleList of per-expert MLPs, not stacked 3-d weights; a dedicated "
                f"family spec is needed")
    if not _is_standard_experts(experts):
        inner = sorted({n.split(".")[0] for n, _ in experts.named_parameters()})
        num = getattr(experts, "num_experts", None)
        return (f"{where}: experts {type(experts).__name__} hold {inner}, num_experts={num!r}; the generic family "
                f"spec needs 3-d gate_up_proj (or up_proj) and down_proj, or packed experts with forward(hidden_states, "
                f"top_k_index, top_k_weights), and an int num_experts")
    if block_parts(module)[0] is None:
        return (f"{where}: no `gate` / `router` child (children: {sorted(children)}); the generic family spec needs "
                f"the router as one of those children")
    return f"{where}: not claimed by any family spec"


__all__ = ["SPECS", "FamilySpec", "WeightRule", "find_spec", "looks_like_moe", "supported_families", "why_unsupported"]
