"""How long ``patch(gate="auto")`` takes, and whether processes agree, with the cost gate's decisions as data.

Each run is a fresh Python process (what a user pays per process), on one model:

- ``fixture-a``: eval/fixtures/qwen2moe-tiny as ``from_pretrained`` loads it;
- ``qwen2-57b``: one Qwen2-57B-A14B MoE layer (H 3584, 64 experts of I 2560, top-8, shared I 20480; bf16; the
  benchmarks' calibrated router, ``lynx_hf.eval.bench.build_tpot_model``).

Per model:

1. ``cold``: an empty per-user cache: the gate measures every bucket and writes the cache;
2. ``cache``: a new process, the same cache: read, not measured;
3. ``table``: a new process, an empty cache, the entry given as a decision table (``gate_table``: what ``lynx-hf
   tune`` writes, or what the package ships for this machine kind);
4. ``pair``: two processes started together on one new empty cache, the second next to a CPU-bound load (a busy
   loop in a third process): both take identical decisions (one measures, the other waits for the cache's lock and
   reads them).

Prints one row per run (patch seconds, where the decisions came from, the step sizes where the policy runs) and
whether the pair agreed; writes eval/results/bench_gate.md. ``--old REV`` adds a row per model for the code at git
revision REV (checked out into eval/work): the gate before decisions were data (it measures in every process).

    python -m lab.bench_gate                     # both models (run it alone: it times)
    python -m lab.bench_gate --models fixture-a --old 6de2659
    python -m lab.bench_gate --ship              # measure the shipped table of this machine kind

``--ship`` measures (in this process, at torch's default thread count) the decisions of fixture A as ``from_pretrained``
loads it (bfloat16) and as ``lynx-hf generate`` does (float32), and of the Qwen2-57B 1-layer cut (bfloat16), and writes
them to ``lynx_hf/gate/tables/<this device kind>.<model>.json`` (``fixture-a``, ``qwen2-57b-a14b-1-layer-cut``): the
tables the package ships for this machine kind, each named as what it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import RESULTS_DIR, ROOT, command

MODELS = ("fixture-a", "qwen2-57b")

#: the child: build the model, patch with the default gate, print one JSON line
CHILD = r"""
import json, sys, time
import torch
model_name, table = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None)
if model_name == "fixture-a":
    from transformers import AutoModelForCausalLM
    from lynx_hf.eval import FIXTURES_DIR
    model = AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / "qwen2moe-tiny").eval()
else:
    from lynx_hf.eval.bench import SHAPES, build_tpot_model
    model = build_tpot_model(SHAPES["qwen2-57b-a14b"][1], layers=1, vocab=1024)
import lynx_hf
from lynx_hf import gate
import warnings
warnings.simplefilter("ignore")
config = lynx_hf.LynxConfig() if table is None else lynx_hf.LynxConfig(gate_table=table)
start = time.perf_counter()
lynx_hf.patch(model, config)
seconds = time.perf_counter() - start
planned = [gate.of(b.plan) for b in lynx_hf.state.state_of(model).blocks]
first = planned[0]
print(json.dumps({"seconds": seconds, "source": getattr(first, "source", "in-process measurement"),
                  "on": [b for b, d in sorted(first.decisions.items()) if d.on],
                  "decisions": {str(b): d.on for b, d in sorted(first.decisions.items())},
                  "digest": first.key.digest() if getattr(first, "key", None) is not None else None}))
"""


def child(model: str, cache: Path, table: Path | None = None, python: str = sys.executable, cwd: Path = ROOT,
          background: bool = False):
    """Start the child process on ``model`` with the per-user cache ``cache`` (and ``table``)."""
    env = {**os.environ, "LYNX_HF_CACHE": str(cache), "PYTHONPATH": str(cwd)}
    env.pop("LYNX_HF_GATE", None)
    args = [python, "-c", CHILD, model, str(table) if table else ""]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    return proc if background else finish(proc)


def finish(proc) -> dict:
    out, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def burner():
    """A CPU-bound load in its own process (a busy loop)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def old_checkout(rev: str) -> Path:
    """The tree at git revision ``rev`` in eval/work/bench_gate_<rev> (a worktree)."""
    where = ROOT / "eval" / "work" / f"bench_gate_{rev}"
    if not where.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                       capture_output=True)
    return where


def run(models, old: str | None, log=print) -> list[dict]:
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory(prefix="lynx_bench_gate_") as tmp:
            tmp = Path(tmp)
            if old:
                worktree = old_checkout(old)
                got = child(model, tmp / "old", cwd=worktree)
                rows.append({"model": model, "run": f"before ({old}): every process measures", **got})
                log(rows[-1])
            cold = child(model, tmp / "a")
            rows.append({"model": model, "run": "cold: empty cache, measured", **cold})
            log(rows[-1])
            rows.append({"model": model, "run": "cache: a new process, same cache", **child(model, tmp / "a")})
            log(rows[-1])
            table = next((tmp / "a" / "gate").glob("*.json"))  # the cache file is a decision table
            rows.append({"model": model, "run": "table: a new process, empty cache, gate_table",
                         **child(model, tmp / "b", table=table)})
            log(rows[-1])
            load = burner()
            try:
                quiet = child(model, tmp / "c", background=True)
                time.sleep(0.2)
                loaded = child(model, tmp / "c", background=True)
                pair = [finish(quiet), finish(loaded)]
            finally:
                load.kill()
            for name, got in zip(("pair: quiet process", "pair: process next to a CPU-bound load"), pair):
                rows.append({"model": model, "run": name, **got})
                log(rows[-1])
            agree = pair[0]["decisions"] == pair[1]["decisions"]
            rows.append({"model": model, "run": "pair agrees", "seconds": None, "source": str(agree), "on": []})
            log(rows[-1])
    return rows


def markdown(rows: list[dict], cmd: str) -> str:
    lines = ["# The cost gate: patch time and agreement with decisions as data", "",
             f"Command: `{cmd}`. Each row a fresh process; `on`: the decode step sizes (buckets, tokens) where the "
             "policy runs on the first MoE layer.", "",
             "| model | run | patch s | decisions from | on at |", "|---|---|---:|---|---|"]
    for r in rows:
        seconds = "" if r["seconds"] is None else f"{r['seconds']:.2f}"
        source = re.sub(r"/tmp/\S+/gate/", ".../gate/", str(r["source"]))
        lines.append(f"| {r['model']} | {r['run']} | {seconds} | {source} | "
                     f"{', '.join(map(str, r['on']))} |")
    return "\n".join(lines) + "\n"


def ship(log=print) -> Path:
    """Measure the shipped tables of this machine kind (the module docstring) and write them; returns the first
    one's path (fixture A's)."""
    import torch
    from transformers import AutoModelForCausalLM

    import lynx_hf
    from lynx_hf import gate
    from lynx_hf.eval import FIXTURES_DIR
    from lynx_hf.eval.bench import SHAPES, build_tpot_model

    # one file per model, named as what it is: a real checkpoint (fixture A) or the benchmarks' 1-layer cut, whose key
    # no real checkpoint has (a 28-layer Qwen2-57B-A14B prices its remaps by depth: another key, measured on its own)
    models = {"fixture-a (bfloat16, from_pretrained's default)": ("fixture-a",
              lambda: AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / "qwen2moe-tiny").eval()),
              "fixture-a (float32, lynx-hf generate's default)": ("fixture-a",
              lambda: AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / "qwen2moe-tiny", dtype=torch.float32).eval()),
              "qwen2-57b-a14b 1-layer cut (bfloat16; lab.bench_gate's benchmark model, not a checkpoint)":
              ("qwen2-57b-a14b-1-layer-cut", lambda: build_tpot_model(SHAPES["qwen2-57b-a14b"][1], 1, 1024))}
    tables, paths = {}, []
    with gate.STORE.refreshing():
        for name, (file, build) in models.items():
            model = build()
            lynx_hf.patch(model, lynx_hf.LynxConfig(gate="auto"))
            planned = gate.of(lynx_hf.state.state_of(model).blocks[0].plan)
            table = tables.setdefault(file, gate.DecisionTable(
                path=gate.SHIPPED_DIR / f"{gate.table.slug(planned.key.device)}.{file}.json"))
            table.put(planned.key, planned.decisions, f"{name}: python -m lab.bench_gate --ship, "
                                                      f"{planned.source.split(',')[0]}")
            log(f"{name}: {planned.key.readable()}: on at "
                f"{[b for b, d in sorted(planned.decisions.items()) if d.on]} ({planned.source.split(',')[0]})")
            lynx_hf.unpatch(model)
    for table in tables.values():
        paths.append(table.save())
        log(f"wrote {table.path}")
    return paths[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--old", default=None, metavar="REV", help="also run the code at this git revision")
    parser.add_argument("--out", default=str(RESULTS_DIR / "bench_gate.md"))
    parser.add_argument("--ship", action="store_true", help="measure the shipped decision table of this machine kind")
    args = parser.parse_args(argv)
    if args.ship:
        ship()
        return 0
    rows = run(args.models, args.old)
    Path(args.out).write_text(markdown(rows, command("bench_gate", argv)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
