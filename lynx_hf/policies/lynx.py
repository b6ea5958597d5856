"""LYNX (Gupta et al., arXiv 2411.08982, Sec. 4), as DESIGN.md "The LYNX policy" specifies it, with the
project's two extensions (``LynxConfig`` documents each field):

- the paper's rule (``mass_price=None``): affinity bins from k/N, exponential batch score, cover +
  consensus (``tau``) + grow by score to k;
- routing-mass growth (``mass_price`` set, the default): the cover, then the expert that restores the
  most routing mass joins while it restores at least ``mass_price`` tokens' worth (greedy);
- ``mass_floor``: each token keeps its own highest-weight experts up to that share of its top-k mass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..kernels.routing_torch import default_lynx_bins
from . import Policy, StepTensors, register


@dataclass(frozen=True)
class LynxParams:
    alpha: float
    beta: int
    tau: float
    mass_price: float | None
    mass_floor: float
    price_unit: str


def bin_parameters(cfg, num_experts: int, top_k: int) -> tuple[float, int]:
    """``(alpha, beta)`` for a layer: the config's values, or the k/N-derived defaults."""
    alpha, beta = default_lynx_bins(num_experts, top_k)
    if cfg.alpha is not None:
        alpha = float(cfg.alpha)
    if cfg.beta is not None:
        beta = int(cfg.beta)
    return alpha, beta


class LynxPolicy(Policy):
    name = "lynx"
    fields = ("alpha", "beta", "tau", "mass_price", "mass_floor")

    def resolve(self, cfg, num_experts, top_k):
        alpha, beta = bin_parameters(cfg, num_experts, top_k)
        return LynxParams(alpha, beta, float(cfg.tau), cfg.mass_price, float(cfg.mass_floor),
                          cfg.price_unit)

    def critical_set(self, p: LynxParams, ops, step: StepTensors):
        s, idx, k = step.scores, step.topk_idx, step.top_k
        if p.mass_price is None:
            critical = ops.lynx_critical_set(s, idx, k, p.alpha, p.beta, p.tau, vote=step.vote, seed=step.seed)
        else:  # cover only (no consensus, grow to 1), then grow by routing mass
            critical = ops.lynx_critical_set(s, idx, 1, p.alpha, p.beta, math.inf, vote=step.vote, seed=step.seed)
            critical = ops.mass_greedy_grow(s, idx, critical, k, p.mass_price, vote=step.vote, seed=step.seed,
                                            unit=p.price_unit)
        if p.mass_floor > 0:
            critical = critical | ops.mass_floor_set(idx, step.topk_weights, s.shape[-1], p.mass_floor, vote=step.vote)
        return critical

    def fused_decode(self, p: LynxParams, ops):
        """The default rule (cover, then routing-mass growth; no ``mass_floor``) as one compiled call on CPU
        (``ops.lynx_mass_decode``, the torch backend with numba): same integers as :meth:`critical_set`
        followed by the remap [issue 12: routing overhead at small batches]."""
        fn = getattr(ops, "lynx_mass_decode", None)
        if fn is None or p.mass_price is None or p.mass_floor > 0 or not math.isfinite(p.alpha):
            return None
        return functools.partial(fn, alpha=p.alpha, beta=p.beta, price=p.mass_price, unit=p.price_unit)


register(LynxPolicy())
