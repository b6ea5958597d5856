"""Pareto sweep on the fixtures: LYNX (the paper's rule, our routing-mass greedy in two price units) vs
OEA and XShare, teacher-forced decode.

    python -m lynx_hf.eval.sweep                          # fixtures A, B, C; B = 16 full grid + 8/32/64
    python -m lynx_hf.eval.sweep --models eval/fixtures/mixtral-tiny --name sweep_b          # one fixture
    python -m lynx_hf.eval.sweep --load eval/results/sweep_b.json eval/results/sweep_c.json  # reuse, add A, fill in
    python -m lynx_hf.eval.sweep --models eval/fixtures/mixtral-tiny --load eval/results/sweep_b.json \
        --fill-series paper --name sweep_b2      # add the full paper grid at every B (no default chosen)

For every fixture and batch size B: the same held-out windows (``--sequences`` windows of
``--prefill + --decode + 1`` tokens, docs and code interleaved) are decoded one token per step through
the KV cache (lynx_hf.eval.evaluation.teacher_forced), unpatched first (the reference), then every policy.
Every policy scores the same ``sequences x decode`` tokens. x = unique experts per MoE layer per decode
step (after the policy), y = dCE = relative change in next-token cross-entropy vs unpatched.

Series (names as in the result tables):
- ``paper``: LYNX as the paper specifies it (``mass_price=None``): tau x alpha-multiplier grid
  ("lynx tau=T a=Mx"; alpha = M x the k/N-derived default);
- ``token``: cover + routing-mass greedy, ``price_unit="token"`` ("lynx price=P/token"): an expert joins
  while it restores >= P tokens' worth of top-k routing mass;
- ``batch``: the same greedy, ``price_unit="batch"`` ("lynx price=P/batch"): threshold P x B (a constant
  price on the mean mass per token). The batch grid is the token grid / 16, so at B = 16 each batch point
  is the token point of 16 x its price -- the same threshold, identical results by construction; at every
  B the sweep reports whether each batch point is bit-identical to the token point of B x its price where
  the token grid has it (a measured check of the unit);
- ``sqrt``: the same greedy, ``price_unit="sqrt"`` ("lynx price=P/sqrt"): threshold P x sqrt(B), between the
  two (added after the token and batch units both missed the budget at some B: an absolute price over-prunes
  small batches, a per-token one large ones); grid = token grid / 4, so again identical to the token series
  at B = 16 (checked bit-identical at B = 16 and 64);
- ``oea``: OEA k0 = 1..k-1;
- ``xshare``: XShare with a fixed expert budget per layer per step, budget = ceil(f x N) experts for the
  fraction grid f (deduplicated by budget; never below k), with warm-up 1 (each token's top-1 kept first,
  so a step may exceed the budget) and 0 (exactly max(budget, k) experts unless the union is smaller);
  the budget does not depend on B, so its frontier is traced by the fraction.
At B != the first batch size the paper grid (alpha 1x), the price grids and OEA/XShare are trimmed or
kept as listed in ``grid``; afterwards every (fixture, B) is *filled in* with the full grid of the
default's series and every series' rule-chosen point, so those are measured everywhere.

Default rule (fixed here before any run; ``--rule-model``, first batch size): on fixture A at B = 16
only, among the candidate series paper, token, batch and sqrt, the configuration with the fewest unique
experts whose dCE <= --ce-budget (1 %) relative; ties -> smaller dCE, then tau = 1, smaller tau, smaller
price. Applied unchanged (calibration-free) at every B on every fixture. The same rule applied to each
candidate series alone gives that series' chosen point. At B = 16 the three price series coincide,
so the B = 16 criterion cannot pick the unit; the unit is then the one whose chosen point keeps
dCE <= budget at every (fixture, B); if both do, the one with fewer unique experts summed over all
(fixture, B); if neither, the one with the smaller worst-case dCE (the report says the budget is missed).

Frontier comparisons (compare(): Pareto frontiers piecewise linear between measured points, anchored at
policy none; at each measured point of one side, the other side's frontier at the same unique experts;
"tie" when they differ by less than the larger standard error of the two sides there): OEA vs the default's series,
XShare vs the default's series, and OEA vs the paper's LYNX, on every fixture and B.

Writes <name>.json, <name>.md and <name>_pareto.png to --out (default: eval/results in the source checkout,
else ./lynx_hf_results). ``lynx-hf sweep`` runs this module.

``--model PATH`` switches to the sweep on your own checkpoint and data (:mod:`lynx_hf.eval.model_sweep`): the
same catalog, harness and frontier comparisons at every requested B, trimmed to ``--max-minutes``, resumable, and
a ``lynx_config.json`` with the configuration that keeps dCE within ``--budget`` at every B with the fewest
unique experts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from lynx_hf import LynxConfig  # noqa: E402

from . import CHECKOUT, command, results_folder  # noqa: E402
from . import evaluation as ev  # noqa: E402

DEFAULT_MODELS = [str(ev.FIXTURES_DIR / n) for n in ("qwen2moe-tiny", "mixtral-tiny", "deepseekv2-tiny")]
FIXTURE_LETTER = {"qwen2moe-tiny": "A", "mixtral-tiny": "B", "deepseekv2-tiny": "C"}
TAUS = [0.5, 1.0, 2.0, 4.0, 8.0, 1e6]  # tau = 0 keeps every candidate: identical to none
ALPHA_MULTS = [0.5, 1.0, 2.0]
PRICE_REF_B = 16  # batch price p <-> token price PRICE_REF_B * p (identical at B = PRICE_REF_B)
PRICE_UNITS = ("token", "batch", "sqrt")  # the routing-mass greedy's price units (LynxConfig.price_unit)
UNIT_SCALE = {"token": 1.0, "batch": float(PRICE_REF_B), "sqrt": math.sqrt(PRICE_REF_B)}  # grid = token grid / scale
TOKEN_PRICES = [0.03125, 0.0625, 0.125, 0.25, 0.375, 0.4375, 0.5, 0.75, 1.0, 1.5, 2.0]  # 0.4375 added after the retrained A crossed 1 % between 0.375 and 0.5
XSHARE_FRACTIONS = [0.125, 0.1875, 0.25, 0.375, 0.5, 0.625, 0.75]
XSHARE_WARMUPS = [1, 0]
# at the other batch sizes (before the fill-in adds the default's series and the chosen points): the
# whole alpha-1x paper grid and both whole price grids, so every candidate series' rule-chosen point is
# measured everywhere without a fill-in unless the rule picks alpha 0.5x or 2x
TAUS_OTHER = list(TAUS)
TOKEN_PRICES_OTHER = list(TOKEN_PRICES)
CANDIDATE_SERIES = ("paper",) + PRICE_UNITS
SERIES_LABEL = {"paper": "LYNX (paper rule)", "token": "mass greedy, token price", "batch": "mass greedy, batch price", "sqrt": "mass greedy, sqrt(B) price",
                "oea": "OEA", "xshare": "XShare", "floor": "LYNX + mass floor"}


def _tau_name(tau: float) -> str:
    return "inf" if tau >= 1e6 else f"{tau:g}"


# -- the policy catalogue -----------------------------------------------------------------------------
def paper_name(tau, mult):
    return f"lynx tau={_tau_name(tau)} a={mult:g}x"


def price_name(price, unit):
    return f"lynx price={price:g}/{unit}"


def xshare_points(num_experts: int, top_k: int, fractions=XSHARE_FRACTIONS) -> list[tuple[float, int]]:
    """``[(fraction, budget)]``: the fraction grid resolved to experts per step, deduplicated by budget
    (the first fraction of each budget), never below k."""
    out, seen = [], set()
    for f in fractions:
        budget = max(top_k, min(num_experts, math.ceil(f * num_experts)))
        if budget not in seen:
            seen.add(budget)
            out.append((f, budget))
    return out


def catalog(num_experts: int, top_k: int, taus=TAUS, alpha_mults=ALPHA_MULTS, token_prices=TOKEN_PRICES,
            xshare_fractions=XSHARE_FRACTIONS, xshare_warmups=XSHARE_WARMUPS) -> dict:
    """``{name: (series, LynxConfig)}`` of every configuration the sweep may run on a layer shape."""
    out = {"none": ("none", LynxConfig(policy="none"))}
    for mult in alpha_mults:
        for tau in taus:
            out[paper_name(tau, mult)] = ("paper", ev.lynx_config(num_experts, top_k, tau, mult))
    for price in token_prices:  # cover, then grow by routing mass (no consensus), alpha 1x
        out[price_name(price, "token")] = ("token", ev.lynx_config(num_experts, top_k, 1e6, 1.0, mass_price=price,
                                                                   price_unit="token"))
        for unit in PRICE_UNITS[1:]:
            uprice = price / UNIT_SCALE[unit]
            out[price_name(uprice, unit)] = (unit, ev.lynx_config(num_experts, top_k, 1e6, 1.0, mass_price=uprice,
                                                                  price_unit=unit))
    for k0 in range(1, top_k):
        out[f"oea k0={k0}"] = ("oea", LynxConfig(policy="oea", oea_k0=k0))
    for warmup in xshare_warmups:
        for f, budget in xshare_points(num_experts, top_k, xshare_fractions):
            out[f"xshare f={f:g} w={warmup}"] = ("xshare", LynxConfig(policy="xshare", xshare_fraction=f,
                                                                      xshare_warmup=warmup))
    return out


def grid(cat: dict, full: bool, taus_other=TAUS_OTHER, token_prices_other=TOKEN_PRICES_OTHER) -> list[str]:
    """Names to run at one batch size: everything in ``cat`` when ``full``; otherwise the paper grid at
    alpha 1x over ``taus_other``, the price grids at ``token_prices_other`` (and their batch twins),
    every OEA and XShare point."""
    if full:
        return list(cat)
    keep = {"none"} | {paper_name(t, 1.0) for t in taus_other}
    keep |= {price_name(p, "token") for p in token_prices_other}
    keep |= {price_name(p / UNIT_SCALE[u], u) for p in token_prices_other for u in PRICE_UNITS[1:]}
    return [n for n, (series, _) in cat.items() if n in keep or series in ("oea", "xshare")]


def series_of(r: dict) -> str | None:
    """The series of a result row (None for the unpatched reference)."""
    pol = r.get("policy")
    if pol == "lynx":
        if r.get("mass_floor"):  # runs recorded before LynxConfig.mass_floor was removed
            return "floor"
        if r.get("mass_price") is None:
            return "paper"
        return r.get("price_unit") if r.get("price_unit") in PRICE_UNITS else "token"
    return pol


def is_paper_lynx(r: dict) -> bool:
    """LYNX as the paper (and docs/design.md) specifies it: no mass floor, no mass price."""
    return series_of(r) == "paper"


def is_price_lynx(r: dict) -> bool:
    return series_of(r) in PRICE_UNITS


def in_series(*names):
    return lambda r: series_of(r) in names


# -- frontier comparisons ----------------------------------------------------------------------------
def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pareto-optimal (unique, delta) points, sorted by unique ascending, delta strictly decreasing."""
    out: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], p[1])):
        while out and out[-1][1] >= y - 1e-12 and out[-1][0] >= x - 1e-12:
            out.pop()
        if not out or y < out[-1][1]:
            out.append((x, y))
    return out


def interpolate(front: list[tuple[float, float]], x: float) -> float | None:
    """delta CE of a frontier at unique count ``x`` (piecewise linear; None outside its range)."""
    if not front or x < front[0][0] - 1e-9 or x > front[-1][0] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in zip(front, front[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return front[-1][1] if abs(x - front[-1][0]) < 1e-9 else front[0][1]


def compare(results: list[dict], select=lambda r: r.get("policy") == "lynx",
            peer=lambda r: r.get("policy") == "oea", names=("lynx", "oea")) -> dict:
    """``peer`` vs ``select`` (our series) at equal unique experts, both ways: at each measured peer point
    our frontier's delta CE, and at each of our Pareto points the peer frontier's. ``winner`` is "tie"
    when the two differ by less than ``se`` = the larger of the measured point's standard error and the
    other frontier's (its points' se interpolated like the frontier, 0 at the anchor), else the name (``names``:
    ``(ours, peer)``) of the side with the smaller delta CE. Row keys: ``at``, ``unique``,
    ``<ours>_delta``, ``<peer>_delta``, ``se``, ``se_point``, ``winner``, ``diff`` (ours - peer); frontiers under
    ``<ours>_frontier`` / ``<peer>_frontier``."""
    ours_name, peer_name = names
    none = next(r for r in results if r.get("policy") == "none")
    anchor = (none["unique_experts_after"], none["delta_ce_rel"])
    ours = [r for r in results if select(r)]
    peers = [r for r in results if peer(r)]
    if not ours or not peers:
        return {f"{ours_name}_frontier": [], f"{peer_name}_frontier": [], "rows": [], "names": list(names)}
    lf = frontier([anchor] + [(r["unique_experts_after"], r["delta_ce_rel"]) for r in ours])
    of = frontier([anchor] + [(r["unique_experts_after"], r["delta_ce_rel"]) for r in peers])
    # standard error along each frontier: the measured points' se, linear in between, 0 at the anchor
    se_of = {anchor: 0.0}
    for r in ours + peers:
        se_of.setdefault((r["unique_experts_after"], r["delta_ce_rel"]), r["delta_ce_rel_se"])
    lse = [(x, se_of.get((x, y), 0.0)) for x, y in lf]
    ose = [(x, se_of.get((x, y), 0.0)) for x, y in of]

    def verdict(y_ours, y_peer, se):
        if y_ours is None or y_peer is None:
            return None
        if abs(y_ours - y_peer) <= se:  # equal values (e.g. both at the anchor, se 0) are a tie
            return "tie"
        return ours_name if y_ours < y_peer else peer_name

    def sides_se(point_se, other_se_front, x):
        """The larger of the measured point's se and the other frontier's (interpolated) se at x."""
        other = interpolate(other_se_front, x) if len(other_se_front) > 1 else None
        return max(point_se, other or 0.0)

    rows = []
    for r in peers:
        x = r["unique_experts_after"]
        y_l = interpolate(lf, x)
        se = sides_se(r["delta_ce_rel_se"], lse, x)
        rows.append({"at": r["name"], "side": peer_name, "unique": x, f"{peer_name}_delta": r["delta_ce_rel"],
                     f"{ours_name}_delta": y_l, "se": se, "se_point": r["delta_ce_rel_se"],
                     "winner": verdict(y_l, r["delta_ce_rel"], se)})
    for x, y in lf:
        if x >= anchor[0] - 1e-9:
            continue
        hit = next(r for r in ours if r["unique_experts_after"] == x and r["delta_ce_rel"] == y)
        y_o = interpolate(of, x)
        se = sides_se(hit["delta_ce_rel_se"], ose, x)
        rows.append({"at": hit["name"], "side": ours_name, "unique": x, f"{peer_name}_delta": y_o,
                     f"{ours_name}_delta": y, "se": se, "se_point": hit["delta_ce_rel_se"],
                     "winner": verdict(y, y_o, se)})
    for row in rows:
        a, b = row[f"{ours_name}_delta"], row[f"{peer_name}_delta"]
        row["diff"] = None if a is None or b is None else a - b
    return {f"{ours_name}_frontier": lf, f"{peer_name}_frontier": of, "names": list(names),
            "rows": sorted(rows, key=lambda r: r["unique"])}


def counts(rows: list[dict], names) -> dict:
    out = {names[0]: 0, "tie": 0, names[1]: 0, "out of range": 0}
    for r in rows:
        out["out of range" if r["winner"] is None else r["winner"]] += 1
    return out


def _rule_key(r: dict):
    return (round(r["unique_experts_after"], 6), r["delta_ce_rel"], r.get("tau") not in (None, 1.0),
            r.get("tau") or 0.0, r.get("mass_price") or 0.0)


def choose_default(results: list[dict], budget: float, candidates=lambda r: r.get("policy") == "lynx") -> dict | None:
    """The rule: among ``candidates``, the fewest unique experts with delta CE <= ``budget``; ties ->
    smaller delta CE, then tau = 1, then the smaller tau, then the smaller price."""
    ok = [r for r in results if candidates(r) and r["delta_ce_rel"] <= budget]
    return min(ok, key=_rule_key) if ok else None


# -- output -----------------------------------------------------------------------------------------
COLUMNS = [("policy", "name", ""), ("series", "series", ""), ("unique experts/layer", "unique_experts_after", ".2f"),
           ("vs none", "unique_ratio_vs_none", ".3f"), ("CE", "ce", ".4f"), ("dCE %", "delta_pct", "+.2f"),
           ("+- se", "se_pct", ".2f"), ("acc", "acc", ".4f"), ("top-1 agree", "top1_agreement", ".4f"),
           ("KL", "kl", ".4f"), ("mass kept", "routing_mass_kept", ".3f"), ("bit-identical", "bit_identical", "")]


def _pct(x, fmt="+.2f"):
    return "-" if x is None else format(100 * x, fmt)


def _rows(results):
    out = []
    for r in results:
        row = dict(r)
        row["series"] = series_of(r) or "reference"
        row["delta_pct"] = 100 * r["delta_ce_rel"]
        row["se_pct"] = 100 * r["delta_ce_rel_se"]
        out.append(row)
    return out


def _label(model: str) -> str:
    letter = FIXTURE_LETTER.get(model)
    return f"{letter} ({model})" if letter else model


def _find(run: dict, name: str) -> dict | None:
    return next((r for r in run["results"] if r["name"] == name), None)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = ["# Pareto sweep: LYNX vs OEA and XShare (teacher-forced decode)", "",
             f"Held-out windows: {s['sequences']} sequences x ({s['prefill']} prefill + {s['decode']} decode steps); "
             f"{s['sequences'] * s['decode']} scored tokens per policy and batch size, all produced by decode steps "
             f"(KV cache, one token per step). dCE = CE / CE(unpatched) - 1; +- se = standard error over sequences of "
             f"the paired difference. fp32, torch backend, {s['threads']} thread(s). Unique experts = mean over MoE "
             f"layers and decode steps of the experts the batch touches (lynx_hf.stats). Total run time of this report's "
             f"runs: {report.get('compute_seconds', 0):.0f} s of compute (sum over runs and fill-ins).", "",
             f"Series: {report['series_note']}", "", f"Default rule: {report['rule']}", "",
             "Code versions of the runs (commit, sha256 of lynx_hf/ kernels/ patches/ sources): " +
             "; ".join(sorted({f"{(c or {}).get('commit', '?')[:10]} {(c or {}).get('sources_sha256', '?')}"
                               for r in report["runs"] for c in [r.get("code")] + [f.get("code") for f in r.get("fills", [])]
                               if c is not None})) + " (fill-ins made before the fill's code was recorded are not listed)", ""]
    d = report.get("default")
    if d:
        lines += [f"**Chosen default (fixture {_label(d['chosen_on'])}, B = {d['batch_size']}): `{d['name']}` "
                  f"(series {d['series']}: {SERIES_LABEL.get(d['series'], d['series'])}).** Rule-chosen point per "
                  f"candidate series: " + ", ".join(f"{k}: `{v['name'] if v else None}`" for k, v in d["series_choice"].items())
                  + f". Overall rule winner at B = {d['batch_size']}: `{d['rule_winner']}`. Unit: {d['unit_note']}", ""]
        lines += ["### The default at every fixture and batch size (calibration-free)", "",
                  "| fixture | B | unique experts none -> default | fewer | dCE % | +- se | <= budget |", "|---|---|---|---|---|---|---|"]
        for row in d["applied"]:
            lines.append(f"| {_label(row['model'])} | {row['batch_size']} | {row['unique_before_none']:.2f} -> "
                         f"{row['unique_experts_after']:.2f} | {100 * (1 - row['unique_ratio_vs_none']):.1f} % | "
                         f"{100 * row['delta_ce_rel']:+.2f} | {100 * row['delta_ce_rel_se']:.2f} | "
                         f"{'yes' if row['delta_ce_rel'] <= s['ce_budget'] else '**no**'} |")
        lines += ["", "Checks: " + "; ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in d["checks"].items()), ""]
        lines += ["### Each candidate series' rule-chosen point at every fixture and B (dCE %, unique experts)", "",
                  "| series | point | " + " | ".join(f"{_label(m)} B={b}" for m, b in d["cells"]) + " | worst dCE % |",
                  "|---|---|" + "---|" * (len(d["cells"]) + 1)]
        for series, info in d["series_everywhere"].items():
            if not info:
                continue
            cells = []
            for cell in info["cells"]:
                cells.append("-" if cell is None else
                             f"{100 * cell['delta_ce_rel']:+.2f} ({cell['unique_experts_after']:.1f})"
                             + ("" if cell["delta_ce_rel"] <= s["ce_budget"] else " **over**"))
            worst = info["worst"]
            lines.append(f"| {series} | `{info['name']}` | " + " | ".join(cells) + f" | {_pct(worst)} |")
        lines.append("")
    if report.get("comparison_summary"):
        lines += ["## Frontier comparisons (counts over all comparison points of every B)", "",
                  "| comparison | fixture | ours wins | tie | peer wins | no overlap |", "|---|---|---|---|---|---|"]
        for key, per_model in report["comparison_summary"].items():
            for model, c in per_model.items():
                lines.append(f"| {c['title']} | {_label(model)} | {c['counts'][c['names'][0]]} | {c['counts']['tie']} | "
                             f"{c['counts'][c['names'][1]]} | {c['counts']['out of range']} |")
        lines += ["", "Points where the peer loses less than our frontier (beyond the larger standard error of the two sides):", ""]
        any_loss = False
        for key, per_model in report["comparison_summary"].items():
            for model, c in per_model.items():
                for loss in c["peer_wins"]:
                    any_loss = True
                    lines.append(f"- {c['title']}, {_label(model)} B = {loss['batch_size']}: at `{loss['at']}` "
                                 f"({loss['unique']:.2f} experts) ours {_pct(loss['ours'])} % vs peer {_pct(loss['peer'])} % "
                                 f"(se {_pct(loss['se'], '.2f')} pp)")
        if not any_loss:
            lines.append("- none")
        lines.append("")
    return "\n".join(lines + run_sections(report)) + "\n"


def run_sections(report: dict) -> list[str]:
    """Markdown lines of every run of ``report``: the table of every point, the price-twin check, the frontier
    comparisons at equal unique experts."""
    lines: list[str] = []
    for run in report["runs"]:
        lines += [f"## {_label(run['model'])}, B = {run['batch_size']} (N = {run['num_experts']}, k = {run['top_k']}; "
                  f"{run['scored_tokens']} tokens; {run['seconds']:.0f} s)", "",
                  ev.markdown_table(_rows(sorted(run["results"], key=_sort_key)), COLUMNS), ""]
        same = run.get("batch_equals_token")
        if same:
            lines += [f"Batch- and sqrt-price points vs their token twins at B = {run['batch_size']} (token price = B x batch "
                      f"price = sqrt(B) x sqrt price): "
                      + ", ".join(f"{k}: {'bit-identical' if v else 'DIFFERENT'}" for k, v in same.items()), ""]
        for key, comp in run.get("comparisons", {}).items():
            rows = comp.get("rows", [])
            if not rows:
                continue
            a, b = comp["names"]
            lines += [f"{comp['title']} at equal unique experts:", "",
                      ev.markdown_table([{**r, "a_pct": None if r[f"{a}_delta"] is None else 100 * r[f"{a}_delta"],
                                          "b_pct": None if r[f"{b}_delta"] is None else 100 * r[f"{b}_delta"],
                                          "diff_pct": None if r["diff"] is None else 100 * r["diff"],
                                          "se_pct": 100 * r["se"]} for r in rows],
                                        [("measured point", "at", ""), ("unique experts", "unique", ".2f"),
                                         (f"{a} dCE %", "a_pct", "+.2f"), (f"{b} dCE %", "b_pct", "+.2f"),
                                         (f"{a} - {b} (pp)", "diff_pct", "+.2f"), ("se, larger of the sides (pp)", "se_pct", ".2f"),
                                         ("loses less", "winner", "")]), ""]
    return lines


_SERIES_ORDER = {None: 0, "none": 1, "paper": 2, "token": 3, "batch": 4, "sqrt": 5, "floor": 6, "oea": 7, "xshare": 8}


def _sort_key(r):
    s = series_of(r)
    return (_SERIES_ORDER.get(s, 9), r.get("alpha_mult") or 0.0, r.get("tau") or 0.0, r.get("mass_price") or 0.0,
            r.get("k0") or 0, -(r.get("xshare_warmup") or 0), r.get("xshare_budget") or 0)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    models = list(dict.fromkeys(r["model"] for r in report["runs"]))
    main_b = report["settings"]["batch_sizes"][0]
    others = [b for b in report["settings"]["batch_sizes"][1:]]
    budget = 100 * report["settings"]["ce_budget"]
    fig = plt.figure(figsize=(6.5 + 3.3 * len(others), 4.6 * len(models)))
    gs = GridSpec(len(models), 1 + len(others), figure=fig, width_ratios=[2.0] + [1.0] * len(others))
    d = report.get("default") or report.get("choice")  # the fixture sweep's default / a model sweep's choice
    mark = "default" if report.get("default") else "chosen"
    styles = [("paper", lambda r: series_of(r) == "paper" and r.get("alpha_mult") == 1.0, "C0", "o", "LYNX paper rule a=1x (tau)"),
              ("paper", lambda r: series_of(r) == "paper" and r.get("alpha_mult") == 0.5, "C1", "s", "LYNX paper rule a=0.5x"),
              ("paper", lambda r: series_of(r) == "paper" and r.get("alpha_mult") == 2.0, "C3", "v", "LYNX paper rule a=2x"),
              ("token", lambda r: series_of(r) == "token", "C4", "D", "mass greedy, token price"),
              ("batch", lambda r: series_of(r) == "batch", "C2", "P", "mass greedy, batch price"),
              ("sqrt", lambda r: series_of(r) == "sqrt", "C8", "X", "mass greedy, sqrt(B) price"),
              ("xshare", lambda r: series_of(r) == "xshare" and r.get("xshare_warmup") == 1, "C5", "^", "XShare warm-up 1 (budget)"),
              ("xshare", lambda r: series_of(r) == "xshare" and r.get("xshare_warmup") == 0, "C9", "<", "XShare warm-up 0 (budget)")]
    for row, model in enumerate(models):
        for col, b in enumerate([main_b] + others):
            run = next((r for r in report["runs"] if r["model"] == model and r["batch_size"] == b), None)
            ax = fig.add_subplot(gs[row, col])
            if run is None:
                ax.axis("off")
                continue
            res = run["results"]
            none = next(r for r in res if r.get("policy") == "none")
            big = col == 0
            ys = [0.0]
            for _, sel, color, marker, label in styles:
                pts = sorted([r for r in res if sel(r)],  # the paper grid in tau order, the others by experts
                             key=lambda r: (r.get("tau") or 0.0) if series_of(r) == "paper" else r["unique_experts_after"])
                if not pts:
                    continue
                ax.plot([r["unique_experts_after"] for r in pts], [100 * r["delta_ce_rel"] for r in pts], marker=marker,
                        color=color, ms=4 if big else 3, lw=1.0 if big else 0.8, label=label, alpha=0.9)
                ys += [100 * r["delta_ce_rel"] for r in pts]
            oea = sorted([r for r in res if r.get("policy") == "oea"], key=lambda r: r["k0"])
            ax.plot([r["unique_experts_after"] for r in oea] + [none["unique_experts_after"]],
                    [100 * r["delta_ce_rel"] for r in oea] + [0.0], "k--x", ms=6 if big else 4, lw=1, label="OEA (k0)")
            ys += [100 * r["delta_ce_rel"] for r in oea]
            if big:
                for r in oea:
                    ax.annotate(f"k0={r['k0']}", (r["unique_experts_after"], 100 * r["delta_ce_rel"]), fontsize=6,
                                xytext=(2, -8), textcoords="offset points")
            ax.plot([none["unique_experts_after"]], [0.0], "r*", ms=9 if big else 6, label="none")
            if d:
                hit = _find(run, d["name"])
                if hit is not None:
                    ax.plot([hit["unique_experts_after"]], [100 * hit["delta_ce_rel"]], "o", mfc="none", mec="red",
                            ms=12 if big else 8, mew=1.5, label=f"{mark} ({d['name']})")
            ax.axhline(budget, color="grey", lw=0.7, ls=":")
            cap = 3.0 * budget  # zoom on the points within 3x the budget; farther ones are clipped (title says so)
            top = min(max([y for y in ys if y <= cap] + [budget]) * 1.15 + 0.05, cap)
            ax.set_ylim(min(ys + [0.0]) - 0.1, top)
            clipped = max(ys) > top
            ax.set_title(f"{_label(model)}  B={b}" + (f" (y clipped at {cap:g} %)" if clipped else ""),
                         fontsize=9 if big else 8)
            ax.set_xlabel("unique experts / layer / decode step", fontsize=8 if big else 7)
            if big:
                ax.set_ylabel("dCE vs unpatched (%)", fontsize=8)
            ax.tick_params(labelsize=7 if big else 6)
            ax.grid(alpha=0.3)
            if row == 0 and big:
                ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------------
def code_version() -> dict:
    """The commit (source checkout only) and a hash of the library sources now (lynx_hf, lynx_hf.kernels,
    lynx_hf.patches, named by their checkout folders lynx_hf/, kernels/, patches/, so a wheel and the checkout
    hash alike): runs merged with --load are comparable only when these agree."""
    import hashlib
    import importlib.util
    import subprocess

    h = hashlib.sha256()
    for folder, package in (("lynx_hf", "lynx_hf"), ("kernels", "lynx_hf.kernels"), ("patches", "lynx_hf.patches")):
        root = Path(importlib.util.find_spec(package).origin).parent
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root)
            if folder == "lynx_hf" and rel.parts[0] in ("kernels", "patches", "eval"):  # the installed layout
                continue
            h.update(f"{folder}/{rel.as_posix()}".encode() + b"\0" + f.read_bytes())
    commit = None
    if CHECKOUT is not None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True,
                                    text=True).stdout.strip() or None
        except OSError:
            pass
    return {"commit": commit, "sources_sha256": h.hexdigest()[:16]}


def run_policies(loaded, path: str, b: int, names: list[str], cat: dict, args, log) -> dict:
    model, tok, windows = loaded
    pol = [(n, cat[n][1]) for n in names]
    t0 = time.perf_counter()
    run = ev.teacher_forced(model, windows, b, args.prefill, pol, progress=lambda line: log("  " + line))
    run.update(model=Path(path).resolve().name, seconds=time.perf_counter() - t0, threads=args.threads,
               code=code_version())
    return run


def parse_grids(args) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(taus, alpha multipliers, token prices, XShare fractions)`` from the comma-separated options
    (``inf`` = no consensus). Raises ``ValueError`` for a value that is not a number."""
    taus = [1e6 if t.strip() == "inf" else float(t) for t in args.taus.split(",") if t.strip()]
    mults = [float(m) for m in args.alpha_mults.split(",") if m.strip()]
    tprices = [float(m) for m in args.token_prices.split(",") if m.strip()]
    fractions = [float(m) for m in args.xshare_fractions.split(",") if m.strip()]
    return taus, mults, tprices, fractions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Pareto sweep LYNX vs OEA vs XShare (teacher-forced decode). With --model: "
                                "on your checkpoint and data, writing the frontier and lynx_config.json (options "
                                "under 'your model'); without: the fixture sweep behind docs/results.md.")
    u = p.add_argument_group("your model (--model switches to this mode; lynx_hf.eval.model_sweep)")
    u.add_argument("--model", default=None, help="local checkpoint folder of a supported MoE family")
    u.add_argument("--data", default=None, help="a .jsonl file (a text field per line), a .txt file or a folder of "
                   "them (default: the held-out docs and code shipped with the package)")
    u.add_argument("--text-field", default="text", help="the text field of .jsonl data")
    u.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (device_map='auto'); default: cuda when "
                   "available, else cpu")
    u.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    u.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget: the grid is trimmed (lowest "
                   "priority points first) to fit, estimated from the points measured so far, and the run says so")
    u.add_argument("--series", default=None, help="comma-separated series to run (paper, token, batch, sqrt, oea, "
                   "xshare; default all; policy none always runs)")
    p.add_argument("--models", nargs="+", default=None, help="fixture sweep: local checkpoints (default: fixtures A, B, C)")
    p.add_argument("--rule-model", default="qwen2moe-tiny", help="fixture (folder name) on which the default is chosen")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (fixture sweep default 16,8,32,64: the first "
                   "gets the full grid and chooses the default; --model default 8,16,32,64)")
    p.add_argument("--taus", default=",".join(_tau_name(t) for t in TAUS))
    p.add_argument("--alpha-mults", default=",".join(f"{m:g}" for m in ALPHA_MULTS))
    p.add_argument("--token-prices", default=",".join(f"{x:g}" for x in TOKEN_PRICES),
                   help=f"token-price grid; the batch-price grid is this / {PRICE_REF_B}")
    p.add_argument("--xshare-fractions", default=",".join(f"{x:g}" for x in XSHARE_FRACTIONS))
    p.add_argument("--sequences", type=int, default=64, help="held-out windows (a multiple of every batch size; "
                   "with --model: at most this many, rounded down to a multiple of every batch size)")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=64, help="decode steps (scored tokens) per sequence")
    p.add_argument("--ce-budget", "--budget", dest="ce_budget", type=float, default=0.01,
                   help="relative delta-CE budget (0.01 = 1 %%) of the default rule / of lynx_config.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (fixture sweep default 1; --model: "
                   "torch's default)")
    p.add_argument("--no-fill", action="store_true", help="skip the fill-in of the default's series and chosen points")
    p.add_argument("--fill-series", default="", help="comma-separated series (paper, token, batch, oea, xshare) whose "
                   "full grid is filled in at every (fixture, B) whether or not a default is chosen in this run")
    p.add_argument("--out", default=None, help="results folder (default: eval/results in the source checkout, else "
                   "./lynx_hf_results; with --model its subfolder sweep_<model folder name>)")
    p.add_argument("--name", default="sweep", help="output file stem")
    p.add_argument("--replot", default=None, help="only redraw the PNG of this sweep JSON, then exit")
    p.add_argument("--load", nargs="*", default=[], help="earlier sweep JSON files: reuse their runs (same settings) "
                   "instead of recomputing; missing (model, B) runs and fill-ins are computed")
    args = p.parse_args(argv)
    results_folder(args.out)  # a file name is refused before any work
    if args.model is not None:
        from . import model_sweep

        return model_sweep.main(args, argv, p.prog)
    user_only = [f"--{n.replace('_', '-')}" for n in ("data", "device", "max_minutes", "series")
                 if getattr(args, n) is not None]
    if user_only:
        p.error(f"{', '.join(user_only)} need --model (the sweep on your checkpoint)")
    args.models = args.models or DEFAULT_MODELS
    args.batch_sizes = args.batch_sizes or "16,8,32,64"
    args.threads = 1 if args.threads is None else args.threads
    args.out = args.out or str(ev.RESULTS_DIR)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_name(Path(args.replot).stem + "_pareto.png"))
        return 0
    torch.set_num_threads(args.threads)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    taus, mults, tprices, fractions = parse_grids(args)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    budget = args.ce_budget
    rule = (f"on {args.rule_model} at B = {sizes[0]} only, among the candidate series {', '.join(CANDIDATE_SERIES)}, the "
            f"fewest unique experts with dCE <= {100 * budget:g} % relative (ties: smaller dCE, then tau = 1, smaller tau, "
            f"smaller price); then fixed and applied unchanged at every B on every fixture. At B = {PRICE_REF_B} the price "
            f"series coincide (batch price p = sqrt price 4 p = token price {PRICE_REF_B} p), so the unit is chosen by the "
            f"second criterion: the unit whose rule-chosen point keeps dCE <= budget at every (fixture, B); if several, "
            f"the fewest unique experts summed over all (fixture, B); if none, the smallest worst-case dCE.")
    series_note = (f"paper = LYNX as the paper specifies it (tau x alpha-multiplier grid, alpha = multiplier x the k/N "
                   f"default); token = cover + routing-mass greedy, mass_price in tokens' worth of top-k mass "
                   f"(grid {', '.join(f'{x:g}' for x in tprices)}); batch = the same greedy with price_unit batch, threshold "
                   f"mass_price x B (grid = token grid / {PRICE_REF_B}); sqrt = the same greedy with price_unit sqrt, threshold "
                   f"mass_price x sqrt(B) (grid = token grid / 4); oea = OEA k0 = 1..k-1; xshare = XShare with a fixed "
                   f"budget of ceil(f x N) experts per layer per decode step (f in {', '.join(f'{x:g}' for x in fractions)}, "
                   f"deduplicated by budget, never below k), warm-up 1 (each token's top-1 first; a step may exceed the "
                   f"budget) and 0; the budget does not depend on B, the fraction traces the frontier. At B != {sizes[0]} "
                   f"the grids are trimmed (paper alpha 1x tau {', '.join(_tau_name(t) for t in TAUS_OTHER)}; prices "
                   f"{', '.join(f'{x:g}' for x in TOKEN_PRICES_OTHER)} and their batch and sqrt twins), then filled in with the full "
                   f"grid of the default's series and every series' rule-chosen point.")
    settings = {"sequences": args.sequences, "prefill": args.prefill, "decode": args.decode, "taus": taus,
                "alpha_mults": mults, "token_prices": tprices, "batch_prices": [x / PRICE_REF_B for x in tprices],
                "sqrt_prices": [x / UNIT_SCALE["sqrt"] for x in tprices],
                "xshare_fractions": fractions, "batch_sizes": sizes, "ce_budget": budget, "threads": args.threads,
                "torch": torch.__version__}
    report = {"settings": settings, "rule": rule, "series_note": series_note, "runs": [], "command": command("sweep", argv)}
    t_all = time.perf_counter()
    compute = 0.0
    for earlier in args.load:
        data = json.loads(Path(earlier).read_text())
        for key in ("sequences", "prefill", "decode"):
            if data["settings"][key] != settings[key]:
                raise SystemExit(f"{earlier}: settings differ ({key}); rerun instead of --load")
        for run in data["runs"]:
            if run["batch_size"] in sizes and not any(r["model"] == run["model"] and r["batch_size"] == run["batch_size"]
                                                      for r in report["runs"]):
                report["runs"].append(run)
                compute += run["seconds"] + sum(f.get("seconds", 0.0) for f in run.get("fills", []))
    paths = {Path(m).resolve().name: m for m in args.models}
    for r in report["runs"]:
        paths.setdefault(r["model"], str(ev.FIXTURES_DIR / r["model"]))
    cache: dict = {}

    def load(name):
        if name not in cache:
            model, tok = ev.load_model(paths[name])
            windows = ev.heldout_windows(tok, args.prefill + args.decode + 1, args.sequences)
            cache[name] = (model, tok, windows)
        return cache[name]

    def cat_of(name, shape=None):
        n, k = shape if shape is not None else ev.moe_shape(load(name)[0])
        return catalog(n, k, taus, mults, tprices, fractions, XSHARE_WARMUPS)

    # 1. the grids
    for name in paths:
        for i, b in enumerate(sizes):
            if any(r["model"] == name and r["batch_size"] == b for r in report["runs"]):
                log(f"== {name} B={b}: reusing the loaded run")
                continue
            cat = cat_of(name)
            names = grid(cat, i == 0)
            log(f"== {name} B={b}: {len(names)} policies")
            run = run_policies(load(name), paths[name], b, names, cat, args, log)
            compute += run["seconds"]
            report["runs"].append(run)
            _save_partial(report, args)
    order = list(paths)
    report["runs"].sort(key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order),
                                       sizes.index(r["batch_size"])))

    # 2. the default rule (fixture A, first batch size)
    base = next((r for r in report["runs"] if r["model"] == args.rule_model and r["batch_size"] == sizes[0]), None)
    choice = None
    if base is not None:
        winner = choose_default(base["results"], budget, in_series(*CANDIDATE_SERIES))
        per_series = {s: choose_default(base["results"], budget, in_series(s)) for s in CANDIDATE_SERIES}
        choice = {"winner": winner, "series": per_series}

    # 3. fill-in: every series' chosen point and the full grid of the default's series (the default's series
    #    is not known before step 2; when the winner is a price point, both price series are filled)
    extra_series = {x.strip() for x in args.fill_series.split(",") if x.strip()}
    if (choice is not None or extra_series) and not args.no_fill:
        win_series = series_of(choice["winner"]) if choice is not None and choice["winner"] else None
        fill_series = set(PRICE_UNITS) if win_series in PRICE_UNITS else {win_series} - {None}
        fill_series |= extra_series
        for run in report["runs"]:
            cat = cat_of(run["model"], (run["num_experts"], run["top_k"]))
            have = {r["name"] for r in run["results"]}
            want = [n for n, (s, _) in cat.items() if s in fill_series]
            if choice is not None:
                want += [r["name"] for r in choice["series"].values() if r is not None]
            missing = [n for n in dict.fromkeys(want) if n not in have and n in cat]
            if not missing:
                continue
            log(f"== fill-in {run['model']} B={run['batch_size']}: {len(missing)} policies")
            extra = run_policies(load(run["model"]), paths[run["model"]], run["batch_size"], missing, cat, args, log)
            compute += extra["seconds"]
            ref_old, ref_new = run["results"][0], extra["results"][0]
            if abs(ref_old["ce"] - ref_new["ce"]) > 1e-6 * ref_old["ce"]:
                raise SystemExit(f"{run['model']} B={run['batch_size']}: unpatched CE differs between runs "
                                 f"({ref_old['ce']} vs {ref_new['ce']}); rerun without --load")
            none = next(r for r in run["results"] if r.get("policy") == "none")
            for r in extra["results"][1:]:
                r["unique_ratio_vs_none"] = r["unique_experts_after"] / none["unique_experts_before"]
                r["filled_in"] = True
                run["results"].append(r)
            run.setdefault("fills", []).append({"names": missing, "seconds": extra["seconds"],
                                                "reference_ce": ref_new["ce"], "code": extra.get("code")})
            _save_partial(report, args)

    # 4. the unit, the default applied everywhere, checks (the rule re-applied: the fill-in may have added
    #    points of a candidate series at the rule's fixture and B)
    if base is not None:
        choice = {"winner": choose_default(base["results"], budget, in_series(*CANDIDATE_SERIES)),
                  "series": {s: choose_default(base["results"], budget, in_series(s)) for s in CANDIDATE_SERIES}}
    if choice is not None and choice["winner"] is not None:
        report["default"] = summarize_default(report, choice, args.rule_model, sizes, budget)

    # 5. comparisons
    compare_runs(report, report.get("default", {}).get("series"))
    report["compute_seconds"] = compute
    report["seconds"] = time.perf_counter() - t_all
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / f"{args.name}.md").write_text(text)
    plot(report, out / f"{args.name}_pareto.png")
    partial = out / f"{args.name}.partial.json"
    if partial.exists():
        partial.unlink()
    print(text)
    log(f"wrote {out}/{args.name}.json, .md, _pareto.png in {report['seconds']:.0f} s "
        f"({compute:.0f} s of teacher-forced compute incl. loaded runs)")
    return 0


def _save_partial(report, args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.partial.json").write_text(json.dumps(report, indent=1))


def compare_runs(report: dict, default_series: str | None) -> None:
    """Frontier comparisons on every run of ``report`` (``run["comparisons"]``, ``report["comparison_summary"]``):
    OEA and XShare vs ``default_series`` (skipped when ``None``), OEA vs the paper's LYNX; and the price-unit
    twin check (``run["batch_equals_token"]``)."""
    titles = {"oea_vs_default": "OEA vs the default's series", "xshare_vs_default": "XShare vs the default's series",
              "oea_vs_paper": "OEA vs LYNX as the paper specifies it"}
    summary: dict = {key: {} for key in titles}
    for run in report["runs"]:
        comps = {}
        if default_series:
            comps["oea_vs_default"] = compare(run["results"], in_series(default_series), in_series("oea"), ("default", "oea"))
            comps["xshare_vs_default"] = compare(run["results"], in_series(default_series), in_series("xshare"),
                                                 ("default", "xshare"))
        comps["oea_vs_paper"] = compare(run["results"], is_paper_lynx, in_series("oea"), ("lynx", "oea"))
        for key, comp in comps.items():
            comp["title"] = titles[key]
            a, b = comp["names"]
            entry = summary[key].setdefault(run["model"], {"title": titles[key], "names": [a, b],
                                                           "counts": {a: 0, "tie": 0, b: 0, "out of range": 0},
                                                           "peer_wins": []})
            for k_, v in counts(comp["rows"], (a, b)).items():
                entry["counts"][k_] += v
            entry["peer_wins"] += [{"batch_size": run["batch_size"], "at": r["at"], "unique": r["unique"],
                                    "ours": r[f"{a}_delta"], "peer": r[f"{b}_delta"], "se": r["se"]}
                                   for r in comp["rows"] if r["winner"] == b]
        run["comparisons"] = comps
        twins = {}  # batch price p is token price B x p at this B, sqrt price p is token price sqrt(B) x p
        for r in run["results"]:  # (a measured check of price_unit; sqrt only where sqrt(B) is an integer)
            unit = series_of(r)
            if unit not in ("batch", "sqrt"):
                continue
            scale = run["batch_size"] if unit == "batch" else math.sqrt(run["batch_size"])
            if unit == "sqrt" and scale != int(scale):
                continue
            t = next((x for x in run["results"] if series_of(x) == "token"
                      and abs(x["mass_price"] - r["mass_price"] * scale) < 1e-12), None)
            if t is not None:
                twins[f"{t['mass_price']:g}/token = {r['mass_price']:g}/{unit}"] = (
                    t["ce"] == r["ce"] and t["unique_experts_after"] == r["unique_experts_after"])
        run["batch_equals_token"] = twins
    report["comparison_summary"] = {k: v for k, v in summary.items() if v}


def summarize_default(report: dict, choice: dict, rule_model: str, sizes: list[int], budget: float) -> dict:
    """The unit decision (second criterion), the default applied at every (fixture, B), the issue's checks
    and each candidate series' chosen point everywhere."""
    cells = [(r["model"], r["batch_size"]) for r in report["runs"]]
    everywhere = {}
    for s, r in choice["series"].items():
        if r is None:
            everywhere[s] = None
            continue
        found = [_find(run, r["name"]) for run in report["runs"]]
        measured = [c for c in found if c is not None]
        everywhere[s] = {"name": r["name"], "cells": [None if c is None else
                                                     {k: c[k] for k in ("unique_experts_after", "delta_ce_rel",
                                                                        "delta_ce_rel_se", "unique_ratio_vs_none")}
                                                     for c in found],
                         "worst": max((c["delta_ce_rel"] for c in measured), default=None),
                         "all_within": all(c["delta_ce_rel"] <= budget for c in measured) and len(measured) == len(found),
                         "unique_sum": sum(c["unique_experts_after"] for c in measured), "complete": len(measured) == len(found)}
    winner = choice["winner"]
    win_series = series_of(winner)
    if win_series in PRICE_UNITS:
        units = [u for u in PRICE_UNITS if everywhere.get(u)]
        within = [u for u in units if everywhere[u]["all_within"]]
        worst = ", ".join(f"{u} {_pct(everywhere[u]['worst'])} %" for u in units)
        if len(within) > 1:
            unit = min(within, key=lambda u: everywhere[u]["unique_sum"])
            note = (f"units keeping dCE <= budget everywhere: {', '.join(within)}; {unit} touches the fewest experts in "
                    f"total (" + ", ".join(f"{u} {everywhere[u]['unique_sum']:.1f}" for u in within) + f"). Worst: {worst}.")
        elif len(within) == 1:
            unit = within[0]
            note = f"only the {unit} unit keeps dCE <= budget at every fixture and B (worst: {worst})."
        else:
            unit = min(units, key=lambda u: everywhere[u]["worst"])
            note = f"no unit keeps dCE <= budget everywhere (worst: {worst}); {unit} has the smallest worst case."
        chosen = choice["series"][unit]
    else:
        unit, chosen = None, winner
        note = "the paper's rule wins at B = 16; the price unit does not apply."
    applied = []
    for run in report["runs"]:
        hit = _find(run, chosen["name"])
        if hit is None:
            continue
        none = next(r for r in run["results"] if r.get("policy") == "none")
        applied.append({"model": run["model"], "batch_size": run["batch_size"], "unique_before_none": none["unique_experts_before"],
                        **{k: hit[k] for k in ("unique_experts_after", "unique_ratio_vs_none", "delta_ce_rel",
                                               "delta_ce_rel_se", "top1_agreement", "routing_mass_kept")}})
    checks = {f"dCE <= {100 * budget:g} % at every fixture and B": bool(applied) and len(applied) == len(cells)
              and all(a["delta_ce_rel"] <= budget for a in applied)}
    for model in ("qwen2moe-tiny", "deepseekv2-tiny"):
        a = next((a for a in applied if a["model"] == model and a["batch_size"] == sizes[0]), None)
        if a is not None:
            checks[f"{_label(model)} B = {sizes[0]}: unique experts >= 50 % fewer"] = a["unique_ratio_vs_none"] <= 0.5
    return {"chosen_on": rule_model, "batch_size": sizes[0], "name": chosen["name"], "series": series_of(chosen),
            "price_unit": unit, "mass_price": chosen.get("mass_price"), "tau": chosen.get("tau"),
            "alpha_mult": chosen.get("alpha_mult"), "rule_winner": winner["name"], "unit_note": note,
            "series_choice": {s: (None if r is None else {"name": r["name"], "unique_experts_after": r["unique_experts_after"],
                                                          "delta_ce_rel": r["delta_ce_rel"]})
                              for s, r in choice["series"].items()},
            "series_everywhere": everywhere, "cells": cells, "applied": applied, "checks": checks}


if __name__ == "__main__":
    sys.exit(main())
