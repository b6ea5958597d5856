"""Router report: what a trained MoE's routers do on held-out text (the phenomenon LYNX exploits).

    python -m lynx_hf.eval.router_report                                      # fixture A (lynx-hf report)
    python -m lynx_hf.eval.router_report --model eval/fixtures/mixtral-tiny

Per MoE layer: quantiles of the logit gap between rank 0 and ranks 1..k-1, router probability and
share of the top-k weight by rank, the share of assignments below LYNX's default voting cut-off
(gap > ln(N/k)), expert load skew (max/mean, min/mean, normalized entropy), and the unique experts a
position-aligned decode batch of B = 1, 8, 16, 32, 64 tokens touches (vs independent uniform routing).
Measured with full-sequence forwards of the unpatched model over held-out windows (docs and code
interleaved; the first --skip positions of each window are left out).
Writes router_report_<fixture>.json and .md to --out (default: eval/results in the source checkout, else
./lynx_hf_results).
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


from . import evaluation as ev  # noqa: E402


def _name(layer: dict) -> str:
    return layer.get("block") or str(layer["layer"])


def markdown(report: dict, name: str) -> str:
    k = report["top_k"]
    out = [f"# Router report: {name}", "",
           f"N = {report['num_experts']}, k = {k}; {report['windows']} held-out windows of {report['window_length']} "
           f"tokens (docs and code interleaved), positions >= {report['skip_positions']}: {report['tokens']} tokens. "
           f"Full-sequence forwards of the unpatched model (fp32).", "",
           "## Logit gap s0 - sr (nats; p_r/p_0 = exp(-gap)), median [q10, q90]", ""]
    head = "| layer | " + " | ".join(f"rank {r}" for r in range(1, k)) + \
           f" | share below vote cut-off ln(N/k)={report['vote_cutoff_gap']:.2f}, ranks 1..{k - 1} |"
    out += [head, "|" + "---|" * (k + 1)]
    for layer in report["layers"]:
        cells = [f"{g['q50']:.2f} [{g['q10']:.2f}, {g['q90']:.2f}]" for g in layer["gap_rank0_to_rank"].values()]
        below = ", ".join(f"{v:.2f}" for v in layer["below_vote_cutoff_by_rank"][1:])
        out.append(f"| {_name(layer)} | " + " | ".join(cells) + f" | {below} |")
    out += ["", "## Routing weight by rank", "",
            "| layer | mean p by rank (softmax over N) | top-k mass | share of top-k weight by rank |", "|---|---|---|---|"]
    for layer in report["layers"]:
        out.append(f"| {_name(layer)} | " + ", ".join(f"{v:.3f}" for v in layer["prob_by_rank"]) +
                   f" | {layer['topk_mass']:.3f} | " + ", ".join(f"{v:.3f}" for v in layer["topk_share_by_rank"]) + " |")
    out += ["", "## Expert load (all top-k assignments)", "", "| layer | max/mean | min/mean | entropy / ln N |",
            "|---|---|---|---|"]
    for layer in report["layers"]:
        out.append(f"| {_name(layer)} | {layer['load_max_over_mean']:.2f} | {layer['load_min_over_mean']:.2f} | "
                   f"{layer['load_entropy_norm']:.3f} |")
    sizes = list(report["layers"][0]["unique_experts_per_batch"])
    out += ["", "## Unique experts per position-aligned decode batch of B tokens: mean [q10, q90]", "",
            "| layer | " + " | ".join(f"B={b}" for b in sizes) + " |", "|" + "---|" * (len(sizes) + 1)]
    for layer in report["layers"]:
        u = layer["unique_experts_per_batch"]
        out.append(f"| {_name(layer)} | " + " | ".join(f"{u[b]['mean']:.2f} [{u[b]['q10']:.0f}, {u[b]['q90']:.0f}]"
                                                         for b in sizes) + " |")
    u = report["layers"][0]["unique_experts_per_batch"]
    out.append("| independent uniform | " + " | ".join(f"{u[b]['independent_uniform']:.2f}" for b in sizes) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ev.FIXTURES_DIR / "qwen2moe-tiny"),
                   help="local checkpoint folder (default: the packaged fixture A, qwen2moe-tiny)")
    p.add_argument("--windows", type=int, default=128, help="held-out windows (a multiple of 64)")
    p.add_argument("--length", type=int, default=128, help="tokens per window")
    p.add_argument("--skip", type=int, default=8, help="leading positions of each window left out")
    ev.add_run_args(p)
    args = p.parse_args(argv)
    name, model, tok, t0 = ev.start_run(args)
    windows = ev.heldout_windows(tok, args.length, args.windows)
    report = ev.router_statistics(model, windows, skip=args.skip)
    report.update(model=name, seconds=round(time.perf_counter() - t0, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"router_report_{name}.json").write_text(json.dumps(report, indent=1))
    text = markdown(report, name)
    (out / f"router_report_{name}.md").write_text(text)
    print(text)
    print(f"wrote {out / f'router_report_{name}.json'} and .md ({report['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
