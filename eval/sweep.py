"""Pareto sweep: LYNX (tau x alpha multiplier) vs OEA (k0 = 1..k-1), teacher-forced decode.

    python eval/sweep.py                                  # both fixtures, B = 16 full grid + 8/32/64
    python eval/sweep.py --batch-sizes 16 --models eval/fixtures/qwen2moe-tiny

For every fixture and batch size B: the same held-out windows (``--sequences`` windows of
``--prefill + --decode + 1`` tokens, docs and code interleaved) are decoded one token per step through
the KV cache (eval/evaluation.py: teacher_forced), unpatched first (the reference), then policy none,
LYNX over the grid and OEA over k0. Every policy scores the same ``sequences x decode`` tokens.
x = unique experts per MoE layer per decode step (after the policy), y = relative change in
next-token cross-entropy vs unpatched.

Default rule (fixed here, applied to fixture A = the first model at B = 16): among the LYNX grid,
the configuration with the fewest unique experts whose delta CE is <= --ce-budget (1 %) relative;
ties -> smaller delta CE. That (tau, alpha multiplier) is then applied unchanged to the other
fixture (calibration-free check). Where OEA and LYNX reach the same unique-expert count, the delta
CE of each frontier (piecewise-linear between measured Pareto points, anchored at policy none) is
compared both ways.

Writes eval/results/sweep.json, sweep.md and sweep_pareto.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from lynx_hf import LynxConfig  # noqa: E402
import evaluation as ev  # noqa: E402  (eval/evaluation.py)

DEFAULT_MODELS = [str(ev.FIXTURES_DIR / "qwen2moe-tiny"), str(ev.FIXTURES_DIR / "mixtral-tiny")]
TAUS = [0.5, 1.0, 2.0, 4.0, 8.0, 1e6]  # tau = 0 keeps every candidate: identical to none
ALPHA_MULTS = [0.5, 1.0, 2.0]


def _tau_name(tau: float) -> str:
    return "inf" if tau >= 1e6 else f"{tau:g}"


def policies(num_experts: int, top_k: int, taus, alpha_mults, mass_floors=(), mass_prices=(), price_mults=(1.0, 2.0)) -> list:
    out = [("none", LynxConfig(policy="none"))]
    for mult in alpha_mults:
        for tau in taus:
            out.append((f"lynx tau={_tau_name(tau)} a={mult:g}x", ev.lynx_config(num_experts, top_k, tau, mult)))
    for floor in mass_floors:  # the per-token routing-mass floor extension, alpha 1x
        for tau in taus:
            out.append((f"lynx tau={_tau_name(tau)} a=1x m={floor:g}",
                        ev.lynx_config(num_experts, top_k, tau, 1.0, mass_floor=floor)))
    for price in mass_prices:  # the routing-mass greedy extension: cover, then grow by mass (no consensus)
        for mult in price_mults:
            out.append((f"lynx price={price:g} a={mult:g}x",
                        ev.lynx_config(num_experts, top_k, 1e6, mult, mass_price=price)))
    for k0 in range(1, top_k):
        out.append((f"oea k0={k0}", LynxConfig(policy="oea", k0=k0)))
    return out


def is_paper_lynx(r: dict) -> bool:
    """LYNX as the paper (and DESIGN.md) specifies it: no mass floor, no mass price."""
    return r.get("policy") == "lynx" and not r.get("mass_floor") and r.get("mass_price") is None


def is_price_lynx(r: dict) -> bool:
    return r.get("policy") == "lynx" and r.get("mass_price") is not None


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


def compare(results: list[dict], select=lambda r: r.get("policy") == "lynx") -> dict:
    """OEA vs LYNX at equal unique experts, both ways: at each measured OEA point the LYNX frontier's
    delta CE, and at each LYNX Pareto point the OEA frontier's. ``winner`` is "tie" when the two
    differ by less than the measured point's standard error."""
    none = next(r for r in results if r.get("policy") == "none")
    anchor = (none["unique_experts_after"], none["delta_ce_rel"])
    lynx = [r for r in results if select(r)]
    oea = [r for r in results if r.get("policy") == "oea"]
    if not lynx:
        return {"lynx_frontier": [], "oea_frontier": [], "rows": []}
    lf = frontier([anchor] + [(r["unique_experts_after"], r["delta_ce_rel"]) for r in lynx])
    of = frontier([anchor] + [(r["unique_experts_after"], r["delta_ce_rel"]) for r in oea])

    def verdict(y_lynx, y_oea, se):
        if y_lynx is None or y_oea is None:
            return None
        if abs(y_lynx - y_oea) < se:
            return "tie"
        return "lynx" if y_lynx < y_oea else "oea"

    rows = []
    for r in oea:
        x = r["unique_experts_after"]
        y_l = interpolate(lf, x)
        rows.append({"at": r["name"], "unique": x, "oea_delta": r["delta_ce_rel"], "lynx_delta": y_l,
                     "se": r["delta_ce_rel_se"], "winner": verdict(y_l, r["delta_ce_rel"], r["delta_ce_rel_se"])})
    for x, y in lf:
        if x >= anchor[0] - 1e-9:
            continue
        hit = next(r for r in lynx if r["unique_experts_after"] == x and r["delta_ce_rel"] == y)
        y_o = interpolate(of, x)
        rows.append({"at": hit["name"], "unique": x, "oea_delta": y_o, "lynx_delta": y, "se": hit["delta_ce_rel_se"],
                     "winner": verdict(y, y_o, hit["delta_ce_rel_se"])})
    for row in rows:
        row["diff"] = None if row["oea_delta"] is None or row["lynx_delta"] is None else row["lynx_delta"] - row["oea_delta"]
    return {"lynx_frontier": lf, "oea_frontier": of, "rows": sorted(rows, key=lambda r: r["unique"])}


def choose_default(results: list[dict], budget: float) -> dict | None:
    ok = [r for r in results if r.get("policy") == "lynx" and r["delta_ce_rel"] <= budget]
    if not ok:
        return None
    # identical measurements (e.g. tau 0.5 and 1 when no expert scores in between): prefer the current
    # LynxConfig default tau = 1, then the smaller tau
    return min(ok, key=lambda r: (round(r["unique_experts_after"], 6), r["delta_ce_rel"], r["tau"] != 1.0, r["tau"],
                                  r.get("mass_price") or 0.0))


# -- output -----------------------------------------------------------------------------------------
COLUMNS = [("policy", "name", ""), ("unique experts/layer", "unique_experts_after", ".2f"),
           ("vs none", "unique_ratio_vs_none", ".3f"), ("CE", "ce", ".4f"), ("dCE %", "delta_pct", "+.2f"),
           ("+- se", "se_pct", ".2f"), ("acc", "acc", ".4f"), ("top-1 agree", "top1_agreement", ".4f"),
           ("KL", "kl", ".4f"), ("mass kept", "routing_mass_kept", ".3f"), ("bit-identical", "bit_identical", "")]


def _rows(results):
    out = []
    for r in results:
        row = dict(r)
        row["delta_pct"] = 100 * r["delta_ce_rel"]
        row["se_pct"] = 100 * r["delta_ce_rel_se"]
        out.append(row)
    return out


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = ["# LYNX vs OEA Pareto sweep (teacher-forced decode)", "",
             f"Held-out windows: {s['sequences']} sequences x ({s['prefill']} prefill + {s['decode']} decode steps); "
             f"{s['sequences'] * s['decode']} scored tokens per policy and batch size, all produced by decode steps "
             f"(KV cache, one token per step). dCE = CE / CE(unpatched) - 1; +- se = standard error over sequences of "
             f"the paired difference. fp32, torch backend, {s['threads']} threads. Unique experts = mean over MoE "
             f"layers and decode steps of the experts the batch touches (lynx_hf.stats).", "",
             f"Default rule: {report['rule']}", ""]
    d = report.get("default")
    if d:
        price = d.get("mass_price")
        lines += [f"**Chosen default (fixture {d['chosen_on']}, B = {d['batch_size']}): tau = {_tau_name(d['tau'])}, "
                  f"alpha = {d['alpha_mult']:g} x the k/N default, mass_floor = {d['mass_floor']:g}, mass_price = "
                  f"{'None' if price is None else f'{price:g}'} ({d['name']}); among the paper's rule alone the rule picks "
                  f"{d.get('paper_rule_choice')}; with alpha fixed at 1x, {d.get('alpha_1x_choice')}.**", ""]
        for name, res in d["applied"].items():
            lines.append(f"- {name}, B = {d['batch_size']}: unique experts {res['unique_before_none']:.2f} -> "
                         f"{res['unique_experts_after']:.2f} ({100 * (1 - res['unique_ratio_vs_none']):.1f} % fewer), "
                         f"dCE {100 * res['delta_ce_rel']:+.2f} % (+- {100 * res['delta_ce_rel_se']:.2f}), top-1 "
                         f"agreement {res['top1_agreement']:.4f}")
        lines.append("")
    for run in report["runs"]:
        lines += [f"## {run['model']}, B = {run['batch_size']} (N = {run['num_experts']}, k = {run['top_k']}; "
                  f"{run['scored_tokens']} tokens; {run['seconds']:.0f} s)", "",
                  ev.markdown_table(_rows(run["results"]), COLUMNS), "",
                  ]
        for key, what in (("comparison", "LYNX as the paper specifies it (tau / alpha grid)"),
                          ("comparison_price", "LYNX with our routing-mass greedy (mass_price series)")):
            rows = run.get(key, {}).get("rows", [])
            if not rows:
                continue
            lines += [f"OEA vs {what} at equal unique experts (frontiers piecewise linear between measured Pareto "
                      "points, anchored at policy none):", "",
                      ev.markdown_table([{**r, "oea_pct": None if r["oea_delta"] is None else 100 * r["oea_delta"],
                                          "lynx_pct": None if r["lynx_delta"] is None else 100 * r["lynx_delta"],
                                          "diff_pct": None if r["diff"] is None else 100 * r["diff"],
                                          "se_pct": 100 * r["se"]} for r in rows],
                                        [("measured point", "at", ""), ("unique experts", "unique", ".2f"),
                                         ("OEA dCE %", "oea_pct", "+.2f"), ("LYNX dCE %", "lynx_pct", "+.2f"),
                                         ("LYNX - OEA (pp)", "diff_pct", "+.2f"), ("se of point (pp)", "se_pct", ".2f"),
                                         ("loses less", "winner", "")]), ""]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in report["runs"]))
    sizes = sorted(set(r["batch_size"] for r in report["runs"]))
    fig, axes = plt.subplots(len(models), len(sizes), figsize=(4.2 * len(sizes), 3.6 * len(models)), squeeze=False)
    for run in report["runs"]:
        ax = axes[models.index(run["model"])][sizes.index(run["batch_size"])]
        res = run["results"]
        none = next(r for r in res if r.get("policy") == "none")
        series = sorted({(r["alpha_mult"], r.get("mass_floor") or 0.0) for r in res if is_paper_lynx(r)
                         or (r.get("policy") == "lynx" and r.get("mass_floor"))})
        for mult, floor in series:
            style = {(1.0, 0.0): ("C0", "o"), (0.5, 0.0): ("C1", "s"), (2.0, 0.0): ("C3", "v")}.get((mult, floor),
                                                                                              ("C2", "^"))
            pts = sorted([r for r in res if r.get("policy") == "lynx" and r["alpha_mult"] == mult
                          and (r.get("mass_floor") or 0.0) == floor and r.get("mass_price") is None],
                         key=lambda r: r["tau"])
            label = f"LYNX a={mult:g}x" + (f" m={floor:g}" if floor else "") + " (tau)"
            ax.plot([r["unique_experts_after"] for r in pts], [100 * r["delta_ce_rel"] for r in pts], marker=style[1],
                    color=style[0], ms=4, lw=1, label=label)
            if mult == 1.0 and not floor:
                for r in pts:
                    ax.annotate(_tau_name(r["tau"]), (r["unique_experts_after"], 100 * r["delta_ce_rel"]), fontsize=6,
                                xytext=(2, 2), textcoords="offset points")
        for mult, color in ((1.0, "C4"), (2.0, "C5")):
            pts = sorted([r for r in res if is_price_lynx(r) and r["alpha_mult"] == mult], key=lambda r: -r["mass_price"])
            if pts:
                ax.plot([r["unique_experts_after"] for r in pts], [100 * r["delta_ce_rel"] for r in pts], marker="D",
                        color=color, ms=4, lw=1.4, label=f"LYNX+mass price a={mult:g}x (ours)")
                for r in pts:
                    ax.annotate(f"{r['mass_price']:g}", (r["unique_experts_after"], 100 * r["delta_ce_rel"]), fontsize=6,
                                xytext=(2, 2), textcoords="offset points", color=color)
        oea = sorted([r for r in res if r.get("policy") == "oea"], key=lambda r: r["k0"])
        ax.plot([r["unique_experts_after"] for r in oea] + [none["unique_experts_after"]],
                [100 * r["delta_ce_rel"] for r in oea] + [0.0], "k--x", ms=6, lw=1, label="OEA (k0)")
        for r in oea:
            ax.annotate(f"k0={r['k0']}", (r["unique_experts_after"], 100 * r["delta_ce_rel"]), fontsize=6,
                        xytext=(2, -8), textcoords="offset points")
        ax.plot([none["unique_experts_after"]], [0.0], "r*", ms=9, label="none")
        d = report.get("default")
        if d:
            for r in res:
                if r.get("policy") == "lynx" and r["name"] == d["name"]:
                    ax.plot([r["unique_experts_after"]], [100 * r["delta_ce_rel"]], "o", mfc="none", mec="red",
                            ms=11, label="default")
        ax.axhline(100 * report["settings"]["ce_budget"], color="grey", lw=0.6, ls=":")
        ax.set_title(f"{run['model']}  B={run['batch_size']}", fontsize=9)
        ax.set_xlabel("unique experts / layer / decode step", fontsize=8)
        ax.set_ylabel("delta CE vs unpatched (%)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    first = sizes.index(report["settings"]["batch_sizes"][0]) if report["settings"]["batch_sizes"][0] in sizes else 0
    axes[0][first].legend(fontsize=6)  # the batch size with the full grid
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="local checkpoints; the first chooses the default")
    p.add_argument("--batch-sizes", default="16,8,32,64", help="the first gets the full grid; the others alpha 1x only")
    p.add_argument("--taus", default=",".join(_tau_name(t) for t in TAUS))
    p.add_argument("--alpha-mults", default=",".join(f"{m:g}" for m in ALPHA_MULTS))
    p.add_argument("--mass-floors", default="0.75", help="extra LYNX series (alpha 1x, first batch size) with LynxConfig.mass_floor; \"\" for none")
    p.add_argument("--mass-prices", default="0.1,0.25,0.5,1",
                   help="extra LYNX series with LynxConfig.mass_price (alpha 1x and 2x at the first batch size, 1x at the others); \"\" for none")
    p.add_argument("--sequences", type=int, default=64, help="held-out windows (a multiple of every batch size)")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=64, help="decode steps (scored tokens) per sequence")
    p.add_argument("--ce-budget", type=float, default=0.01, help="relative delta-CE budget of the default rule")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ev.RESULTS_DIR))
    p.add_argument("--name", default="sweep", help="output file stem")
    p.add_argument("--replot", default=None, help="only redraw the PNG of this sweep JSON, then exit")
    p.add_argument("--load", nargs="*", default=[], help="earlier sweep JSON files: reuse their runs (same settings) "
                   "instead of recomputing models already in them; the report, default and plot cover all runs")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_name(Path(args.replot).stem + "_pareto.png"))
        return 0
    torch.set_num_threads(args.threads)
    taus = [1e6 if t.strip() == "inf" else float(t) for t in args.taus.split(",")]
    mults = [float(m) for m in args.alpha_mults.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    floors = [float(m) for m in args.mass_floors.split(",") if m.strip()]
    prices = [float(m) for m in args.mass_prices.split(",") if m.strip()]
    rule = (f"among the LYNX grid at B = {sizes[0]} on {Path(args.models[0]).name}, the fewest unique experts with "
            f"dCE <= {100 * args.ce_budget:g} % relative (ties: smaller dCE, then tau = 1, then smaller tau); then fixed "
            f"for every other model")
    report = {"settings": {"sequences": args.sequences, "prefill": args.prefill, "decode": args.decode,
                           "taus": taus, "alpha_mults": mults, "batch_sizes": sizes, "ce_budget": args.ce_budget,
                           "threads": args.threads, "torch": torch.__version__},
              "rule": rule, "runs": []}
    t_all = time.perf_counter()
    reused = set()
    for earlier in args.load:
        data = json.loads(Path(earlier).read_text())
        for key in ("sequences", "prefill", "decode"):
            if data["settings"][key] != report["settings"][key]:
                raise SystemExit(f"{earlier}: settings differ ({key}); rerun instead of --load")
        for run in data["runs"]:
            if run["batch_size"] in sizes:
                report["runs"].append(run)
                reused.add(run["model"])
    for path in args.models:
        name = Path(path).resolve().name
        if name in reused:
            print(f"== {name}: reusing runs from --load", file=sys.stderr)
            continue
        model, tok = ev.load_model(path)
        num_experts, top_k = ev.moe_shape(model)
        windows = ev.heldout_windows(tok, args.prefill + args.decode + 1, args.sequences)
        for i, b in enumerate(sizes):
            pol = policies(num_experts, top_k, taus, mults if i == 0 else [1.0], floors if i == 0 else [],
                           prices, (1.0, 2.0) if i == 0 else (1.0,))
            t0 = time.perf_counter()
            print(f"== {name} B={b}: {len(pol)} policies", file=sys.stderr, flush=True)
            run = ev.teacher_forced(model, windows, b, args.prefill, pol,
                                    progress=lambda line: print("  " + line, file=sys.stderr, flush=True))
            run.update(model=name, seconds=time.perf_counter() - t0)
            run["comparison"] = compare(run["results"], is_paper_lynx)
            run["comparison_price"] = compare(run["results"], is_price_lynx)
            report["runs"].append(run)
    order = [Path(m).resolve().name for m in args.models]
    report["runs"].sort(key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order),
                                       sizes.index(r["batch_size"])))
    first = Path(args.models[0]).resolve().name
    base = next(r for r in report["runs"] if r["model"] == first and r["batch_size"] == sizes[0])
    chosen = choose_default(base["results"], args.ce_budget)
    if chosen is not None:
        d = {"chosen_on": first, "batch_size": sizes[0], "tau": chosen["tau"], "alpha_mult": chosen["alpha_mult"],
             "mass_floor": chosen.get("mass_floor") or 0.0, "mass_price": chosen.get("mass_price"),
             "name": chosen["name"], "applied": {}}
        for run in report["runs"]:
            if run["batch_size"] != sizes[0]:
                continue
            none = next(r for r in run["results"] if r.get("policy") == "none")
            hit = next((r for r in run["results"] if r.get("policy") == "lynx" and r["tau"] == d["tau"]
                        and abs(r["alpha_mult"] - d["alpha_mult"]) < 1e-9
                        and (r.get("mass_floor") or 0.0) == d["mass_floor"]
                        and r.get("mass_price") == d["mass_price"]), None)
            if hit is not None:
                d["applied"][run["model"]] = {**{k: hit[k] for k in ("name", "unique_experts_after", "unique_ratio_vs_none",
                                                                      "delta_ce_rel", "delta_ce_rel_se", "top1_agreement",
                                                                      "routing_mass_kept")},
                                              "unique_before_none": none["unique_experts_before"]}
            own = choose_default(run["results"], args.ce_budget)  # what the rule would pick there (not used)
            d.setdefault("rule_on_each_model", {})[run["model"]] = None if own is None else own["name"]
        # at alpha 1x only (the k/N-derived alpha LynxConfig uses when alpha is None)
        only1 = choose_default([r for r in base["results"] if r.get("alpha_mult") in (None, 1.0)
                                and is_paper_lynx(r)], args.ce_budget)
        d["alpha_1x_choice"] = None if only1 is None else only1["name"]
        paper = choose_default([r for r in base["results"] if is_paper_lynx(r)], args.ce_budget)
        d["paper_rule_choice"] = None if paper is None else paper["name"]
        report["default"] = d
    report["seconds"] = time.perf_counter() - t_all
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / f"{args.name}.md").write_text(text)
    plot(report, out / f"{args.name}_pareto.png")
    print(text)
    print(f"wrote {out}/{args.name}.json, .md, _pareto.png in {report['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
