"""Throughput under a TPOT SLO: the most decode tokens/s a serving engine reaches while its requests' TPOT stays within
a budget, unpatched vs LYNX (default config) vs OEA (k0 = 1) vs XShare (budget matched to LYNX), at the Qwen2-57B-A14B
layer shape.

    python -m lynx_hf.eval.slo transformers          # HF continuous batching (model.generate_batch): measure + table
    python -m lynx_hf.eval.slo table RUN.json ...    # the table and plot from measured curves (this script's JSON or
                                                     # lab.serve_bench's: the vLLM engine, run in .venv-vllm); two
                                                     # runs of one engine and model are two curves, each labeled
                                                     # with its file name (merge_runs), never merged

A serving user runs the batch (concurrent requests) with the most throughput whose decode-step latency meets the SLO
(the largest such batch only where tokens/s rise with the batch: measured curves dip); fewer distinct experts per step
move that point. Per engine, model and variant the run measures one point per concurrency C:
the median per-request TPOT (ms; (time of the last token - time of the first) / (tokens - 1), as vLLM's benchmarks
define it) and the decode throughput (tokens/s: decode tokens / decode span, all C requests added at once). For an
SLO of S ms, a variant's reachable throughput is the most tokens/s among its points with TPOT <= S (measured points
only, no interpolation: a variant whose point at C lands 1 % above S does not get C). The SLOs are (a) multiples of
the unpatched engine's TPOT at C = 1 (``--multiples``) and (b) the unpatched TPOT at C = 8, 16, 32 (``--at``).

CPU vs GPU. Absolute TPOTs here are CPU times (2 cores, ~10-20 GB/s of memory bandwidth), far from an H200's. The
paper's SLOs (25 / 50 ms) are absolute GPU budgets; the SLOs here are relative to the unpatched batch-1 TPOT, which
carries over to a GPU where a decode step is memory-bound on both (step time ~ bytes of the distinct experts read +
a fixed part): an SLO of m x TPOT(C = 1) on the GPU corresponds to the same m here only as far as the fixed part
(attention, router, launch overhead) has the same share of the batch-1 step, which it does not in general. Read the
ratios, not the milliseconds; lab/gpu_check.py times the GPU.

The transformers engine (``transformers``): the model of ``lynx_hf.eval.bench``'s TPOT section (Qwen2-57B-A14B config
cut to ``--layers`` decoder layers, vocabulary ``--vocab``, random bf16 weights (``--dtype``), router calibrated to a mean top-1
probability of 0.42), in one process; variants are patched / unpatched in turn (rotated per round) on the same
weights; prompts of ``--prompt-tokens`` random ids, greedy, no EOS, ``--new-tokens`` each, ``record_timestamps``.

Routing-mass price: ``--full-layers`` (``lynx_hf.eval.depth``; default ``real``: Qwen2-57B-A14B's 28 MoE layers, price
7/64 x 4 / 28 = 1/64) sets the price LYNX runs on the cut (``lynx_hf.at_depth``); ``cut`` runs the price as given (7/64
on a cut of <= 4 layers: every run before issue 52). Each point records it (``mass_price``, ``full_layers``) and the
tables say it; a run file without it predates the option (the price as given on its cut).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from . import RESULTS_DIR as RESULTS  # noqa: E402
from . import command, results_folder  # noqa: E402
from .depth import add_full_layers, full_depth, options_at_depth, price_label, price_of  # noqa: E402

#: XShare's budget (experts per layer-step; ``--xshare-budget``): the default's unique experts at 16 requests on this
#: shape, rounded up, at the price the run gives LYNX. At the full model's price (``--full-layers real``, the default:
#: 1/64 at Qwen2-57B-A14B's 28 MoE layers) LYNX keeps 40.55 in vLLM (eval/results/serve_slo_vllm_fulldepth_r3.md): 41;
#: at the price as given on the cut (``--full-layers cut``, 7/64) it kept 14.93 (eval/results/serve_bench.md): 15
XSHARE_BUDGET = {"real": 41, "cut": 15}
#: the variants compared and their lynx_hf configuration (``None``: the model unpatched); XShare's budget is the
#: full model's price's (:func:`variants` sets another)
VARIANTS = {"unpatched": None, "lynx": {"policy": "lynx"}, "oea": {"policy": "oea", "oea_k0": 1},
            "xshare": {"policy": "xshare", "xshare_budget": XSHARE_BUDGET["real"], "xshare_warmup": 1}}


def variants(xshare_budget: int | None = None, full_layers="real") -> dict:
    """:data:`VARIANTS` with XShare's budget ``xshare_budget`` (experts per layer-step), or where ``None`` the one
    matched to LYNX at the price ``full_layers`` gives (:data:`XSHARE_BUDGET`: ``"cut"`` -> 15, else 41; a depth
    other than Qwen2-57B-A14B's 28 has no matched budget and takes 41). Raises ``ValueError`` for a budget < 1."""
    if xshare_budget is None:
        xshare_budget = XSHARE_BUDGET["cut" if full_layers == "cut" else "real"]
    if int(xshare_budget) < 1:
        raise ValueError(f"xshare_budget must be >= 1, got {xshare_budget}")
    return {**VARIANTS, "xshare": {**VARIANTS["xshare"], "xshare_budget": int(xshare_budget)}}
CONCURRENCY = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
MULTIPLES = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
AT = (8, 16, 32)


# ------------------------------------------------------------------------------------------ the table
def points_of(run: dict) -> list[dict]:
    """The measured points of a run file: this script's (``points``) or ``lab.serve_bench``'s (``rows``), as
    ``{engine, model, variant, concurrency, tpot_ms, tok_s, unique_before, unique_after}``."""
    if "points" in run:
        return run["points"]
    return [{"engine": "vllm", "model": r["model"], "variant": r["variant"], "concurrency": r["concurrency"],
             "tpot_ms": r["tpot_ms"], "tok_s": r["decode_tok_s"], "unique_before": r.get("unique_before"),
             "unique_after": r.get("unique_after"), "gate_off": r.get("gate_off", False),
             **{key: r[key] for key in ("mass_price", "full_layers", "cut_layers") if key in r}}
            for r in run["rows"]]


def merge_runs(runs: list[dict], labels: list[str] | None = None) -> list[dict]:
    """The points of several run files, for one table. Where two files hold a point of the same engine, model, variant
    and concurrency C (two runs of one engine and model: another day, another machine, another config), their curves
    are never merged into one: each of those files' points keeps its own curve, the model named ``"<model> [<label>]"``
    (``labels``: one per run, default ``run 1``, ``run 2``, ...; the table command uses the file names), so its SLO
    rows are its own. Files whose points do not collide (variants measured in separate runs) still make one curve.
    Raises ``ValueError`` for a run file that holds two points of one (engine, model, variant, C)."""
    labels = labels or [f"run {i + 1}" for i in range(len(runs))]
    if len(labels) != len(runs) or len(set(labels)) != len(labels):
        raise ValueError(f"one distinct label per run file, got {labels} for {len(runs)} runs")
    per_run = [points_of(run) for run in runs]
    owners: dict[tuple, list[int]] = {}
    for i, points in enumerate(per_run):
        seen = set()
        for point in points:
            key = (point["engine"], point["model"], point["variant"], point["concurrency"])
            if key in seen:
                raise ValueError(f"{labels[i]}: two points of {key[0]} / {key[1]} / {key[2]} at C={key[3]}; a run file "
                                 f"holds one point per engine, model, variant and concurrency")
            seen.add(key)
        for curve in {(p["engine"], p["model"]) for p in points}:
            owners.setdefault(curve, []).append(i)
    clashing = set()
    for curve, files in owners.items():
        keys = [{(p["variant"], p["concurrency"]) for p in per_run[i] if (p["engine"], p["model"]) == curve}
                for i in files]
        if any(a & b for j, a in enumerate(keys) for b in keys[j + 1:]):
            clashing.add(curve)
    out = []
    for i, points in enumerate(per_run):
        for point in points:
            if (point["engine"], point["model"]) in clashing:
                point = {**point, "model": f"{point['model']} [{labels[i]}]"}
            out.append(point)
    return out


def best_under(points: list[dict], slo_ms: float) -> dict | None:
    """The point with the most tokens/s among ``points`` whose TPOT meets ``slo_ms``; None when none does."""
    ok = [p for p in points if p["tpot_ms"] <= slo_ms]
    return max(ok, key=lambda p: p["tok_s"]) if ok else None


def slo_rows(points: list[dict], multiples=MULTIPLES, at=AT) -> list[dict]:
    """One row per (engine, model, SLO, variant): the SLO (ms), the best point under it and its throughput ratio to
    the unpatched engine's best under the same SLO. ``ValueError`` when a curve has no unpatched points."""
    rows = []
    for engine, model in sorted({(p["engine"], p["model"]) for p in points}):
        curve = [p for p in points if p["engine"] == engine and p["model"] == model]
        base = sorted((p for p in curve if p["variant"] == "unpatched"), key=lambda p: p["concurrency"])
        if not base:
            raise ValueError(f"{engine} / {model}: no unpatched points to set the SLOs from")
        slos = [(f"{m:g} x TPOT(unpatched, C={base[0]['concurrency']})", m * base[0]["tpot_ms"]) for m in multiples]
        slos += [(f"TPOT(unpatched, C={p['concurrency']})", p["tpot_ms"]) for p in base if p["concurrency"] in at]
        variants = list(dict.fromkeys(p["variant"] for p in curve))
        for label, slo in slos:
            ref = best_under(base, slo)
            for v in variants:
                best = best_under([p for p in curve if p["variant"] == v], slo)
                rows.append({"engine": engine, "model": model, "slo": label, "slo_ms": slo, "variant": v,
                             "concurrency": best and best["concurrency"], "tpot_ms": best and best["tpot_ms"],
                             "tok_s": best and best["tok_s"],
                             "ratio": (best["tok_s"] / ref["tok_s"]) if best and ref else None})
    return rows


def step_model(points: list[dict]) -> dict | None:
    """Least-squares fit of ``TPOT = a + b * T + c * C`` over one curve's points (T: unique experts per MoE layer per
    decode step after the policy; the unpatched engine's T is the other variants' T before at the same C): ``b`` is
    the time of one more distinct expert (its weights read: memory), ``c`` the time of one more request (its k experts,
    the shared expert, attention: compute). A step is memory-bound while ``b * T`` dominates ``c * C``; LYNX lowers T,
    never the FLOPs, so its gain shrinks as ``c * C`` grows. None with fewer than 4 points that know T."""
    import numpy as np

    before = {}
    for p in points:
        if p.get("unique_before") is not None:
            before.setdefault(p["concurrency"], []).append(p["unique_before"])
    rows, y = [], []
    for p in points:
        t = p.get("unique_after")
        if p["variant"] == "unpatched" and p["concurrency"] in before:
            t = statistics.mean(before[p["concurrency"]])
        if t is not None and not p.get("gate_off"):
            rows.append([1.0, t, p["concurrency"]])
            y.append(p["tpot_ms"])
    if len(rows) < 4:
        return None
    a, y = np.array(rows), np.array(y)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - a @ coef
    r2 = 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())
    return {"a_ms": float(coef[0]), "b_ms_per_expert": float(coef[1]), "c_ms_per_request": float(coef[2]),
            "r2": r2, "points": len(y), "max_abs_residual_ms": float(abs(resid).max())}


def point_price(point: dict) -> str:
    """The routing-mass price a point ran, as the tables say it (``mass_price`` / ``full_layers`` / ``cut_layers`` of
    the point; a point without them is from a run before ``--full-layers``)."""
    if point["variant"] != "lynx":
        return "—"
    if "full_layers" not in point:
        return "not recorded (before --full-layers: as given on the cut)"
    depth = point["full_layers"]
    return price_label(point.get("mass_price"), None if depth == "cut" else depth, point.get("cut_layers", "?"))


def unique_from_summary(summary: dict) -> dict:
    """A patched point's ``unique_before`` / ``unique_after`` from ``lynx_hf.stats(model).summary()``; with no decode
    step recorded (``decode_steps`` 0: the cost gate kept the model's own routing on every layer-step, e.g. XShare
    whose budget exceeds the batch's union) both ``None`` and ``gate_off`` true where the gate skipped steps, so the
    table says so instead of "0.00 -> 0.00" (the summary's placeholders for no step)."""
    if not summary.get("decode_steps"):
        return {"unique_before": None, "unique_after": None, "gate_off": bool(summary.get("gate_steps_skipped"))}
    return {"unique_before": summary.get("unique_experts_before"), "unique_after": summary.get("unique_experts_after")}


def curve_markdown(points: list[dict]) -> str:
    out = ["| engine | model | C | variant | TPOT (ms) | decode tok/s | unique experts before → after | routing-mass price |",
           "|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["engine"], p["model"], p["concurrency"], p["variant"])):
        t = "—" if p.get("unique_before") is None else f"{p['unique_before']:.2f} → {p['unique_after']:.2f}"
        if p.get("gate_off"):
            t = "gate off: the engine's own routing"
        out.append(f"| {p['engine']} | {p['model']} | {p['concurrency']} | {p['variant']} | {p['tpot_ms']:.1f} | "
                   f"{p['tok_s']:.1f} | {t} | {point_price(p)} |")
    return "\n".join(out)


def slo_markdown(rows: list[dict]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    out = ["| engine | model | SLO | SLO (ms) | " + " | ".join(f"{v}: tok/s (C)" for v in variants)
           + " | " + " | ".join(f"{v} / unpatched" for v in variants if v != "unpatched") + " |",
           "|---" * (4 + len(variants) + len(variants) - 1) + "|"]
    keys = list(dict.fromkeys((r["engine"], r["model"], r["slo"]) for r in rows))
    for key in keys:
        mine = [r for r in rows if (r["engine"], r["model"], r["slo"]) == key]
        cells = {r["variant"]: r for r in mine}
        if len(cells) != len(mine):  # one row per variant: never keep one of two same-named rows
            raise ValueError(f"{' / '.join(key)}: several rows of one variant (label the runs: merge_runs)")
        first = next(iter(cells.values()))
        tput = [("—" if cells[v]["tok_s"] is None else f"{cells[v]['tok_s']:.1f} ({cells[v]['concurrency']})")
                if v in cells else "" for v in variants]
        ratio = [("—" if cells[v]["ratio"] is None else f"**{cells[v]['ratio']:.2f}×**") if v in cells else ""
                 for v in variants if v != "unpatched"]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {first['slo_ms']:.1f} | " + " | ".join(tput) + " | "
                   + " | ".join(ratio) + " |")
    return "\n".join(out)


def plot(points: list[dict], rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = sorted({(p["engine"], p["model"]) for p in points})
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (engine, model) in zip(axes[0], curves):
        mine = [p for p in points if (p["engine"], p["model"]) == (engine, model)]
        for v in dict.fromkeys(p["variant"] for p in mine):
            pts = sorted((p for p in mine if p["variant"] == v), key=lambda p: p["concurrency"])
            ax.plot([p["tpot_ms"] for p in pts], [p["tok_s"] for p in pts], marker="o", label=v)
            for p in pts:
                ax.annotate(str(p["concurrency"]), (p["tpot_ms"], p["tok_s"]), fontsize=6, alpha=0.7)
        for r in rows:
            if (r["engine"], r["model"]) == (engine, model) and r["variant"] == "unpatched" and r["slo"].startswith("TPOT"):
                ax.axvline(r["slo_ms"], color="grey", lw=0.7, ls="--")
        ax.set_xlabel("TPOT (ms, median per request)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{engine}: {model}\n(numbers: concurrent requests; dashed: unpatched TPOT at C = 8/16/32)",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_table(runs: list[dict], out: Path, stem: str, cmd: str, multiples=MULTIPLES, at=AT,
                labels: list[str] | None = None) -> str:
    """Write ``<stem>.md`` / ``.json`` / ``.png`` (the SLO table, the curves, the plot) to ``out``; returns the
    markdown. Runs of one engine and model whose points collide are labeled apart (:func:`merge_runs`)."""
    points = merge_runs(runs, labels)
    rows = slo_rows(points, multiples, at)
    sources = "; ".join(f"`{run.get('command', '?')}`" for run in runs)
    fits = {}
    for engine, model in sorted({(p["engine"], p["model"]) for p in points}):
        fit = step_model([p for p in points if (p["engine"], p["model"]) == (engine, model)])
        if fit:
            fits[f"{engine} / {model}"] = fit
    fit_md = "\n".join(f"- {k}: TPOT ≈ {f['a_ms']:.1f} ms + {f['b_ms_per_expert']:.2f} ms × T + "
                        f"{f['c_ms_per_request']:.2f} ms × C (R² {f['r2']:.3f}, {f['points']} points, largest residual "
                        f"{f['max_abs_residual_ms']:.1f} ms)" for k, f in fits.items())
    prices = "\n".join(f"- {engine} / {model}: LYNX ran {label}" for (engine, model), label in sorted(
        {((p["engine"], p["model"]), point_price(p)) for p in points if p["variant"] == "lynx"}))
    md = (f"# Throughput under a TPOT SLO\n\ncommand: `{cmd.strip()}`; measured by {sources}\n\n"
          "Most decode tokens/s whose median TPOT meets the SLO (the concurrency C that reached it); ratios to the "
          "unpatched engine under the same SLO.\n\n" + (f"Routing-mass price:\n\n{prices}\n\n" if prices else "")
          + slo_markdown(rows) + "\n\n## Step model\n\n"
          "Least squares over every point (T: unique experts per layer-step after the policy; C: requests):\n\n"
          + (fit_md or "- (too few points)") + "\n\n## Curves\n\n" + curve_markdown(points) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "sources": [r.get("command") for r in runs],
                                                  "rows": rows, "step_model": fits, "points": points}, indent=1))
    plot(points, rows, out / f"{stem}.png")
    return md


# ------------------------------------------------------------------------------------------ transformers engine
def run_transformers(args) -> dict:
    """Measure the transformers continuous-batching curves (see the module docstring). Returns the run dict."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import lynx_hf

    from .bench import SHAPES, build_tpot_model, scaled_shapes

    if args.threads:
        torch.set_num_threads(args.threads)
    kw = (scaled_shapes(args.scale) if args.scale > 1 else SHAPES)["qwen2-57b-a14b"][1]
    model = build_tpot_model(kw, args.layers, args.vocab)
    if args.dtype == "float32":
        model = model.float()
    model = model.to(getattr(args, "device", "cpu"))
    gen = torch.Generator().manual_seed(7)
    top = max(args.concurrency)
    prompts = torch.randint(1, args.vocab, (top, args.prompt_tokens), generator=gen).tolist()
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    depth = full_depth(getattr(args, "full_layers", "real"), "qwen2-57b-a14b")
    chosen = variants(getattr(args, "xshare_budget", None), getattr(args, "full_layers", "real"))
    options = {v: options_at_depth(chosen[v], depth) for v in chosen}
    print(f"  LYNX routing-mass {price_label(price_of(options['lynx'], args.layers), depth, args.layers)}", flush=True)

    def once(variant: str, c: int, new_tokens: int) -> dict:
        lynx_hf.unpatch(model)
        if options[variant] is not None:
            lynx_hf.patch(model, **options[variant])
        # explicit sizes: transformers otherwise sizes the paged cache from free memory (slow to zero on CPU); one
        # forward holds every prompt (the timed part is pure decode)
        cb = ContinuousBatchingConfig(num_blocks=max(16, 2 * c), page_size=64,
                                      max_batch_tokens=max(256, c * args.prompt_tokens), max_requests_per_batch=top)
        cfg = GenerationConfig(**{**config.to_dict(), "max_new_tokens": new_tokens})
        t0 = time.perf_counter()
        out = model.generate_batch(prompts[:c], generation_config=cfg, continuous_batching_config=cb,
                                   record_timestamps=True, progress_bar=False)
        wall = time.perf_counter() - t0
        stamps = [o.timestamps for o in out.values()]
        tpots = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if s and len(s) > 1]
        first, last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
        point = {"tpot_ms": statistics.median(tpots) * 1e3,
                 "tok_s": sum(len(s) - 1 for s in stamps) / (last - first), "wall_s": wall,
                 "tokens": [len(o.generated_tokens) for o in out.values()]}
        if options[variant] is not None:
            point.update(unique_from_summary(lynx_hf.stats(model).summary()))
            lynx_hf.unpatch(model)
        return point

    names = ["unpatched", *[v for v in args.variants if v != "unpatched"]]
    measured = {}
    with torch.inference_mode():
        for c in args.concurrency:
            for v in names:  # warm-up per C (allocator, first-call costs, the gate's patch-time timing)
                once(v, c, 3)
            for r in range(args.rounds):
                for v in names[r % len(names):] + names[:r % len(names)]:
                    p = once(v, c, args.new_tokens)
                    measured.setdefault((v, c), []).append(p)
                    print(f"  transformers C={c:3d} {v:9s} round {r}: TPOT {p['tpot_ms']:8.1f} ms  {p['tok_s']:7.1f} "
                          f"tok/s  T {p.get('unique_before')} -> {p.get('unique_after')}", flush=True)
    model_name = (f"qwen2-57b-{args.layers}l" + (f"/{args.scale}" if args.scale > 1 else "")
                  + ("" if args.dtype == "bfloat16" else f" {args.dtype}"))
    points = []
    for (v, c), ps in measured.items():
        med = lambda key, ps=ps: statistics.median(p[key] for p in ps)  # noqa: E731
        before = [p["unique_before"] for p in ps if p.get("unique_before") is not None]
        points.append({"engine": "transformers-cb", "model": model_name, "variant": v, "concurrency": c,
                       "tpot_ms": med("tpot_ms"), "tok_s": med("tok_s"), "rounds": len(ps),
                       "tpot_ms_rounds": [round(p["tpot_ms"], 2) for p in ps],
                       "unique_before": statistics.median(before) if before else None,
                       "unique_after": statistics.median(p["unique_after"] for p in ps) if before else None,
                       "mass_price": price_of(options[v], args.layers), "full_layers": depth or "cut",
                       "cut_layers": args.layers})
    return {"command": args.cmd, "points": points}


# ------------------------------------------------------------------------------------------ CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("transformers", help="measure HF continuous batching (generate_batch), then write the table")
    t.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    t.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    t.add_argument("--rounds", type=int, default=1)
    t.add_argument("--prompt-tokens", type=int, default=32)
    t.add_argument("--new-tokens", type=int, default=32)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--scale", type=int, default=1, help="divide the model's sizes by this (smoke runs)")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="float32 on CPUs without native bf16 (AVX2 only), where bf16 GEMMs take slow paths")
    t.add_argument("--also", nargs="*", type=Path, default=[], help="further run files to put in the same table")
    add_full_layers(t, "Qwen2-57B-A14B")
    t.add_argument("--xshare-budget", type=int, default=None,
                   help="XShare's budget, experts per layer-step (default: matched to LYNX at 16 requests at the price "
                        "--full-layers gives: 41 at the full model's, 15 with --full-layers cut)")
    s = sub.add_parser("table", help="the table and plot from run files")
    s.add_argument("runs", nargs="+", type=Path)
    for q in (t, s):
        q.add_argument("--multiples", nargs="+", type=float, default=list(MULTIPLES))
        q.add_argument("--at", nargs="+", type=int, default=list(AT))
        q.add_argument("--out", type=Path, default=RESULTS, help="results folder")
        q.add_argument("--name", default="slo", help="output stem")
    args = p.parse_args(argv)
    results_folder(args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.cmd = command("slo", argv)
    if args.what == "transformers":
        import torch

        torch.set_flush_denormal(True)  # process-wide state: set by the command, never by run_transformers (callers)
        run = run_transformers(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}_run.json").write_text(json.dumps(run, indent=1))
        runs = [run, *[json.loads(p.read_text()) for p in args.also]]
        files = [Path(f"{args.name}_run.json"), *args.also]
    else:
        runs = [json.loads(p.read_text()) for p in args.runs]
        files = list(args.runs)
    labels = [str(f) for f in files] if len({f.name for f in files}) < len(files) else [f.name for f in files]
    print(write_table(runs, args.out, args.name, args.cmd, args.multiples, args.at, labels), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
