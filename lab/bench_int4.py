"""LYNX over 4-bit experts (arXiv 2411.08982 reports +10 % on top of INT4 quantization): decode-step time and unique
experts with and without LYNX, int4 experts beside bf16 experts, on this CPU.

    python -m lab.bench_int4                          # fixture A and the Qwen2-57B-A14B shape (1 layer), B 16, 32, 64
    python -m lab.bench_int4 --quick                  # smoke run: fixture A and a 1/16-scaled Qwen2-57B, B 4, 4 tokens

The int4 experts are :class:`lab.int4_experts.Int4Experts`: PyTorch's own CPU int4 matmul (tinygemm layout, groupwise
asymmetric int4, group 128 where the expert sizes allow it), one packed weight per expert, only the routed experts
computed (``docs/expert-storage.md`` "4-bit experts": why no quantization package runs 4-bit experts on this stack).
The bf16 experts are the model's own (transformers' ``grouped_mm`` on this machine). Models: fixture A
(``eval/fixtures/qwen2moe-tiny``, bf16, N 32, k 4, H 256, I 64) and the Qwen2-57B-A14B layer shape (H 3584, expert I
2560, N 64, k 8, shared I 20480) cut to ``--layers`` decoder layers, random bf16 weights, router calibrated as in
``lynx_hf.eval.bench.build_tpot_model`` (the same builder: mean top-1 router probability 0.42).

Per model and batch B: four variants of one set of weights (twins sharing every other tensor), bf16 unpatched,
bf16 + LYNX, int4 unpatched, int4 + LYNX (default config, ``gate="always"``: the policy on every decode step, so the
expert counts do not depend on this machine's timing; ``--gate auto`` for the cost gate), each ``model.generate`` of B
random prompts (``--prompt`` tokens, ``--tokens`` greedy new tokens), interleaved over ``--rounds`` rounds (the start
rotating each round). Reported: the median decode-step time (mean time between consecutive tokens, a logits
processor's timestamps), its ratio to the same storage unpatched (the LYNX gain on that storage) and to bf16 unpatched,
the unique experts per MoE layer-step before / after (``lynx_hf.stats``) and the ideal ratio T_after / T_before,
whether the greedy tokens equal the same storage's unpatched ones. Timings on a shared machine are noisy: run it
alone, read the ratios. Writes ``bench_int4.md`` (``bench_int4_quick.md`` with ``--quick``) to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

import lynx_hf
from lynx_hf.eval.bench import SHAPES, StepClock, build_tpot_model, scaled_shapes

from . import DEFAULT_FIXTURE, RESULTS_DIR, command
from .bench_compile import twin
from .int4_experts import Int4Experts, quantize_experts

VARIANTS = ("bf16", "bf16+lynx", "int4", "int4+lynx")


def group_size(hidden: int, intermediate: int) -> int:
    """The largest group of the CPU int4 kernel (128, 64, 32) that divides both expert input sizes."""
    for g in (128, 64, 32):
        if hidden % g == 0 and intermediate % g == 0:
            return g
    raise SystemExit(f"no int4 group size divides H {hidden} and I {intermediate}")


def build(name: str, layers: int, scale: int):
    """``(model, vocab, label)``: a bf16 model of ``name`` ("fixture" or "qwen2-57b")."""
    if name == "fixture":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(DEFAULT_FIXTURE, dtype=torch.bfloat16).eval()
        return model, model.config.vocab_size, "fixture A (N 32, k 4, H 256, I 64)"
    kwargs = dict((scaled_shapes(scale) if scale > 1 else SHAPES)["qwen2-57b-a14b"][1])
    vocab = 512
    model = build_tpot_model(kwargs, layers, vocab)
    shape = f"H {kwargs['hidden_size']}, I {kwargs['moe_intermediate_size']}"
    label = f"Qwen2-57B-A14B shape{'' if scale == 1 else f' / {scale}'} ({shape}, N 64, k 8), {layers} layer(s)"
    return model, vocab, label


def variants(model, gate: str) -> tuple[dict, int]:
    """The four variants (module docstring) sharing ``model``'s tensors (the int4 ones their experts' buffers)."""
    cfg = model.config
    group = group_size(cfg.hidden_size, cfg.moe_intermediate_size)
    quantized = twin(model)
    quantize_experts(quantized, group)
    out = {"bf16": model, "bf16+lynx": twin(model), "int4": quantized, "int4+lynx": twin(quantized)}
    for name in ("bf16+lynx", "int4+lynx"):
        lynx_hf.patch(out[name], lynx_hf.LynxConfig(policy="lynx", gate=gate))
    return out, group


def expert_bytes(model) -> dict:
    """Bytes of routed-expert storage per MoE layer, by variant storage (bf16 weights; int4 packed + scales)."""
    bf16 = int4 = 0
    for module in model.modules():
        experts = module._modules.get("experts")
        if experts is None:
            continue
        size = sum(t.numel() * t.element_size() for t in (*experts.parameters(), *experts.buffers()))
        if isinstance(experts, Int4Experts):
            int4 += size
        else:
            bf16 += size
    return {"bf16": bf16, "int4": int4}


def run_batch(models: dict, batch: int, vocab: int, args) -> list[dict]:
    from transformers import LogitsProcessorList

    gen = torch.Generator().manual_seed(5 + batch)
    ids = torch.randint(3, vocab, (batch, args.prompt), generator=gen)
    mask = torch.ones_like(ids)
    steps = {v: [] for v in models}
    stats, tokens = {}, {}

    def run(name, new_tokens):
        model = models[name]
        if name.endswith("+lynx"):
            lynx_hf.reset_stats(model)
        clock = StepClock()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
        diffs = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
        if new_tokens == args.tokens:
            steps[name].append(sum(diffs) / len(diffs))
            tokens[name] = out
            if name.endswith("+lynx"):
                stats[name] = lynx_hf.stats(model).summary()

    names = list(models)
    with torch.inference_mode():
        for name in names:  # warm-up: first-call costs (allocator, numba's cache load, oneDNN primitives)
            run(name, 2)
        for r in range(args.rounds):
            for i in range(len(names)):
                run(names[(r + i) % len(names)], args.tokens)
    rows = []
    step = {v: statistics.median(steps[v]) for v in names}
    for name in names:
        storage = name.split("+")[0]
        s = stats.get(name if name.endswith("+lynx") else f"{name}+lynx", {})
        before, after = s.get("unique_experts_before"), s.get("unique_experts_after")
        rows.append({
            "B": batch, "variant": name, "step_ms": step[name] * 1e3,
            "vs_storage": step[name] / step[storage], "vs_bf16": step[name] / step["bf16"],
            "T": f"{before:.2f}" if not name.endswith("+lynx") and before is not None else
                 (f"{before:.2f} -> {after:.2f}" if before is not None else "-"),
            "ideal": (after / before) if name.endswith("+lynx") and before else None,
            "same_tokens": bool(torch.equal(tokens[name], tokens[storage])),
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["fixture", "qwen2-57b"], choices=["fixture", "qwen2-57b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the Qwen2-57B-shaped model (1 or 2)")
    ap.add_argument("--scale", type=int, default=1, help="divide the Qwen2-57B sizes by this (smoke runs)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=16, help="greedy new tokens per generate")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants")
    ap.add_argument("--gate", default="always", choices=["always", "auto"], help="the LYNX variants' cost gate")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: --batches 4 --tokens 4 --rounds 1 --scale 16, writes bench_int4_quick.md")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.tokens, args.rounds, args.scale, args.prompt = [4], 4, 1, 16, 8
    if args.threads:
        torch.set_num_threads(args.threads)

    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    sections = []
    for name in args.models:
        t0 = time.perf_counter()
        model, vocab, label = build(name, args.layers, args.scale)
        models, group = variants(model, args.gate)
        sizes = expert_bytes(models["int4"]), expert_bytes(model)
        layers = sum(1 for m in model.modules() if "experts" in m._modules)
        log(f"{label}: int4 group {group}; routed-expert bytes per MoE layer bf16 {sizes[1]['bf16'] / layers / 2**20:.1f}"
            f" MiB, int4 {sizes[0]['int4'] / layers / 2**20:.1f} MiB (built in {time.perf_counter() - t0:.0f} s)")
        rows = []
        for batch in args.batches:
            for row in run_batch(models, batch, vocab, args):
                rows.append(row)
                ideal = f"{row['ideal']:.3f}" if row["ideal"] is not None else "-"
                log(f"  B={batch:<3d} {row['variant']:10s} {row['step_ms']:9.2f} ms  x{row['vs_storage']:.3f} of "
                    f"same storage  x{row['vs_bf16']:.3f} of bf16  T {row['T']}  ideal {ideal}  "
                    f"same tokens {row['same_tokens']}")
        sections.append((label, group, sizes, layers, rows))
        for name in ("bf16+lynx", "int4+lynx"):
            lynx_hf.unpatch(models[name])
        del model, models
        gc.collect()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# LYNX over 4-bit experts (CPU)", "", f"command: `{command('bench_int4', argv)}`", "",
          f"Decode-step time (median over {args.rounds} interleaved rounds of `generate`, {args.prompt}-token random "
          f"prompts, {args.tokens} greedy tokens; {torch.get_num_threads()} thread(s)), bf16 experts (transformers' "
          "own, `grouped_mm`) vs int4 experts (`lab.int4_experts.Int4Experts`: PyTorch's CPU int4 tinygemm matmul per "
          f"expert), unpatched vs LYNX (default config, gate `{args.gate}`). `x storage`: step time over the same "
          "storage's unpatched step (the LYNX gain on that storage); `x bf16`: over bf16 unpatched. T: unique experts "
          "per MoE layer-step, before -> after LYNX; ideal = T_after / T_before. `same tokens`: greedy tokens equal to "
          "the same storage unpatched (fixture A: trained weights; the Qwen2-57B shape: random weights, the tokens "
          "test the path, not quality). Timings on a shared machine are noisy: read the ratios.", ""]
    for label, group, sizes, layers, rows in sections:
        md += [f"## {label}", "",
               f"int4 group size {group}; routed-expert storage per MoE layer: bf16 "
               f"{sizes[1]['bf16'] / layers / 2**20:.1f} MiB, int4 {sizes[0]['int4'] / layers / 2**20:.1f} MiB.", "",
               "| B | variant | step ms | x storage | x bf16 | T | ideal | same tokens |",
               "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ideal = f"{r['ideal']:.3f}" if r["ideal"] is not None else ""
            md.append(f"| {r['B']} | {r['variant']} | {r['step_ms']:.2f} | {r['vs_storage']:.3f} | {r['vs_bf16']:.3f} "
                      f"| {r['T']} | {ideal} | {r['same_tokens']} |")
        md.append("")
    path = out / ("bench_int4_quick.md" if args.quick else "bench_int4.md")
    path.write_text("\n".join(md))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
