"""What one patched MoE layer adds to a decode step on the accelerator path: dispatched torch ops and Triton launches
of one block forward, patched minus unpatched, counted exactly (the count behind ``docs/decode-step.md``'s table and
``tests/accelerator/test_step_ops.py``).

    TRITON_INTERPRET=1 python -m lab.step_ops                 # the table: before (op by op) / after (fused step)
    TRITON_INTERPRET=1 python -m lab.step_ops --time          # + host time per router call (kernel stubbed on CPU)

Each model is a tiny one of its family at the router shape N 64, k 8 (the Qwen2-57B-A14B / DeepSeek-V2-Lite class;
op counts do not depend on the hidden size), B = 16 decode rows, one MoE layer. The block's forward runs in a
published decode step (every row decodes), patched with ``routing_backend="triton"``, ``expert_path="model"`` (the
model's own experts on both sides, so the difference is the routing step), ``gate="always"``, inside
``routing_torch.strict_sync_free()`` (the accelerator code path on CPU tensors; the Triton kernels interpreted). The
counter (:class:`StepCounter`) is a ``TorchDispatchMode`` plus a count of Triton kernel launches.

``--before`` counts the step-by-step path the Triton backend ran before the fused step (the policies' ops one by one,
``lynx_hf.core.remap_step``). ``--time``: the shortest router call (router + lynx_hf's hook) over ``--reps`` calls,
patched vs unpatched; on CPU the fused kernel's launch is replaced by a no-op (``--stub``, the default off CUDA), so
the figure is the Python around the launch, which is what the issue's host budget (unpatched + 30 us) bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the families counted, each (label, family, config overrides of :func:`build`)
MODELS = (
    ("Qwen2-MoE", "qwen2_moe", {}),
    ("Mixtral", "mixtral", {}),
    ("DeepSeek-V2 (greedy)", "deepseek_v2", {}),
    ("DeepSeek-V2 (group-limited)", "deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 8,
                                                     "topk_group": 4}),
    ("DeepSeek-V3 (bias + groups)", "deepseek_v3", {}),
    ("Llama-4 (k 1)", "llama4", {}),
)
#: the policies counted, each (label, ``patch`` overrides)
POLICIES = (("LYNX default", {}), ("LYNX paper rule", {"mass_price": None}), ("OEA", {"policy": "oea"}),
            ("XShare", {"policy": "xshare"}), ("none", {"policy": "none"}))


class StepCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (``ops``: per op name) and the Triton kernel launches
    (``launches``: per kernel name), compiled or interpreted."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.launches: Counter = Counter()
        self._patches = []
        self._inside = 0  # > 0 inside a launch: the interpreter's own host copies are not the step's ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter, jit

        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            real = cls.run

            def run(fn, *args, _real=real, **kwargs):
                if not self._inside:
                    self.launches[getattr(getattr(fn, "fn", fn), "__name__", "?")] += 1
                self._inside += 1
                try:
                    return _real(fn, *args, **kwargs)
                finally:
                    self._inside -= 1

            cls.run = run
            self._patches.append((cls, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, real in self._patches:
            cls.run = real
        self._patches.clear()
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        """Dispatched ops plus Triton launches."""
        return sum(self.ops.values()) + sum(self.launches.values())


def build(family: str, **overrides):
    """A tiny model of ``family`` at N 64, k 8 (Llama-4: k 1, as the family routes), one MoE layer, hidden 64, fp32,
    routers scaled like a trained router's, DeepSeek-V3's selection bias random (it matters)."""
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                num_experts=64, num_experts_per_tok=8)
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=64,
                                                       num_experts_per_tok=8))
    elif family in ("deepseek_v2", "deepseek_v3"):
        kw = dict(common, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=64, num_experts_per_tok=8,
                  n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
        if family == "deepseek_v2":
            kw.update(topk_method="greedy", n_group=1, topk_group=1)
            kw.update(overrides)
            model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**kw))
        else:
            kw.update(n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
            kw.update(overrides)
            model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**kw))
    elif family == "llama4":
        cfg = tf.Llama4TextConfig(**common, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=64,
                                  num_experts_per_tok=1, interleave_moe_layer_step=1, head_dim=16)
        model = tf.Llama4ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown family {family!r}")
    model = model.eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] > 1:
                p.mul_(20.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def moe_block(model):
    """``(name, block)`` of the model's first MoE block (the family spec's block class)."""
    from lynx_hf.patches import SPECS

    for name, module in model.named_modules():
        if any(spec.matches(module) for spec in SPECS):
            return name, module
    raise ValueError(f"{type(model).__name__}: no MoE block a family spec matches")


@contextlib.contextmanager
def decode_step(model):
    """A published decode step (every row decodes) on ``model``'s tracker while inside (a patched model), as the
    decoder backbone's pre-hook publishes one in ``generate``."""
    from .bench_step import _Decode

    with _Decode(model):
        yield


@contextlib.contextmanager
def step_by_step():
    """The Triton backend's path before the fused step: the policies' ops one by one (``core.remap_step``), the
    telemetry in torch ops (for ``--before``: plans made inside this context)."""
    from lynx_hf import core
    from lynx_hf.policies import base

    real_policy, real_device = core.FusedPolicy, base.Policy.device_policy
    core.FusedPolicy = lambda kind: None
    base.Policy.device_policy = lambda self, params: None
    saved = {name: type(p).device_policy for name, p in base.REGISTRY.items()}
    for p in base.REGISTRY.values():
        type(p).device_policy = lambda self, params: None
    try:
        yield
    finally:
        core.FusedPolicy, base.Policy.device_policy = real_policy, real_device
        for name, p in base.REGISTRY.items():
            type(p).device_policy = saved[name]


def count_block(model, batch: int = 16, warmup: int = 9, seed: int = 0) -> StepCounter:
    """The ops and launches of one forward of ``model``'s first MoE block on ``[batch, 1, H]`` random hidden states,
    inside a published decode step and ``strict_sync_free()`` (a patched model; an unpatched one: the plain forward),
    after ``warmup`` forwards (a step size's buffers are made on its first step; the flatness probe, where the
    configuration has it, reads the first 8)."""
    from lynx_hf.kernels.routing_torch import strict_sync_free

    _, block = moe_block(model)
    hidden = model.config.hidden_size
    x = torch.randn(batch, 1, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), decode_step(model), strict_sync_free():
        for _ in range(warmup):
            block(x)
        counter = StepCounter()
        with counter:
            block(x)
    return counter


def extra_per_step(model, batch: int = 16, **patch_kw) -> tuple[int, StepCounter, StepCounter]:
    """``(patched minus unpatched ops + launches, unpatched counter, patched counter)`` of one decode step of the first
    MoE layer of ``model`` (left unpatched): :func:`count_block` before and after ``lynx_hf.patch(model,
    routing_backend="triton", expert_path="model", gate="always", **patch_kw)``."""
    import lynx_hf

    plain = count_block(model, batch)
    lynx_hf.patch(model, **{"routing_backend": "triton", "expert_path": "model", "gate": "always", **patch_kw})
    try:
        patched = count_block(model, batch)
    finally:
        lynx_hf.unpatch(model)
    return patched.total - plain.total, plain, patched


def router_call_us(model, batch: int, reps: int, stub: bool, **patch_kw) -> tuple[float, float]:
    """``(unpatched, patched)`` shortest router call (router + lynx_hf's hook) in microseconds over ``reps`` calls, in a
    published decode step; ``stub``: the fused step's kernel launch replaced by a no-op (the Python around it)."""
    import lynx_hf
    from lynx_hf.kernels import fused_step

    _, block = moe_block(model)
    from lynx_hf.patches import SPECS

    spec = next(s for s in SPECS if s.matches(block))
    router = spec.router_of(block)
    x = torch.randn(batch, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def best(fn):
        fn()
        out = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if x.is_cuda:
                torch.cuda.synchronize()
            out = min(out, time.perf_counter() - t0)
        return out * 1e6

    with torch.no_grad(), decode_step(model):
        plain = best(lambda: router(x))
    lynx_hf.patch(model, **{"routing_backend": "triton", "expert_path": "model", "gate": "always", **patch_kw})
    real = fused_step._fused_step_kernel
    try:
        with torch.no_grad(), decode_step(model):
            for _ in range(9):  # the real kernel: buffers made, the flatness probe's first steps read
                router(x)
            if stub:
                fused_step._fused_step_kernel = _NoLaunch()
            patched = best(lambda: router(x))
    finally:
        fused_step._fused_step_kernel = real
        lynx_hf.unpatch(model)
    return plain, patched


class _NoLaunch:
    """Stands in for the kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--before", action="store_true", help="also count the step-by-step Triton path")
    ap.add_argument("--time", action="store_true", help="host time per router call, patched vs unpatched")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("on CPU set TRITON_INTERPRET=1 (before Python starts: triton reads it at import)")
    torch.set_num_threads(1)
    print(f"ops + Triton launches per MoE layer-step over the unpatched block, B = {args.batch}, N 64, k 8 "
          f"(Llama-4: k 1); routing_backend='triton', expert_path='model', gate='always', strict_sync_free")
    header = f"{'model':30s} {'policy':16s} {'unpatched':>9s} {'+fused':>7s}"
    print(header + (f" {'+before':>8s}" if args.before else "") + (f" {'host us (unpatched / patched)':>32s}"
                                                                      if args.time else ""))
    for label, family, overrides in MODELS:
        model = build(family, **overrides).to(args.device)
        for plabel, kw in POLICIES:
            extra, plain, patched = extra_per_step(model, args.batch, **kw)
            line = f"{label:30s} {plabel:16s} {plain.total:9d} {extra:+7d}"
            if args.before:
                with step_by_step():
                    before, _, _ = extra_per_step(model, args.batch, **kw)
                line += f" {before:+8d}"
            if args.time:
                stub = torch.device(args.device).type != "cuda"
                plain_us, patched_us = router_call_us(model, args.batch, args.reps, stub, **kw)
                line += f" {plain_us:14.1f} / {patched_us:8.1f}{' (stub)' if stub else ''}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
