"""Decode with offloaded experts: bytes read per decode step and decode time, accelerate's whole-module offload vs
lynx_hf's expert-granular reads (``lynx_hf.offload``), with and without LYNX and a resident-expert cache.

    python -m lab.bench_offload            # full run (writes bench_offload.{csv,md} to --out)
    python -m lab.bench_offload --quick    # smoke run: 1/8-scaled shapes, 2 layers, B = 4, 2 steps

Model: OLMoE-1B-7B layer shapes (hidden 2048, expert intermediate 1024, 64 experts, top-8, softmax over all N, no
renormalisation), ``--layers`` decoder layers (default 4), vocab ``--vocab``, bf16, random weights; routers set so
the router logits' spread gives a mean top-1 probability of 0.42 (the calibration of ``lynx_hf.eval.bench``: the
trained fixture's routers). The model is saved, then loaded with ``from_pretrained(device_map=...)``: every
``model.layers.i.mlp.experts`` on ``"disk"`` (accelerate disk offload: safetensors files read per forward) on a
CPU run; on a GPU run the experts on ``"cpu"`` (accelerate keeps them in a CPU map; lynx_hf stages the rows it reads
in pinned memory and copies them ``non_blocking``) and everything else on ``cuda:0``.

Variants (one process, the same loaded model; ``lynx_hf.unpatch`` restores accelerate's objects between them):

- ``accelerate``: the unpatched model (accelerate loads every expert of a layer for every forward);
- ``granular-none``: ``patch(policy="none")``: the step's unique experts only, the model's own routing;
- ``granular-lynx``: ``patch(policy="lynx")`` (default LYNX, cost gate forced on);
- ``granular-lynx-cache{S}``: the same with ``expert_cache_bytes`` = S experts of a layer (``--cache-experts``,
  default 8 and 16 of 64), resident experts seeding the critical set.

Per batch size B (``--batches``, default 1 4 16): one prefill of a ``--prompt``-token random prompt (untimed), then
``--steps`` teacher-forced decode steps (the same random tokens for every variant). Before each timed step the
offload files are dropped from the page cache (``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``) so the reads are
real (``--warm`` skips that; the table says which); ``read_bytes`` of ``/proc/self/io`` gives what the step really
read from storage. Reported per variant and B: median decode-step time, bytes read from the offload store per step
(lynx_hf's telemetry; for ``accelerate``: every offloaded tensor of every layer), storage bytes actually read,
experts read and cache hits per layer-step, unique experts before / after the policy, and the ratios to
``accelerate``. "storage MiB" is what reached storage by ``/proc/self/io``; pages another holder keeps mapped cannot
be dropped, so it can be below the bytes read from the store (then part of the read was warm, for every variant).

Footprint of the full run: the model is built in memory (about 0.8 GiB of experts per layer in bf16), saved, and
loaded with its experts offloaded: about 2 x 3.2 GiB of files under ``--work`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import lynx_hf
from lynx_hf import offload as lynx_offload
from lynx_hf.config import LynxConfig
from lynx_hf.eval.bench import calibrate_temperature

from . import RESULTS_DIR as RESULTS
from . import command

hf_logging.set_verbosity_error()

OLMOE = dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
             num_attention_heads=16, num_key_value_heads=16)
ALWAYS = {"gate": "always"} if "gate" in LynxConfig.__dataclass_fields__ else {}


# -- the model ------------------------------------------------------------------------------------------------------
def build_model(shape: dict, layers: int, vocab: int):
    """A random bf16 OLMoE of ``layers`` layers at ``shape`` (unit norms, routers at the calibrated spread)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(**shape, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=False, norm_topk_prob=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = OlmoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device="cpu").eval()
    h = cfg.hidden_size
    scale, _ = calibrate_temperature(cfg.num_experts, cfg.num_experts_per_tok)
    bound = scale * math.sqrt(3.0 / h)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                p.uniform_(-bound, bound, generator=gen)
            elif "embed_tokens" in name:
                p.normal_(0, 1, generator=gen)
            else:
                p.uniform_(-0.02, 0.02, generator=gen)
    for module in model.modules():  # buffers are not parameters: recompute RoPE frequencies
        if hasattr(module, "inv_freq"):
            inv, _ = module.compute_default_rope_parameters(module.config)
            module.inv_freq = inv
            module.original_inv_freq = inv.clone()
    return model


def load_offloaded(path: Path, offload_dir: Path, layers: int, device: torch.device):
    """The saved model with every layer's experts offloaded (``"disk"`` on CPU, ``"cpu"`` on a GPU)."""
    from transformers import AutoModelForCausalLM

    main = "cpu" if device.type == "cpu" else device.index or 0
    tier = "disk" if device.type == "cpu" else "cpu"
    device_map = {"model.embed_tokens": main, "model.rotary_emb": main, "model.norm": main, "lm_head": main}
    for i in range(layers):
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
            device_map[f"model.layers.{i}.{part}"] = main
        device_map[f"model.layers.{i}.mlp.experts"] = tier
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, dtype=torch.bfloat16,
                                                 offload_folder=str(offload_dir)).eval()
    assert model.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta", "experts not offloaded"
    return model


def expert_bytes(model) -> int:
    """Bytes of every offloaded experts tensor of the model (what accelerate loads per decode step: the ``meta``
    placeholders' shapes and dtypes)."""
    return sum(p.numel() * p.element_size() for layer in model.model.layers
               for p in layer.mlp.experts.parameters())


# -- cold reads ----------------------------------------------------------------------------------------------------
def offload_files(folders) -> list[Path]:
    return sorted(p for folder in folders for p in Path(folder).rglob("*") if p.is_file())


def drop_page_cache(files) -> None:
    """Evict ``files`` from the page cache (``POSIX_FADV_DONTNEED``), so the next read comes from storage."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def storage_read_bytes() -> int | None:
    """``read_bytes`` of ``/proc/self/io`` (bytes this process made storage read), ``None`` where unavailable."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# -- one variant ---------------------------------------------------------------------------------------------------
def run_variant(model, variant: dict, batch: int, prompt, tokens, device, files, warm: bool):
    """Prefill (untimed), then one timed decode step per token column; per-step times and counters."""
    config = variant.get("config")
    if config is not None:
        lynx_hf.patch(model, **config)
    try:
        ids = prompt[:batch].to(device)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache = out.past_key_values
            if config is not None:
                lynx_hf.reset_stats(model)
            times, reads = [], []
            for step in range(tokens.shape[1]):
                tok = tokens[:batch, step:step + 1].to(device)
                mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
                if not warm:
                    drop_page_cache(files)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                before = storage_read_bytes()
                start = time.perf_counter()
                out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                after = storage_read_bytes()
                reads.append(None if before is None or after is None else after - before)
                cache = out.past_key_values
        summary = lynx_hf.stats(model).summary() if config is not None else {}
        transfer = lynx_offload.transfer_ms(model) if config is not None else {}
    finally:
        if config is not None:
            lynx_hf.unpatch(model)
    return times, reads, summary, transfer


def variants(cache_experts, per_expert: int) -> list[dict]:
    out = [{"name": "accelerate"},
           {"name": "granular-none", "config": {"policy": "none"}},
           {"name": "granular-lynx", "config": {"policy": "lynx", **ALWAYS}}]
    for count in cache_experts:
        out.append({"name": f"granular-lynx-cache{count}",
                    "config": {"policy": "lynx", "expert_cache_bytes": count * per_expert, **ALWAYS}})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: shapes / 8, 2 layers, vocab 256, B = 4, prompt 4, 2 decode steps")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 4 16 (--quick: 4)")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="timed decode steps per variant and B (median)")
    p.add_argument("--cache-experts", nargs="+", type=int, default=[8, 16],
                   help="resident-cache budgets, in experts of one layer (default 8 16)")
    p.add_argument("--warm", action="store_true", help="do not drop the offload files from the page cache")
    p.add_argument("--device", default=None, help="execution device (default: cuda if available, else cpu)")
    p.add_argument("--work", type=Path, default=None, help="folder for the saved model and offload files (default: "
                   "a temporary folder, removed at the end)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="results folder (default: eval/results)")
    args = p.parse_args(argv)
    if args.batches is None:
        args.batches = [4] if args.quick else [1, 4, 16]
    if args.quick:
        args.layers, args.vocab, args.prompt, args.steps = 2, 256, 4, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = dict(OLMOE)
    if args.quick:
        shape.update(hidden_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
    prefix = "bench_offload_quick" if args.quick else "bench_offload"
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    cmd = command("bench_offload", argv)
    tmp = None
    work = args.work
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="lynx_offload_")
        work = Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        model = build_model(shape, args.layers, args.vocab)
        model.save_pretrained(work / "model")
        del model
        model = load_offloaded(work / "model", work / "offload", args.layers, device)
        files = offload_files([work / "offload", work / "model"])
        total = expert_bytes(model)
        per_expert = total // (args.layers * shape["num_experts"])
        cold = not args.warm and device.type == "cpu"
        log(f"# Offloaded-experts decode ({'quick, shapes / 8' if args.quick else 'OLMoE-1B-7B layer shapes'})")
        log(f"command: `{cmd}`; torch {torch.__version__}, {torch.get_num_threads()} threads, {device}, bf16; "
            f"{args.layers} layers, H {shape['hidden_size']}, I {shape['intermediate_size']}, "
            f"N {shape['num_experts']}, k {shape['num_experts_per_tok']}; experts on "
            f"{'disk (accelerate disk offload)' if device.type == 'cpu' else 'CPU (accelerate CPU offload)'}: "
            f"{total / 2**20:.1f} MiB in all, {per_expert / 2**20:.2f} MiB per expert; reads "
            f"{'cold (page cache dropped before each step)' if cold else 'warm'}")
        gen = torch.Generator().manual_seed(11)
        batch_max = max(args.batches)
        prompt = torch.randint(3, args.vocab, (batch_max, args.prompt), generator=gen)
        tokens = torch.randint(3, args.vocab, (batch_max, args.steps), generator=gen)
        rows = []
        for batch in args.batches:
            base = None
            for variant in variants(args.cache_experts, per_expert):
                times, reads, summary, transfer = run_variant(model, variant, batch, prompt, tokens, device, files,
                                                              args.warm)
                ms = 1e3 * statistics.median(times)
                logical = summary.get("offload_bytes_read", total) if variant.get("config") else total
                storage = [r for r in reads if r is not None]
                row = {
                    "device": device.type, "B": batch, "variant": variant["name"], "reads": "cold" if cold else "warm",
                    "step_ms": round(ms, 2),
                    "store_MiB_per_step": round(logical / 2**20, 2),
                    "storage_read_MiB_per_step": round(statistics.mean(storage) / 2**20, 2) if storage else "",
                    "experts_read_per_layer": round(summary.get("offload_experts_fetched", shape["num_experts"] *
                                                                args.layers) / args.layers, 2),
                    "cache_hits_per_layer": round(summary.get("offload_cache_hits", 0) / args.layers, 2),
                    "unique_before": round(summary["unique_experts_before"], 2) if summary else "",
                    "unique_after": round(summary["unique_experts_after"], 2) if summary else "",
                    "transfer_ms_per_expert": round(statistics.mean(v for v in transfer.values() if v is not None), 3)
                    if any(v is not None for v in transfer.values()) else "",
                }
                if base is None:
                    base = row
                row["bytes_ratio"] = round(logical / 2**20 / base["store_MiB_per_step"], 3) \
                    if base["store_MiB_per_step"] else ""
                row["speedup"] = round(base["step_ms"] / row["step_ms"], 2) if row["step_ms"] else ""
                rows.append(row)
                log(f"B={batch:>2} {variant['name']:<24} {row['step_ms']:9.1f} ms/step  "
                    f"store {row['store_MiB_per_step']:8.1f} MiB  storage {row['storage_read_MiB_per_step']} MiB  "
                    f"read {row['experts_read_per_layer']} hit {row['cache_hits_per_layer']} experts/layer  "
                    f"x{row['speedup']} vs accelerate")
    finally:
        if tmp is not None:
            tmp.cleanup()
    with open(args.out / f"{prefix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    md = ["| B | variant | decode step (ms) | x vs accelerate | store MiB / step | bytes ratio | storage MiB / step "
          "| experts read / layer | cache hits / layer | unique before → after |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['B']} | {r['variant']} | {r['step_ms']} | {r['speedup']} | {r['store_MiB_per_step']} | "
           f"{r['bytes_ratio']} | {r['storage_read_MiB_per_step']} | {r['experts_read_per_layer']} | "
           f"{r['cache_hits_per_layer']} | {r['unique_before']} → {r['unique_after']} |" for r in rows]
    text = "\n".join([*lines, "", *md, "", f"total time {time.perf_counter() - started:.0f}s"]) + "\n"
    (args.out / f"{prefix}.md").write_text(text)
    print("\n".join(md), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
