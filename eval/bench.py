"""Decode latency benchmarks at real MoE shapes: MoE-layer micro-benchmark, latency vs
unique experts, end-to-end TPOT. Random bf16 weights; every comparison runs in ONE process,
interleaved (round-robin over variants, rotating the start each round), reported as medians and
ratios. Timings on a shared machine are noisy: read ratios, not absolute times.

    python -m lynx_hf.eval.bench            # full run (writes bench_* to --out)
    python -m lynx_hf.eval.bench --quick    # smoke run: one 1/16-scaled shape, B = 16, one round (writes bench_quick_*)

``lynx-hf bench`` runs this module. --out defaults to eval/results in the source checkout, else ./lynx_hf_results.

Sections
1. layer: one MoE block per shape (Qwen2-57B-A14B, DeepSeek-V2-Lite, Mixtral-8x7B), B in {1,4,16,32,64}.
   Variants: HF block with experts implementation "eager" and "grouped_mm" (HF's default for a
   model on this machine), the lynx_hf-patched block (LynxConfig(phase="decode")) with policy none,
   lynx, oea on the block's own experts (grouped_mm), and lynx with lynx_hf.eval.sparse_torch's
   sparse_experts_torch as the experts path ("lynx+sparse"). Router logits are injected by setting
   the router weight W so that router(hidden) = L (least squares, exact for B <= H up to bf16
   rounding). Sources of L: "real" = i.i.d. normal logits scaled by a temperature calibrated so that
   the mean top-1 router probability is 0.42 (the trained fixture's routers: mean top-1 p 0.34-0.50,
   rank k-1 p < 0.1 for > 90 % of tokens, docs/design.md), "uniform" = U[0, 1) logits (near-flat routing:
   the worst case). Per cell: median time, ratio to HF grouped_mm, T before/after (unique experts),
   the ideal ratio T_after/T_before, and the routing overhead = median time of the block's whole
   decode-step routing post-process (BlockRouting.route: selection scores, policy, remap, weight
   rule, per-token merge, telemetry) on the same router output / median lynx layer time.
2. T sweep: Qwen2-57B shape, B = 16, the HF block (grouped_mm) with a router forced to touch exactly
   T experts, T = k..N; least-squares line time = a + b*T, R^2. Also the sparse torch path.
3. TPOT: Qwen2-57B-A14B config truncated to 2 decoder layers (small vocab), bf16, random weights,
   B = 16, model.generate greedy, unpatched vs patched none / lynx / oea, interleaved; TPOT = mean
   time between consecutive decode steps (timestamps taken by a logits processor).

Routing-mass price (``--full-layers``, ``lynx_hf.eval.depth``): the default's price depends on the model's MoE depth
(7/64 x 4 / L above 4 layers), and a one-block holder or a 2-layer cut would run the price as given. By default every
LYNX config here runs the price of the real model the shape is cut from (``lynx_hf.at_depth``: Qwen2-57B-A14B 28 MoE
layers -> 1/64, DeepSeek-V2-Lite 26, Mixtral-8x7B 32); ``--full-layers N`` sets one depth for every shape,
``--full-layers cut`` runs the price as given (every figure before issue 52). The tables and CSVs say which price each
row ran (``mass_price``, ``price``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import lynx_hf  # noqa: E402
from lynx_hf import policies  # noqa: E402
from lynx_hf.patches import find_spec  # noqa: E402

from . import RESULTS_DIR as RESULTS  # noqa: E402
from . import command, results_folder  # noqa: E402
from .depth import REAL_MOE_LAYERS, add_full_layers, config_at_depth, full_depth, price_label, price_of  # noqa: E402
from .sparse_torch import sparse_experts_torch  # noqa: E402

hf_logging.set_verbosity_error()
TOP1_TARGET = 0.42

# name: (family, HF config kwargs) at real sizes (H, moe I, N, k, shared)
SHAPES = {
    "qwen2-57b-a14b": ("qwen2_moe", dict(hidden_size=3584, moe_intermediate_size=2560, num_experts=64,
                                         num_experts_per_tok=8, shared_expert_intermediate_size=20480,
                                         norm_topk_prob=False)),
    "deepseek-v2-lite": ("deepseek_v2", dict(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                                             num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy",
                                             n_group=1, topk_group=1, routed_scaling_factor=1.0)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2)),
}
SIZE_KEYS = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size")
QUICK_SHAPE = "deepseek-v2-lite"  # the smallest block (H 2048, 64 experts of I 1408)


# --------------------------------------------------------------------------------------------- build
def _config(family: str, kwargs: dict):
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as C
    elif family == "deepseek_v2":
        from transformers import DeepseekV2Config as C
    else:
        from transformers import MixtralConfig as C
    return C(**kwargs)


def _block_class(family: str):
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        return Qwen2MoeSparseMoeBlock
    if family == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
        return DeepseekV2Moe
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    return MixtralSparseMoeBlock


def _materialize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Allocate a meta-built bf16 module on CPU and fill every parameter with U(-0.02, 0.02)."""
    module = module.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-0.02, 0.02, generator=gen)
    return module


def build_block(family: str, kwargs: dict, seed: int = 0):
    cfg = _config(family, kwargs)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            block = _block_class(family)(cfg)
    finally:
        torch.set_default_dtype(old)
    block = _materialize(block, seed).eval()
    return block, cfg


class Holder(torch.nn.Module):
    """A one-block model so lynx_hf.patch finds the block (phase="decode" forces decode)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)


def rule_of(family: str, block):
    if family == "qwen2_moe":
        return "softmax_all", bool(block.gate.norm_topk_prob), 1.0
    if family == "deepseek_v2":
        return "softmax_all", False, float(block.gate.routed_scaling_factor)
    return "softmax_all", True, 1.0


# ------------------------------------------------------------------------------------------ routing
def calibrate_temperature(num_experts: int, top_k: int, target: float = TOP1_TARGET, samples: int = 4096):
    """Scale s of N(0,1) logits so that the mean top-1 softmax probability is ``target``."""
    gen = torch.Generator().manual_seed(1234)
    z = torch.randn(samples, num_experts, generator=gen, dtype=torch.float64)
    lo, hi = 0.01, 50.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        top1 = (z * mid).softmax(-1).max(-1).values.mean().item()
        lo, hi = (mid, hi) if top1 < target else (lo, mid)
    scale = math.sqrt(lo * hi)
    p = (z * scale).softmax(-1).sort(-1, descending=True).values
    stats = {"scale": scale, "mean_top1": p[:, 0].mean().item(), "mean_rank_k-1": p[:, top_k - 1].mean().item(),
             "frac_rank_k-1_below_0.1": (p[:, top_k - 1] < 0.1).double().mean().item()}
    return scale, stats


def make_logits(source: str, batch: int, num_experts: int, scale: float, gen) -> torch.Tensor:
    if source == "real":
        return torch.randn(batch, num_experts, generator=gen) * scale
    return torch.rand(batch, num_experts, generator=gen)


def inject_router(block, hidden2d: torch.Tensor, logits: torch.Tensor) -> None:
    """Set the router weight W [N, H] so that hidden2d @ W.T == logits (minimum-norm solution)."""
    h = hidden2d.double()
    w_t = torch.linalg.lstsq(h, logits.double(), driver="gelsd").solution  # [H, N]
    with torch.no_grad():
        block.gate.weight.copy_(w_t.T.to(block.gate.weight.dtype))


def layer_configs(full_layers, shape: str) -> dict:
    """The configs section 1 patches the one-block holder with, per policy (``none``, ``lynx``, ``oea``; decode
    forced, no telemetry): LYNX at the price of ``shape``'s model at the depth ``--full-layers`` gives
    (``lynx_hf.eval.depth``)."""
    depth = full_depth(full_layers, shape)
    return {p: config_at_depth(lynx_hf.LynxConfig(policy=p, phase="decode", telemetry=False), depth)
            for p in ("none", "lynx", "oea")}


def tpot_config(policy: str, full_layers, shape: str = "qwen2-57b-a14b") -> "lynx_hf.LynxConfig":
    """The config section 3 patches the cut with (phase auto): the price of ``shape``'s model at the depth
    ``--full-layers`` gives."""
    return config_at_depth(lynx_hf.LynxConfig(policy=policy), full_depth(full_layers, shape))


def unique_count(idx: torch.Tensor) -> int:
    return int(torch.unique(idx).numel())


# ------------------------------------------------------------------------------------------- timing
def _now():
    return time.perf_counter()


def interleaved(fns: dict, rounds: int, warmup: int = 1) -> dict:
    """Median seconds per variant; each round calls every variant once, start rotating per round."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            t0 = _now()
            fns[n]()
            times[n].append(_now() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def time_route(holder, cfg, logits, weights, topk_idx, reps: int) -> float:
    """Median time of the whole decode-step routing post-process of one block, as the router hook runs
    it: selection scores, policy, remap, weight rule, per-token merge and telemetry (BlockRouting.route)."""
    from lynx_hf.core import Step
    from lynx_hf.state import state_of

    lynx_hf.patch(holder, cfg)
    state = state_of(holder).blocks[0]
    ts = []
    for _ in range(reps + 1):
        t0 = _now()
        state.route(Step("decode"), logits, weights, topk_idx)
        ts.append(_now() - t0)
    return statistics.median(ts[1:])


def prewarm(experts, max_rows: int) -> None:
    """Run one expert's two projections at every row count 1..max_rows once: oneDNN builds (JITs) a
    primitive per new matmul shape (~5 ms each here), a one-time cost a serving process has long paid."""
    w1, w2 = experts.gate_up_proj[0], experts.down_proj[0]
    for m in range(1, max_rows + 1):
        F.linear(torch.zeros(m, w1.shape[-1], dtype=w1.dtype), w1)
        F.linear(torch.zeros(m, w2.shape[-1], dtype=w2.dtype), w2)


# -------------------------------------------------------------------------------------------- layer
def bench_layer(args, shapes: dict, out_rows: list, log) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, (family, kwargs) in shapes.items():
        t_build = _now()
        block, cfg = build_block(family, kwargs)
        holder = Holder(block)
        num_experts, top_k = find_spec(block).shape(block)
        scale, cal = calibrate_temperature(num_experts, top_k)
        log(f"\n## {name}: H={cfg.hidden_size} N={num_experts} k={top_k}; built in {_now() - t_build:.1f}s; "
            f"real-routing temperature: logits = N(0,1) x {scale:.3f} -> mean top-1 p {cal['mean_top1']:.3f}, "
            f"mean rank-{top_k - 1} p {cal['mean_rank_k-1']:.3f}, rank-{top_k - 1} p < 0.1 for "
            f"{100 * cal['frac_rank_k-1_below_0.1']:.0f}% of tokens")
        rule = rule_of(family, block)
        expert_bytes = sum(p.numel() * p.element_size() for p in block.experts.parameters()) / num_experts
        const_bytes = sum(p.numel() * p.element_size() for n, p in block.named_parameters() if not n.startswith("experts."))
        log(f"  bytes per routed expert {expert_bytes / 2**20:.0f} MiB, router + shared {const_bytes / 2**20:.0f} MiB")

        def byte_ratio(t_after, t_before):
            return (const_bytes + t_after * expert_bytes) / (const_bytes + t_before * expert_bytes)
        hf_forward = type(block).forward
        lynx_hf.patch(holder, lynx_hf.LynxConfig(policy="none", phase="decode", telemetry=False))
        configs = layer_configs(args.full_layers, name)
        depth = full_depth(args.full_layers, name)
        price = price_of(configs["lynx"], 1)
        log(f"  LYNX routing-mass {price_label(price, depth, 1)}"
            + (f" ({name}: {REAL_MOE_LAYERS[name]} MoE layers)" if name in REAL_MOE_LAYERS else ""))
        experts_forward = type(block.experts).forward

        def set_impl(impl):
            block.experts.config._experts_implementation = impl

        def hf(impl, x):
            def run():
                set_impl(impl)
                return hf_forward(block, x)
            return run

        def patched(p, x, sparse=False):
            def run():
                set_impl("grouped_mm")
                lynx_hf.patch(holder, configs[p])
                if sparse:
                    block.experts.forward = lambda h, i, w: sparse_experts_torch(block.experts, h, i, w)
                try:
                    return block(x)
                finally:
                    if sparse:
                        del block.experts.forward
            return run

        first = True
        with torch.inference_mode():
            prewarm(block.experts, max(args.batches))
            for source in args.sources:
                for batch in args.batches:
                    x = torch.randn(batch, 1, cfg.hidden_size, generator=gen).to(torch.bfloat16)
                    target = make_logits(source, batch, num_experts, scale, gen)
                    inject_router(block, x.view(batch, -1), target)
                    logits, w_hf, idx_hf = block.gate(x.view(batch, -1))
                    scores = logits.float()
                    t_before = unique_count(idx_hf)
                    t_after = {}
                    for p in ("lynx", "oea"):
                        new_idx, _ = policies.remap(configs[p], scores, idx_hf, logits, *rule)
                        t_after[p] = unique_count(new_idx)
                    fns = {"hf_eager": hf("eager", x), "hf_grouped_mm": hf("grouped_mm", x),
                           "none": patched("none", x), "lynx": patched("lynx", x), "oea": patched("oea", x),
                           "lynx+sparse": patched("lynx", x, sparse=True)}
                    if (source != "real" or batch > 16) and not args.eager_everywhere:
                        fns.pop("hf_eager")  # the slowest variant: timed only on real routing, B <= 16
                    if source != "real":
                        fns.pop("lynx+sparse")
                    # correctness guard (untimed; doubles as warmup): patched none == HF default, bit for bit
                    ref = fns["hf_grouped_mm"]()
                    assert torch.equal(fns["none"](), ref), "patched policy none differs from HF grouped_mm"
                    med = interleaved(fns, args.rounds, warmup=1 if first else 0)
                    first = False
                    remap_s = time_route(holder, dataclasses.replace(configs["lynx"], telemetry=True), logits, w_hf,
                                         idx_hf, reps=args.remap_reps)
                    base = med["hf_grouped_mm"]
                    for variant, sec in med.items():
                        pol = variant.split("+")[0]
                        after = t_after.get(pol, t_before)
                        out_rows.append({
                            "shape": name, "source": source, "B": batch, "variant": variant,
                            "median_ms": round(sec * 1e3, 3), "ratio_to_hf": round(sec / base, 4),
                            "T_before": t_before, "T_after": after, "ideal_ratio": round(after / t_before, 4),
                            "ideal_bytes_ratio": round(byte_ratio(after, t_before), 4),
                            "remap_ms": round(remap_s * 1e3, 4) if pol == "lynx" else "",
                            "overhead_pct": round(100 * remap_s / sec, 3) if pol == "lynx" else "",
                            "mass_price": price if pol == "lynx" else "",
                            "full_layers": (depth or "cut") if pol == "lynx" else "",
                        })
                    log(f"  {source:7s} B={batch:3d} T {t_before}->lynx {t_after['lynx']}/oea {t_after['oea']}  "
                        + "  ".join(f"{v}={med[v] * 1e3:.1f}ms({med[v] / base:.2f})" for v in med)
                        + f"  remap={remap_s * 1e3:.2f}ms ({100 * remap_s / med['lynx']:.2f}% of lynx layer)")
        lynx_hf.unpatch(holder)
        assert type(block.experts).forward is experts_forward
        holder = block = None  # free the weights (the timing closures hold the cells)
        gc.collect()


# ------------------------------------------------------------------------------------------ T sweep
def bench_t_sweep(args, shape: tuple, log) -> dict:
    family, kwargs = shape
    block, cfg = build_block(family, kwargs, seed=1)
    num_experts, top_k = block.gate.num_experts, block.gate.top_k
    batch = args.sweep_batch
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, 1, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    gate_forward = type(block.gate).forward
    t_values = sorted({t for t in range(top_k, num_experts + 1, args.sweep_step)} | {num_experts})
    t_values = [t for t in t_values if t <= batch * top_k]
    hf_forward = type(block).forward
    block.experts.config._experts_implementation = "grouped_mm"

    def forced(t_count):
        experts = torch.randperm(num_experts, generator=gen)[:t_count]
        pos = (torch.arange(batch)[:, None] * top_k + torch.arange(top_k)[None, :]) % t_count  # all T covered
        idx = experts[pos]
        assert unique_count(idx) == t_count

        def gate(self, h):
            logits, w, _ = gate_forward(self, h)
            return logits, w, idx
        return gate

    fns = {}
    for t_count in t_values:
        gate = forced(t_count)

        def run(gate=gate, sparse=False):
            block.gate.forward = gate.__get__(block.gate)
            if sparse:
                block.experts.forward = lambda h, i, w: sparse_experts_torch(block.experts, h, i, w)
            try:
                return hf_forward(block, x)
            finally:
                del block.gate.forward
                if sparse:
                    del block.experts.forward
        fns[("hf_grouped_mm", t_count)] = run
        fns[("sparse_torch", t_count)] = lambda run=run: run(sparse=True)
    with torch.inference_mode():
        prewarm(block.experts, batch)  # tokens per expert <= B
        med = interleaved(fns, args.sweep_rounds, warmup=1)
    fits = {}
    for variant in ("hf_grouped_mm", "sparse_torch"):
        xs = [t for t in t_values]
        ys = [med[(variant, t)] * 1e3 for t in t_values]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((a - mx) ** 2 for a in xs)
        slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sxx
        intercept = my - slope * mx
        ss_res = sum((b - (intercept + slope * a)) ** 2 for a, b in zip(xs, ys))
        ss_tot = sum((b - my) ** 2 for b in ys)
        r2 = 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")
        fits[variant] = {"T": xs, "ms": ys, "slope_ms_per_expert": slope, "intercept_ms": intercept, "r2": r2}
        log(f"  T-fit {variant}: time = {intercept:.2f} ms + {slope:.3f} ms x T  (R^2 = {r2:.4f}); "
            + " ".join(f"T{t}:{y:.1f}" for t, y in zip(xs, ys)))
        if not r2 >= 0.8:  # time should grow with T; a poor fit means the timings are noise (a busy machine)
            log(f"  CAUTION: the T-fit of {variant} explains little (R^2 {r2:.2f} < 0.8): these timings are "
                "dominated by noise (another process on the CPU?); rerun alone before reading any ratio")
    block = None  # free the weights (the timing closures hold the cell)
    gc.collect()
    return fits


# --------------------------------------------------------------------------------------------- TPOT
class StepClock:
    """LogitsProcessor that records a timestamp per generated token (after each forward)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(_now())
        return scores


def build_tpot_model(kwargs: dict, layers: int, vocab: int):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    h = kwargs["hidden_size"]
    cfg = Qwen2MoeConfig(**kwargs, num_hidden_layers=layers, vocab_size=vocab,
                         num_attention_heads=28, num_key_value_heads=4,
                         intermediate_size=18944 * h // 3584, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen2MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = _materialize(model, seed=3).eval()
    for module in model.modules():  # buffers are not parameters: recompute RoPE frequencies
        if hasattr(module, "inv_freq"):
            inv, _ = module.compute_default_rope_parameters(module.config)
            module.inv_freq = inv
            module.original_inv_freq = inv.clone()
    # realistic router confidence: unit-RMS normed inputs, router weights U(-a, a) with a chosen so the
    # logits' std equals the calibrated "real routing" temperature (mean top-1 p ~ TOP1_TARGET)
    scale, _ = calibrate_temperature(cfg.num_experts, cfg.num_experts_per_tok)
    bound = scale * math.sqrt(3.0 / h)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1, generator=gen)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                param.uniform_(-bound, bound, generator=gen)
    return model


def bench_tpot(args, kwargs: dict, log) -> list:
    from transformers import LogitsProcessorList

    model = build_tpot_model(kwargs, args.tpot_layers, args.tpot_vocab)
    impl = model.config._experts_implementation
    log(f"  HF default experts implementation for this model on this machine: {impl!r}")
    depth = full_depth(args.full_layers, "qwen2-57b-a14b")
    price = price_of(tpot_config("lynx", args.full_layers), args.tpot_layers)
    log(f"  LYNX routing-mass {price_label(price, depth, args.tpot_layers)}")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, args.tpot_vocab, (args.tpot_batch, args.tpot_prompt), generator=gen)
    mask = torch.ones_like(ids)
    rows = []
    variants = ["hf", "none", "lynx", "oea"]
    stamps = {v: [] for v in variants}
    stats = {}
    outputs = {}

    def run(v):
        if v == "hf":
            lynx_hf.unpatch(model)
        else:
            lynx_hf.patch(model, tpot_config(v, args.full_layers))  # phase auto: decode via the KV cache
            lynx_hf.reset_stats(model)
        clock = StepClock()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.tpot_new_tokens,
                             min_new_tokens=args.tpot_new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]))
        diffs = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
        stamps[v].append(sum(diffs) / len(diffs))
        outputs[v] = out
        if v != "hf":
            stats[v] = lynx_hf.stats(model).summary()

    with torch.inference_mode():
        warm, args.tpot_new_tokens = args.tpot_new_tokens, 2
        for v in variants:  # warmup (2 new tokens each): first-call costs (numba's on-disk cache load, allocator)
            run(v)
        args.tpot_new_tokens = warm
        for v in variants:
            stamps[v].clear()
        for r in range(args.tpot_rounds):
            for i in range(len(variants)):
                run(variants[(r + i) % len(variants)])
    lynx_hf.unpatch(model)
    base = statistics.median(stamps["hf"])
    for v in variants:
        tpot = statistics.median(stamps[v])
        s = stats.get(v, {})
        rows.append({"variant": v, "tpot_ms": round(tpot * 1e3, 2), "ratio_to_hf": round(tpot / base, 4),
                     "T_before": _fmt(s.get("unique_experts_before")), "T_after": _fmt(s.get("unique_experts_after")),
                     "same_tokens_as_hf": bool(torch.equal(outputs[v], outputs["hf"])),
                     "mass_price": price if v == "lynx" else "", "full_layers": (depth or "cut") if v == "lynx" else ""})
        log(f"  TPOT {v:5s}: {tpot * 1e3:8.1f} ms  ratio {tpot / base:.3f}  T {rows[-1]['T_before']} -> "
            f"{rows[-1]['T_after']}")
    model = None  # free the weights (the run closure holds the cell)
    gc.collect()
    return rows


def _price_cell(row: dict, cut_layers: int) -> str:
    """The routing-mass price a LYNX row ran, as the tables say it; ``—`` for the other variants."""
    if row.get("mass_price") in ("", None):
        return "—"
    depth = row["full_layers"]
    return price_label(row["mass_price"], None if depth == "cut" else depth, cut_layers)


def _fmt(value):
    if value is None:
        return ""
    return round(float(value), 2) if isinstance(value, (int, float)) else value


# ------------------------------------------------------------------------------------------- output
def write_csv(path: Path, rows: list) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def layer_markdown(rows: list, header: str) -> str:
    out = [header, "",
           "Median time per decode step of one MoE block (ms) and ratio to HF's grouped_mm block "
           "(HF's default experts implementation). T = unique experts the step touches; ideal = T_after/T_before; "
           "ideal (bytes) = weight bytes the step reads after/before, counting the router and shared experts "
           "that every step reads (the best a memory-bound layer can do); "
           "overhead = the block's whole routing post-process (BlockRouting.route: scores, policy, remap, weights, merge, telemetry) / lynx layer time; "
           "price = the routing-mass price LYNX ran on this one-block cut (--full-layers: the full model's depth, or as given).", ""]
    cells = {}
    for r in rows:
        cells.setdefault((r["shape"], r["source"], r["B"]), {})[r["variant"]] = r
    variants = ["hf_eager", "hf_grouped_mm", "none", "lynx", "oea", "lynx+sparse"]
    out.append("| shape | routing | B | " + " | ".join(variants) + " | T before | T lynx (ideal) | T oea (ideal) "
               "| lynx ideal (bytes) | lynx ratio / ideal | lynx ratio / ideal (bytes) | overhead | lynx routing-mass price |")
    out.append("|---" * (len(variants) + 11) + "|")
    for (shape, source, batch), cell in cells.items():
        vals = []
        for v in variants:
            r = cell.get(v)
            vals.append("—" if r is None else f"{r['median_ms']:.1f} ({r['ratio_to_hf']:.2f})")
        ly, oe = cell["lynx"], cell["oea"]
        vals += [str(ly["T_before"]), f"{ly['T_after']} ({ly['ideal_ratio']:.2f})",
                 f"{oe['T_after']} ({oe['ideal_ratio']:.2f})",
                 f"{ly['ideal_bytes_ratio']:.2f}", f"{ly['ratio_to_hf'] / ly['ideal_ratio']:.2f}",
                 f"{ly['ratio_to_hf'] / ly['ideal_bytes_ratio']:.2f}", f"{ly['overhead_pct']:.2f}%",
                 _price_cell(ly, 1)]
        out.append(f"| {shape} | {source} | {batch} | " + " | ".join(vals) + " |")
    return "\n".join(out) + "\n"


def plot_sweep(fits: dict, path: Path, title: str, log=print) -> None:
    """The T-sweep PNG; skipped with a note when matplotlib (the ``eval`` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        log(f"  (no {path.name}: matplotlib is not installed; pip install 'lynx-hf[eval]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, fit in fits.items():
        ax.plot(fit["T"], fit["ms"], "o", label=f"{variant} (measured)")
        xs = [min(fit["T"]), max(fit["T"])]
        ax.plot(xs, [fit["intercept_ms"] + fit["slope_ms_per_expert"] * t for t in xs], "--",
                label=f"{variant}: {fit['intercept_ms']:.0f} + {fit['slope_ms_per_expert']:.2f}·T ms, "
                      f"R²={fit['r2']:.3f}")
    ax.set_xlabel("unique experts touched T")
    ax.set_ylabel("MoE layer time per decode step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaled_shapes(factor: int) -> dict:
    out = {}
    for name, (family, kwargs) in SHAPES.items():
        kw = dict(kwargs)
        for key in SIZE_KEYS:
            if key in kw:
                kw[key] = max(64, kw[key] // factor)
        out[name] = (family, kw)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run in well under a minute: the smallest shape ({QUICK_SHAPE}) scaled by 1/16, B = 16, "
                        "real routing, one round, a coarse T sweep, a 3-token generate; prints the ratios")
    p.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES), help="default: all (--quick: the smallest)")
    p.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 4 16 32 64 (--quick: 16)")
    p.add_argument("--sources", nargs="+", default=None, choices=["real", "uniform"],
                   help="default: real uniform (--quick: real)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per layer cell (median)")
    p.add_argument("--remap-reps", type=int, default=20)
    p.add_argument("--eager-everywhere", action="store_true", help="also time HF eager on uniform routing")
    p.add_argument("--sweep-batch", type=int, default=16)
    p.add_argument("--sweep-step", type=int, default=8)
    p.add_argument("--sweep-rounds", type=int, default=3)
    p.add_argument("--tpot-layers", type=int, default=2)
    p.add_argument("--tpot-vocab", type=int, default=2048)
    p.add_argument("--tpot-batch", type=int, default=16)
    p.add_argument("--tpot-prompt", type=int, default=16)
    p.add_argument("--tpot-new-tokens", type=int, default=32)
    p.add_argument("--tpot-rounds", type=int, default=1)
    p.add_argument("--skip", nargs="*", default=[], choices=["layer", "sweep", "tpot"])
    add_full_layers(p, "each shape's real model")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="results folder (default: eval/results in the source checkout, else ./lynx_hf_results)")
    args = p.parse_args(argv)
    results_folder(args.out)  # a file name is refused before any work
    quick = {"shapes": [QUICK_SHAPE], "batches": [16], "sources": ["real"]}
    full = {"shapes": list(SHAPES), "batches": [1, 4, 16, 32, 64], "sources": ["real", "uniform"]}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.rounds = 1
        args.remap_reps = 3
        args.sweep_step = 24
        args.sweep_rounds = 1
        args.tpot_new_tokens = 3
        args.tpot_prompt = 4
        args.tpot_batch = 8
        args.tpot_vocab = 256
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    shapes = scaled_shapes(16) if args.quick else SHAPES
    shapes = {k: v for k, v in shapes.items() if k in args.shapes}
    prefix = "bench_quick_" if args.quick else "bench_"
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    start = _now()

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    cmd = command("bench", argv)
    log(f"# lynx_hf decode benchmark ({'quick, 1/16-scaled shapes' if args.quick else 'real shapes'})")
    log(f"command: `{cmd.strip()}`; torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, CPU; "
        f"interleaved rounds={args.rounds}; LYNX's routing-mass price at --full-layers {args.full_layers} "
        "(real: each shape's real model's MoE layers; cut: the price as given)")
    layer_rows = []
    if "layer" not in args.skip:
        bench_layer(args, shapes, layer_rows, log)
        write_csv(args.out / f"{prefix}layer.csv", layer_rows)
        md = layer_markdown(layer_rows, f"# MoE-layer decode benchmark\n\ncommand: `{cmd.strip()}`")
        (args.out / f"{prefix}layer.md").write_text(md)
        print("\n" + md, flush=True)
    if "sweep" not in args.skip:
        name = "qwen2-57b-a14b" if "qwen2-57b-a14b" in shapes else next(iter(shapes))
        log(f"\n## latency vs unique experts: {name}, B={args.sweep_batch}")
        fits = bench_t_sweep(args, shapes[name], log)
        plot_sweep(fits, args.out / f"{prefix}latency_vs_T.png", f"{name} MoE block, B={args.sweep_batch}, bf16 CPU",
                   log)
        write_csv(args.out / f"{prefix}latency_vs_T.csv",
                  [{"variant": v, "T": t, "median_ms": round(ms, 3)} for v, f in fits.items()
                   for t, ms in zip(f["T"], f["ms"])])
        md = ["| variant | slope (ms / expert) | intercept (ms) | R² |", "|---|---|---|---|"]
        md += [f"| {v} | {f['slope_ms_per_expert']:.3f} | {f['intercept_ms']:.2f} | {f['r2']:.4f} |" for v, f in fits.items()]
        (args.out / f"{prefix}latency_vs_T.md").write_text(f"# Latency vs unique experts ({name}, B={args.sweep_batch})\n\n"
                                                          + "\n".join(md) + "\n")
        print("\n".join(md), flush=True)
    if "tpot" not in args.skip:
        kw = shapes["qwen2-57b-a14b"][1] if "qwen2-57b-a14b" in shapes else scaled_shapes(16)["qwen2-57b-a14b"][1]
        log(f"\n## end-to-end TPOT: Qwen2-57B-A14B config, {args.tpot_layers} layers, vocab {args.tpot_vocab}, "
            f"B={args.tpot_batch}, prompt {args.tpot_prompt}, {args.tpot_new_tokens} new tokens, rounds={args.tpot_rounds}")
        rows = bench_tpot(args, kw, log)
        write_csv(args.out / f"{prefix}tpot.csv", rows)
        md = ["| variant | TPOT (ms) | ratio to HF | T before | T after | same tokens as HF | routing-mass price |",
              "|---|---|---|---|---|---|---|"]
        md += [f"| {r['variant']} | {r['tpot_ms']:.1f} | {r['ratio_to_hf']:.3f} | {r['T_before']} | {r['T_after']} | "
               f"{r['same_tokens_as_hf']} | {_price_cell(r, args.tpot_layers)} |" for r in rows]
        (args.out / f"{prefix}tpot.md").write_text(f"# End-to-end decode TPOT\n\ncommand: `{cmd.strip()}`\n\n"
                                                  + "\n".join(md) + "\n")
        print("\n".join(md), flush=True)
    log(f"\ntotal time {_now() - start:.0f}s")
    (args.out / f"{prefix}log.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
