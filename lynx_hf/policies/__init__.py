"""Routing policies: which experts a decode step keeps (the *critical set*), on plain tensors.

A policy is one module here (built on :mod:`lynx_hf.policies.base`, registering itself with ``register``) plus one
import line below. It sees a decode step
as :class:`StepTensors` and returns the critical set ``S [N]`` bool; the core (``lynx_hf.core``)
then remaps every decode token to its top-k restricted to ``S`` (``ops.remap``; equal scores prefer the
token's own experts, then the lower id) and recomputes the routing weights with the family's rule. Policies never see prefill-only forwards; in a mixed
step the prefill tokens arrive as ``seed`` (experts loaded anyway) and do not vote.

``ops`` is the kernel backend the plan resolved (``kernels.backend.routing_ops``): the torch ops of
:mod:`lynx_hf.kernels.routing_torch`, their numba twins (CPU, eager) or the Triton twins in
:mod:`lynx_hf.kernels.routing` (same function names, same integers).

Each policy validates its own ``LynxConfig`` fields (:meth:`Policy.validate`, called by ``LynxConfig`` for
every registered policy); the ``check_*`` helpers (:mod:`lynx_hf.policies.base`) are shared with ``LynxConfig``'s
generic fields.
"""

from __future__ import annotations

import torch

from ..kernels.backend import resolve_backend, routing_ops
from ..kernels.routing_torch import host_reads_allowed
from . import lynx, oea, xshare  # noqa: F401  (each registers its policy)
from .base import (
    REGISTRY,
    NonePolicy,
    Policy,
    StepTensors,
    check_bool,
    check_choice,
    check_int,
    check_number,
    get,
    names,
    register,
)


def _ops(cfg, scores):
    return routing_ops(resolve_backend(cfg.routing_backend, scores.device), host=host_reads_allowed(scores))


def critical_set(cfg, scores, topk_idx, top_k=None, topk_weights=None, vote=None, seed=None):
    """Critical set ``[N]`` bool of one decode step under ``cfg`` (a ``LynxConfig``), or ``None`` for a
    policy that does not remap. Plain-tensor API (the core resolves the same things once at patch time).

    ``scores [T, N]`` fp32 selection scores, ``topk_idx [T, k]`` int64 the model's own selection,
    ``topk_weights [T, k]`` its weights (default: uniform), ``vote`` /
    ``seed``: see :class:`StepTensors`. Raises ``KeyError`` for an unregistered policy.
    """
    policy = get(cfg.policy)
    if not policy.remaps:
        return None
    top_k = topk_idx.shape[-1] if top_k is None else top_k
    if topk_weights is None:
        topk_weights = torch.full(topk_idx.shape, 1.0 / top_k, device=scores.device)
    params = policy.resolve(cfg, scores.shape[-1], top_k)
    step = StepTensors(scores, topk_idx.long(), topk_weights, vote, seed, top_k)
    return policy.critical_set(params, _ops(cfg, scores), step)


def remap(cfg, scores, topk_idx, logits=None, rule=None, renormalize=False, scale=1.0, topk_weights=None,
          vote=None, seed=None):
    """Remapped top-k ``[T, k]`` int64 (each row ``k`` distinct allowed experts) for every row, or ``None``
    for a policy that does not remap. ``topk_idx [T, k]``: the model's own top-k ids; on equal scores a row
    prefers them, then the lower id. With ``rule`` (a ``WEIGHT_RULES`` name) returns ``(idx, weights
    [T, k] fp32)`` recomputed from ``logits`` (default ``scores``) by that rule. The core applies it
    only to decode rows; this function remaps every row.
    """
    top_k = topk_idx.shape[-1]
    critical = critical_set(cfg, scores, topk_idx, top_k, topk_weights, vote, seed)
    if critical is None:
        return None
    ops = _ops(cfg, scores)
    idx, weights = ops.remap(scores, critical, top_k, scores if logits is None else logits.float(),
                             rule or "softmax_all", renormalize, scale, topk_idx=topk_idx.long())
    return idx if rule is None else (idx, weights)


__all__ = ["StepTensors", "Policy", "REGISTRY", "register", "get", "names", "NonePolicy", "check_choice",
           "check_number", "check_int", "check_bool", "critical_set", "remap"]
