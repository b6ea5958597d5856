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
unique experts. What both sweeps share (the catalogue, frontiers, the default rule, the per-run tables and plot) is
:mod:`lynx_hf.eval.pareto`; this module imports both, neither imports it.
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

from . import CHECKOUT, command, model_sweep, results_folder  # noqa: E402
from . import evaluation as ev  # noqa: E402
from .pareto import (  # noqa: E402
    ALPHA_MULTS,
    CANDIDATE_SERIES,
    PRICE_REF_B,
    PRICE_UNITS,
    SERIES_LABEL,
    TAUS,
    TAUS_OTHER,
    TOKEN_PRICES,
    TOKEN_PRICES_OTHER,
    UNIT_SCALE,
    XSHARE_FRACTIONS,
    XSHARE_WARMUPS,
    catalog,
    choose_default,
    compare_runs,
    find_point,
    fixture_label,
    grid,
    in_series,
    parse_grids,
    pct,
    plot,
    run_sections,
    series_of,
    tau_name,
)

DEFAULT_MODELS = [str(ev.FIXTURES_DIR / n) for n in ("qwen2moe-tiny", "mixtral-tiny", "deepseekv2-tiny")]
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
        lines += [f"**Chosen default (fixture {fixture_label(d['chosen_on'])}, B = {d['batch_size']}): `{d['name']}` "
                  f"(series {d['series']}: {SERIES_LABEL.get(d['series'], d['series'])}).** Rule-chosen point per "
                  f"candidate series: " + ", ".join(f"{k}: `{v['name'] if v else None}`" for k, v in d["series_choice"].items())
                  + f". Overall rule winner at B = {d['batch_size']}: `{d['rule_winner']}`. Unit: {d['unit_note']}", ""]
        lines += ["### The default at every fixture and batch size (calibration-free)", "",
                  "| fixture | B | unique experts none -> default | fewer | dCE % | +- se | <= budget |", "|---|---|---|---|---|---|---|"]
        for row in d["applied"]:
            lines.append(f"| {fixture_label(row['model'])} | {row['batch_size']} | {row['unique_before_none']:.2f} -> "
                         f"{row['unique_experts_after']:.2f} | {100 * (1 - row['unique_ratio_vs_none']):.1f} % | "
                         f"{100 * row['delta_ce_rel']:+.2f} | {100 * row['delta_ce_rel_se']:.2f} | "
                         f"{'yes' if row['delta_ce_rel'] <= s['ce_budget'] else '**no**'} |")
        lines += ["", "Checks: " + "; ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in d["checks"].items()), ""]
        lines += ["### Each candidate series' rule-chosen point at every fixture and B (dCE %, unique experts)", "",
                  "| series | point | " + " | ".join(f"{fixture_label(m)} B={b}" for m, b in d["cells"]) + " | worst dCE % |",
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
            lines.append(f"| {series} | `{info['name']}` | " + " | ".join(cells) + f" | {pct(worst)} |")
        lines.append("")
    if report.get("comparison_summary"):
        lines += ["## Frontier comparisons (counts over all comparison points of every B)", "",
                  "| comparison | fixture | ours wins | tie | peer wins | no overlap |", "|---|---|---|---|---|---|"]
        for key, per_model in report["comparison_summary"].items():
            for model, c in per_model.items():
                lines.append(f"| {c['title']} | {fixture_label(model)} | {c['counts'][c['names'][0]]} | {c['counts']['tie']} | "
                             f"{c['counts'][c['names'][1]]} | {c['counts']['out of range']} |")
        lines += ["", "Points where the peer loses less than our frontier (beyond the larger standard error of the two sides):", ""]
        any_loss = False
        for key, per_model in report["comparison_summary"].items():
            for model, c in per_model.items():
                for loss in c["peer_wins"]:
                    any_loss = True
                    lines.append(f"- {c['title']}, {fixture_label(model)} B = {loss['batch_size']}: at `{loss['at']}` "
                                 f"({loss['unique']:.2f} experts) ours {pct(loss['ours'])} % vs peer {pct(loss['peer'])} % "
                                 f"(se {pct(loss['se'], '.2f')} pp)")
        if not any_loss:
            lines.append("- none")
        lines.append("")
    return "\n".join(lines + run_sections(report)) + "\n"


# -- main -------------------------------------------------------------------------------------------
def code_version() -> dict:
    """The commit (source checkout only) and a hash of the library sources now (lynx_hf, lynx_hf.kernels,
    lynx_hf.patches, named lynx_hf/, kernels/, patches/ (the checkout folders before lynx_hf/kernels/), so a wheel and the checkout
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
    p.add_argument("--taus", default=",".join(tau_name(t) for t in TAUS))
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
                   f"the grids are trimmed (paper alpha 1x tau {', '.join(tau_name(t) for t in TAUS_OTHER)}; prices "
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


def summarize_default(report: dict, choice: dict, rule_model: str, sizes: list[int], budget: float) -> dict:
    """The unit decision (second criterion), the default applied at every (fixture, B), the issue's checks
    and each candidate series' chosen point everywhere."""
    cells = [(r["model"], r["batch_size"]) for r in report["runs"]]
    everywhere = {}
    for s, r in choice["series"].items():
        if r is None:
            everywhere[s] = None
            continue
        found = [find_point(run, r["name"]) for run in report["runs"]]
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
        worst = ", ".join(f"{u} {pct(everywhere[u]['worst'])} %" for u in units)
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
        hit = find_point(run, chosen["name"])
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
            checks[f"{fixture_label(model)} B = {sizes[0]}: unique experts >= 50 % fewer"] = a["unique_ratio_vs_none"] <= 0.5
    return {"chosen_on": rule_model, "batch_size": sizes[0], "name": chosen["name"], "series": series_of(chosen),
            "price_unit": unit, "mass_price": chosen.get("mass_price"), "tau": chosen.get("tau"),
            "alpha_mult": chosen.get("alpha_mult"), "rule_winner": winner["name"], "unit_note": note,
            "series_choice": {s: (None if r is None else {"name": r["name"], "unique_experts_after": r["unique_experts_after"],
                                                          "delta_ce_rel": r["delta_ce_rel"]})
                              for s, r in choice["series"].items()},
            "series_everywhere": everywhere, "cells": cells, "applied": applied, "checks": checks}


if __name__ == "__main__":
    sys.exit(main())
