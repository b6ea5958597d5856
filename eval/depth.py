"""The routing-mass price a benchmark of a cut runs (issue 52 item 4): ``--full-layers`` of ``lynx_hf.eval.bench``,
``lynx_hf.eval.slo``, ``lab.serve_bench`` and ``lab.gpu_check``.

Those scripts time 1-2-layer cuts of real shapes. The default's routing-mass price depends on the model's MoE depth
(``LynxConfig.price_ref_layers``: ``mass_price * 4 / L`` for L > 4 MoE layers, :func:`lynx_hf.policies.lynx.layer_price`),
so a cut patched with the default runs the price as given (7/64), not the price the full model's layers run (1/64 for
Qwen2-57B-A14B's 28). ``--full-layers`` picks the depth whose price every LYNX routing-mass configuration of the script
runs, through :func:`lynx_hf.at_depth` (the one place the price is worked out):

- ``real`` (the default): the depth of the real model the cut is taken from (:data:`REAL_MOE_LAYERS`);
- an int N >= 1: the price of a model of N MoE layers, for every shape the script runs;
- ``cut``: no change, the price as given on the cut (how every figure before issue 52 was measured).

:func:`options_at_depth` applies it to the option dicts the scripts patch with and pass to vLLM workers
(``additional_config={"lynx": {...}}``); :func:`price_label` is the text the result tables show.
"""

from __future__ import annotations

import argparse

from lynx_hf import LynxConfig, at_depth
from lynx_hf.policies.lynx import layer_price

#: the MoE layers of the real models whose shapes the benchmarks cut (from each public checkpoint's config.json):
#: Qwen2-57B-A14B 28 layers, all MoE; DeepSeek-V2-Lite 27 layers, the first dense (``first_k_dense_replace`` 1);
#: Mixtral-8x7B 32, all MoE; Qwen3-30B-A3B 48, all MoE; OLMoE-1B-7B 16, all MoE
REAL_MOE_LAYERS = {"qwen2-57b-a14b": 28, "deepseek-v2-lite": 26, "mixtral-8x7b": 32, "qwen3-30b-a3b": 48,
                   "olmoe-1b-7b": 16}
REAL = "real"
CUT = "cut"


def full_layers_arg(text: str) -> int | str:
    """``argparse`` type of ``--full-layers``: ``real``, ``cut`` or an int >= 1."""
    value = str(text).strip().lower()
    if value in (REAL, CUT):
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"--full-layers takes 'real', 'cut' or an int >= 1, got {text!r}")
    return number


def add_full_layers(parser: argparse.ArgumentParser, what: str = "the cut's real model") -> None:
    """The ``--full-layers`` option, the same in every script (default ``real``)."""
    parser.add_argument("--full-layers", type=full_layers_arg, default=REAL, metavar="N|real|cut",
                        help="every LYNX routing-mass config runs the price the default gives a model of N MoE layers "
                             f"(lynx_hf.at_depth); 'real' (default): {what}'s depth "
                             "(Qwen2-57B-A14B 28, DeepSeek-V2-Lite 26, Mixtral-8x7B 32); "
                             "'cut': the price as given on the cut (figures before issue 52)")


def full_depth(choice: int | str, shape: str | None) -> int | None:
    """The depth ``--full-layers`` ``choice`` gives a cut of ``shape`` (a :data:`REAL_MOE_LAYERS` name): the int
    itself, the real model's MoE layers for ``real`` (``None`` for a shape that is no real model's, e.g. a fixture,
    which runs whole at its own depth), ``None`` for ``cut``."""
    if choice == CUT:
        return None
    if choice == REAL:
        return REAL_MOE_LAYERS.get(shape) if shape is not None else None
    return int(choice)


def options_at_depth(options: dict | None, moe_layers: int | None) -> dict | None:
    """``options`` (LynxConfig fields as keyword options, optionally with the vLLM plugin's own keys such as
    ``stats_path``) with the price of a model of ``moe_layers`` MoE layers: for a LYNX routing-mass policy (the fields
    given over the defaults) ``mass_price`` = ``layer_price(config, moe_layers)`` and ``price_ref_layers`` = ``None``
    (:func:`lynx_hf.at_depth`); other options, ``None`` (unpatched) and ``moe_layers=None`` pass through unchanged
    (a copy). Raises :class:`lynx_hf.LynxConfigError` for a bad depth or option."""
    if options is None:
        return None
    out = dict(options)
    if moe_layers is None:
        return out
    fields = set(LynxConfig.__dataclass_fields__)
    config = LynxConfig.from_options({k: v for k, v in out.items() if k in fields}, base=LynxConfig())
    deep = at_depth(config, moe_layers)
    if deep is not config:
        out.update(mass_price=deep.mass_price, price_ref_layers=deep.price_ref_layers)
    return out


def price_of(options: dict | LynxConfig | None, cut_layers: int) -> float | None:
    """The routing-mass price every layer of a model of ``cut_layers`` MoE layers runs under ``options`` (or a
    config); ``None`` where there is none (unpatched, another policy, the paper's rule)."""
    if options is None:
        return None
    if not isinstance(options, LynxConfig):
        fields = set(LynxConfig.__dataclass_fields__)
        options = LynxConfig.from_options({k: v for k, v in options.items() if k in fields}, base=LynxConfig())
    if options.policy != "lynx":
        return None
    return layer_price(options, cut_layers)


def price_label(price: float | None, moe_layers: int | None, cut_layers: int, whole: bool = False) -> str:
    """What a result table says of a row: ``"price 0.015625 (at 28 MoE layers)"`` (the full model's price),
    ``"price 0.109375 (as given, on the 2-layer cut)"`` (``--full-layers cut``), ``"price 0.109375 (its own 4 MoE
    layers)"`` (``whole``: a model run whole, e.g. fixture A) or ``"no routing-mass price"``."""
    if price is None:
        return "no routing-mass price"
    if moe_layers is not None:
        return f"price {price:.6g} (at {moe_layers} MoE layers)"
    if whole:
        return f"price {price:.6g} (its own {cut_layers} MoE layers)"
    return f"price {price:.6g} (as given, on the {cut_layers}-layer cut)"


def config_at_depth(config: LynxConfig, moe_layers: int | None) -> LynxConfig:
    """:func:`lynx_hf.at_depth` where ``moe_layers`` is set; ``config`` itself for ``None`` (``--full-layers cut``, or a
    model run whole)."""
    return config if moe_layers is None else at_depth(config, moe_layers)
