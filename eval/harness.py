"""Accuracy harness on one local checkpoint: teacher-forced decode, generation agreement, lm-eval.

    python -m lynx_hf.eval.harness                       # fixture A (lynx-hf eval)
    python -m lynx_hf.eval.harness --model eval/fixtures/mixtral-tiny --tau 1 --skip-lm-eval

Policies: unpatched (reference), none, LYNX (--tau/--alpha/--beta/--mass-price/--price-unit;
LynxConfig defaults otherwise), OEA for each --k0 (default k-1 .. 1), and XShare when --xshare-budget,
--xshare-fraction or --xshare-match (budget = the sweep default's unique experts at this fixture and
--batch-size, rounded) is given. The library code is lynx_hf.eval.evaluation (eval/evaluation.py).

1. teacher-forced decode: --sequences held-out windows in batches of --batch-size, a prefill of
   --prefill tokens then one token per step through the DynamicCache (every scored token comes from a
   true decode step); cross-entropy, accuracy, top-1 agreement / KL vs unpatched, unique experts per
   layer, routing mass kept. Checks: policy none is bit-identical to the unpatched model.
2. generation: greedy continuations of --gen-prompts prompts from eval/data/prompts.txt (one
   left-padded batch) vs unpatched: token agreement, exact match.
3. lm-eval (HFLM over the model object, fixed --lm-batch-size, local tasks in eval/tasks): per
   policy; check (CASES C17): the loglikelihood task's per-request results are bit-identical to
   unpatched for every policy.
Writes harness_<fixture>.json and .md to --out (default: eval/results in the source checkout, else
./lynx_hf_results); exit status 1 if a check fails.
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


from lynx_hf import LynxConfig  # noqa: E402

from . import command  # noqa: E402
from . import evaluation as ev  # noqa: E402

GEN_TASK = "lynx_code_line_completion"
LL_TASK = "lynx_code_next_line_mc"


def build_policies(args, top_k: int, xshare_budget: int | None = None) -> list:
    """none, LYNX (LynxConfig defaults unless a LYNX option is given; parsed like the CLI), OEA for each
    k0, and XShare when a budget is given (``--xshare-budget`` / ``--xshare-fraction`` / ``--xshare-match``)."""
    lynx = {k: v for k, v in (("tau", args.tau), ("alpha", args.alpha), ("beta", args.beta),
                              ("mass_price", args.mass_price),
                              ("price_unit", args.price_unit)) if v is not None}
    out = [("none", LynxConfig(policy="none")),
           ("lynx", LynxConfig.from_options({"policy": "lynx", **lynx}))]
    k0s = [int(k) for k in args.k0.split(",")] if args.k0 else list(range(top_k - 1, 0, -1))
    out += [(f"oea k0={k0}", LynxConfig(policy="oea", oea_k0=k0)) for k0 in k0s if 1 <= k0 < top_k]
    if xshare_budget is not None:
        out.append((f"xshare E={xshare_budget} w={args.xshare_warmup}",
                    LynxConfig(policy="xshare", xshare_budget=xshare_budget, xshare_warmup=args.xshare_warmup)))
    elif args.xshare_fraction is not None:
        out.append((f"xshare f={args.xshare_fraction:g} w={args.xshare_warmup}",
                    LynxConfig(policy="xshare", xshare_fraction=args.xshare_fraction, xshare_warmup=args.xshare_warmup)))
    return out


def matching_xshare_budget(sweep_json: str, model: str, batch_size: int) -> tuple[int, dict]:
    """XShare's budget matched to the sweep's default at this fixture and batch size: the default's mean
    unique experts per layer per decode step, rounded to the nearest int (>= 1). Returns (budget, the
    sweep's row of the default)."""
    report = json.loads(Path(sweep_json).read_text())
    d = report.get("default") or {}
    row = next((a for a in d.get("applied", []) if a["model"] == model and a["batch_size"] == batch_size), None)
    if row is None:
        raise SystemExit(f"{sweep_json}: no default measured for {model} at B = {batch_size}")
    return max(1, round(row["unique_experts_after"])), {**row, "default": d.get("name")}


def markdown(report: dict) -> str:
    tf = report["teacher_forced"]
    lines = [f"# Accuracy harness: {report['model']}", "",
             f"Command: `{report.get('command', '')}`", "",
             f"LYNX config: `{report['lynx_config']}`", ""]
    if report.get("xshare"):
        x = report["xshare"]
        lines += [f"XShare: `{x['name']}`" + (f" (budget matched to the sweep's default `{x['match']['default']}` at "
                                               f"B = {x['match']['batch_size']}: {x['match']['unique_experts_after']:.2f} "
                                               f"unique experts per layer per step, rounded)" if x.get("match") else ""), ""]
    lines += [
             f"## Teacher-forced decode (B = {tf['batch_size']}, {tf['sequences']} sequences x "
             f"({tf['prefill']} prefill + {tf['window_length'] - tf['prefill'] - 1} decode steps) = "
             f"{tf['scored_tokens']} scored tokens)", "",
             ev.markdown_table([{**r, "dpct": 100 * r["delta_ce_rel"], "se": 100 * r["delta_ce_rel_se"]}
                                for r in tf["results"]],
                               [("policy", "name", ""), ("CE", "ce", ".4f"), ("dCE %", "dpct", "+.2f"),
                                ("+- se", "se", ".2f"), ("acc", "acc", ".4f"), ("top-1 agree", "top1_agreement", ".4f"),
                                ("KL", "kl", ".5f"), ("experts before", "unique_experts_before", ".2f"),
                                ("experts after", "unique_experts_after", ".2f"),
                                ("mass kept", "routing_mass_kept", ".3f"), ("bit-identical", "bit_identical", "")]),
             ""]
    per = [r for r in tf["results"] if r.get("per_layer")]
    if per:
        layers = [layer["layer"] for layer in per[0]["per_layer"]]
        lines += ["Unique experts per layer (after the policy; policy none = the model's own routing):", "",
                  "| policy | " + " | ".join(layers) + " |", "|" + "---|" * (len(layers) + 1)]
        for r in per:
            lines.append(f"| {r['name']} | " + " | ".join(f"{layer['unique_experts_after']:.2f}"
                                                          for layer in r["per_layer"]) + " |")
        lines.append("")
    g = report["generation"]
    lines += [f"## Generation agreement ({g['prompts']} prompts, one left-padded batch, {g['max_new_tokens']} greedy "
              f"tokens)", "",
              ev.markdown_table(g["results"], [("policy", "name", ""), ("token agreement", "token_agreement", ".4f"),
                                               ("exact match", "exact_match", ".4f"),
                                               ("mean agreeing prefix", "mean_agree_prefix", ".2f"),
                                               ("experts before", "unique_experts_before", ".2f"),
                                               ("experts after", "unique_experts_after", ".2f")]), ""]
    if report.get("lm_eval"):
        le = report["lm_eval"]
        rows = []
        for name, run in le["runs"].items():
            row = {"name": name}
            for task, metrics in run["results"].items():
                for key, value in metrics.items():
                    if isinstance(value, float) and not key.endswith("_stderr,none"):
                        row[f"{task}/{key.split(',')[0]}"] = value
            if run.get("stats"):
                row["after"] = run["stats"]["unique_experts_after"]
                row["before"] = run["stats"]["unique_experts_before"]
            row["ll_identical"] = le["loglikelihood_bit_identical"].get(name, True)
            rows.append(row)
        metric_keys = sorted({k for row in rows for k in row if "/" in k})
        lines += [f"## lm-eval (HFLM, batch size {le['batch_size']}, limit {le['limit']}, local tasks)", "",
                  ev.markdown_table(rows, [("policy", "name", "")] + [(k, k, ".4f") for k in metric_keys] +
                                    [("experts before", "before", ".2f"), ("experts after", "after", ".2f"),
                                     (f"{LL_TASK} bit-identical (C17)", "ll_identical", "")]), ""]
    lines += ["## Checks", ""] + [f"- {name}: {'PASS' if ok else 'FAIL'}" for name, ok in report["checks"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ev.FIXTURES_DIR / "qwen2moe-tiny"),
                   help="local checkpoint folder (default: the packaged fixture A, qwen2moe-tiny)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--tau", type=float, default=None)
    p.add_argument("--alpha", type=float, default=None)
    p.add_argument("--beta", type=int, default=None)
    p.add_argument("--mass-price", default=None, help="LYNX mass_price (a number, or None for the paper's rule)")
    p.add_argument("--price-unit", default=None, choices=("token", "batch", "sqrt"), help="LYNX price_unit")
    p.add_argument("--xshare-budget", type=int, default=None, help="add XShare with this many experts per step")
    p.add_argument("--xshare-fraction", type=float, default=None, help="add XShare with budget ceil(fraction x N)")
    p.add_argument("--xshare-match", default=None, metavar="SWEEP_JSON",
                   help="add XShare with the budget of the sweep's default at this fixture and --batch-size (rounded)")
    p.add_argument("--xshare-warmup", type=int, default=1, help="XShare warm-up (each token's top experts kept first)")
    p.add_argument("--oea-k0", dest="k0", default=None, help="OEA k0 list, e.g. 2,1 (default k-1..1)")
    p.add_argument("--gen-prompts", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--skip-lm-eval", action="store_true")
    p.add_argument("--lm-batch-size", type=int, default=16)
    p.add_argument("--lm-limit", type=int, default=None, help="items per lm-eval task (default all)")
    ev.add_run_args(p)
    args = p.parse_args(argv)
    name, model, tok, t_all = ev.start_run(args)
    num_experts, top_k = ev.moe_shape(model)
    match = None
    xbudget = args.xshare_budget
    if args.xshare_match:
        xbudget, match = matching_xshare_budget(args.xshare_match, name, args.batch_size)
    pols = build_policies(args, top_k, xbudget)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report = {"model": name, "num_experts": num_experts, "top_k": top_k, "command": command("harness", argv),
              "lynx_config": {**dict(pols)["lynx"].to_dict(), "gate": ev.ACCURACY_GATE}, "checks": {}}  # what ran
    xs = [(n_, c) for n_, c in pols if c.policy == "xshare"]
    if xs:
        report["xshare"] = {"name": xs[0][0], "config": xs[0][1].to_dict(), "match": match}

    log(f"== teacher-forced decode ({name}, B={args.batch_size})")
    windows = ev.heldout_windows(tok, args.prefill + args.decode + 1, args.sequences)
    tf = ev.teacher_forced(model, windows, args.batch_size, args.prefill, pols, progress=lambda s: log("  " + s))
    report["teacher_forced"] = tf
    res = {r["name"]: r for r in tf["results"]}
    report["checks"]["policy none bit-identical to unpatched (teacher-forced)"] = (
        res["none"]["bit_identical"] and res["none"]["ce"] == res["unpatched"]["ce"])
    report["checks"]["lynx unique experts <= none"] = (
        res["lynx"]["unique_experts_after"] <= res["none"]["unique_experts_before"] + 1e-9)

    log("== generation agreement")
    gen = ev.generation_agreement(model, tok, ev.prompts_from_file(count=args.gen_prompts), pols,
                                  max_new_tokens=args.gen_tokens)
    report["generation"] = gen
    report["checks"]["policy none generation identical"] = next(
        r for r in gen["results"] if r["name"] == "none")["exact_match"] == 1.0

    if not args.skip_lm_eval:
        log("== lm-eval")
        runs, samples = {}, {}
        for pname, cfg in [("unpatched", None)] + pols:
            t0 = time.perf_counter()
            out = ev.run_lm_eval(model, tok, [GEN_TASK, LL_TASK], batch_size=args.lm_batch_size, config=cfg,
                                 limit=args.lm_limit)
            runs[pname] = {"results": out["results"], "seconds": time.perf_counter() - t0,
                           "stats": None if out["stats"] is None else
                           {k: out["stats"][k] for k in ("decode_steps", "unique_experts_before", "unique_experts_after",
                                                         "routing_mass_kept")}}
            samples[pname] = {task: ev.sample_responses(s) for task, s in out["samples"].items()}
            log(f"  {pname}: {json.dumps(out['results'])[:300]} ({runs[pname]['seconds']:.0f}s)")
        identical = {p_: samples[p_][LL_TASK] == samples["unpatched"][LL_TASK] for p_ in samples if p_ != "unpatched"}
        gen_same = {p_: sum(a == b for a, b in zip(samples[p_][GEN_TASK], samples["unpatched"][GEN_TASK])) /
                    max(len(samples["unpatched"][GEN_TASK]), 1) for p_ in samples if p_ != "unpatched"}
        report["lm_eval"] = {"batch_size": args.lm_batch_size, "limit": args.lm_limit, "runs": runs,
                             "loglikelihood_bit_identical": identical, "generation_same_output_share": gen_same}
        report["checks"]["C17 loglikelihood task bit-identical for every policy"] = all(identical.values())
        report["checks"]["policy none lm-eval generations identical"] = gen_same.get("none") == 1.0

    report["seconds"] = time.perf_counter() - t_all
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = report["generation"].pop("texts")
    (out / f"harness_{name}.json").write_text(json.dumps({**report, "generation_texts": texts}, indent=1))
    text = markdown(report)
    (out / f"harness_{name}.md").write_text(text)
    print(text)
    log(f"wrote {out}/harness_{name}.json and .md ({report['seconds']:.0f} s)")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
