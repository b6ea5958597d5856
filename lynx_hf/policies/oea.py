"""OEA (Oncescu et al., arXiv 2511.02237, Sec. 3), the baseline: each decode token keeps its own
top-``k0``; the critical set is the union of those (plus the step's seed); the remap then lets each
token "piggyback" on experts already in the set until it has k."""

from __future__ import annotations

from . import Policy, StepTensors, register


class OeaPolicy(Policy):
    name = "oea"
    fields = ("k0",)

    def resolve(self, cfg, num_experts, top_k):
        return min(cfg.k0, top_k)

    def critical_set(self, params, ops, step: StepTensors):
        return ops.oea_critical_set(step.scores, params, vote=step.vote, seed=step.seed)


register(OeaPolicy())
