"""Where a vLLM CPU decode step's time goes, and what the lynx_hf plugin adds to it. No engine is
started: every part calls vLLM's own code (router, ``cpu_fused_moe`` experts kernel, dense GEMM dispatch) or the
plugin's custom op directly, at the served models' shapes. Runs in the vLLM environment (.venv-vllm).

    .venv-vllm/bin/python -m lab.serve_profile                 # both parts
    .venv-vllm/bin/python -m lab.serve_profile --part op       # the plugin op only (seconds)
    .venv-vllm/bin/python -m lab.serve_profile --part step     # the decode-step breakdown (~4 GB of RAM)

Part ``op`` -- the plugin's added time per MoE layer per decode step, on a constructed process state
(``lynx_hf.vllm.state.isolated``: one layer per policy and path, a 16-token all-decode step written with
``lynx_hf.vllm.steps.write_kinds``, telemetry on, gate "always", under ``inference_mode`` as in vLLM's worker), for
policy none and lynx, beside vLLM's routing alone (``CPURouter._compute_routing``, what the op follows): ``masked``
(the body on the step described with masks, ``lynx_hf.vllm.rows.masked_step`` passed to
``lynx_hf.vllm.op.remap_step``: the path every step took before the fused one, what mixed steps take now), ``fused``
(the same body on the plain decode step ``rows.DECODE_STEP``: the core's one-call fused path that records its own
telemetry, what an all-decode step takes on CPU) and ``op`` (``torch.ops.lynx_vllm.remap_routing`` itself: the fused
path plus the op's dispatch, what a served step pays). ``masked`` and ``fused`` are called without the op's dispatch,
so they compare like for like. No longer measured (the plugin has no switches for them any more): the masked path
through the op's dispatch (the ``before`` column of earlier tables; ~10 us above ``masked``) and the op body on one
torch thread (``SINGLE_THREAD``: in a served engine vLLM's CPU worker makes ``torch.set_num_threads`` a no-op that
logs, and the toggle made decode slower). Shapes: fixture A (N 32, k 4), DeepSeek-V2-Lite (N 64, k 6; its greedy
routing is softmax top-k, what ``CPURouter`` does) and Qwen2-57B-A14B (N 64, k 8), bf16 router logits (the served
dtype).

Part ``step`` -- a decode step of serve_bench's ``qwen2-57b-2l`` model (2 layers, 16 requests) split into: vLLM's CPU
experts kernel (``cpu_fused_moe``, bf16, H 3584, I 2560, 64 prepacked experts) at the unique experts per layer
before / after LYNX, the shared expert (I 20480, vLLM's CPU linear dispatch), the plugin op, and the dense rest
(qkv / o projections, router, lm_head). The experts kernel is also timed at fixed tokens while the unique experts vary
and at fixed unique experts while the tokens vary: its cost per expert (weight bytes) vs per token-expert pair
(compute). Bytes-ideal: the experts time scaled by the unique-experts ratio. ``--tpot`` (two measured TPOTs, e.g.
from eval/results/serve_bench*.json) adds the unaccounted rest (attention kernel, norms, sampling, scheduler).

Timings are the minimum over interleaved repetitions (variants alternate within each repetition); on a shared
machine they are still noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import command

QWEN2_57B = dict(hidden=3584, inter=2560, shared_inter=20480, experts=64, top_k=8, heads=28, kv_heads=4, vocab=4096,
                 layers=2)
OP_SHAPES = {"fixture-a": (32, 4), "dsv2-lite": (64, 6), "qwen2-57b": (64, 8)}
#: the op's paths (see the module docstring): masked (the reference), fused (the body on the plain decode step), op
PATHS = ("masked", "fused", "op")


# ------------------------------------------------------------------------------------------ timing
def _interleaved_min(fns: dict, reps: int, inner: int) -> dict:
    """``{name: min over reps of the mean of inner calls, in ms}``, the names alternating within each repetition."""
    best = {name: float("inf") for name in fns}
    names = list(fns)
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            fn = fns[name]
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / inner * 1e3)
    return best


# ------------------------------------------------------------------------------------------ part op
def profile_op(rows: int = 16, reps: int = 30, inner: int = 200) -> list[dict]:
    """ms per layer-step of vLLM's routing alone and of the plugin (policy none / lynx; masked / fused / op)."""
    import numpy as np
    import torch
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from lynx_hf.gate import synthetic_routing
    from lynx_hf.vllm import layers, op, parse, state, steps
    from lynx_hf.vllm import rows as step_rows

    policies = ("none", "lynx")
    configs = {policy: parse({"policy": policy, "gate": "always"}) for policy in policies}
    out = []
    for model, (n, k) in OP_SHAPES.items():
        logits, _, _ = synthetic_routing(rows, n, k, torch.bfloat16, "cpu", seed=0)
        router = CPURouter(top_k=k, global_num_experts=n, renormalize=False)
        with state.isolated({"policy": "none", "gate": "always"}, capacity=max(rows, 16)) as st:
            steps.write_kinds(np.full(rows, state.DECODE, dtype=np.int8), "cpu")  # an all-decode step of `rows`
            masked = step_rows.masked_step(steps.buffer(torch.device("cpu"), rows)[:rows])
            fns = {}
            for policy in policies:
                for path in PATHS:
                    # one layer per (policy, path); the policy's configuration made current before each call
                    layer = state.Layer(index=len(st.layers), name=f"{policy}/{path}", top_k=k, num_experts=n,
                                        rule=layers.weight_rule(router), gathered=False)
                    st.layers.append(layer)

                    def call(cfg=configs[policy], path=path, layer=layer):
                        st.config = cfg
                        weights, ids = router._compute_routing(None, logits, None)
                        if path == "op":
                            return op.remap_routing(logits, weights, ids, layer.index)
                        step = masked if path == "masked" else step_rows.DECODE_STEP
                        return op.remap_step(layer, step, logits, weights, ids, True)

                    fns[f"{policy}/{path}"] = call

            def routing_only():
                return router._compute_routing(None, logits, None)

            fns["vllm routing"] = routing_only
            with torch.inference_mode():
                for fn in fns.values():  # warm-up: plans, numba compilation
                    for _ in range(3):
                        fn()
                best = _interleaved_min(fns, reps, inner)
        base = best["vllm routing"]
        for policy in policies:
            out.append({"model": model, "N": n, "k": k, "rows": rows, "policy": policy, "routing_ms": base,
                        **{f"added_{path}_ms": best[f"{policy}/{path}"] - base for path in PATHS}})
    return out


# ------------------------------------------------------------------------------------------ part step
def _routing_ids(tokens: int, unique: int, top_k: int):
    """fp32 weights, int32 ids ``[tokens, top_k]`` using exactly ``unique`` distinct experts (each row distinct)."""
    import torch

    if unique < top_k or unique > tokens * top_k:
        raise ValueError(f"{unique} unique experts impossible with {tokens} tokens x k {top_k}")
    slots = torch.arange(tokens * top_k).view(tokens, top_k)
    ids = (slots % unique).to(torch.int32)
    weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32)
    return weights, ids.contiguous()


class _Experts:
    """vLLM's CPU unquantized experts kernel on one layer's weights (``num_experts`` experts, prepacked per expert)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, seed: int = 0):
        import torch
        from vllm._custom_ops import cpu_fused_moe  # noqa: F401 (fails early without vLLM's CPU ops)

        self.isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"  # what vLLM picks (cpu_moe.py)
        gen = torch.Generator().manual_seed(seed)
        self.w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=torch.bfloat16)
        self.w2 = torch.empty(num_experts, hidden, inter, dtype=torch.bfloat16)
        for e in range(num_experts):  # one expert at a time: no second full copy in memory
            for packed, shape in ((self.w13, (1, 2 * inter, hidden)), (self.w2, (1, hidden, inter))):
                src = torch.empty(shape, dtype=torch.float32).uniform_(-0.02, 0.02, generator=gen).to(torch.bfloat16)
                torch.ops._C.prepack_moe_weight(src, packed[e:e + 1], self.isa)
        self.hidden = hidden
        self.bytes_per_expert = (self.w13[0].numel() + self.w2[0].numel()) * 2

    def call(self, x, weights, ids, out):
        from vllm._custom_ops import cpu_fused_moe

        cpu_fused_moe(out, x, self.w13, self.w2, None, None, weights, ids, "silu", self.isa, False)


def _vllm_linear(out_features: int, in_features: int, bias: bool = False, seed: int = 0):
    """A bf16 linear through vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``): ``x -> y``."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.uniform_(-0.02, 0.02, generator=torch.Generator().manual_seed(seed))
    layer.weight.requires_grad_(False)
    if bias:
        layer.bias.requires_grad_(False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, layer.weight, layer.bias)


def profile_step(tokens: int, unique_before: float, unique_after: float, op_ms: float, reps: int,
                 sweep: bool = True) -> dict:
    import torch
    from vllm.model_executor.layers.activation import SiluAndMul  # noqa: F401 (vLLM's act; the op below is its math)

    cfg = QWEN2_57B
    h, k, n = cfg["hidden"], cfg["top_k"], cfg["experts"]
    experts = _Experts(h, cfg["inter"], n)
    gen = torch.Generator().manual_seed(1)

    def x_of(t):
        return torch.randn(t, h, generator=gen).to(torch.bfloat16)

    def experts_fn(t, u):
        x, (w, ids) = x_of(t), _routing_ids(t, u, k)
        out = torch.empty_like(x)
        return lambda: experts.call(x, w, ids, out)

    u_b, u_a = round(unique_before), round(unique_after)
    fns = {("experts", tokens, u_b): experts_fn(tokens, u_b), ("experts", tokens, u_a): experts_fn(tokens, u_a)}
    if sweep:  # per expert: fixed tokens, unique experts vary; per token: fixed unique experts, tokens vary
        for u in (8, 32, 64):
            fns[("experts", tokens, u)] = experts_fn(tokens, u)
        for t in (2, 4 * tokens):
            fns[("experts", t, u_a)] = experts_fn(t, u_a)
    # shared expert (gate_up merged, SiLU-and-mul, down) and the dense rest of one layer, vLLM's CPU GEMM dispatch
    si = cfg["shared_inter"]
    head_dim = h // cfg["heads"]
    gate_up, down = _vllm_linear(2 * si, h), _vllm_linear(h, si)
    qkv = _vllm_linear((cfg["heads"] + 2 * cfg["kv_heads"]) * head_dim, h, bias=True)
    o_proj = _vllm_linear(h, cfg["heads"] * head_dim)
    router, shared_gate = _vllm_linear(n, h), _vllm_linear(1, h)
    lm_head = _vllm_linear(cfg["vocab"], h)
    x = x_of(tokens)

    def shared():
        y = gate_up(x)
        return down(torch.nn.functional.silu(y[:, :si]) * y[:, si:])

    def dense_layer():
        qkv(x), o_proj(x), router(x), shared_gate(x)

    fns[("shared",)] = shared
    fns[("dense",)] = dense_layer
    fns[("lm_head",)] = lambda: lm_head(x)
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        best = _interleaved_min(fns, reps, 1)
    layers = cfg["layers"]
    e_b, e_a = best[("experts", tokens, u_b)], best[("experts", tokens, u_a)]
    sweep_rows = sorted((key[1], key[2], ms) for key, ms in best.items() if key[0] == "experts")
    return {"tokens": tokens, "unique_before": unique_before, "unique_after": unique_after, "layers": layers,
            "isa": experts.isa, "bytes_per_expert": experts.bytes_per_expert,
            "experts_before_ms": e_b, "experts_after_ms": e_a, "shared_ms": best[("shared",)],
            "dense_ms": best[("dense",)], "lm_head_ms": best[("lm_head",)], "op_ms": op_ms, "sweep": sweep_rows}


def _fit(points):
    """Least-squares line ``y = a + b x`` through ``[(x, y)]``: ``(a, b)``."""
    m = len(points)
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] ** 2 for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    b = (m * sxy - sx * sy) / max(m * sxx - sx ** 2, 1e-12)
    return (sy - b * sx) / m, b


def step_table(r: dict, tpot=None) -> str:
    layers = r["layers"]
    u_b, u_a = r["unique_before"], r["unique_after"]
    rows = [
        ("experts path (cpu_fused_moe)", r["experts_before_ms"] * layers, r["experts_after_ms"] * layers,
         r["experts_before_ms"] * layers * u_a / u_b),
        ("shared expert", r["shared_ms"] * layers, r["shared_ms"] * layers, r["shared_ms"] * layers),
        ("plugin op added (lynx, fused path)", 0.0, r["op_ms"] * layers, 0.0),
        ("dense rest (qkv, o, router, lm_head)", r["dense_ms"] * layers + r["lm_head_ms"],
         r["dense_ms"] * layers + r["lm_head_ms"], r["dense_ms"] * layers + r["lm_head_ms"]),
    ]
    total = [sum(row[i] for row in rows) for i in (1, 2, 3)]
    out = [f"Decode step of qwen2-57b-2l ({layers} layers, {r['tokens']} requests, bf16, cpu_fused_moe isa "
           f"{r['isa']}), unique experts per layer {u_b:.2f} (unpatched) -> {u_a:.2f} (lynx); ms per step:", "",
           "| component | unpatched | lynx | bytes-ideal lynx |", "|---|---|---|---|"]
    for name, a, b, c in rows:
        out.append(f"| {name} | {a:.1f} | {b:.1f} | {c:.1f} |")
    out.append(f"| **measured sum** | {total[0]:.1f} | {total[1]:.1f} | {total[2]:.1f} |")
    if tpot and (tpot[0] < total[0] or tpot[1] < total[1]):
        out.append(f"| (--tpot {tpot[0]:g} / {tpot[1]:g} ms is below the measured sum: that TPOT was measured in another "
                   "run / load; nothing subtracted, compare ratios) | | | |")
        tpot = None
    if tpot:
        rest = [tpot[0] - total[0], tpot[1] - total[1]]
        out.append(f"| other (TPOT - sum: attention, norms, sampling, scheduler) | {rest[0]:.1f} | {rest[1]:.1f} | "
                   f"{rest[0]:.1f} |")
        out.append(f"| **TPOT (--tpot)** | {tpot[0]:.1f} | {tpot[1]:.1f} | {total[2] + rest[0]:.1f} |")
        total = [tpot[0], tpot[1], total[2] + rest[0]]
    out.append("")
    out.append(f"step speed-up unpatched/lynx: {total[0] / total[1]:.2f}x measured, {total[0] / total[2]:.2f}x "
               f"bytes-ideal; experts path alone {r['experts_before_ms'] / r['experts_after_ms']:.2f}x vs bytes-ideal "
               f"{u_b / u_a:.2f}x")
    sweep = r["sweep"]
    t0 = r["tokens"]
    by_u = [(u, ms) for t, u, ms in sweep if t == t0]
    by_t = [(t * QWEN2_57B["top_k"], ms) for t, u, ms in sweep if u == round(u_a)]
    a_u, b_u = _fit(by_u)
    a_t, b_t = _fit(by_t)
    out += ["", f"cpu_fused_moe per layer (ms), one expert = {r['bytes_per_expert'] / 2**20:.0f} MiB of weights:", "",
            "| tokens | unique experts | ms | GB/s of expert weights | ms per unique expert |", "|---|---|---|---|---|"]
    for t, u, ms in sweep:
        out.append(f"| {t} | {u} | {ms:.1f} | {u * r['bytes_per_expert'] / ms / 1e6:.1f} | {ms / u:.2f} |")
    out += ["", f"fixed {t0} tokens, unique experts vary: {a_u:.1f} ms + {b_u:.2f} ms per unique expert "
                f"(at {round(u_b)} experts the per-expert part is {b_u * round(u_b) / r['experts_before_ms']:.0%})",
            f"fixed {round(u_a)} unique experts, tokens vary: {a_t:.1f} ms + {b_t:.3f} ms per token-expert pair "
            f"({t0} tokens x k {QWEN2_57B['top_k']} = {t0 * QWEN2_57B['top_k']} pairs: "
            f"{b_t * t0 * QWEN2_57B['top_k']:.1f} ms, which LYNX does not reduce: every token keeps k experts)"]
    return "\n".join(out)


def op_table(rows: list[dict]) -> str:
    out = [f"Plugin op, ms per MoE layer per decode step ({rows[0]['rows']} decode rows, bf16 logits, telemetry on, "
           "torch threads as the worker's; added = vLLM routing + the plugin - vLLM routing alone). masked: the body on "
           "the step described with masks (the path before the fused one; mixed steps now); fused: the same body on "
           "the plain decode step (one-call fused path, telemetry in that call); both without the op's dispatch; op: "
           "torch.ops.lynx_vllm.remap_routing (the fused path + the op's dispatch: what a served all-decode step "
           "pays):", "",
           "| shape | policy | vLLM routing alone | added masked | added fused | added op | fused / masked |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} (N {r['N']}, k {r['k']}) | {r['policy']} | {r['routing_ms']:.4f} | "
                   f"{r['added_masked_ms']:.4f} | {r['added_fused_ms']:.4f} | {r['added_op_ms']:.4f} | "
                   f"{r['added_fused_ms'] / max(r['added_masked_ms'], 1e-9):.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["op", "step", "all"], default="all")
    p.add_argument("--tokens", type=int, default=16, help="decode rows per step (concurrent requests)")
    p.add_argument("--unique", nargs=2, type=float, default=[56.27, 14.93], metavar=("BEFORE", "AFTER"),
                   help="unique experts per layer per step, unpatched and lynx (serve_bench's telemetry, 16 requests)")
    p.add_argument("--tpot", nargs=2, type=float, default=None, metavar=("UNPATCHED", "LYNX"),
                   help="measured TPOTs (ms) of the same step (serve_bench) to show the unaccounted rest")
    p.add_argument("--reps", type=int, default=0, help="repetitions (default: 30 for op, 5 for step)")
    p.add_argument("--no-sweep", action="store_true", help="step: only the before / after experts calls")
    args = p.parse_args(argv)
    try:
        import torch
        import vllm
    except ImportError:
        print("serve_profile needs vLLM: run it with .venv-vllm/bin/python", file=sys.stderr)
        return 2
    from lynx_hf.vllm import op  # noqa: F401 (registers the custom op)

    print(f"# {command('serve_profile', argv)}\n# vLLM {vllm.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; minimum over interleaved repetitions "
          "(noisy on a shared machine)\n", flush=True)
    op_ms = None
    if args.part in ("op", "all"):
        rows = profile_op(args.tokens, reps=args.reps or 30)
        print(op_table(rows) + "\n", flush=True)
        op_ms = next(r["added_op_ms"] for r in rows if r["model"] == "qwen2-57b" and r["policy"] == "lynx")
    if args.part in ("step", "all"):
        if op_ms is None:
            op_ms = next(r["added_op_ms"] for r in profile_op(args.tokens, reps=10)
                         if r["model"] == "qwen2-57b" and r["policy"] == "lynx")
        r = profile_step(args.tokens, args.unique[0], args.unique[1], op_ms, reps=args.reps or 5,
                         sweep=not args.no_sweep)
        print(step_table(r, args.tpot), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
