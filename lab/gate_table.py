"""The cost gate's decision per MoE layer shape x decode batch size on this machine (``LynxConfig.gate="auto"``,
``lynx_hf.gate``): measured routing cost, expected experts before / after (synthetic router logits), one expert's
time, expected saving, on / off.

    python -m lab.gate_table                       # every shape x B in (1, 4, 16, 64), on CUDA if present
    python -m lab.gate_table --quick --shapes fixture-a   # a smoke run: one shape, B 4 and 16, short timings
    python -m lab.gate_table --device cpu

Shapes (N experts, top-k, hidden H, expert intermediate I): fixture A (eval/fixtures/qwen2moe-tiny, its stored dtype),
DeepSeek-V2-Lite (64, 6, 2048, 1408), Qwen2-57B-A14B (64, 8, 3584, 2560), Mixtral-8x7B (8, 2, 4096, 14336),
OLMoE-1B-7B (64, 8, 2048, 1024); the real shapes in bf16. The policy is the default (``LynxConfig()``). Nothing is
loaded from a hub: the gate measures synthetic inputs at each shape. Run it alone on the machine: it times.
Writes gate_table.md to --out (default: eval/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lynx_hf import LynxConfig, gate
from lynx_hf.core import MoELayer, make_plan

from . import DEFAULT_FIXTURE, RESULTS_DIR, command

#: name -> (num_experts, top_k, hidden, intermediate, dtype); fixture A's is read from its config.json
SHAPES = {
    "deepseek-v2-lite": (64, 6, 2048, 1408, torch.bfloat16),
    "qwen2-57b-a14b": (64, 8, 3584, 2560, torch.bfloat16),
    "mixtral-8x7b": (8, 2, 4096, 14336, torch.bfloat16),
    "olmoe-1b-7b": (64, 8, 2048, 1024, torch.bfloat16),
}
BATCHES = (1, 4, 16, 64)


def fixture_shape(path: Path = DEFAULT_FIXTURE) -> tuple:
    """``(N, k, H, I, dtype)`` of fixture A from its ``config.json``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"], dtype)


def shapes() -> dict:
    return {"fixture-a": fixture_shape(), **SHAPES}


def table(names, batches, device, config: LynxConfig | None = None, tuning: gate.Tuning = gate.TUNING,
          log=print, captured: bool = False) -> list[dict]:
    """One row per (shape, B): the gate's :class:`lynx_hf.gate.GateDecision` fields plus ``shape``, ``B``,
    ``seconds`` (the measurement's wall time). ``captured``: the step as a CUDA-graph engine runs it
    (``LayerShape.captured``: on CUDA the routing cost is a graph replay's)."""
    config = config or LynxConfig(gate="auto")
    rows = []
    known = shapes()
    for name in names:
        n, k, h, i, dtype = known[name]
        plan = make_plan(config.__class__(**{**config.to_dict(), "gate": "always"}), MoELayer(n, k, device))
        planned = gate.PlanGate(gate.LayerShape(n, k, h, i, dtype, dtype, captured=captured),
                                telemetry=config.telemetry, plan=plan)
        expert_times: dict = {}
        for b in batches:
            t0 = time.perf_counter()
            d = gate.measure_bucket(planned, b, expert_times, tuning)  # measured now (no table, no cache)
            row = {"shape": name, "N": n, "k": k, "H": h, "I": i, "dtype": str(dtype).removeprefix("torch."), "B": b,
                   "captured": captured, **d.to_dict(), "seconds": time.perf_counter() - t0}
            rows.append(row)
            log(f"{name + (' (graph)' if captured else ''):<26} B={b:<4} {'on ' if d.on else 'off'}  cost {d.cost_ms:8.4f} ms  saving {d.saving_ms:8.4f} ms"
                f"  experts {d.experts_before:5.1f} -> {d.experts_after:5.1f}  expert {d.expert_ms:8.4f} ms"
                f"  ({row['seconds']:.1f} s)")
    return rows


def markdown(rows, device, argv, seconds: float) -> str:
    md = ["# The cost gate's decisions", "", f"command: `{command('gate_table', argv)}`", "",
          f"Device {device} ({torch.get_num_threads()} CPU threads), default policy (`LynxConfig()`), gate `auto`; per "
          "layer-step: routing cost = the decode-step routing work measured on synthetic router logits at the shape; "
          "saving = expected experts saved (the policy on synthetic logits of std "
          f"{gate.TUNING.logit_std}) x one expert's time in a fused experts path (bmm slope). On iff saving > "
          f"{gate.TUNING.margin} x cost. Measured now, in this process (`lynx-hf tune` writes a checkpoint's table). "
          f"Total {seconds:.0f} s.", "",
          "| shape | N | k | H | I | dtype | B | gate | cost ms | saving ms | experts before | experts after | "
          "expert ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['shape']}{' (graph replay)' if r.get('captured') else ''} | {r['N']} | {r['k']} | {r['H']} | {r['I']} | {r['dtype']} | {r['B']} | "
                  f"{'on' if r['on'] else 'off'} | {r['cost_ms']:.4f} | {r['saving_ms']:.4f} | "
                  f"{r['experts_before']:.2f} | {r['experts_after']:.2f} | {r['expert_ms']:.4f} |")
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None, choices=["fixture-a", *SHAPES],
                    help="default: all (--quick: fixture-a)")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help=f"default {BATCHES} (--quick: 4 16)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="smoke run: fixture A, B 4 and 16, short timings")
    ap.add_argument("--out", default=str(RESULTS_DIR),
                    help="results folder (default: eval/results)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tuning = gate.Tuning(time_budget_s=0.01) if args.quick else gate.TUNING
    names = args.shapes or (["fixture-a"] if args.quick else list(shapes()))
    batches = args.batches or ([4, 16] if args.quick else list(BATCHES))
    device = torch.device(args.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        rows = table(names, batches, device, tuning=tuning)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gate_table_quick.md" if args.quick else f"gate_table{'_' + device.type if device.type != 'cpu' else ''}.md"
    (out / name).write_text(markdown(rows, device, argv, time.perf_counter() - t0))
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
