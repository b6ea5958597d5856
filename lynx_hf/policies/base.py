"""What every routing policy is built from (``lynx_hf.policies``): :class:`StepTensors` (one decode step as a policy
sees it), :class:`Policy` (the base class), the registry (:func:`register`, :func:`get`, :func:`names`), the policy
``none`` and the ``check_*`` field checks shared with ``LynxConfig``. The policy modules import this, and the package
imports them (each registers itself), so no module imports the package it is in."""

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

    def resolve(self, cfg, num_experts: int, top_k: int, moe_layers: int = 1):
        """Per-layer parameters, computed once at patch time (``None`` if there are none); ``moe_layers``: how many
        MoE layers the model has (``lynx_hf.core.MoELayer.moe_layers``)."""
        return None

    def critical_set(self, params, ops, step: StepTensors) -> torch.Tensor:
        raise NotImplementedError

    def fused_decode(self, params, ops):
        """A callable doing this policy's whole decode step in one call (critical set, remap, weight rule,
        telemetry row), used by the core on CPU in eager mode for steps where every token decodes; ``None``
        (the default) when the policy has none for ``params`` / ``ops``. Signature and return value:
        :func:`lynx_hf.kernels.routing_cpu.lynx_mass_decode` without its keyword parameters."""
        return None

    def device_policy(self, params):
        """This policy under ``params`` as data for the fused device step (``lynx_hf.kernels.step_spec.FusedPolicy``:
        the whole decode step in one Triton launch, ``lynx_hf.core.device_step``), or ``None`` (the default): the
        Triton backend then runs the policy's ops one by one (``lynx_hf.core.remap_step``)."""
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


__all__ = ["StepTensors", "Policy", "REGISTRY", "register", "get", "names", "NonePolicy", "check_choice",
           "check_number", "check_int", "check_bool"]
