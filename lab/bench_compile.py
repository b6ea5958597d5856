"""Compiled decode on CPU: one decode step of a batch through a StaticCache, eager vs
``torch.compile(fullgraph=True)`` (inductor), unpatched vs LYNX (default config), interleaved rounds in one
process, medians and ratios to eager unpatched.

    python -m lab.bench_compile                   # fixture A (bf16, its stored dtype) and the 2-layer Qwen2-57B-A14B config (bf16)
    python -m lab.bench_compile --models fixture  # only fixture A

Models: fixture A (eval/fixtures/qwen2moe-tiny) and Qwen2-57B-A14B's config cut to 2 decoder layers with
random weights (lynx_hf.eval.bench.build_tpot_model; router weights scaled to the fixtures' confidence).
For each: prefill B prompts into a StaticCache, then time the forward of one decode token per row
(the same inputs every call; the cache is rewound to the prompt before each, so every call writes the same slot). Variants: eager unpatched, eager LYNX,
compiled unpatched, compiled LYNX (each compiled once, fullgraph, static shapes; compile time printed
but not counted). Also checks that compiled LYNX routes as eager LYNX does (unique experts per layer before /
after, lynx_hf.stats) and prints the largest compiled-vs-eager logit gap of LYNX beside the unpatched one. Run it alone on the machine: it times.
Writes bench_compile.md to --out (default: eval/results).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StaticCache

import lynx_hf

from . import DEFAULT_FIXTURE, RESULTS_DIR, command


def _decode_inputs(model, batch: int, prompt: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt), generator=gen)
    mask = torch.ones_like(ids)
    cache = StaticCache(config=model.config, max_cache_len=prompt + 8)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return dict(input_ids=nxt, attention_mask=torch.ones(batch, prompt + 1, dtype=torch.long),
                past_key_values=out.past_key_values, use_cache=True)


def twin(model):
    """A second model object sharing every parameter and buffer tensor with ``model`` (no extra memory):
    one stays unpatched, the other is patched, so no variant toggles hooks between timed calls."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _rewind(inputs) -> None:
    """Put the StaticCache back to the prompt's length (its layers count their own position), so every timed
    call decodes the same token at the same slot: identical work and comparable logits across variants."""
    held = inputs["attention_mask"].shape[1] - 1
    for layer in inputs["past_key_values"].layers:
        if getattr(layer, "cumulative_length", None) is not None and torch.is_tensor(layer.cumulative_length):
            layer.cumulative_length.fill_(held)


def _step_stats(model, fn, inputs) -> dict:
    """``lynx_hf.stats(model).summary()`` of one call of ``fn`` (stats reset before it)."""
    lynx_hf.reset_stats(model)
    _rewind(inputs)
    fn(**inputs)
    return lynx_hf.stats(model).summary()


def _routes(summary: dict) -> list:
    """Per MoE layer, the (before, after) unique experts of a stats summary."""
    return [(layer["unique_experts_before"], layer["unique_experts_after"]) for layer in summary["per_layer"]]


def bench(name, model, inputs, rounds: int, log) -> list[dict]:
    plain, lynx = model, twin(model)
    lynx_hf.patch(lynx, policy="lynx")
    variants = {"eager unpatched": plain.__call__, "eager lynx": lynx.__call__}
    for label, m in (("compiled unpatched", plain), ("compiled lynx", lynx)):
        fn = torch.compile(m.__call__, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            _rewind(inputs)
            fn(**inputs)
        log(f"  {name}: {label} compiled in {time.perf_counter() - t0:.1f} s")
        variants[label] = fn
    with torch.inference_mode():
        outs = {}
        for label, fn in variants.items():  # warm-up and correctness
            _rewind(inputs)
            outs[label] = fn(**inputs).logits.clone()
        # compiled vs eager logits: inductor's fused bf16 arithmetic differs from eager's, so the unpatched pair is
        # the yardstick the LYNX pair is read against (a routing difference would show as a far larger gap)
        gap = {v: (outs[f"compiled {v}"].float() - outs[f"eager {v}"].float()).abs().max().item()
               for v in ("unpatched", "lynx")}
        stats = _step_stats(lynx, variants["compiled lynx"], inputs)
        same_routing = _routes(_step_stats(lynx, variants["eager lynx"], inputs)) == _routes(stats)
        log(f"  {name}: max |compiled - eager| logits: unpatched {gap['unpatched']:.3g}, lynx {gap['lynx']:.3g}; "
            f"compiled lynx routing == eager lynx routing (unique experts per layer): {same_routing}")
        log(f"  {name}: compiled step remaps: unique experts "
            f"{stats['unique_experts_before']:.2f} -> {stats['unique_experts_after']:.2f}")
        times = {label: [] for label in variants}
        labels = list(variants)
        for r in range(rounds):
            for i in range(len(labels)):
                label = labels[(r + i) % len(labels)]
                _rewind(inputs)
                t0 = time.perf_counter()
                variants[label](**inputs)
                times[label].append(time.perf_counter() - t0)
    lynx_hf.unpatch(lynx)
    base = statistics.median(times["eager unpatched"])
    rows = []
    for label, ts in times.items():
        med = statistics.median(ts)
        rows.append({"model": name, "variant": label, "ms": med * 1e3, "ratio": med / base,
                     "unique_after": stats["unique_experts_after"] if "lynx" in label else stats["unique_experts_before"],
                     "equal": same_routing if label == "compiled lynx" else ""})
        log(f"  {name}: {label:20s} {med * 1e3:9.2f} ms  ({med / base:.2f} of eager unpatched)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["fixture", "qwen2-57b-2l"], choices=["fixture", "qwen2-57b-2l"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS_DIR),
                    help="results folder (default: eval/results)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    rows = []
    t_start = time.perf_counter()
    if "fixture" in args.models:
        model = AutoModelForCausalLM.from_pretrained(DEFAULT_FIXTURE).eval()
        rows += bench("fixture A (bf16)", model, _decode_inputs(model, args.batch, args.prompt, 4096), args.rounds, log)
        del model
    if "qwen2-57b-2l" in args.models:
        from lynx_hf.eval.bench import SHAPES, build_tpot_model

        model = build_tpot_model(SHAPES["qwen2-57b-a14b"][1], layers=2, vocab=512)
        rows += bench("Qwen2-57B-A14B, 2 layers (bf16)", model, _decode_inputs(model, args.batch, args.prompt, 512),
                      args.rounds, log)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# Compiled decode on CPU", "", f"command: `{command('bench_compile', argv)}`",
          "", f"One decode step (B = {args.batch}, StaticCache, prompt {args.prompt}), median of {args.rounds} "
          "interleaved rounds, ratio to eager unpatched; torch.compile(fullgraph=True, dynamic=False), inductor on "
          f"{args.threads} CPU threads; compile time excluded. Total run {time.perf_counter() - t_start:.0f} s.", "",
          "| model | variant | ms / step | ratio | unique experts / layer | compiled routing == eager |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['variant']} | {r['ms']:.2f} | {r['ratio']:.2f} | {r['unique_after']:.2f} | "
                  f"{r['equal']} |")
    md += ["", "Log:", "", "```text", *lines, "```", ""]
    (out / "bench_compile.md").write_text("\n".join(md))
    print(f"wrote {out / 'bench_compile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
