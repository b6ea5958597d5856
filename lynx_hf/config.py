"""LynxConfig: the user-facing knobs of the policy, validated at construction.

Generic fields are checked here; each policy checks its own (``Policy.validate``, ``lynx_hf.policies``).
A ``LynxConfig`` is a plain value: nothing in it reads the environment. The entry points that build one from a
partial set of options (``lynx_hf.patch``, :meth:`LynxConfig.from_options` / :meth:`~LynxConfig.from_file`: the CLI,
lm-eval's ``model_args``, the vLLM plugin) start from :meth:`LynxConfig.from_environment`, where ``LYNX_HF_GATE``
sets ``gate``.
"""

from __future__ import annotations

import json
import os
import re
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from . import policies
from .errors import LynxConfigError
from .kernels.backend import EXPERT_PATHS, ROUTING_BACKENDS
from .policies import check_bool, check_choice, check_int
from .telemetry import COUNTS as TELEMETRY_COUNTS

PHASES = ("auto", "decode")
OFFLOAD_PATHS = ("experts", "module")  # LynxConfig.offload_path (lynx_hf.offload)
#: ``LynxConfig.gate`` values: ``"auto"`` (the cost gate, ``lynx_hf.gate``, decides per layer shape and step size),
#: ``"always"`` (the policy runs on every decode step: reproducible, timing-independent)
GATES = ("auto", "always")
#: environment variable read by the entry points that build a config from options (:meth:`LynxConfig.from_environment`):
#: the ``gate`` of a config whose options do not name one (``always`` forces the policy on: tests, accuracy work)
GATE_ENV = "LYNX_HF_GATE"
#: the one key of a config file (:meth:`LynxConfig.to_file`) that is not a field: free-form notes on what made
#: the file (``lynx-hf sweep`` records the sweep's numbers there); ignored by :meth:`LynxConfig.from_file`
FILE_NOTE_KEY = "_about"


@dataclass(frozen=True)
class LynxConfig:
    """Configuration of a patched model.

    Fields (each validated at construction; a bad value raises :class:`LynxConfigError`, a
    ``ValueError`` naming the field). Each is described here once: the CLI's ``--<field>`` help is the first
    sentence of its entry (:func:`field_help`), the table in ``docs/policies.md`` the whole entry
    (:func:`fields_markdown`).

    - ``policy``: a registered policy (``lynx_hf.policies``): ``"lynx"`` (LYNX, arXiv 2411.08982
      Sec. 4), ``"oea"`` (OEA, arXiv 2511.02237, a baseline), ``"xshare"`` (XShare, arXiv 2602.07265,
      a baseline) or ``"none"`` (the model's own routing; decode is bit-identical to unpatched).
    - ``phase``: ``"auto"`` (the decode tokens of each forward are detected, ``docs/decode-step.md``) or
      ``"decode"`` (every forward is treated as decode: decode emulation). ``"never"`` was
      removed: use ``policy="none"`` (telemetry, no remap) or :func:`lynx_hf.unpatch`.
    - ``alpha``: LYNX, inverse bin width of the affinity binning (1/nat of logit gap). ``None`` derives it
      from k/N: ``beta / ln(N/k)``. Must be finite and > 0.
    - ``beta``: LYNX, number of bins below bin 0 that still vote. ``None`` derives ``ceil(log2(N/k)) + 1``.
      Must be an int in ``0..64``. Experts vote iff ``ceil(gap * alpha) >= -beta``.
    - ``tau``: LYNX consensus threshold on the exponential batch score (units: one bin-0 vote), used by the
      paper's rule (``mass_price=None``). ``>= 0``. Default 1.0 (every expert that is some token's
      bin-0 choice joins the critical set).
    - ``mass_price``: LYNX extension (ours): when set, the critical set is LYNX's cover grown
      greedily by routing mass: an expert of the batch's union joins while the routing mass it
      restores, summed over the batch's tokens (units: one token's whole top-k mass), is at least
      ``mass_price``. This replaces the consensus and grow-by-score steps (``tau`` is then unused).
      Default 0.109375 (7/64) with ``price_unit="sqrt"`` (0.4375 tokens' mass at B = 16): chosen by the Pareto
      sweep (``eval/sweep.py``, rule: on fixture A at B = 16 the fewest unique experts with next-token
      cross-entropy up <= 1 % relative, over the paper's tau/alpha grid and this series; the unit by
      dCE <= 1 % at every B on fixtures A, B, C, ``eval/results/sweep.md``), then fixed. ``None`` gives the
      paper's rule (tau, grow by score). ``>= 0``.
    - ``price_unit``: LYNX, the unit of ``mass_price``: ``"token"`` (tokens' worth of top-k mass: an expert
      joins while it restores at least ``mass_price`` tokens' mass), ``"batch"`` (a share of the step's
      total mass: at least ``mass_price * B`` tokens' worth, B = voting decode tokens of the step; a
      constant price on the mean mass per token) or ``"sqrt"`` (at least ``mass_price * sqrt(B)`` tokens'
      worth: between the two; an absolute price over-prunes small batches, a per-token one large ones,
      ``eval/results/sweep.md``). The threshold is exact in fixed point (``routing_torch.batch_threshold``).
    - ``price_ref_layers``: LYNX extension (ours): a model with ``L`` MoE layers, more than this, uses the
      routing-mass price ``mass_price * price_ref_layers / L`` on every layer (``None``: no scaling). It is the depth
      ``mass_price`` was chosen at; each layer's remap perturbs
      the residual stream and the perturbations add up over the layers, so a deeper model may move less routing mass
      per layer (a lower price keeps more experts). Default 4, the MoE layers of the fixtures the price was chosen on
      (A, B; C has 3): the identity there. Chosen on training-split text of the 30-layer fixture D2 and confirmed on
      held-out text (``docs/results.md``, "A default that keeps its promise"). ``None``: the price as given at any
      depth. An int ``>= 1`` or ``None``.
    - ``oea_k0``: OEA's kept top-k0 per token, ``>= 1`` (clipped to the layer's k at run time; at or above
      every layer's k OEA changes nothing, and ``patch`` warns).
    - ``xshare_budget``: XShare (policy ``"xshare"``, arXiv 2602.07265, a baseline): experts per step, an int
      ``>= 1``, or ``None``: ``ceil(xshare_fraction * N)``.
    - ``xshare_fraction``: XShare: the budget as a fraction of N when ``xshare_budget`` is ``None``, in ``(0, 1]``.
    - ``xshare_warmup``: XShare: each token's top-``xshare_warmup`` experts are kept first, an int ``>= 0``.
    - ``q_max``: outside ``generate``, the largest query length treated as decode when a cache is
      present (1 = plain decode); in continuous batching, the largest per-request query length of a
      decoding request. ``>= 1``. (Inside ``generate`` decode steps are known exactly.)
    - ``verify``: remap the verification forwards of assisted / prompt-lookup decoding (every token
      of a verify forward is decode work). Default True.
    - ``routing_backend``: which routing ops run: ``"auto"`` (Triton on CUDA tensors, torch on CPU),
      ``"torch"`` or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).
    - ``expert_path``: what computes the routed experts in decode: ``"auto"`` (on CUDA the sparse Triton decode
      kernel for steps of at least 4 tokens, ``lynx_hf.core.AUTO_KERNEL_MIN_TOKENS``, measured on an H200;
      otherwise the model's own experts implementation, transformers' ``grouped_mm`` on CUDA), ``"model"``
      (the model's own, never a kernel of ours) or ``"triton"`` (the sparse Triton decode kernel for every
      decode step, ``lynx_hf.kernels.moe``; CUDA, or the interpreter).
    - ``telemetry``: collect per-layer statistics in decode (``lynx_hf.stats``): ``True`` (every key), ``"counts"``
      (the cheaper counting mode: decode steps, unique experts before / after and the token counts only;
      ``remapped_fraction`` and ``routing_mass_kept`` read ``None``, so the routing weights are never read) or
      ``False`` (none).
    - ``offload_path``: experts that accelerate offloads (CPU / disk offload, ``lynx_hf.offload``): ``"experts"``
      (default: a decode step reads only the rows of the unique experts its routing uses from the offload store)
      or ``"module"`` (accelerate's own whole-module load on every forward). Prefill always runs accelerate's.
    - ``expert_cache_bytes``: per offloaded MoE layer, bytes of expert weights kept resident on the execution
      device between decode steps (least recently used replaced; resident experts seed the critical set of a
      remapping policy). ``0`` (default): no cache. An int ``>= 0``.
    - ``gate``: the cost gate (``lynx_hf.gate``; the paper's phase-aware optimizer, arXiv 2411.08982, extended from
      phase to cost): ``"auto"`` runs the policy on a decode step of T tokens only where the expected saving
      (experts saved x one expert's time on this device) beats the routing cost, per layer and T, from decisions
      keyed by what the step runs (a table, the per-user cache, else measured once per machine and stored; a
      host-side lookup on the static T); ``"always"`` runs it on every decode step (reproducible: accuracy work).
      Default ``"auto"``; where a config is built from options that do not name ``gate`` (``lynx_hf.patch(model)``,
      ``patch(model, policy=...)``, a config file or dict, ``lynx-hf generate``, the vLLM plugin), the environment
      variable ``LYNX_HF_GATE`` (e.g. ``LYNX_HF_GATE=always``) sets it (:meth:`LynxConfig.from_environment`);
      ``lynx-hf eval`` / ``sweep`` and the lm-eval model use ``"always"``.
    - ``gate_table``: a decision table of the cost gate (``lynx_hf.gate.table``; written by ``lynx-hf tune``), a
      path, read before the tables lynx_hf ships and the per-user cache; ``None`` (default): those alone.

    Raises :class:`LynxConfigError` for a bad value or ``phase="never"``.
    """

    policy: str = "lynx"
    phase: str = "auto"
    alpha: float | None = None
    beta: int | None = None
    tau: float = 1.0
    mass_price: float | None = 0.109375
    price_unit: str = "sqrt"
    price_ref_layers: int | None = 4
    oea_k0: int = 1
    xshare_budget: int | None = None
    xshare_fraction: float = 0.5
    xshare_warmup: int = 1
    q_max: int = 1
    verify: bool = True
    routing_backend: str = "auto"
    expert_path: str = "auto"
    telemetry: bool | str = True
    gate: str = "auto"
    gate_table: str | None = None
    offload_path: str = "experts"
    expert_cache_bytes: int = 0

    def __post_init__(self) -> None:
        if self.phase == "never":
            raise LynxConfigError('LynxConfig.phase="never" was removed: use policy="none" (the model\'s own '
                                  'routing, telemetry kept) or lynx_hf.unpatch(model)')
        check_choice("policy", self.policy, policies.names())
        check_choice("phase", self.phase, PHASES)
        check_choice("routing_backend", self.routing_backend, ROUTING_BACKENDS)
        check_choice("expert_path", self.expert_path, EXPERT_PATHS)
        check_choice("gate", self.gate, GATES)
        if self.gate_table is not None:
            if isinstance(self.gate_table, os.PathLike):
                object.__setattr__(self, "gate_table", os.fspath(self.gate_table))
            if not isinstance(self.gate_table, str) or not self.gate_table:
                raise LynxConfigError(f"LynxConfig.gate_table must be a path (str) or None, got {self.gate_table!r}")
        check_int("q_max", self.q_max, minimum=1)
        check_choice("offload_path", self.offload_path, OFFLOAD_PATHS)
        check_int("expert_cache_bytes", self.expert_cache_bytes, minimum=0)
        if not isinstance(self.telemetry, bool) and self.telemetry != TELEMETRY_COUNTS:
            raise LynxConfigError(f"LynxConfig.telemetry must be True, False or {TELEMETRY_COUNTS!r}, "
                                  f"got {self.telemetry!r}")
        check_bool("verify", self.verify)
        for policy in policies.REGISTRY.values():  # every policy's own fields, whichever policy is chosen
            policy.validate(self)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict, base: "LynxConfig | None" = None) -> "LynxConfig":
        """A config from ``{field: value}``; ``base`` supplies the fields left out (default: the defaults; the
        environment is not read). Raises :class:`LynxConfigError` for an unknown field or a bad value."""
        _check_names(values)
        if base is not None:
            values = {**base.to_dict(), **values}
        return cls(**values)

    @classmethod
    def from_options(cls, values: dict, base: "LynxConfig | None" = None) -> "LynxConfig":
        """A config from command-line style options: every value may be a string (``"0.5"``, ``"None"``,
        ``"true"``) or already typed; strings are parsed by the field's type (:func:`parse_option`).
        The one parsing path of the CLI (``lynx-hf``), the lm-eval ``lynx`` model's ``model_args`` and the
        vLLM plugin. ``base`` supplies the other fields (default :meth:`from_environment`: the defaults, ``gate``
        from ``LYNX_HF_GATE`` where set). Raises :class:`LynxConfigError`.
        """
        _check_names(values)
        parsed = {name: parse_option(name, value) for name, value in values.items()}
        return cls(**{**(base or cls.from_environment()).to_dict(), **parsed})

    @classmethod
    def from_environment(cls) -> "LynxConfig":
        """The defaults, with ``gate`` from the environment variable :data:`GATE_ENV` (``LYNX_HF_GATE``) where it is
        set: the base of every entry point that builds a config from options not naming ``gate`` (``lynx_hf.patch``
        without a ``LynxConfig``, :meth:`from_options`, :meth:`from_file`: ``lynx-hf``, lm-eval's ``model_args``, the
        vLLM plugin). ``LynxConfig()`` itself never reads the environment. Raises :class:`LynxConfigError` naming the
        variable for a value other than ``auto`` / ``always``."""
        value = os.environ.get(GATE_ENV, "").strip()
        if not value:
            return cls()
        if value not in GATES:
            raise LynxConfigError(f"LynxConfig.gate must be one of {GATES}, got {value!r} from the environment "
                                  f"variable {GATE_ENV} (unset it, or set it to 'auto' or 'always')")
        return cls(gate=value)

    @classmethod
    def from_file(cls, path: str | os.PathLike, base: "LynxConfig | None" = None) -> "LynxConfig":
        """A config from a JSON file holding one object of fields (what :meth:`to_file` and ``lynx-hf sweep``
        write): ``{"policy": "lynx", "mass_price": 0.109375, ...}``. Fields left out take ``base``'s values
        (default ``LynxConfig()``); values may be JSON-typed or strings, parsed as by :meth:`from_options`; the key
        ``"_about"`` (:data:`FILE_NOTE_KEY`, notes on what made the file) is ignored; a name that is no field (a
        former name such as ``k0`` or ``backend`` included) is refused.

        The one file format of ``lynx_hf.patch(model, "lynx_config.json")``, ``lynx-hf generate --config``,
        lm-eval's ``model_args=...,lynx_config=FILE`` and the vLLM plugin's ``config_file``.

        Raises ``FileNotFoundError`` when ``path`` is not a file and :class:`LynxConfigError` (its message
        starts with the path) when the file is not JSON, not an object, or has an unknown or invalid field
        (named).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no LynxConfig file at {path}")
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LynxConfigError(f"{path}: not a JSON file ({exc})") from None
        if not isinstance(values, dict):
            raise LynxConfigError(f"{path}: expected a JSON object of LynxConfig fields, got {type(values).__name__}")
        values = {name: value for name, value in values.items() if name != FILE_NOTE_KEY}
        try:
            return cls.from_options(values, base=base)
        except LynxConfigError as exc:
            raise LynxConfigError(f"{path}: {exc}") from None

    def to_file(self, path: str | os.PathLike, about: dict | str | None = None) -> Path:
        """Write every field of this config to ``path`` as a JSON object (all fields, so a later change of a
        default does not change what the file means); ``about``, if given, is stored under ``"_about"``
        (ignored when read). Returns the path; :meth:`from_file` reads it back to an equal config."""
        path = Path(path)
        data = self.to_dict()
        if about is not None:
            data[FILE_NOTE_KEY] = about
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        return path


def _check_names(values) -> None:
    """Raise :class:`LynxConfigError` for a name that is no field (listing the fields)."""
    known = {f.name for f in fields(LynxConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LynxConfigError(f"unknown LynxConfig field(s) {unknown}; known: {sorted(known)}")


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


_BULLET = re.compile(r"^    - ``(\w+)``: ")
_ROLE = re.compile(r":\w+:`~?([^`]+)`")


def field_docs() -> dict[str, str]:
    """``{field: its entry in the LynxConfig docstring}``, in reStructuredText (one line, continuation lines joined),
    in the docstring's order. The one description of each field (module tests check every field has exactly one)."""
    out, name = {}, None
    for line in (LynxConfig.__doc__ or "").splitlines():
        found = _BULLET.match(line)
        if found:
            name = found.group(1)
            out[name] = line[found.end():].strip()
        elif name is not None and line.startswith("      ") and line.strip():
            out[name] += " " + line.strip()
        else:
            name = None
    return out


def _markdown(text: str) -> str:
    """reStructuredText inline markup as markdown: ``x`` -> `x`, :role:`x` -> `x`."""
    return _ROLE.sub(r"`\1`", text).replace("``", "`")


def field_help(name: str) -> str:
    """The first sentence of field ``name``'s entry (:func:`field_docs`) in plain text: the ``lynx-hf`` option's help.
    Raises ``KeyError`` for a field without an entry."""
    plain = _markdown(field_docs()[name]).replace("`", "")
    return re.split(r"(?<=[.)])\s+(?=[A-Z])", plain, maxsplit=1)[0]


def fields_markdown() -> str:
    """The markdown table of every field (name, default, its whole entry), as ``docs/policies.md`` has it."""
    docs = field_docs()
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in fields(LynxConfig):
        default = f'`"{f.default}"`' if isinstance(f.default, str) else f"`{f.default!r}`"
        meaning = _markdown(docs[f.name]).replace("|", "\\|")
        rows.append(f"| `{f.name}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


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
            if name == "telemetry" and text.lower() not in _BOOL_WORDS:
                return text  # telemetry="counts" (validated by LynxConfig)
            return _BOOL_WORDS[text.lower()]
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except (KeyError, ValueError):
        raise LynxConfigError(f"LynxConfig.{name}: cannot parse {value!r} as {base.__name__}"
                              f"{' or None' if optional else ''}") from None
    return text
