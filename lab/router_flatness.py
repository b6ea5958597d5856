"""The router-flatness probe's figures (``lynx_hf.flatness``: routing mass moved, top-1 excess share) of checkpoints, through the public API: each model patched with
the default configuration (``gate="always"``: the policy on every step), ``generate`` on B held-out prompts for
``lynx_hf.flatness.STEPS + 1`` new tokens, then ``lynx_hf.stats(model)``'s per-layer ``router_flatness``, and whether
``LynxAccuracyWarning`` fired.

    python -m lab.router_flatness                                    # fixtures A, B, C
    python -m lab.router_flatness eval/fixtures/qwen2moe-tiny /tmp/smollm2-carved /tmp/smollm2-d2
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

from . import FIXTURES_DIR

DEFAULT_MODELS = [FIXTURES_DIR / n for n in ("qwen2moe-tiny", "mixtral-tiny", "deepseekv2-tiny")]


def measure(path: Path, batch: int, prefill: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lynx_hf
    from lynx_hf import flatness
    from lynx_hf.eval.evaluation import heldout_windows

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = heldout_windows(tok, prefill, batch)
    lynx_hf.patch(model, lynx_hf.LynxConfig(gate="always"))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=flatness.STEPS + 1,
                       min_new_tokens=flatness.STEPS + 1, do_sample=False)
    figs = [lay["router_flatness"] for lay in lynx_hf.stats(model).summary()["per_layer"] if lay.get("router_flatness")]
    moved = [f["routing_mass_moved"] for f in figs]
    warned = any(issubclass(w.category, lynx_hf.LynxAccuracyWarning) for w in got)
    return {"model": path.name, "moved": moved, "share": sum(f["top1_excess_share"] for f in figs) / len(figs),
            "warned": warned}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", type=Path, default=DEFAULT_MODELS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"B = {args.batch}, prefill {args.prefill}")
    print("| model | MoE layers | routing mass moved, sum over layers | per layer min-max | top-1 excess share "
          "(mean over layers) | LynxAccuracyWarning |")
    print("|---|---:|---:|---|---:|---|")
    for path in args.models:
        r = measure(path, args.batch, args.prefill)
        print(f"| {r['model']} | {len(r['moved'])} | {sum(r['moved']):.2f} | {min(r['moved']):.2f}-{max(r['moved']):.2f} "
              f"| {r['share']:.3f} | {'yes' if r['warned'] else 'no'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
