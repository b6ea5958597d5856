"""The library default on every fixture, in one table: unique experts and relative dCE against the unpatched model.

    python -m lab.default_table --models eval/fixtures/qwen2moe-tiny eval/fixtures/mixtral-tiny \\
        eval/fixtures/deepseekv2-tiny eval/fixtures/qwen2moe-deep /tmp/smollm2-d2 --batch-sizes 16,32
    python -m lab.default_table --models eval/fixtures/qwen2moe-deep --rules default,sqrt,none4 \\
        --data eval/work/train_split.jsonl          # compare depth rules on training-split text

For each model and batch size B: the same position-aligned windows (``--sequences`` of ``--prefill + --decode + 1``
tokens of the held-out docs and code shipped in ``eval/data``, or ``--data``), decoded one token per step through the
KV cache by the unpatched model (the reference), then by the model patched with each depth rule
(:func:`lynx_hf.eval.evaluation.teacher_forced`; the gate forced on, as every accuracy run). A rule maps the model's
MoE depth L to the routing-mass price a layer uses (``LynxConfig.mass_price`` 7/64, sqrt unit):

- ``default``: what ``LynxConfig()`` gives (``price_ref_layers`` 4: ``7/64 * 4 / L`` for L > 4);
- ``sqrt``: the milder law ``7/64 * sqrt(4 / L)`` for L > 4;
- ``none4``: no depth scaling (7/64 at every depth: the default before the depth rule);
- ``law<a>`` (e.g. ``law0.75``): the power law ``7/64 * (4 / L) ** a`` for L > 4 (``default`` is ``law1``, ``sqrt``
  ``law0.5``).

Printed and written (``--out``, default ``eval/results/default_table.{md,json}``): per (model, L, B) the unpatched
model's unique experts per MoE layer per decode step, each rule's unique experts, the saving (1 - after / before) and
dCE = CE / CE(unpatched) - 1 with its standard error over the windows (paired per-sequence differences).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from lynx_hf import LynxConfig
from lynx_hf.eval import evaluation as ev

from . import ROOT

DEFAULT_PRICE = LynxConfig().mass_price
REF_LAYERS = LynxConfig().price_ref_layers  # the depth the price was chosen at (4)
RULES = {
    "default": lambda layers: LynxConfig(),
    "sqrt": lambda layers: LynxConfig(mass_price=DEFAULT_PRICE * math.sqrt(min(1.0, REF_LAYERS / layers)), price_ref_layers=None),
    "none4": lambda layers: LynxConfig(price_ref_layers=None),
}


def rule(name: str):
    """The rule called ``name``: one of :data:`RULES` or ``law<a>`` (``a`` a float >= 0); ValueError otherwise."""
    if name in RULES:
        return RULES[name]
    if name.startswith("law"):
        try:
            a = float(name[3:])
        except ValueError:
            a = -1.0
        if a >= 0:
            return lambda layers: LynxConfig(mass_price=DEFAULT_PRICE * min(1.0, REF_LAYERS / layers) ** a,
                                             price_ref_layers=None)
    raise ValueError(f"unknown rule {name!r}: one of {', '.join(RULES)} or law<a> (a >= 0)")


def moe_layers(model) -> int:
    """The number of MoE layers ``lynx_hf.patch`` finds in ``model``."""
    return len(ev.moe_block_names(model))


def run(paths, sizes, rules, args, log=print) -> list[dict]:
    rows = []
    for path in paths:
        model, tok = ev.load_model(path)
        depth = moe_layers(model)
        length = args.prefill + args.decode + 1
        files = [args.data] if args.data else ev.HELDOUT_FILES
        windows = ev.heldout_windows(tok, length, args.sequences, files)
        for b in sizes:
            t0 = time.perf_counter()
            policies = [("none", LynxConfig(policy="none"))] + [(r, rule(r)(depth)) for r in rules]
            res = ev.teacher_forced(model, windows, b, args.prefill, policies)
            by = {r["name"]: r for r in res["results"]}
            before = by["none"]["unique_experts_before"]
            for r in rules:
                e = by[r]
                rows.append({"model": Path(path).name, "moe_layers": depth, "batch_size": b, "rule": r,
                             "layer_price": e["layer_price"], "unique_before": before,
                             "unique_after": e["unique_experts_after"], "saving": 1 - e["unique_experts_after"] / before,
                             "delta_ce_rel": e["delta_ce_rel"], "delta_ce_rel_se": e["delta_ce_rel_se"],
                             "tokens": res["scored_tokens"]})
                log(f"{Path(path).name} (L {depth}) B {b} {r}: price {e['layer_price']:.4f}, experts {before:.2f} -> "
                    f"{e['unique_experts_after']:.2f} ({rows[-1]['saving'] * 100:.1f} % fewer), dCE "
                    f"{e['delta_ce_rel'] * 100:+.2f} % +- {e['delta_ce_rel_se'] * 100:.2f}")
            log(f"  ({time.perf_counter() - t0:.0f} s)")
        del model
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"Made by `{command}`.", "",
             "| model (MoE layers) | B | unpatched experts | rule | layer price | experts | fewer | dCE % +- se |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['moe_layers']}) | {r['batch_size']} | {r['unique_before']:.2f} | {r['rule']} | "
                     f"{r['layer_price']:.4f} | {r['unique_after']:.2f} | {r['saving'] * 100:.1f} % | "
                     f"{r['delta_ce_rel'] * 100:+.2f} +- {r['delta_ce_rel_se'] * 100:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", type=Path, required=True, help="local checkpoint folders")
    ap.add_argument("--batch-sizes", default="16,32")
    ap.add_argument("--rules", default="default", help="comma-separated: " + ", ".join(RULES) + " or law<a>")
    ap.add_argument("--data", type=Path, default=None, help=".jsonl/.txt text (default: the shipped held-out docs + code)")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "default_table")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rules = args.rules.split(",")
    bad = []
    for r in rules:
        try:
            rule(r)
        except ValueError:
            bad.append(r)
    if bad or any(b < 1 or args.sequences % b for b in sizes):
        ap.error(f"unknown rules {bad}" if bad else f"--sequences {args.sequences} must be a multiple of every batch size")
    torch.set_num_threads(args.threads)
    command = "python -m lab.default_table " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run(args.models, sizes, rules, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
