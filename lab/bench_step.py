"""The fixed cost of a decode step, per MoE layer-step: the router call (the model's own router plus lynx_hf's
router hook: unpack, selection scores, policy, remap, weight rule, telemetry, repack) unpatched vs patched.

    python -m lab.bench_step                        # fixture A and the DeepSeek-V2-Lite shape, B 4 and 16
    python -m lab.bench_step --models fixture --batches 16 --no-compile

For each model and batch size B: the router inputs ``[B, H]`` of every MoE layer are taken from a forward of B
random prompts (the last position: what a decode step's router sees), then each layer's router is called on them
in a published decode step (every row decodes, eager: the CPU one-call path where the policy has one; compiled:
``torch.compile(fullgraph=True)`` of the router call, the sync-free path). Per variant and per layer-step:

- ``ops``: aten ops dispatched by the router call (a ``TorchDispatchMode`` counter; the numba work of the CPU
  one-call path is no torch op, its time is in ``us``; compiled: the ops of the sync-free path counted eagerly
  inside ``routing_torch.strict_sync_free()``, i.e. the graph before inductor fuses it), and ``+ops`` over the
  unpatched router;
- ``us``: the shortest router-call time over ``--reps`` calls (interleaved variants), and ``+us`` over unpatched.
  Timings on a shared machine are noisy: op counts are exact, times are an upper bound of the work.

Variants: ``unpatched``; ``none`` (policy none: telemetry only); ``lynx`` (the default policy, gate forced on,
default telemetry); ``lynx counts`` (``telemetry="counts"``, the cheaper counting mode, where this lynx_hf has it);
``lynx off`` (telemetry off). Models: fixture A (``eval/fixtures/qwen2moe-tiny``, bf16, N 32, k 4, H 256) and the
DeepSeek-V2-Lite shape (``DeepseekV2`` config cut to 1 MoE layer: N 64, k 6, H 2048, expert I 1408, 2 shared
experts, greedy routing; random weights, bf16 and fp32). Writes ``bench_step.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lynx_hf
from lynx_hf.kernels.routing_torch import strict_sync_free

from . import DEFAULT_FIXTURE, RESULTS_DIR, command
from .bench_compile import twin


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (``total``; ``ops``: per op name)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def build_dsv2(dtype: torch.dtype, layers: int = 1):
    """A DeepSeek-V2 model at DeepSeek-V2-Lite's MoE shape (N 64, k 6, H 2048, I 1408, 2 shared, greedy), ``layers``
    MoE layers (no dense first layer), small attention and vocabulary, random weights in ``dtype``; router weights
    scaled so the logits' spread is like a trained router's (``lynx_hf.eval.bench.calibrate_temperature``)."""
    import math

    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from lynx_hf.eval.bench import calibrate_temperature

    cfg = DeepseekV2Config(hidden_size=2048, moe_intermediate_size=1408, intermediate_size=4096,
                           n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy",
                           n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=0,
                           num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                           kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
                           v_head_dim=32, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(cfg).to(dtype).eval()
    scale, _ = calibrate_temperature(64, 6)
    bound = scale * math.sqrt(3.0 / cfg.hidden_size)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=gen).to(param.dtype))
            elif param.dim() >= 2:
                param.copy_((torch.randn(param.shape, generator=gen) * 0.02).to(param.dtype))
    return model


def _routers(model):
    """``[(block_name, router)]`` of the model's MoE blocks, in order (the family spec's router child)."""
    from lynx_hf.patches import SPECS

    out = []
    for name, module in model.named_modules():
        for spec in SPECS:
            if spec.matches(module):
                out.append((name, spec.router_of(module)))
                break
    return out


def router_inputs(model, batch: int, prompt: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Per MoE layer, the router's input ``[batch, H]`` at the last position of ``batch`` random prompts."""
    routers = _routers(model)
    seen = {}
    handles = [r.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].detach()))
               for i, (_, r) in enumerate(routers)]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt), generator=gen)
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = []
    for i in range(len(routers)):
        x = seen[i].reshape(batch, prompt, -1)[:, -1].contiguous().clone()
        out.append(x)
    return out


class _Decode:
    """Publish a decode step (every row decodes) on a patched model's tracker, eager and traced."""

    def __init__(self, model):
        from lynx_hf.core import DECODE, Step
        from lynx_hf.detection import _Frame
        from lynx_hf.state import find_state

        self.state = find_state(model)
        self.step = Step(DECODE)
        self.frame = _Frame
        self.token = None

    def __enter__(self):
        if self.state is None:
            return self
        tracker = self.state.tracker
        self.token = tracker._var.set(self.frame(self.step, None))
        tracker._traced = self.step
        return self

    def __exit__(self, *exc):
        if self.state is not None:
            self.state.tracker._var.reset(self.token)


def _variants(model, include_counts: bool):
    out = {"unpatched": model}
    configs = [("none", dict(policy="none")), ("lynx", dict(policy="lynx"))]
    if include_counts:
        configs.append(("lynx counts", dict(policy="lynx", telemetry="counts")))
    configs.append(("lynx off", dict(policy="lynx", telemetry=False)))
    for label, kw in configs:
        variant = twin(model)
        try:
            lynx_hf.patch(variant, gate="always", **kw)
        except Exception as exc:  # noqa: BLE001 - an older lynx_hf without the mode
            print(f"  (variant {label!r} skipped: {exc})")
            continue
        out[label] = variant
    return out


def _time_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(model, inputs, compiled: bool, reps: int, rounds: int, include_counts: bool, log) -> dict:
    """Per variant: mean over MoE layers of (ops, us) per router call."""
    variants = _variants(model, include_counts)
    calls = {}
    for label, m in variants.items():
        routers = [r for _, r in _routers(m)]
        fns = []
        for router, x in zip(routers, inputs):
            def call(router=router, x=x):
                return router(x)
            fns.append(torch.compile(call, fullgraph=True, dynamic=False) if compiled else call)
        calls[label] = (m, fns)
    ops, times = {}, {label: [float("inf")] * len(inputs) for label in calls}
    with torch.inference_mode():
        for label, (m, fns) in calls.items():
            with _Decode(m):
                for fn in fns:  # warm-up / compile
                    fn()
                # compiled: the aten ops the traced code dispatches (the graph before inductor fuses it) are counted
                # on the sync-free path eagerly (a dispatch mode cannot run inside a compiled call)
                counter, plain = OpCounter(), [r for _, r in _routers(m)]
                with strict_sync_free() if compiled else contextlib.nullcontext(), counter:
                    for router, x in zip(plain, inputs):
                        router(x)
                ops[label] = counter.total / len(fns)
        labels = list(calls)
        for r in range(rounds):
            for j in range(len(labels)):
                label = labels[(r + j) % len(labels)]
                m, fns = calls[label]
                with _Decode(m):
                    for i, fn in enumerate(fns):
                        times[label][i] = min(times[label][i], _time_us(fn, reps))
    for label, (m, _) in calls.items():
        if label != "unpatched":
            lynx_hf.unpatch(m)
    return {label: (ops[label], sum(times[label]) / len(inputs)) for label in calls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["fixture", "dsv2-bf16", "dsv2-fp32"],
                    choices=["fixture", "dsv2-bf16", "dsv2-fp32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--reps", type=int, default=50, help="calls per timing (the minimum is kept)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the variants")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    include_counts = True  # skipped (with a note) where this lynx_hf has no telemetry="counts"
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    rows = []
    for name in args.models:
        if name == "fixture":
            from transformers import AutoModelForCausalLM

            model, vocab, label = AutoModelForCausalLM.from_pretrained(DEFAULT_FIXTURE).eval(), 4096, "fixture A (bf16)"
        else:
            dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
            model, vocab = build_dsv2(dtype), 512
            label = f"DS-V2-Lite shape, 1 layer ({'bf16' if dtype == torch.bfloat16 else 'fp32'})"
        for batch in args.batches:
            inputs = router_inputs(model, batch, 8, vocab)
            for compiled in ([False] if args.no_compile else [False, True]):
                mode = "compiled" if compiled else "eager"
                res = measure(model, inputs, compiled, args.reps, args.rounds, include_counts, log)
                base_ops, base_us = res["unpatched"]
                for variant, (o, us) in res.items():
                    rows.append((label, batch, mode, variant, o, o - base_ops, us, us - base_us))
                    log(f"{label:34s} B={batch:<3d} {mode:8s} {variant:12s} ops {o:6.1f} (+{o - base_ops:5.1f})  "
                        f"{us:8.1f} us (+{us - base_us:7.1f})")
        del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# Fixed cost per MoE layer-step (router call + lynx_hf's router hook)", "",
          f"command: `{command('bench_step', argv)}`", "",
          "ops: aten ops per router call (TorchDispatchMode); +ops / +us: over the unpatched router. us: shortest "
          f"call over {args.reps} calls x {args.rounds} interleaved rounds, {args.threads} thread(s); timings on a "
          "shared machine are noisy, op counts exact. Policy gate forced on (gate='always').", "",
          "| model | B | mode | variant | ops | +ops | us | +us |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:+.1f} | {r[6]:.1f} | {r[7]:+.1f} |")
    md += [""]
    (out / "bench_step.md").write_text("\n".join(md))
    print(f"wrote {out / 'bench_step.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
