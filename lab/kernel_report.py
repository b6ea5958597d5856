#!/usr/bin/env python
"""Ahead-of-time compile of every Triton kernel of lynx_hf for real GPUs, on a machine without one.

Triton compiles without a device when it is given the target (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``; ``ptxas`` and ``cuobjdump`` ship in the triton wheel). This script
does not re-state any block size: it runs the **real launchers** of :mod:`lynx_hf.kernels.routing`,
:mod:`lynx_hf.kernels.moe` and :mod:`lynx_hf.kernels.fused_step` (the fused device decode step) on ``meta`` tensors of the real shapes with ``JITFunction.run`` replaced by
a recorder, so it compiles exactly the (kernel, constexprs, launch options) each launch site would use
(block sizes from :func:`lynx_hf.kernels.routing.block_sizes` / :func:`lynx_hf.kernels.moe.moe_block_config`);
the signature and the integer / alignment specialisation come from Triton's own binder for that
target, as a launch on the GPU would make them. Identical (kernel, signature, constexprs, options)
combinations are compiled once.

For each compiled kernel it reads registers, spill / stack bytes and local memory from the cubin
(``cuobjdump --dump-resource-usage``), shared memory from the compile metadata, and whether the PTX
declares ``.local`` memory. Output: a markdown table (``kernel_report.md`` in ``--out``) and/or JSON.

Matrix: Qwen2-57B-A14B (H 3584, I 2560, N 64, k 8), DeepSeek-V2-Lite (H 2048,
I 1408, N 64, k 6), Mixtral-8x7B (H 4096, I 14336, N 8, k 2), Qwen3-30B-A3B (H 2048, I 768, N 128,
k 8), DeepSeek-V3 (H 7168, I 2048, N 256, k 8); decode batches T in {1, 16, 64}; sm_80 and sm_90;
plus the expert kernels in Llama-4 Scout's layout (transposed, weight on the input; bf16);
the expert kernels in fp32 / fp16 / bf16 (the routing kernels take fp32 router scores only, by
contract). Routing launches are the decode path's (``vote`` / ``seed`` masks given, as
``lynx_hf.core.remap`` passes them); ``record_launches(decode_masks=(True, False))`` adds the plain
API (no masks).

    python -m lab.kernel_report              # writes eval/results/kernel_report.md
    python -m lab.kernel_report --json out.json --no-markdown --jobs 2

Must run with ``TRITON_INTERPRET`` unset (the interpreter replaces ``@triton.jit`` functions); the
script refuses otherwise.
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
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import RESULTS_DIR

#: name -> (H, I, N, k, weight rule, renormalize, scale) of the routed experts (the model's own config)
MODELS = {
    "Qwen2-57B-A14B": (3584, 2560, 64, 8, "softmax_all", False, 1.0),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6, "softmax_all", False, 1.0),
    "Mixtral-8x7B": (4096, 14336, 8, 2, "softmax_chosen", False, 1.0),
    "Qwen3-30B-A3B": (2048, 768, 128, 8, "softmax_all", True, 1.0),
    "DeepSeek-V3": (7168, 2048, 256, 8, "sigmoid", True, 2.5),
}
#: expert launches of another layout: Llama-4 Scout's routed experts (transposed weights, routing weight
#: on the input, k = 1), bf16 only
LLAMA4 = {"Llama-4-Scout (experts only)": (5120, 8192, 16, 1)}
BATCHES = (1, 16, 64)
ARCHS = (80, 90)
EXPERT_DTYPES = ("fp32", "fp16", "bf16")
_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _require_compiler_mode() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_report: unset TRITON_INTERPRET (the interpreter replaces @triton.jit kernels)")


# ----------------------------------------------------------------------------------------- recording
def record_launches(models=MODELS, batches=BATCHES, dtypes=EXPERT_DTYPES, decode_masks=(True,), llama4=True):
    """Run every launcher on meta tensors; return ``[(labels dict, JITFunction, args, kwargs)]``."""
    import torch
    import triton
    from triton.runtime.jit import JITFunction

    from lynx_hf.kernels import moe, routing, routing_torch

    launches = []
    current = {}
    real_run = JITFunction.run

    def recorder(self, *args, grid, warmup, **kwargs):
        launches.append((dict(current), self, args, kwargs))

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    JITFunction.run = recorder
    try:
        meta = torch.device("meta")
        for model, (H, I, N, k, rule, renorm, scale) in models.items():
            alpha, beta = routing_torch.default_lynx_bins(N, k)
            for T in batches:
                scores = torch.empty(T, N, dtype=torch.float32, device=meta)
                idx = torch.empty(T, k, dtype=torch.int64, device=meta)
                crit = torch.empty(N, dtype=torch.bool, device=meta)
                for masked in decode_masks:
                    vote = torch.empty(T, dtype=torch.bool, device=meta) if masked else None
                    seed = torch.empty(N, dtype=torch.bool, device=meta) if masked else None
                    base = dict(model=model, T=T, dtype="fp32", masks="vote+seed" if masked else "none")
                    current.update(base, call="lynx cover (default policy)")
                    routing.lynx_critical_set(scores, idx, 1, alpha, beta, float("inf"), vote=vote, seed=seed)
                    current.update(base, call="lynx paper rule")
                    routing.lynx_critical_set(scores, idx, k, alpha, beta, 1.0, vote=vote, seed=seed)
                    for unit in routing.PRICE_UNITS:  # threshold P, P x B, ceil(P sqrt B)
                        current.update(base, call=f"mass greedy, price unit {unit}")
                        routing.mass_greedy_grow(scores, idx, crit, k, 0.5, vote=vote, seed=seed, unit=unit)
                    current.update(base, call="oea k0=1")
                    routing.oea_critical_set(scores, 1, vote=vote, seed=seed, topk_idx=idx)
                _record_fused(current, model, T, N, k, rule, renorm, scale, alpha, beta, decode_masks)
                current.update(model=model, T=T, dtype="fp32", masks="-", call=f"remap + {rule}")
                routing.remap_topk(scores, crit, k, logits=scores, rule=rule, renormalize=renorm, scale=scale,
                                   check=False, topk_idx=idx)
                for dt in dtypes:
                    d = torch_dtype[dt]
                    x = torch.empty(T, H, dtype=d, device=meta)
                    w = torch.empty(T, k, dtype=d, device=meta)
                    gu = torch.empty(N, 2 * I, H, dtype=d, device=meta)
                    dn = torch.empty(N, H, I, dtype=d, device=meta)
                    current.update(model=model, T=T, dtype=dt, masks="-", call="sparse_moe (decode)")
                    moe.sparse_moe(x, idx, w, gu, dn, exact_grid=False)
        for model, (H, I, N, k) in (LLAMA4 if llama4 else {}).items():
            for T in batches:
                d = torch.bfloat16
                x = torch.empty(T, H, dtype=d, device=meta)
                idx = torch.empty(T, k, dtype=torch.int64, device=meta)
                w = torch.empty(T, k, dtype=d, device=meta)
                gu = torch.empty(N, H, 2 * I, dtype=d, device=meta)
                dn = torch.empty(N, I, H, dtype=d, device=meta)
                current.update(model=model, T=T, dtype="bf16", masks="-", call="sparse_moe (transposed, weight on input)")
                moe.sparse_moe(x, idx, w, gu, dn, transposed=True, weight_on_input=True, exact_grid=False)
    finally:
        JITFunction.run = real_run
    del triton
    return launches


#: the fused device step's selection per model (``lynx_hf.kernels.step_spec.FusedSelection`` arguments): the
#: DeepSeek-V3 router (sigmoid + bias, top-4 of 8 groups by the top-2 sum), the others plain logits
FUSED_SELECTION = {"DeepSeek-V3": ("biased", "sigmoid", 8, 4, "top2_sum")}


def _record_fused(current, model, T, N, k, rule, renorm, scale, alpha, beta, decode_masks):
    """The fused device step's launches (``lynx_hf.kernels.fused_step.FusedStep``) at one model shape and step size,
    bf16 router logits, full telemetry: the default policy, the paper rule and the telemetry-only ``keep`` with the
    decode-path masks (decode / live / seed; without them too where ``decode_masks`` says so); on the first model
    also OEA, XShare, the default's other price units, its counting mode, without telemetry and without masks."""
    import torch

    from lynx_hf.kernels import fused_step
    from lynx_hf.kernels.step_spec import LOGITS, FusedPolicy, FusedSelection

    meta = torch.device("meta")
    logits = torch.empty(T, N, dtype=torch.bfloat16, device=meta)
    idx = torch.empty(T, k, dtype=torch.int64, device=meta)
    weights = torch.empty(T, k, dtype=torch.bfloat16, device=meta)
    acc = torch.empty(13, dtype=torch.float64, device=meta)
    rows = torch.empty(T, dtype=torch.bool, device=meta)
    seed = torch.empty(N, dtype=torch.bool, device=meta)
    spec = FUSED_SELECTION.get(model)
    selection = LOGITS if spec is None else FusedSelection(*spec)
    bias = torch.empty(N, dtype=torch.float32, device=meta) if spec is not None else None
    default = FusedPolicy("lynx_mass", alpha, beta, price=0.5)
    launches = [("default", default, True, {}), ("paper rule", FusedPolicy("lynx", alpha, beta, tau=1.0), True, {}),
                ("keep (telemetry)", FusedPolicy("keep"), True, {})]
    launches += [(f"{label}, no masks", policy, False, {}) for label, policy, _, _ in launches if False in decode_masks]
    if model == next(iter(MODELS)):  # the rest of the policies and options at one shape (each compile takes seconds)
        launches += [("oea k0=1", FusedPolicy("oea", k0=1), True, {}),
                     ("xshare", FusedPolicy("xshare", budget=N // 2, warmup=1), True, {})]
        launches += [(f"default, price unit {unit}", FusedPolicy("lynx_mass", alpha, beta, price=0.5, unit=unit), True,
                      {}) for unit in ("batch", "sqrt")]
        launches += [("default, no masks", default, False, {}),
                     ("default, telemetry counts", default, True, {"counts_only": True}),
                     ("default, telemetry off", default, True, {"acc": None})]
    for label, policy, masked, kw in launches:
        current.update(model=model, T=T, dtype="bf16", masks="decode+live+seed" if masked else "none",
                       call=f"fused step: {label}, {rule}")
        fused_step.FusedStep(policy, N, k)(logits, weights, idx, rule, renorm, scale, decode=rows if masked else None,
                                           live=rows if masked else None, seed=seed if masked else None,
                                           selection=selection, bias=bias, **{"acc": acc, **kw})


def project_kernels() -> list[str]:
    """Names of every ``@triton.jit`` kernel (a launched function, not a helper) in lynx_hf.kernels."""
    from triton.runtime.jit import JITFunction

    from lynx_hf.kernels import fused_step, moe, routing

    names = []
    for mod in (routing, moe, fused_step):
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None) if not isinstance(obj, JITFunction) else obj  # triton.autotune wraps
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                names.append(fn.fn.__name__)
    return sorted(names)


# ----------------------------------------------------------------------------------------- compiling
def _specialize(fn, args, kwargs, arch: int):
    """Signature, constexprs, attrs and options exactly as ``JITFunction.run`` builds them for ``arch``, on every
    triton release pyproject.toml admits (3.7.1 - 3.9: the compilation knobs ``run`` passes as options differ, each
    one the backend's options take is passed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    from triton import knobs

    kw = dict(kwargs)  # the options JITFunction.run adds before binding
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    accepted = backend.parse_options({}).__dict__
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if knob in accepted and hasattr(knobs.compilation, knob):
            kw[knob] = getattr(knobs.compilation, knob)
    bound_args, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound_args, specialization, options)
    return target, signature, constexprs, attrs, options


def _key(fn, signature, constexprs, attrs, options, arch) -> str:
    opts = {k: v for k, v in sorted(options.__dict__.items()) if k in ("num_warps", "num_stages", "num_ctas", "maxnreg")}
    return json.dumps([fn.fn.__name__, arch, signature, sorted((str(k), str(v)) for k, v in constexprs.items()),
                       sorted((str(k), str(v)) for k, v in attrs.items()), opts], sort_keys=True)


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path)


def _usage_cache_path(cubin: bytes, name: str) -> Path | None:
    """Where :func:`resource_usage`'s reading of ``cubin`` is kept: ``<Triton's cache dir>/lynx_hf_cuobjdump/
    <sha256 of the cubin, the kernel name and cuobjdump's path>.json`` (None: ``LYNX_KERNEL_REPORT_NO_CACHE=1``).
    The cubin's bytes determine what cuobjdump reads from them, so a second run with the same Triton (CI's newest and
    next legs both run triton 3.9; Triton's own cache gives the same cubin) skips the two cuobjdump runs per compile,
    ~0.4 s each, most of this script's time."""
    if os.environ.get("LYNX_KERNEL_REPORT_NO_CACHE") == "1":
        return None
    import hashlib

    import triton

    key = hashlib.sha256(cubin + b"\0" + name.encode() + b"\0" + _tool("cuobjdump").encode()).hexdigest()
    return Path(triton.knobs.cache.dir) / "lynx_hf_cuobjdump" / f"{key}.json"


def resource_usage(cubin: bytes, name: str) -> dict:
    """``{"registers", "stack", "local", "shared_static", "spill_insts"}`` of ``name`` in ``cubin``:
    cuobjdump's resource usage, and the number of local-memory instructions (``STL`` / ``LDL``: register
    spills, or local arrays) in its SASS. A stack frame alone (ptxas reserves 8 bytes at times with
    "0 bytes spill stores") is not a spill. Kept per cubin (:func:`_usage_cache_path`)."""
    cache = _usage_cache_path(cubin, name)
    if cache is not None and cache.exists():
        try:
            return json.loads(cache.read_text())
        except (OSError, ValueError):
            pass   # a torn or unreadable entry: read the cubin again
    res = _read_resource_usage(cubin, name)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(res))
            os.replace(tmp, cache)
        except OSError:
            pass   # a read-only cache: the reading stands, unkept
    return res


def _read_resource_usage(cubin: bytes, name: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    spill_insts = len(re.findall(r"\b(?:STL|LDL)(?:\.[A-Z0-9]+)*\s", sass))
    for line in out.splitlines():
        m = _RES_RE.search(line)
        if m:
            reg, stack, shared, local = map(int, m.groups())
            return {"registers": reg, "stack": stack, "local": local, "shared_static": shared,
                    "spill_insts": spill_insts}
    raise RuntimeError(f"no resource usage for {name} in cuobjdump output:\n{out}")


def compile_one(job) -> dict:
    """Compile one deduplicated (kernel, specialisation, arch); returns its resource row."""
    import triton
    from triton.compiler import ASTSource

    fn, target, signature, constexprs, attrs, options = job
    t0 = time.perf_counter()
    try:
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 - reported per kernel; the test asserts none
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "seconds": time.perf_counter() - t0}
    ptx = ck.asm["ptx"]
    res = resource_usage(ck.asm["cubin"], fn.fn.__name__)
    return {
        "ok": True, "seconds": round(time.perf_counter() - t0, 2), **res,
        "shared": int(ck.metadata.shared), "ptx_local": ".local" in ptx,
        "spill": bool(res["spill_insts"] or res["local"] or ".local" in ptx),
        "num_warps": options.num_warps, "num_stages": options.num_stages, "maxnreg": options.maxnreg,
    }


_JOBS: dict = {}


def _compile_key(key: str) -> tuple[str, dict]:
    return key, compile_one(_JOBS[key])


def build_matrix(launches, archs=ARCHS):
    """``(rows, jobs)``: one row per (launch, arch) pointing at a deduplicated compile job."""
    rows, jobs = [], {}
    for labels, fn, args, kwargs in launches:
        for arch in archs:
            target, signature, constexprs, attrs, options = _specialize(fn, args, kwargs, arch)
            key = _key(fn, signature, constexprs, attrs, options, arch)
            jobs.setdefault(key, (fn, target, signature, constexprs, attrs, options))
            consts = {fn.arg_names[k[0]]: (v.value if hasattr(v, "value") else v) for k, v in constexprs.items()}
            rows.append({**labels, "kernel": fn.fn.__name__, "arch": f"sm_{arch}", "key": key,
                         "constexprs": {k: v for k, v in consts.items() if k.isupper()}})
    return rows, jobs


def run(archs=ARCHS, models=MODELS, batches=BATCHES, dtypes=EXPERT_DTYPES, jobs_n: int = 1) -> dict:
    _require_compiler_mode()
    t0 = time.perf_counter()
    launches = record_launches(models, batches, dtypes)
    rows, jobs = build_matrix(launches, archs)
    _JOBS.clear()
    _JOBS.update(jobs)
    results = {}
    if jobs_n > 1:
        import multiprocessing

        with ProcessPoolExecutor(jobs_n, mp_context=multiprocessing.get_context("fork")) as pool:
            for key, res in pool.map(_compile_key, list(jobs)):
                results[key] = res
    else:
        for key in jobs:
            results[key] = compile_one(jobs[key])
    for row in rows:
        row.update(results[row["key"]])
    return {
        "rows": [{k: v for k, v in r.items() if k != "key"} for r in rows],
        "unique_compiles": len(jobs), "launch_rows": len(rows), "kernels": project_kernels(),
        "seconds": round(time.perf_counter() - t0, 1),
        "triton": __import__("triton").__version__,
    }


# ------------------------------------------------------------------------------------------ spill self-check
def spill_self_check(arch: int = 90) -> dict:
    """Compile a kernel that cannot fit its registers (:mod:`lab.spill_probe`: a 2048-element fp32 tile
    live across a loop, one warp, ``maxnreg=32``): the detector must report a spill. Returns its resource row."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from .spill_probe import spilling_kernel

    target = GPUTarget("cuda", arch, 32)
    options = make_backend(target).parse_options({"num_warps": 1, "maxnreg": 32})
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    return compile_one((spilling_kernel, target, signature, {(3,): 2048}, {}, options))


# ----------------------------------------------------------------------------------------- markdown
def to_markdown(report: dict) -> str:
    rows = report["rows"]
    by = {}
    for r in rows:
        k = (r["kernel"], r["call"], r["model"], r["T"], r["dtype"], r["masks"])
        by.setdefault(k, {})[r["arch"]] = r
    lines = [
        "# Triton kernels compiled ahead of time for sm_80 / sm_90",
        "",
        f"Generated by `python -m lab.kernel_report` (triton {report['triton']}, no GPU needed): "
        f"{report['launch_rows']} (launch, arch) rows, {report['unique_compiles']} distinct compiles, "
        f"{report['seconds']} s. Each launch is the real launcher's, recorded on meta tensors of the model's "
        "shape; registers / stack / local bytes from `cuobjdump --dump-resource-usage`, shared memory from "
        "the compile metadata, `.local` = local memory declared in the PTX, *spill* = any local-memory "
        "instruction (`STL`/`LDL`) in the SASS, local bytes or `.local` (must be none); the routing kernels "
        "are single-program launches with `maxnreg=255` (`routing.SINGLE_PROGRAM`).",
        "",
        "| kernel | call | model | T | dtype | masks | blocks | sm_80 regs / smem B / spill | sm_90 regs / smem B / spill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r):
        if r is None:
            return "-"
        if not r["ok"]:
            return "**compile error**"
        spill = f"**yes** ({r['spill_insts']} STL/LDL)" if r["spill"] else "no"
        return f"{r['registers']} / {r['shared']} / {spill}"

    for (kernel, call, model, T, dtype, masks), per in by.items():
        any_row = next(iter(per.values()))
        blocks = ", ".join(f"{k}={v}" for k, v in any_row["constexprs"].items() if k.startswith("BLOCK") or k in ("K", "KK"))
        blocks += f", warps={any_row.get('num_warps', '?')}, stages={any_row.get('num_stages', '?')}"
        if any_row.get("maxnreg"):
            blocks += f", maxnreg={any_row['maxnreg']}"
        lines.append(f"| `{kernel}` | {call} | {model} | {T} | {dtype} | {masks} | {blocks} | "
                     f"{cell(per.get('sm_80'))} | {cell(per.get('sm_90'))} |")
    bad = [r for r in rows if not r["ok"] or r["spill"]]
    lines += ["", f"Compile errors or spills: {len(bad)}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the full report as JSON to this path")
    p.add_argument("--no-markdown", action="store_true", help="do not write kernel_report.md")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder of kernel_report.md (default: eval/results)")
    p.add_argument("--jobs", type=int, default=1, help="parallel compile processes")
    p.add_argument("--self-check", action="store_true", help="also compile a deliberately spilling kernel")
    args = p.parse_args(argv)
    _require_compiler_mode()
    report = run(jobs_n=args.jobs)
    if args.self_check:
        report["spill_self_check"] = spill_self_check()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    if not args.no_markdown:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_report.md").write_text(to_markdown(report))
    bad = [r for r in report["rows"] if not r["ok"] or r["spill"]]
    print(f"kernel_report: {report['launch_rows']} rows, {report['unique_compiles']} compiles, "
          f"{len(bad)} with errors or spills, {report['seconds']} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
