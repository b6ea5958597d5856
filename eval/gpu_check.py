#!/usr/bin/env python
"""One prepared GPU check of the lynx_hf kernels (run on a CUDA machine, e.g. one H200; < 8 minutes).

1. Correctness at real shapes (bf16 experts, fp32 router scores), every kernel vs its torch reference:
   routing kernels (LYNX critical set, OEA critical set, remap + weights) must match *exactly*
   (weights within 1e-5); block alignment exactly; the sparse expert kernel within a relative
   Frobenius error of 2e-2 in bf16 (the kernel rounds the gate/up intermediate to bf16, the reference
   keeps it in fp32) and 1e-4 in fp32 (TF32 off).
2. Timing of the MoE routed-expert computation at B = 1, 16, 64, as ratios:
   - ``sparse``: the Triton sparse decode kernel (lynx_hf.kernels.moe.sparse_moe);
   - ``batched_mm``: HF transformers 5.x ``batched_mm`` style (gathers one expert matrix per
     (token, slot), then bmm) — the default HF decode path on GPU;
   - ``loop``: a loop over the unique experts (HF eager style, F.linear per expert);
   - ``sparse+lynx``: the sparse kernel on LYNX-remapped routing of skewed logits (fewer unique
     experts T), plus the routing overhead (critical set + remap) timed separately.
   T (unique experts) before/after LYNX and the ideal ratio T_after / T_before are printed.

Shapes (DESIGN.md "Evaluation"): Qwen2-57B-A14B H 3584, I 2560, N 64, k 8; DeepSeek-V2-Lite H 2048,
I 1408, N 64, k 6; Mixtral-8x7B H 4096, I 14336, N 8, k 2. Weights are random (latency does not
depend on values; correctness uses the same random weights for both sides).

Usage: ``python eval/gpu_check.py [--quick] [--iters N]``. Without CUDA it prints a message and
exits 0. ``--cpu-smoke`` runs the same code paths on tiny shapes with the Triton interpreter (a test
of this script, not of performance). Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402

MODELS = {
    # name: (H, I, N, k)
    "Qwen2-57B-A14B": (3584, 2560, 64, 8),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "Mixtral-8x7B": (4096, 14336, 8, 2),
}
SMOKE_MODELS = {"tiny-qwen": (64, 32, 16, 4), "tiny-mixtral": (48, 32, 8, 2)}
BATCHES = (1, 16, 64)
FAILURES: list[str] = []


def _import_kernels():
    """The installed package's kernels (``pip install -e .``); never the folder as a top-level ``kernels``."""
    from lynx_hf.kernels import moe, moe_naive, routing, routing_torch

    return moe, moe_naive, routing, routing_torch


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(f"{name} {detail}")


def timeit(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call (CUDA events on GPU, perf_counter otherwise)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def batched_mm_baseline(x, idx, w, gu, dn):
    """HF ``batched_mm_experts_forward`` (transformers 5.x), non-transposed layout, SiLU gate."""
    T, k = idx.shape
    ids = idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    h = torch.bmm(gu[ids], xs.unsqueeze(-1)).squeeze(-1)
    gate, up = h.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    y = torch.bmm(dn[ids], h.unsqueeze(-1)).squeeze(-1)
    y = y * w.reshape(-1, 1).to(y.dtype)
    return y.view(T, k, -1).float().sum(1).to(x.dtype)


def expert_loop_baseline(x, idx, w, gu, dn):
    """Loop over the unique experts (HF eager style): F.linear per expert, index_add_ in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    hit = torch.zeros(gu.shape[0], dtype=torch.bool, device=x.device)
    hit[idx.reshape(-1)] = True
    for e in hit.nonzero().flatten().tolist():
        tok, slot = torch.where(idx == e)
        gate, up = torch.nn.functional.linear(x[tok], gu[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, dn[e])
        out.index_add_(0, tok, (y * w[tok, slot, None].to(y.dtype)).float())
    return out.to(x.dtype)


def skewed_logits(T, N, gen, device, skew=2.0):
    """Router logits with a popular-expert bias plus token noise (a confident, skewed router)."""
    bias = torch.linspace(skew, -skew, N)[torch.randperm(N, generator=gen)]
    return (bias + torch.randn(T, N, generator=gen)).to(device)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_model(name, shape, args, dev, dtype, kernels):
    moe, moe_naive, routing, ref = kernels
    H, I, N, k = shape
    gen = torch.Generator().manual_seed(0)
    print(f"\n== {name}: H {H}, I {I}, N {N}, k {k}, {dtype} ==", flush=True)
    gu = (torch.randn(N, 2 * I, H, generator=gen, dtype=torch.float32) / H**0.5).to(dev, dtype)
    dn = (torch.randn(N, H, I, generator=gen, dtype=torch.float32) / I**0.5).to(dev, dtype)
    blk = dict(block_m=16, block_n=args.block_n, block_k=args.block_k)
    alpha, beta = ref.default_lynx_bins(N, k)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    batches = BATCHES if not args.quick else (1, 64)
    for B in batches:
        logits = skewed_logits(B, N, gen, dev)
        idx0 = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
        w0 = ref.routing_weights(logits, idx0, "softmax_all")
        x = torch.randn(B, H, generator=gen).to(dev, dtype)

        # --- routing kernels: exact ---
        crit_ref = ref.lynx_critical_set(logits, idx0, k, alpha, beta, args.tau)
        crit = routing.lynx_critical_set(logits, idx0, k, alpha, beta, args.tau)
        check(f"B={B} lynx_critical_set", torch.equal(crit, crit_ref), f"|S|={int(crit.sum())}")
        oea_ref = ref.oea_critical_set(logits, min(2, k))
        check(f"B={B} oea_critical_set", torch.equal(routing.oea_critical_set(logits, min(2, k)), oea_ref))
        idx1_ref = ref.remap_topk(logits, crit_ref, k)
        idx1, w1 = routing.remap_topk(logits, crit, k, rule="softmax_all", renormalize=True)
        check(f"B={B} remap_topk", torch.equal(idx1, idx1_ref))
        w1_ref = ref.routing_weights(logits, idx1_ref, "softmax_all", renormalize=True)
        check(f"B={B} remap weights", torch.allclose(w1, w1_ref, atol=1e-5, rtol=1e-5),
              f"max abs {float((w1 - w1_ref).abs().max()):.2e}")

        # --- alignment: exact ---
        a_ref = moe_naive.naive_moe_align_block_size(idx0, N, 16)
        a = moe.moe_align_block_size(idx0, N, 16)
        check(f"B={B} moe_align_block_size", all(torch.equal(p, q) for p, q in zip(a, a_ref)))

        # --- sparse experts vs reference ---
        want = moe_naive.naive_sparse_moe(x, idx0, w0, gu, dn)
        got = moe.sparse_moe(x, idx0, w0, gu, dn, **blk)
        err = rel_err(got, want)
        check(f"B={B} sparse_moe", bool(torch.isfinite(got).all()) and err < tol, f"rel err {err:.2e} (tol {tol:g})")
        if B == batches[-1]:  # the baselines compute the same function (sanity of the timing)
            check(f"B={B} batched_mm baseline", rel_err(batched_mm_baseline(x, idx0, w0, gu, dn), want) < tol)
            check(f"B={B} loop baseline", rel_err(expert_loop_baseline(x, idx0, w0, gu, dn), want) < tol)

        # --- timing ---
        T0 = int(idx0.unique().numel())
        T1 = int(idx1.unique().numel())
        it = args.iters
        t_sparse = timeit(lambda: moe.sparse_moe(x, idx0, w0, gu, dn, **blk), it)
        t_loop = timeit(lambda: expert_loop_baseline(x, idx0, w0, gu, dn), it)
        gather_bytes = B * k * (gu[0].numel() + dn[0].numel()) * gu.element_size()
        free = torch.cuda.mem_get_info()[0] if dev.type == "cuda" else float("inf")
        if gather_bytes < 0.6 * free:
            t_bmm = timeit(lambda: batched_mm_baseline(x, idx0, w0, gu, dn), max(3, it // 2), warmup=1)
        else:
            t_bmm = float("nan")
        t_lynx = timeit(lambda: moe.sparse_moe(x, idx1, w1, gu, dn, **blk), it)

        def _route():
            c = routing.lynx_critical_set(logits, idx0, k, alpha, beta, args.tau)
            return routing.remap_topk(logits, c, k, rule="softmax_all", renormalize=True, check=False)

        t_route = timeit(_route, it)
        print(
            f"  B={B:3d}  T {T0:3d} -> {T1:3d} (ideal {T1 / T0:.2f})  "
            f"sparse {t_sparse:8.3f} ms | batched_mm {t_bmm:8.3f} ms ({t_bmm / t_sparse:5.2f}x) | "
            f"loop {t_loop:8.3f} ms ({t_loop / t_sparse:5.2f}x) | sparse+lynx {t_lynx:8.3f} ms "
            f"({t_lynx / t_sparse:4.2f} of sparse; +routing {t_route:.3f} ms -> {(t_lynx + t_route) / t_sparse:4.2f})",
            flush=True,
        )
    del gu, dn
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="B in (1, 64) only")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--fp32", action="store_true", help="also check the expert kernel in fp32 (first model)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Triton interpreter, CPU (tests this script)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        dev, dtype, models = torch.device("cpu"), torch.float32, SMOKE_MODELS
        args.iters, args.block_n, args.block_k, args.quick = 1, 32, 32, True
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device available; nothing to check (run this on a GPU machine).")
            return 0
        dev, dtype = torch.device("cuda"), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = False
        models = {m: MODELS[m] for m in args.models.split(",")}
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    kernels = _import_kernels()
    t_start = time.time()
    for name, shape in models.items():
        run_model(name, shape, args, dev, dtype, kernels)
    if args.fp32 and not args.cpu_smoke:
        name, shape = next(iter(models.items()))
        args.quick = True
        run_model(name + " (fp32)", shape, args, dev, torch.float32, kernels)
    print(f"\n{len(FAILURES)} failure(s) in {time.time() - t_start:.0f} s", flush=True)
    for f in FAILURES:
        print("  FAIL", f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
