"""The Pareto sweep's shared parts, used by the fixture sweep (:mod:`lynx_hf.eval.sweep`) and the sweep on a
user's checkpoint (:mod:`lynx_hf.eval.model_sweep`): the policy catalogue (series, grids, names), Pareto frontiers
and their comparison at equal unique experts, the default rule, and the per-run tables and plot."""

from __future__ import annotations

import math
from pathlib import Path

from lynx_hf import LynxConfig

from . import evaluation as ev

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


def tau_name(tau: float) -> str:
    return "inf" if tau >= 1e6 else f"{tau:g}"


# -- the policy catalogue -----------------------------------------------------------------------------
def paper_name(tau, mult):
    return f"lynx tau={tau_name(tau)} a={mult:g}x"


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
        # each point its price as given at any depth (price_ref_layers None); the library default is its own entry
        out[price_name(price, "token")] = ("token", ev.lynx_config(num_experts, top_k, 1e6, 1.0, mass_price=price,
                                                                   price_unit="token", price_ref_layers=None))
        for unit in PRICE_UNITS[1:]:
            uprice = price / UNIT_SCALE[unit]
            out[price_name(uprice, unit)] = (unit, ev.lynx_config(num_experts, top_k, 1e6, 1.0, mass_price=uprice,
                                                                  price_unit=unit, price_ref_layers=None))
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


def pct(x, fmt="+.2f"):
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


def fixture_label(model: str) -> str:
    letter = FIXTURE_LETTER.get(model)
    return f"{letter} ({model})" if letter else model


def find_point(run: dict, name: str) -> dict | None:
    return next((r for r in run["results"] if r["name"] == name), None)


def run_sections(report: dict) -> list[str]:
    """Markdown lines of every run of ``report``: the table of every point, the price-twin check, the frontier
    comparisons at equal unique experts."""
    lines: list[str] = []
    for run in report["runs"]:
        lines += [f"## {fixture_label(run['model'])}, B = {run['batch_size']} (N = {run['num_experts']}, k = {run['top_k']}; "
                  f"{run['scored_tokens']} tokens; {run['seconds']:.0f} s)", "",
                  ev.markdown_table(_rows(sorted(run["results"], key=sort_key)), COLUMNS), ""]
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


def sort_key(r):
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
                hit = find_point(run, d["name"])
                if hit is not None:
                    ax.plot([hit["unique_experts_after"]], [100 * hit["delta_ce_rel"]], "o", mfc="none", mec="red",
                            ms=12 if big else 8, mew=1.5, label=f"{mark} ({d['name']})")
            ax.axhline(budget, color="grey", lw=0.7, ls=":")
            cap = 3.0 * budget  # zoom on the points within 3x the budget; farther ones are clipped (title says so)
            top = min(max([y for y in ys if y <= cap] + [budget]) * 1.15 + 0.05, cap)
            ax.set_ylim(min(ys + [0.0]) - 0.1, top)
            clipped = max(ys) > top
            ax.set_title(f"{fixture_label(model)}  B={b}" + (f" (y clipped at {cap:g} %)" if clipped else ""),
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


def parse_grids(args) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(taus, alpha multipliers, token prices, XShare fractions)`` from the comma-separated options
    (``inf`` = no consensus). Raises ``ValueError`` for a value that is not a number."""
    taus = [1e6 if t.strip() == "inf" else float(t) for t in args.taus.split(",") if t.strip()]
    mults = [float(m) for m in args.alpha_mults.split(",") if m.strip()]
    tprices = [float(m) for m in args.token_prices.split(",") if m.strip()]
    fractions = [float(m) for m in args.xshare_fractions.split(",") if m.strip()]
    return taus, mults, tprices, fractions


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
