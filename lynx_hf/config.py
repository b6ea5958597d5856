"""LynxConfig: the user-facing knobs of the policy, validated at construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from . import policies
from .errors import LynxConfigError

PHASES = ("auto", "decode", "never")
BACKENDS = ("auto", "torch", "triton")
#: largest accepted ``beta``: the score term ``B ** -beta`` of a bin this low is already < 2**-64.
MAX_BETA = 64


@dataclass(frozen=True)
class LynxConfig:
    """Configuration of a patched model.

    Fields (each validated at construction; a bad value raises :class:`LynxConfigError`, a
    ``ValueError`` naming the field):

    - ``policy``: a registered policy (``lynx_hf.policies``): ``"lynx"`` (LYNX, arXiv 2411.08982
      Sec. 4), ``"oea"`` (OEA, arXiv 2511.02237, the baseline) or ``"none"`` (the model's own routing;
      decode is bit-identical to unpatched).
    - ``phase``: ``"auto"`` (decode detected from the KV-cache length, DESIGN.md "Phase detection"),
      ``"decode"`` (every forward is treated as decode: decode emulation), ``"never"`` (never remap).
    - ``alpha``: inverse bin width of the affinity binning (1/nat of logit gap). ``None`` derives it
      from k/N: ``beta / ln(N/k)``. Must be finite and > 0.
    - ``beta``: number of bins below bin 0 that still vote. ``None`` derives ``ceil(log2(N/k)) + 1``.
      Must be an int in ``0..64``. Experts vote iff ``ceil(gap * alpha) >= -beta``.
    - ``tau``: consensus threshold on the exponential batch score (units: one bin-0 vote), used by the
      paper's rule (``mass_price=None``). ``>= 0``. Default 1.0 (every expert that is some token's
      bin-0 choice joins the critical set).
    - ``mass_floor``: LYNX extension (ours, not in the paper): each token also keeps its own
      highest-weight experts until they hold at least this share of its original top-k routing
      weight; 0 (default) disables it, 1 keeps every original expert. In ``[0, 1]``.
    - ``mass_price``: LYNX extension (ours): when set, the critical set is LYNX's cover grown
      greedily by routing mass: an expert of the batch's union joins while the routing mass it
      restores, summed over the batch's tokens (units: one token's whole top-k mass), is at least
      ``mass_price``. This replaces the consensus and grow-by-score steps (``tau`` is then unused).
      Default 0.5: chosen by the Pareto sweep (``eval/sweep.py``, rule: on fixture A at B = 16 the
      fewest unique experts with next-token cross-entropy up <= 1 % relative, over the paper's
      tau/alpha grid and this series), then fixed. ``None`` gives the paper's rule (tau, grow by
      score). ``>= 0``.
    - ``k0``: OEA's kept top-k0 per token, ``>= 1`` (clipped to the layer's k at run time).
    - ``q_max``: outside ``generate``, the largest query length treated as decode when a cache is
      present (1 = plain decode); in continuous batching, the largest per-request query length of a
      decoding request. ``>= 1``. (Inside ``generate`` decode steps are known exactly.)
    - ``verify``: remap the verification forwards of assisted / prompt-lookup decoding (every token
      of a verify forward is decode work). Default True.
    - ``backend``: ``"auto"`` (Triton on CUDA tensors, torch on CPU), ``"torch"``, ``"triton"``.
    - ``telemetry``: collect per-layer statistics in decode (``lynx_hf.stats``).
    """

    policy: str = "lynx"
    phase: str = "auto"
    alpha: float | None = None
    beta: int | None = None
    tau: float = 1.0
    mass_floor: float = 0.0
    mass_price: float | None = 0.5
    k0: int = 1
    q_max: int = 1
    verify: bool = True
    backend: str = "auto"
    telemetry: bool = True

    def __post_init__(self) -> None:
        _choice("policy", self.policy, policies.names())
        _choice("phase", self.phase, PHASES)
        _choice("backend", self.backend, BACKENDS)
        if self.alpha is not None:
            _number("alpha", self.alpha)
            if not (0 < self.alpha < math.inf):
                raise LynxConfigError(f"LynxConfig.alpha must be finite and > 0 (or None), got {self.alpha!r}")
        if self.beta is not None:
            _integer("beta", self.beta, minimum=0)
            if self.beta > MAX_BETA:
                raise LynxConfigError(
                    f"LynxConfig.beta must be <= {MAX_BETA} (B**-beta is below fp32 range long before), got {self.beta!r}"
                )
        _number("tau", self.tau)
        if not (self.tau >= 0) or math.isinf(self.tau):
            raise LynxConfigError(f"LynxConfig.tau must be finite and >= 0, got {self.tau!r}")
        _number("mass_floor", self.mass_floor)
        if not 0.0 <= self.mass_floor <= 1.0:
            raise LynxConfigError(f"LynxConfig.mass_floor must be in [0, 1], got {self.mass_floor!r}")
        if self.mass_price is not None:
            _number("mass_price", self.mass_price)
            if not (0.0 <= self.mass_price < math.inf):
                raise LynxConfigError(f"LynxConfig.mass_price must be finite and >= 0 (or None), got {self.mass_price!r}")
        _integer("k0", self.k0, minimum=1)
        _integer("q_max", self.q_max, minimum=1)
        for name in ("telemetry", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise LynxConfigError(f"LynxConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "LynxConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LynxConfigError(f"unknown LynxConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def _choice(name, value, allowed):
    if not isinstance(value, str) or value not in allowed:
        raise LynxConfigError(f"LynxConfig.{name} must be one of {allowed}, got {value!r}")


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise LynxConfigError(f"LynxConfig.{name} must be a real number, got {value!r}")


def _integer(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LynxConfigError(f"LynxConfig.{name} must be an int >= {minimum}, got {value!r}")
