"""Never slower with the gate off (issue 54 item 7): fixture A served by vLLM on CPU, unpatched against the plugin
with its default configuration (``{"policy": "lynx"}``: the cost gate on, which keeps vLLM's routing on fixture A,
so every layer is bypassed), in eager and compiled mode, over interleaved rounds. Runs in the vLLM environment
(.venv-vllm, built by .ci/vllm_env.sh); the lead runs it alone (timings on a shared machine are noise):

    .venv-vllm/bin/python -m lab.gate_off_bench            # 5 rounds, eager and compiled, C 16 (prints the ratios)
    .venv-vllm/bin/python -m lab.gate_off_bench --tiny     # dry run: 1 round, 4 requests, 8 tokens

Protocol: one engine per (round, mode, variant), each in its own process (``lab.serve_bench``'s worker: in-process
engine core stepped by hand, a warm-up batch, then C requests of ``--prompt-tokens`` tokens at once, greedy,
``ignore_eos``, ``--max-tokens`` new tokens each). Within a round the modes and the variants are interleaved, the
order rotated each round (:func:`schedule`), so a drift of the machine falls on both sides. Per mode: the paired
ratio plugin / unpatched of each round's decode throughput and TPOT, their median and range
(:func:`ratios`); the goal is a decode-throughput ratio >= 1.0 (TPOT ratio <= 1.0). The engines' telemetry says how
many layers the gate bypassed. Writes ``eval/results/gate_off_bench.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import DEFAULT_FIXTURE as FIXTURE_A
from . import RESULTS_DIR as RESULTS
from . import command
from .serve_bench import run_engine, write_results

#: the variants compared: vLLM with the plugin installed but off, and the plugin's default configuration
VARIANTS = {"unpatched": None, "default": {"policy": "lynx"}}
MODES = ("eager", "compiled")


def schedule(rounds: int, modes=MODES, variants=tuple(VARIANTS)) -> list[tuple[int, str, str]]:
    """``[(round, mode, variant)]`` in run order: every (mode, variant) once per round, the modes and the variants
    each rotated by the round (round 0: eager unpatched, eager default, compiled unpatched, compiled default; round
    1 starts with compiled, and each mode with the default), so neither side always runs first."""
    out = []
    for rnd in range(rounds):
        mode_order = list(modes[rnd % len(modes):]) + list(modes[:rnd % len(modes)])
        variant_order = list(variants[rnd % len(variants):]) + list(variants[:rnd % len(variants)])
        out.extend((rnd, mode, variant) for mode in mode_order for variant in variant_order)
    return out


def ratios(results: list[dict], concurrency: int) -> dict:
    """Per mode, the paired ratios default / unpatched of each round (``results``: the workers' outputs with
    ``round``, ``mode`` and ``variant``): ``{mode: {"decode": [...], "tpot": [...], "decode_median", "tpot_median",
    "rounds", "bypassed"}}``; a round missing either side is left out."""
    cells = {}
    for r in results:
        cells.setdefault((r["mode"], r["round"]), {})[r["variant"]] = r["cells"][str(concurrency)]
    out = {}
    for mode in sorted({m for m, _ in cells}, key=lambda m: MODES.index(m) if m in MODES else len(MODES)):
        paired = [pair for (m, _), pair in sorted(cells.items()) if m == mode and {"unpatched", "default"} <= set(pair)]
        decode = [p["default"]["decode_tok_s"] / p["unpatched"]["decode_tok_s"] for p in paired]
        tpot = [p["default"]["tpot_ms"] / p["unpatched"]["tpot_ms"] for p in paired]
        bypassed = [p["default"].get("gate_bypassed_layers") for p in paired]
        out[mode] = {"decode": decode, "tpot": tpot, "rounds": len(paired),
                     "decode_median": statistics.median(decode) if decode else None,
                     "tpot_median": statistics.median(tpot) if tpot else None,
                     "bypassed": max((b for b in bypassed if b is not None), default=None)}
    return out


def markdown(table: dict, header: str) -> str:
    lines = [header, "", "| mode | rounds | decode tok/s ratio (median) | per round | TPOT ratio (median) | per round | "
             "layers bypassed | >= 1.0x |", "|---|---|---|---|---|---|---|---|"]
    for mode, row in table.items():
        med = row["decode_median"]
        lines.append(f"| {mode} | {row['rounds']} | {'—' if med is None else f'{med:.3f}'} | "
                     f"{[round(x, 3) for x in row['decode']]} | "
                     f"{'—' if row['tpot_median'] is None else format(row['tpot_median'], '.3f')} | "
                     f"{[round(x, 3) for x in row['tpot']]} | {row['bypassed']} | "
                     f"{'—' if med is None else ('yes' if med >= 1.0 else 'no')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine process")
    p.add_argument("--tiny", action="store_true", help="dry run: 1 round, C 4, 8 prompt and 8 new tokens")
    p.add_argument("--out", type=Path, default=None, help="output stem (default: eval/results/gate_off_bench[_tiny])")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.concurrency, args.prompt_tokens, args.max_tokens = 1, 4, 8, 8
    if args.out is None:
        args.out = RESULTS / ("gate_off_bench_tiny" if args.tiny else "gate_off_bench")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import vllm
    except ImportError:
        print("gate_off_bench needs vLLM: build .venv-vllm with .ci/vllm_env.sh and run it with .venv-vllm/bin/python",
              file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    cmd = command("gate_off_bench", argv)
    env = {k: v for k, v in os.environ.items() if k not in ("LYNX_VLLM_CONFIG", "LYNX_HF_GATE", "TRITON_INTERPRET")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    results = []
    with tempfile.TemporaryDirectory(prefix="lynx_gate_off_bench_") as tmp:
        work = Path(tmp)
        env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm_cache"))
        for rnd, mode, variant in schedule(args.rounds, tuple(args.modes)):
            spec = {"model": "fixture-a", "model_path": str(FIXTURE_A), "variant": f"{variant}_{mode}", "round": rnd,
                    "lynx": VARIANTS[variant], "eager": mode == "eager", "concurrency": [args.concurrency],
                    "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "vocab": 4096,
                    "dtype": args.dtype}
            out = run_engine(spec, work, env, args.timeout)  # (the worker's files are named by variant and mode)
            out.update(round=rnd, mode=mode, variant=variant)
            results.append(out)
    table = ratios(results, args.concurrency)
    import torch

    header = (f"# Gate off: fixture A in vLLM, the default configuration against unpatched (CPU)\n\ncommand: "
              f"`{cmd.strip()}`; vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
              f"{args.dtype}; {args.rounds} interleaved round(s), C {args.concurrency}, prompt {args.prompt_tokens} "
              f"tokens, {args.max_tokens} new tokens, greedy; total {time.perf_counter() - t_start:.0f} s")
    write_results(args.out, markdown(table, header), {"command": cmd, "ratios": table, "engines": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
