"""Compiled static-cache ``generate`` with LYNX on a GPU, one variant per process.

What a GPU takes by default: ``model.generate(..., cache_implementation="static")`` compiles the decode forward with
transformers' default ``CompileConfig()`` (inductor, ``mode="reduce-overhead"``: CUDA graphs). The 2-layer Qwen2-MoE of
``lab.gpu_check``'s ``compiled`` section (hidden 1024, N 64, k 8, random weights), 16 rows, 12 new tokens, stop tokens
picked from LYNX's own continuation so rows finish at different steps: compiled LYNX must equal eager LYNX in tokens,
decode tokens, finished-row tokens and unique experts. Each variant runs in its own process (a failed capture can
break the process's CUDA-graph state); ``python -m lab.gpu_compiled fp32`` runs one, no argument all four.
The shorter cousin of ``python -m lab.gpu_check --sections compiled`` for a lease with little time left.
"""
import json
import subprocess
import sys
import time

VARIANTS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "fp32-notel": dict(dtype="float32", telemetry=False),
    "fp32-noeos": dict(dtype="float32", eos=False),
}


def one(name):
    spec = VARIANTS[name]
    import torch
    from transformers import CompileConfig

    import lynx_hf
    from lab import gpu_check as g

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, spec["dtype"])
    model = g.build_model(g._compiled_config(False), dev, dtype)
    ids, mask = g.prompts(16, 8, 4096, dev)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
               cache_implementation="static")
    tel = spec.get("telemetry", True)
    lynx_hf.patch(model, policy="lynx", gate="always", telemetry=tel)
    with torch.inference_mode():
        free = model.generate(**gen, disable_compile=True, eos_token_id=None)
    eos = g._stop_tokens(free[:, 8:], 0) if spec.get("eos", True) else None
    lynx_hf.reset_stats(model)
    with torch.inference_mode():
        eager = model.generate(**gen, disable_compile=True, eos_token_id=eos)
    keys = ("decode_steps", "decode_tokens", "finished_row_tokens", "unique_experts_after")
    es = {k: lynx_hf.stats(model).summary().get(k) for k in keys} if tel else {}
    lynx_hf.reset_stats(model)
    t0 = time.time()
    try:
        with torch.inference_mode():
            comp = model.generate(**gen, eos_token_id=eos, compile_config=CompileConfig())
        cs = {k: lynx_hf.stats(model).summary().get(k) for k in keys} if tel else {}
        res = dict(ok=True, same_tokens=bool(torch.equal(comp, eager)), eager=es, compiled=cs,
                   s=round(time.time() - t0, 1))
    except Exception as exc:  # noqa: BLE001
        res = dict(ok=False, err=f"{type(exc).__name__}: {str(exc)[:400]}", s=round(time.time() - t0, 1))
    print("RESULT", name, json.dumps(res), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] not in VARIANTS:
        print(f"usage: python -m lab.gpu_compiled [{'|'.join(VARIANTS)}]  (no argument: every variant, one process "
              "each)", file=sys.stderr)
        sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)
    if len(sys.argv) > 1:
        one(sys.argv[1])
    else:
        for name in VARIANTS:
            try:
                out = subprocess.run([sys.executable, "-m", "lab.gpu_compiled", name], capture_output=True, text=True, timeout=110)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
                print(lines[-1] if lines else f"RESULT {name} no result rc={out.returncode}: {out.stderr[-600:]}",
                      flush=True)
            except subprocess.TimeoutExpired:
                print(f"RESULT {name} timeout", flush=True)
