"""LynxConfig: the user-facing knobs of the policy, validated at construction."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields

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
      Sec. 4), ``"oea"`` (OEA, arXiv 2511.02237, a baseline), ``"xshare"`` (XShare, arXiv 2602.07265,
      a baseline) or ``"none"`` (the model's own routing; decode is bit-identical to unpatched).
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
      Default 0.109375 (7/64) with ``price_unit="sqrt"`` (0.4375 tokens' mass at B = 16): chosen by the Pareto sweep
      (``eval/sweep.py``, rule: on fixture A at B = 16 the fewest unique experts with next-token
      cross-entropy up <= 1 % relative, over the paper's tau/alpha grid and this series; the unit by
      dCE <= 1 % at every B on fixtures A, B, C, ``eval/results/sweep.md``), then fixed. ``None`` gives the paper's rule (tau, grow by
      score). ``>= 0``.
    - ``price_unit``: the unit of ``mass_price``: ``"token"`` (tokens' worth of top-k mass: an expert
      joins while it restores at least ``mass_price`` tokens' mass), ``"batch"`` (a share of the step's
      total mass: at least ``mass_price * B`` tokens' worth, B = voting decode tokens of the step; a
      constant price on the mean mass per token) or ``"sqrt"`` (at least ``mass_price * sqrt(B)`` tokens'
      worth: between the two; an absolute price over-prunes small batches, a per-token one large ones,
      ``eval/results/sweep.md``). The threshold is exact in fixed point (``routing_torch.batch_threshold``).
    - ``k0``: OEA's kept top-k0 per token, ``>= 1`` (clipped to the layer's k at run time).
    - ``xshare_budget`` / ``xshare_fraction`` / ``xshare_warmup``: the XShare baseline (policy
      ``"xshare"``, arXiv 2602.07265): experts per step (an int ``>= 1``, or ``None``: ``ceil(fraction * N)``,
      fraction in ``(0, 1]``), and each token's top-``warmup`` experts kept first (``>= 0``).
    - ``q_max``: outside ``generate``, the largest query length treated as decode when a cache is
      present (1 = plain decode); in continuous batching, the largest per-request query length of a
      decoding request. ``>= 1``. (Inside ``generate`` decode steps are known exactly.)
    - ``verify``: remap the verification forwards of assisted / prompt-lookup decoding (every token
      of a verify forward is decode work). Default True.
    - ``backend``: ``"auto"`` (Triton on CUDA tensors, torch on CPU), ``"torch"``, ``"triton"``.
    - ``telemetry``: collect per-layer statistics in decode (``lynx_hf.stats``).
    """

    policy: str = field(default="lynx", metadata={"help": "routing policy in decode (registered: lynx, oea, xshare, none)"})
    phase: str = field(default="auto", metadata={"help": "auto: decode steps detected; decode: every forward; never"})
    alpha: float | None = field(default=None, metadata={"help": "LYNX inverse bin width (None: from k/N)"})
    beta: int | None = field(default=None, metadata={"help": "LYNX voting bins below bin 0 (None: from k/N)"})
    tau: float = field(default=1.0, metadata={"help": "LYNX consensus threshold (paper rule, mass_price=None)"})
    mass_floor: float = field(default=0.0, metadata={"help": "share of each token's top-k weight it always keeps"})
    mass_price: float | None = field(default=0.109375, metadata={
        "help": "routing-mass growth price in tokens' worth of mass (None: the paper's rule)"})
    price_unit: str = field(default="sqrt", metadata={
        "help": "mass_price unit: token (tokens' worth of mass), batch (x B decode tokens) or sqrt (x sqrt(B))"})
    k0: int = field(default=1, metadata={"help": "OEA: experts each token keeps"})
    xshare_budget: int | None = field(default=None, metadata={"help": "XShare: experts per step (None: fraction)"})
    xshare_fraction: float = field(default=0.5, metadata={"help": "XShare: budget as a fraction of N"})
    xshare_warmup: int = field(default=1, metadata={"help": "XShare: each token's top experts kept first"})
    q_max: int = field(default=1, metadata={"help": "longest query treated as decode outside generate"})
    verify: bool = field(default=True, metadata={"help": "remap verification forwards (assisted / prompt lookup)"})
    backend: str = field(default="auto", metadata={"help": "kernels: auto (Triton on CUDA), torch, triton"})
    telemetry: bool = field(default=True, metadata={"help": "collect decode statistics (lynx_hf.stats)"})

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
        _choice("price_unit", self.price_unit, ("token", "batch", "sqrt"))
        if self.xshare_budget is not None:
            _integer("xshare_budget", self.xshare_budget, minimum=1)
        _number("xshare_fraction", self.xshare_fraction)
        if not 0.0 < self.xshare_fraction <= 1.0:
            raise LynxConfigError(f"LynxConfig.xshare_fraction must be in (0, 1], got {self.xshare_fraction!r}")
        _integer("xshare_warmup", self.xshare_warmup, minimum=0)
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

    @classmethod
    def from_options(cls, values: dict, base: "LynxConfig | None" = None) -> "LynxConfig":
        """A config from command-line style options: every value may be a string (``"0.5"``, ``"None"``,
        ``"true"``) or already typed; strings are parsed by the field's type (:func:`parse_option`).
        The one parsing path of the CLI (``lynx-hf``) and the lm-eval ``lynx`` model's ``model_args``.
        ``base`` supplies the other fields (default ``LynxConfig()``). Raises :class:`LynxConfigError`.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LynxConfigError(f"unknown LynxConfig field(s) {unknown}; known: {sorted(known)}")
        parsed = {name: parse_option(name, value) for name, value in values.items()}
        return cls.from_dict({**(base or cls()).to_dict(), **parsed})


_NONE_WORDS = ("none", "null")
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def field_types() -> dict[str, tuple[type, bool]]:
    """``{field: (base type, accepts None)}`` of :class:`LynxConfig`."""
    hints = typing.get_type_hints(LynxConfig)
    out = {}
    for f in fields(LynxConfig):
        args = typing.get_args(hints[f.name])
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hints[f.name])
        out[f.name] = (base, optional)
    return out


def parse_option(name: str, value):
    """Parse one option value for field ``name``: strings by the field's type (``"None"`` / ``"null"``
    -> ``None`` for optional fields; ``"true"`` / ``"false"`` for bools; numbers); other values as they
    are. Raises :class:`LynxConfigError` naming the field for an unparsable string."""
    if not isinstance(value, str):
        return value
    base, optional = field_types()[name]
    text = value.strip()
    if optional and text.lower() in _NONE_WORDS:
        return None
    try:
        if base is bool:
            return _BOOL_WORDS[text.lower()]
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except (KeyError, ValueError):
        raise LynxConfigError(f"LynxConfig.{name}: cannot parse {value!r} as {base.__name__}"
                              f"{' or None' if optional else ''}") from None
    return text


def _choice(name, value, allowed):
    if not isinstance(value, str) or value not in allowed:
        raise LynxConfigError(f"LynxConfig.{name} must be one of {allowed}, got {value!r}")


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise LynxConfigError(f"LynxConfig.{name} must be a real number, got {value!r}")


def _integer(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LynxConfigError(f"LynxConfig.{name} must be an int >= {minimum}, got {value!r}")
