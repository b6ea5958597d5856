"""XShare (Vankov et al., arXiv 2602.07265), a peer baseline on the same harness: keep each decode
token's top-``xshare_warmup`` experts, then the experts with the largest total gating score over the
batch until the step holds ``xshare_budget`` experts (default ``xshare_fraction`` of N, as the vLLM pull
request's ``budget_alpha``); each token then takes its top-k inside that set. The sweep traces its
frontier by varying the budget fraction."""

from __future__ import annotations

import math

from ..errors import LynxConfigError
from ..kernels.step_spec import FusedPolicy
from .base import Policy, StepTensors, check_int, check_number, register


class XSharePolicy(Policy):
    name = "xshare"
    fields = ("xshare_budget", "xshare_fraction", "xshare_warmup")

    def validate(self, cfg):
        """``xshare_budget`` an int >= 1 or None; ``xshare_fraction`` in (0, 1]; ``xshare_warmup`` an int >= 0."""
        if cfg.xshare_budget is not None:
            check_int("xshare_budget", cfg.xshare_budget, minimum=1)
        check_number("xshare_fraction", cfg.xshare_fraction)
        if not 0.0 < cfg.xshare_fraction <= 1.0:
            raise LynxConfigError(f"LynxConfig.xshare_fraction must be in (0, 1], got {cfg.xshare_fraction!r}")
        check_int("xshare_warmup", cfg.xshare_warmup, minimum=0)

    def resolve(self, cfg, num_experts, top_k, moe_layers=1):
        budget = cfg.xshare_budget if cfg.xshare_budget is not None else math.ceil(cfg.xshare_fraction * num_experts)
        return min(max(int(budget), 1), num_experts), min(int(cfg.xshare_warmup), top_k)

    def critical_set(self, params, ops, step: StepTensors):
        budget, warmup = params
        return ops.xshare_critical_set(step.scores, step.topk_idx, step.top_k, budget, warmup,
                                       vote=step.vote, seed=step.seed)

    def device_policy(self, params):
        budget, warmup = params
        return FusedPolicy("xshare", budget=budget, warmup=warmup)


register(XSharePolicy())
