"""Routing policies: which experts a decode step keeps (the *critical set*), on plain tensors.

A policy is one module here plus one entry in :data:`REGISTRY` (``register``). It sees a decode step
as :class:`StepTensors` and returns the critical set ``S [N]`` bool; the core (``lynx_hf.core``)
then remaps every decode token to its top-k restricted to ``S`` (``ops.remap_topk``) and recomputes
the routing weights with the family's rule. Policies never see prefill-only forwards; in a mixed
step the prefill tokens arrive as ``seed`` (experts loaded anyway) and do not vote.

``ops`` is the kernel backend the plan resolved (``kernels.backend.routing_ops``): the torch ops of
:mod:`lynx_hf.kernels.routing_torch`, their numba twins (CPU, eager) or the Triton twins in
:mod:`lynx_hf.kernels.routing` (same function names, same integers).

Each policy validates its own ``LynxConfig`` fields (:meth:`Policy.validate`, called by ``LynxConfig`` for
every registered policy); the ``check_*`` helpers below are shared with ``LynxConfig``'s generic fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LynxConfigError


# -- field checks (raise LynxConfigError naming the LynxConfig field) ------------------------------------------
def check_choice(name: str, value, allowed) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise LynxConfigError(f"LynxConfig.{name} must be one of {tuple(allowed)}, got {value!r}")


def check_number(name: str, value) -> None:
    """A real number (an int or a float, not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise LynxConfigError(f"LynxConfig.{name} must be a real number, got {value!r}")


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LynxConfigError(f"LynxConfig.{name} must be an int >= {minimum}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise LynxConfigError(f"LynxConfig.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class StepTensors:
    """One MoE layer's decode step, as a policy sees it.

    - ``scores [T, N]`` fp32 selection scores (``-inf``: the model forbids the expert);
    - ``topk_idx [T, k]`` int64 and ``topk_weights [T, k]`` (model dtype): the model's own routing;
    - ``vote [T]`` bool or ``None`` (every row): the tokens whose routing the policy decides;
    - ``seed [N]`` bool or ``None``: experts loaded anyway this step (prefill tokens' experts);
    - ``top_k``: k of the layer.
    """

    scores: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    vote: torch.Tensor | None
    seed: torch.Tensor | None
    top_k: int


class Policy:
    """Base class. ``name`` is the ``LynxConfig.policy`` value; ``remaps`` is False only for ``none``."""

    name: str = ""
    remaps: bool = True
    #: with a single token in the step the critical set holds its own top-k, so its routing is unchanged
    #: (true of every shipped policy); the core then skips the policy for one-token steps
    single_token_identity: bool = True
    #: the ``LynxConfig`` fields this policy reads (and validates)
    fields: tuple[str, ...] = ()

    def validate(self, cfg) -> None:
        """Check this policy's own fields of ``cfg`` (a ``LynxConfig`` under construction); raise
        :class:`~lynx_hf.LynxConfigError` naming the field. Called for every registered policy, whichever
        ``cfg.policy`` is, so a config is valid as a whole."""

    def resolve(self, cfg, num_experts: int, top_k: int):
        """Per-layer parameters, computed once at patch time (``None`` if there are none)."""
        return None

    def critical_set(self, params, ops, step: StepTensors) -> torch.Tensor:
        raise NotImplementedError

    def fused_decode(self, params, ops):
        """A callable doing this policy's whole decode step in one call (critical set, remap, weight rule,
        telemetry row), used by the core on CPU in eager mode for steps where every token decodes; ``None``
        (the default) when the policy has none for ``params`` / ``ops``. Signature and return value:
        :func:`lynx_hf.kernels.routing_cpu.lynx_mass_decode` without its keyword parameters."""
        return None


REGISTRY: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    """Add ``policy`` under ``policy.name`` (replacing an earlier one of that name) and return it."""
    REGISTRY[policy.name] = policy
    return policy


def get(name: str) -> Policy:
    """The registered policy ``name``. Raises ``KeyError`` listing the registered names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; registered: {sorted(REGISTRY)}") from None


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


class NonePolicy(Policy):
    """The model's own routing (decode bit-identical to unpatched); telemetry only."""

    name = "none"
    remaps = False


register(NonePolicy())


def _ops(cfg, scores):
    from ..kernels.backend import resolve_backend, routing_ops
    from ..kernels.routing_torch import host_reads_allowed

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
    for a policy that does not remap. With ``rule`` (a ``WEIGHT_RULES`` name) returns ``(idx, weights
    [T, k] fp32)`` recomputed from ``logits`` (default ``scores``) by that rule. The core applies it
    only to decode rows; this function remaps every row.
    """
    top_k = topk_idx.shape[-1]
    critical = critical_set(cfg, scores, topk_idx, top_k, topk_weights, vote, seed)
    if critical is None:
        return None
    ops = _ops(cfg, scores)
    idx, weights = ops.remap(scores, critical, top_k, scores if logits is None else logits.float(),
                             rule or "softmax_all", renormalize, scale)
    return idx if rule is None else (idx, weights)

from . import lynx as _lynx  # noqa: E402,F401  (registers "lynx")
from . import oea as _oea  # noqa: E402,F401  (registers "oea")
from . import xshare as _xshare  # noqa: E402,F401  (registers "xshare")
