"""Never slower with the gate off (issue 54 item 7): fixture A served by vLLM on CPU, unpatched against the plugin
with its default configuration (``{"policy": "lynx"}``: the cost gate on, which keeps vLLM's routing on fixture A,
so every layer is bypassed), in eager and compiled mode, over interleaved rounds. Runs in the vLLM environment
(.venv-vllm, built by .ci/vllm_env.sh); the lead runs it alone (timings on a shared machine are noise):

    .venv-vllm/bin/python -m lab.gate_off_bench            # 5 rounds, eager and compiled, C 16 (prints the ratios)
    .venv-vllm/bin/python -m lab.gate_off_bench --tiny     # dry run: 1 round, 4 requests, 8 tokens
    .venv-vllm/bin/python -m lab.gate_off_bench --host-cost  # the plugin's own host time per step, in one engine

Protocol: one engine per (round, mode, variant), each in its own process (``lab.serve_bench``'s worker: in-process
engine core stepped by hand, a warm-up batch, then C requests of ``--prompt-tokens`` tokens at once, greedy,
``ignore_eos``, ``--max-tokens`` new tokens each). Within a round the modes and the variants are interleaved, the
order rotated each round (:func:`schedule`), so a drift of the machine falls on both sides. Per mode: the paired
ratio plugin / unpatched of each round's decode throughput and TPOT, their median and range
(:func:`ratios`); the goal is a decode-throughput ratio >= 1.0 (TPOT ratio <= 1.0). The engines' telemetry says how
many layers the gate bypassed. Writes ``eval/results/gate_off_bench.{md,json}``.

``--host-cost``: what the rounds cannot resolve on a noisy host (per-round ratios spread 0.8-1.2x: two 5-round runs
gave compiled medians 0.949 and 1.051) measured directly. With every layer bypassed the traced graph is vLLM's own
(the same Inductor kernels), so what the plugin adds to a step is host work: the functions its hooks call
(:data:`HOST_FUNCTIONS`) timed inside one default engine per mode while it serves the same batch, plus the three hook
frames (:func:`hook_frame_ns`, a microbenchmark of ``compat.wrap``), as a share of the engine's wall time per step.
Writes ``eval/results/gate_off_host.{md,json}``.
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
from .serve_bench import rotated, run_engine, write_results

#: the variants compared: vLLM with the plugin installed but off, and the plugin's default configuration
VARIANTS = {"unpatched": None, "default": {"policy": "lynx"}}
MODES = ("eager", "compiled")


def schedule(rounds: int, modes=MODES, variants=tuple(VARIANTS)) -> list[tuple[int, str, str]]:
    """``[(round, mode, variant)]`` in run order: every (mode, variant) once per round, the modes and the variants
    each rotated by the round (round 0: eager unpatched, eager default, compiled unpatched, compiled default; round
    1 starts with compiled, and each mode with the default), so neither side always runs first."""
    out = []
    for rnd in range(rounds):
        out.extend((rnd, mode, variant) for mode in rotated(modes, rnd) for variant in rotated(variants, rnd))
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


#: the plugin's per-step host functions, called by its hooks (lynx_hf.vllm.install) through module attributes: timed
#: where they are looked up. count_step and the bypass count run inside set_step_v1 / set_step_v2
HOST_FUNCTIONS = (("lynx_hf.vllm.steps", "set_step_v1"), ("lynx_hf.vllm.steps", "set_step_v2"),
                  ("lynx_hf.vllm.steps", "end_step"), ("lynx_hf.vllm.checks", "after_worker_step"),
                  ("lynx_hf.vllm.checks", "op_calls"), ("lynx_hf.vllm.checks", "check_warmup"))
#: the hooks a served step passes through (input preparation, the runner's and the worker's execute_model)
HOOK_FRAMES_PER_STEP = 3


def time_host_functions() -> dict:
    """Wrap each of :data:`HOST_FUNCTIONS` with a timer; returns ``{"module.name": [ns, calls]}`` (zeroed in place
    by the caller). The timer's own cost (two ``perf_counter_ns`` calls, ~0.1 us) is counted in: an upper bound."""
    import importlib

    cells = {}
    for module, name in HOST_FUNCTIONS:
        mod = importlib.import_module(module)
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        cell = cells.setdefault(f"{module.rsplit('.', 1)[1]}.{name}", [0, 0])

        def timed(*args, _fn=fn, _cell=cell, **kwargs):
            t = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                _cell[0] += time.perf_counter_ns() - t
                _cell[1] += 1

        setattr(mod, name, timed)
    return cells


def hook_frame_ns(calls: int = 200_000) -> float:
    """Nanoseconds one ``compat.wrap`` hook frame adds to a call (a wrapped method whose hook calls the original,
    against the method called directly; best of 5)."""
    from lynx_hf.vllm import compat

    class Plain:
        def step(self, x):
            return x

    class Wrapped(Plain):
        pass

    compat.wrap(Wrapped, "step", lambda original, self, x: original(self, x))
    best = []
    for obj in (Plain(), Wrapped()):
        runs = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for i in range(calls):
                obj.step(i)
            runs.append((time.perf_counter_ns() - t) / calls)
        best.append(min(runs))
    return best[1] - best[0]


def host_worker(spec_path: str, out_path: str) -> None:
    """One default engine (``spec``: a :func:`lab.serve_bench.worker` spec, one concurrency) serving a warm-up batch,
    then the timed batch with :data:`HOST_FUNCTIONS` timed: writes ``{"steps", "wall_s", "tpot_ms", "functions": {name: us per step}}``."""
    import json

    spec = json.loads(Path(spec_path).read_text())
    from .serve_bench import make_llm, make_prompts, timed_batch

    cells = time_host_functions()
    llm = make_llm(spec)
    concurrency = spec["concurrency"][0]
    prompts = make_prompts("fixture-a", Path(spec["model_path"]), concurrency, spec["prompt_tokens"], 4096,
                           seed=concurrency)
    timed_batch(llm, prompts, min(4, spec["max_tokens"]))
    for cell in cells.values():
        cell[0] = cell[1] = 0
    cell = timed_batch(llm, prompts, spec["max_tokens"])
    import lynx_hf.vllm as lynx_vllm

    summary = lynx_vllm.stats(llm)[0]["summary"]
    steps = cell["steps"]
    Path(out_path).write_text(json.dumps({
        "steps": steps, "wall_s": cell["wall_s"], "tpot_ms": cell["tpot_ms"],
        "bypassed": summary.get("gate_bypassed_layers"),
        "functions": {name: {"us_per_step": ns / 1e3 / steps, "calls_per_step": calls / steps}
                      for name, (ns, calls) in cells.items() if calls}}))


def host_cost(args, cmd: str, env: dict) -> int:
    """``--host-cost``: per mode one default engine (its own process) timing the plugin's host functions; the table
    of microseconds per step and their share of the step's wall time. Returns 0."""
    import vllm

    frame_ns = hook_frame_ns()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="lynx_gate_off_host_") as tmp:
        env.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "vllm_cache"))
        for mode in args.modes:
            spec = {"model": "fixture-a", "model_path": str(FIXTURE_A), "variant": f"host_{mode}", "round": 0,
                    "lynx": VARIANTS["default"], "eager": mode == "eager", "concurrency": [args.concurrency],
                    "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "dtype": args.dtype}
            rows[mode] = run_engine(spec, Path(tmp), env, args.timeout, worker=("lab.gate_off_bench", "--host-worker"))
    import torch

    lines = [f"# Gate off: the plugin's host time per step, fixture A in vLLM (CPU)\n\ncommand: `{cmd.strip()}`; "
             f"vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, {args.dtype}; one default "
             f"engine per mode, C {args.concurrency}, prompt {args.prompt_tokens} tokens, {args.max_tokens} new "
             f"tokens; hook frame {frame_ns:.0f} ns x {HOOK_FRAMES_PER_STEP} per step (microbenchmark of "
             "`compat.wrap`)", "",
             "| mode | layers bypassed | steps | wall per step (us) | TPOT (ms) | plugin host time per step (us) | "
             "share of the step | by function (us per step) |", "|---|---|---|---|---|---|---|---|"]
    for mode, r in rows.items():
        per_step_us = r["wall_s"] / r["steps"] * 1e6
        plugin_us = sum(f["us_per_step"] for f in r["functions"].values()) + HOOK_FRAMES_PER_STEP * frame_ns / 1e3
        r.update(wall_per_step_us=per_step_us, plugin_us_per_step=plugin_us, share=plugin_us / per_step_us)
        by = ", ".join(f"{name} {f['us_per_step']:.1f}" for name, f in sorted(r["functions"].items()))
        lines.append(f"| {mode} | {r['bypassed']} | {r['steps']} | {per_step_us:.0f} | {r['tpot_ms']:.2f} | "
                     f"{plugin_us:.1f} | {100 * r['share']:.2f} % | {by} |")
    write_results(args.out, "\n".join(lines) + "\n", {"command": cmd, "hook_frame_ns": frame_ns, "modes": rows})
    return 0


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
    p.add_argument("--host-cost", action="store_true",
                   help="time the plugin's host functions inside one default engine per mode (no rounds)")
    p.add_argument("--out", type=Path, default=None, help="output stem (default: eval/results/gate_off_bench[_tiny])")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.concurrency, args.prompt_tokens, args.max_tokens = 1, 4, 8, 8
    if args.out is None:
        stem = "gate_off_host" if args.host_cost else "gate_off_bench"
        args.out = RESULTS / (f"{stem}_tiny" if args.tiny else stem)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--host-worker"]:
        host_worker(argv[1], argv[2])
        return 0
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
    if args.host_cost:
        return host_cost(args, cmd, env)
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
