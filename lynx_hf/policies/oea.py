"""OEA (Oncescu et al., arXiv 2511.02237, Sec. 3), the baseline: each decode token keeps its own
top-``oea_k0``; the critical set is the union of those (plus the step's seed); the remap then lets each
token "piggyback" on experts already in the set until it has k. A token's top-``k0`` breaks exact score ties
to its own experts (the model's top-k ids), then the lower id: with ``oea_k0 = k`` the policy is the identity."""

from __future__ import annotations

from ..kernels.step_spec import FusedPolicy
from .base import Policy, StepTensors, check_int, register


class OeaPolicy(Policy):
    name = "oea"
    fields = ("oea_k0",)

    def validate(self, cfg):
        """``oea_k0`` an int >= 1."""
        check_int("oea_k0", cfg.oea_k0, minimum=1)

    def resolve(self, cfg, num_experts, top_k, moe_layers=1):
        return min(cfg.oea_k0, top_k)

    def critical_set(self, params, ops, step: StepTensors):
        return ops.oea_critical_set(step.scores, params, vote=step.vote, seed=step.seed, topk_idx=step.topk_idx)

    def device_policy(self, params):
        return FusedPolicy("oea", k0=params)


register(OeaPolicy())
