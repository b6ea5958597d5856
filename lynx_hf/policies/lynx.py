"""LYNX (Gupta et al., arXiv 2411.08982, Sec. 4), as ``docs/design.md`` "The LYNX policy" specifies it, with
the project's extension (``LynxConfig`` documents each field):

- the paper's rule (``mass_price=None``): affinity bins from k/N, exponential batch score, cover +
  consensus (``tau``) + grow by score to k;
- routing-mass growth (``mass_price`` set, the default): the cover, then the expert that restores the
  most routing mass joins while it restores at least ``mass_price`` tokens' worth (greedy; ``price_unit``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..errors import LynxConfigError
from ..kernels.routing_torch import PRICE_UNITS, default_lynx_bins
from ..kernels.step_spec import FusedPolicy
from .base import Policy, StepTensors, check_choice, check_int, check_number, register

#: largest accepted ``beta``: the score term ``B ** -beta`` of a bin this low is already < 2**-64.
MAX_BETA = 64


@dataclass(frozen=True)
class LynxParams:
    alpha: float
    beta: int
    tau: float
    mass_price: float | None  # the price this layer uses (``price_ref_layers`` applied)
    price_unit: str


def bin_parameters(cfg, num_experts: int, top_k: int) -> tuple[float, int]:
    """``(alpha, beta)`` for a layer: the config's values, or the k/N-derived defaults."""
    alpha, beta = default_lynx_bins(num_experts, top_k)
    if cfg.alpha is not None:
        alpha = float(cfg.alpha)
    if cfg.beta is not None:
        beta = int(cfg.beta)
    return alpha, beta


def layer_price(cfg, moe_layers: int) -> float | None:
    """The routing-mass price of a layer of a model with ``moe_layers`` MoE layers: ``mass_price``, times
    ``price_ref_layers / moe_layers`` where the model is deeper than ``price_ref_layers`` (``LynxConfig``)."""
    price, ref = cfg.mass_price, cfg.price_ref_layers
    if price is None or ref is None or moe_layers <= ref:
        return price
    return price * ref / moe_layers


def at_depth(config, moe_layers: int):
    """``config`` with the routing-mass price a model of ``moe_layers`` MoE layers gets, fixed for any depth: for a
    LYNX routing-mass config (``policy="lynx"``, ``mass_price`` set) a copy whose ``mass_price`` is
    :func:`layer_price` ``(config, moe_layers)`` and whose ``price_ref_layers`` is ``None``, so every layer of a model
    of any depth (a 1-2-layer cut of a real shape in a benchmark) runs the price the full model's layers run. Every
    other config (policies ``"oea"`` / ``"xshare"`` / ``"none"``, the paper's rule ``mass_price=None``: no
    routing-mass price) is returned unchanged.

    Args:
        config: a :class:`~lynx_hf.LynxConfig`.
        moe_layers: the MoE layers of the full model (``int >= 1``), e.g. 28 for Qwen2-57B-A14B, 26 for
            DeepSeek-V2-Lite (27 layers, the first dense), 48 for Qwen3-30B-A3B.

    Returns a :class:`~lynx_hf.LynxConfig` (units of ``mass_price`` unchanged: ``price_unit``); with the defaults
    (7/64, ``price_ref_layers=4``) the price is 7/64 for ``moe_layers <= 4`` and ``7/64 * 4 / moe_layers`` above
    (1/64 at 28). Raises :class:`LynxConfigError` when ``moe_layers`` is not an int ``>= 1`` (a bool is refused).

    Example::

        >>> from lynx_hf import LynxConfig, at_depth
        >>> at_depth(LynxConfig(), 28).mass_price, at_depth(LynxConfig(), 28).price_ref_layers
        (0.015625, None)
    """
    if isinstance(moe_layers, bool) or not isinstance(moe_layers, int) or moe_layers < 1:
        raise LynxConfigError(f"at_depth: moe_layers (the full model's MoE layers) must be an int >= 1, "
                              f"got {moe_layers!r}")
    if config.policy != "lynx" or config.mass_price is None:
        return config
    return dataclasses.replace(config, mass_price=layer_price(config, moe_layers), price_ref_layers=None)


class LynxPolicy(Policy):
    name = "lynx"
    fields = ("alpha", "beta", "tau", "mass_price", "price_unit", "price_ref_layers")

    def validate(self, cfg):
        """``alpha`` finite > 0 or None; ``beta`` an int in 0..64 or None; ``tau`` finite >= 0; ``mass_price``
        finite >= 0 or None; ``price_unit`` one of ``PRICE_UNITS``."""
        if cfg.alpha is not None:
            check_number("alpha", cfg.alpha)
            if not (0 < cfg.alpha < math.inf):
                raise LynxConfigError(f"LynxConfig.alpha must be finite and > 0 (or None), got {cfg.alpha!r}")
        if cfg.beta is not None:
            check_int("beta", cfg.beta, minimum=0)
            if cfg.beta > MAX_BETA:
                raise LynxConfigError(
                    f"LynxConfig.beta must be <= {MAX_BETA} (B**-beta is below fp32 range long before), got {cfg.beta!r}"
                )
        check_number("tau", cfg.tau)
        if not (cfg.tau >= 0) or math.isinf(cfg.tau):
            raise LynxConfigError(f"LynxConfig.tau must be finite and >= 0, got {cfg.tau!r}")
        if cfg.mass_price is not None:
            check_number("mass_price", cfg.mass_price)
            if not (0.0 <= cfg.mass_price < math.inf):
                raise LynxConfigError(f"LynxConfig.mass_price must be finite and >= 0 (or None), got {cfg.mass_price!r}")
        check_choice("price_unit", cfg.price_unit, PRICE_UNITS)
        if cfg.price_ref_layers is not None:
            check_int("price_ref_layers", cfg.price_ref_layers, minimum=1)

    def resolve(self, cfg, num_experts, top_k, moe_layers=1):
        alpha, beta = bin_parameters(cfg, num_experts, top_k)
        return LynxParams(alpha, beta, float(cfg.tau), layer_price(cfg, moe_layers), cfg.price_unit)

    def critical_set(self, p: LynxParams, ops, step: StepTensors):
        s, idx, k = step.scores, step.topk_idx, step.top_k
        if p.mass_price is None:
            critical = ops.lynx_critical_set(s, idx, k, p.alpha, p.beta, p.tau, vote=step.vote, seed=step.seed)
        else:  # cover only (no consensus, grow to 1), then grow by routing mass
            critical = ops.lynx_critical_set(s, idx, 1, p.alpha, p.beta, math.inf, vote=step.vote, seed=step.seed)
            critical = ops.mass_greedy_grow(s, idx, critical, k, p.mass_price, vote=step.vote, seed=step.seed,
                                            unit=p.price_unit)
        return critical

    def fused_decode(self, p: LynxParams, ops):
        """The default rule (cover, then routing-mass growth) as one compiled call on CPU
        (``ops.lynx_mass_decode``, the torch backend's numba twins): same integers as :meth:`critical_set`
        followed by the remap, without torch's per-op overhead, which dominates at small batches."""
        fn = getattr(ops, "lynx_mass_decode", None)
        if fn is None or p.mass_price is None or not math.isfinite(p.alpha):
            return None
        return functools.partial(fn, alpha=p.alpha, beta=p.beta, price=p.mass_price, unit=p.price_unit)

    def device_policy(self, p: LynxParams):
        """The default rule (``"lynx_mass"``) or the paper's (``"lynx"``, ``mass_price=None``) for the fused device
        step; ``None`` for infinite bins (``alpha`` inf: k = N, nothing to reduce)."""
        if not math.isfinite(p.alpha):
            return None
        if p.mass_price is None:
            return FusedPolicy("lynx", alpha=p.alpha, beta=p.beta, tau=p.tau)
        return FusedPolicy("lynx_mass", alpha=p.alpha, beta=p.beta, price=p.mass_price, unit=p.price_unit)


register(LynxPolicy())
