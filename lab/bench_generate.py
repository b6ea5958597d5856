"""``model.generate`` on fixture A, side by side in one process: unpatched, LYNX with the default config (the cost gate
``gate="auto"`` decides per layer and step size) and LYNX forced on every decode step (``gate="always"``), with a
dynamic and a static KV cache. Rounds are interleaved (unpatched, default, always, unpatched, ...) and each variant's
median wall time is divided by the unpatched median of the same cache type: the machines are noisy, only ratios from
one run mean anything. Run it alone on the machine.

    python -m lab.bench_generate                       # B 16, 32 greedy tokens, 5 rounds
    python -m lab.bench_generate --batch 4 --rounds 3

Three model objects share every parameter tensor (``bench_compile.twin``), so no variant toggles hooks between timed
calls. Also prints what the gate decided (``lynx_hf.stats``) and checks the greedy tokens of ``gate="always"``
against its own earlier rounds (deterministic). Writes bench_generate.md to --out (default: eval/results).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import lynx_hf

from . import DEFAULT_FIXTURE, RESULTS_DIR, command
from .bench_compile import twin

VARIANTS = ("unpatched", "lynx default (gate auto)", "lynx gate always")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_FIXTURE))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--caches", nargs="+", default=["dynamic", "static"], choices=["dynamic", "static"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.model).eval()
    models = {VARIANTS[0]: base, VARIANTS[1]: twin(base), VARIANTS[2]: twin(base)}
    lynx_hf.patch(models[VARIANTS[1]])  # the default LynxConfig: gate from LYNX_HF_GATE, else "auto"
    lynx_hf.patch(models[VARIANTS[2]], gate="always")
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=gen)
    mask = torch.ones_like(ids)
    lines = [f"# bench_generate: {Path(args.model).name}, B {args.batch}, prompt {args.prompt}, "
             f"{args.new_tokens} greedy tokens, {args.rounds} interleaved rounds, torch threads "
             f"{torch.get_num_threads()}", "", f"command: `{command('bench_generate', argv)}`", "",
             "| cache | variant | median s | ratio to unpatched (lower is faster) | speed-up |", "|---|---|---|---|---|"]
    for cache in args.caches:
        times = {v: [] for v in VARIANTS}
        outs = {}

        def run(v):
            kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                      min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            if cache == "static":
                kw["cache_implementation"] = "static"
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = models[v].generate(**kw)
            return time.perf_counter() - t0, out

        for v in VARIANTS:  # warm-up (numba compile, static cache allocation)
            run(v)
        for _ in range(args.rounds):
            for v in VARIANTS:
                dt, out = run(v)
                times[v].append(dt)
                if v == VARIANTS[2]:
                    assert v not in outs or torch.equal(outs[v], out), "gate=always is not deterministic"
                    outs[v] = out
        ref = statistics.median(times[VARIANTS[0]])
        for v in VARIANTS:
            med = statistics.median(times[v])
            lines.append(f"| {cache} | {v} | {med:.3f} | {med / ref:.3f} | {ref / med:.3f}x |")
            print(lines[-1], flush=True)
    summary = lynx_hf.stats(models[VARIANTS[1]]).summary()
    from lynx_hf.gate import off_line

    gated = off_line(summary["per_layer"])
    lines += ["", f"gate (default config): {gated or 'LYNX on at every step size seen'}; decode steps remapped "
              f"{summary['decode_steps']}, skipped by the gate {summary.get('gate_steps_skipped', 0)}"]
    print(lines[-1])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_generate.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'bench_generate.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
