"""The routing policies (LYNX, OEA, none) on plain tensors.

``remap`` takes a decode step's router selection scores and the model's own top-k and returns the
remapped top-k (or ``None`` when the policy leaves routing unchanged). The step math lives in
:mod:`lynx_hf.kernels.routing_naive` (torch) and :mod:`lynx_hf.kernels.routing` (Triton), which are
tested to agree exactly; this module only picks parameters and the backend.
"""

from __future__ import annotations

import math

import torch

from .config import LynxConfig
from .kernels import routing_naive as naive


def bin_parameters(cfg: LynxConfig, num_experts: int, top_k: int) -> tuple[float, int]:
    """``(alpha, beta)`` for a layer: the config's values, or the k/N-derived defaults."""
    alpha, beta = naive.default_lynx_bins(num_experts, top_k)
    if cfg.alpha is not None:
        alpha = float(cfg.alpha)
    if cfg.beta is not None:
        beta = int(cfg.beta)
    return alpha, beta


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (see ``kernels.dispatch``).

    Raises ``RuntimeError`` for ``backend="triton"`` on CPU without ``TRITON_INTERPRET=1``.
    """
    from .kernels.dispatch import resolve_backend

    return resolve_backend(backend, device) == "triton"


def _ops(backend: str, device: torch.device):
    if not use_triton(backend, device):
        return naive.naive_lynx_critical_set, naive.naive_oea_critical_set, naive.naive_remap_topk
    from .kernels import routing  # imports triton: only when the Triton path is taken

    return routing.lynx_critical_set, routing.oea_critical_set, routing.remap_topk


def critical_set(
    cfg: LynxConfig,
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    top_k: int,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Critical set ``[N]`` bool for one decode step, or ``None`` for policy ``"none"``.

    ``scores [T, N]`` fp32 selection scores (``-inf`` = forbidden), ``topk_idx [T, k]`` int64 the
    model's own selection, ``topk_weights [T, k]`` its weights (needed only for ``mass_floor``).
    LYNX: DESIGN.md steps 1-4, plus the experts ``mass_floor`` keeps; OEA: union of each token's
    top-``k0``. Raises ``ValueError`` when ``mass_floor > 0`` and no weights are given.
    """
    if cfg.policy == "none":
        return None
    lynx_op, oea_op, _ = _ops(cfg.backend, scores.device)
    num_experts = scores.shape[-1]
    if cfg.policy == "oea":
        return oea_op(scores, min(cfg.k0, top_k))
    alpha, beta = bin_parameters(cfg, num_experts, top_k)
    if cfg.mass_price is None:
        critical = lynx_op(scores, topk_idx, top_k, alpha, beta, cfg.tau, scores.shape[0])
    else:  # cover only (no consensus, grow to 1), then grow by routing mass (torch; small [T, N] ops)
        critical = lynx_op(scores, topk_idx, 1, alpha, beta, math.inf, scores.shape[0])
        critical = naive.naive_mass_greedy_grow(scores, topk_idx, critical, top_k, cfg.mass_price)
    if cfg.mass_floor > 0:
        if topk_weights is None:
            raise ValueError("LynxConfig.mass_floor > 0 needs the model's own top-k weights")
        critical = critical | naive.naive_mass_floor_set(topk_idx, topk_weights, num_experts, cfg.mass_floor)
    return critical


def remap(
    cfg: LynxConfig,
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    logits: torch.Tensor | None = None,
    rule: str | None = None,
    renormalize: bool = False,
    scale: float = 1.0,
    topk_weights: torch.Tensor | None = None,
):
    """Remapped top-k ``[T, k]`` int64 (each row ``k`` distinct allowed experts), or ``None``.

    ``scores [T, N]`` must be fp32 and finite wherever the expert is allowed (callers fall back to
    the model's own routing otherwise). With ``rule`` (a ``WEIGHT_RULES`` name) returns
    ``(idx, weights [T, k] fp32)`` with the weights recomputed from ``logits`` by that rule (fused
    into the remap kernel on the Triton path). ``topk_weights`` (the model's own) serve
    ``LynxConfig.mass_floor``. Raises ``ValueError`` if a row has fewer than k
    allowed experts.
    """
    top_k = topk_idx.shape[-1]
    critical = critical_set(cfg, scores, topk_idx, top_k, topk_weights)
    if critical is None:
        return None
    if rule is None:
        return _ops(cfg.backend, scores.device)[2](scores, critical, top_k)
    logits = scores if logits is None else logits.float()
    if use_triton(cfg.backend, scores.device):
        from .kernels import routing

        return routing.remap_topk(scores, critical, top_k, logits=logits, rule=rule, renormalize=renormalize,
                                  scale=scale)
    idx = naive.naive_remap_topk(scores, critical, top_k)
    return idx, naive.naive_routing_weights(logits, idx, rule, renormalize, scale)
