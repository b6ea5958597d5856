#!/usr/bin/env python
"""One prepared GPU check of lynx_hf: one script, under 8 minutes on one H200.

Sections (run in this order; each is skipped with a printed note when the time budget is nearly spent):

0. ``vllm`` — what a lent GPU should check first for the vLLM plugin, without vLLM on the device: the
   plugin's step function (``lynx_hf.vllm.plans.route``, what its custom op runs; vLLM is not imported) on CUDA
   tensors, sync-free path. Padding rows (expert id -1, as vLLM's ``FusedTopKRouter`` gives them under
   ``VLLM_MOE_SKIP_PADDING=1``) under policies lynx / paper rule / oea / none on the torch and Triton routing ops:
   live rows and telemetry equal to the torch path on the live rows alone, padding rows untouched, an all-padding
   step (capture warm-up) untouched; then one layer-step captured in a CUDA graph (``torch.cuda.graph``) and replayed
   on new routing and step masks: equal to eager, the telemetry reset in place between replays (same addresses,
   counting from zero), an all-padding replay a no-op.
0b. ``compiled`` — transformers' default on a GPU: ``model.generate(..., cache_implementation="static")``
   compiles the decode forward (``CompileConfig()``'s defaults: inductor, ``mode="reduce-overhead"``, CUDA graphs) and
   LYNX must classify it as eager does. A 2-layer Qwen2-MoE (hidden 1024, N 64, k 8, fp32, random weights), 16 rows
   and 20 new tokens, stop tokens picked from LYNX's own continuation so that rows finish at different steps: the
   unpatched compiled tokens equal eager (the control: if not, inductor's arithmetic alone moves tokens), and
   compiled LYNX (the default ``CompileConfig``, then ``fullgraph=True``) equals eager LYNX in tokens, decode tokens,
   finished-row tokens and unique experts; inductor's CUDA-graph skips are printed (the finished-row data are
   static addresses: none should come from lynx_hf).
1. ``kernels`` — every Triton kernel vs its torch reference at the real shapes of Qwen2-57B-A14B,
   DeepSeek-V2-Lite, Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3, decode batches B = 1, 16, 64:
   routing kernels (LYNX critical set, paper rule and the default policy's cover, the routing-mass
   greedy, OEA, remap) with ``vote`` / ``seed`` masks and a 0-d batch-base tensor must equal
   :mod:`lynx_hf.kernels.routing_torch` *exactly* (remap weights within 1e-5); block alignment exactly;
   the sparse expert kernel in bf16 (block sizes from ``moe_block_config``) within a relative Frobenius
   error of 2e-2 of :func:`lynx_hf.kernels.moe_naive.naive_sparse_moe` (the kernel rounds the gate/up
   intermediate to bf16, the reference keeps fp32). Also: the Triton routing step and the expert kernel
   traced by ``torch.compile(fullgraph=True)`` equal eager.
2. ``sync`` — ``torch.cuda.set_sync_debug_mode("error")`` over patched decode steps of the 2-layer
   Qwen2-57B-A14B config (random weights, built from its config, never the hub) with policies lynx
   default, paper rule (``mass_price=None``), oea; the Triton routing ops + sparse expert kernel (what ``auto``
   gives on CUDA) and the torch routing ops. Scope: the whole decode forward if the *unpatched* forward passes the same mode;
   else (HF's own code syncs) the ``"warn"`` mode with each sync attributed to the Python frame that
   issued it: none may come from lynx_hf's files.
3. ``tpot`` — TPOT of ``model.generate`` for the 2-layer Qwen2-57B-A14B and DeepSeek-V2-Lite configs
   (bf16, vocab 4096), B = 1, 4, 16, 64: HF default (unpatched) vs LYNX default with transformers'
   ``grouped_mm`` experts (``routing_backend="torch"``) vs LYNX default with the Triton routing + sparse expert
   kernel (``routing_backend="triton", expert_path="triton"``: the fused device step, one launch per layer-step) vs the
   defaults with the gate forced on / as a user gets them vs LYNX off (policy ``none``) with the same sparse kernel,
   interleaved rounds; unique experts per layer-step before / after.
   Prints, per shape, the expert path ``auto`` should take (the faster LYNX variant).
4. ``graphs`` — CUDA-graph capture of compiled static-cache decode with LYNX: ``model.generate(...,
   cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))``
   on the patched 2-layer Qwen2-57B-A14B; tokens equal to eager LYNX.
5. ``gate`` — the cost gate's decisions (``LynxConfig.gate="auto"``, ``lab.gate_table``) on this GPU for
   fixture A, DeepSeek-V2-Lite, Qwen2-57B-A14B, Mixtral-8x7B and OLMoE-1B-7B shapes x B = 1, 4, 16, 64: measured
   routing cost, expected saving, on / off. Sections 2-4 force the gate on (``gate="always"``): they check the policy.
6. ``int4`` — LYNX over 4-bit experts (the paper: +10 % on top of INT4): the 2-layer Qwen2-57B-A14B
   model's experts in int4 (``lab.int4_experts.Int4Experts``, PyTorch's tinygemm int4 matmul per expert, group 128,
   bf16 activations: ``torch.ops.aten._weight_int4pack_mm`` on CUDA). First the CUDA packing against the CPU kernel
   (4 experts, same int4 weights: relative error < 2e-2) and the int4 error against the bf16 experts (info); then
   decode-step time of ``model.generate`` at B = 16, 64, interleaved: bf16 unpatched, bf16 + LYNX (grouped_mm), int4
   unpatched, int4 + LYNX; unique experts before / after. Not a fused int4 MoE kernel (vLLM's Marlin MoE is the GPU
   one): a loop over the routed experts, one host read of the routing per layer, so launches may dominate; the
   ratio int4 + LYNX / int4 is the figure to read. CPU figures: ``python -m lab.bench_int4``.

8. ``torch_capture`` (last: a failed capture can break the process's capture state) — whether the vLLM plugin's step
   with ``routing_backend="torch"`` can be captured in a CUDA graph; the plugin refuses it on captured engines
   (printed for the record). The ``vllm`` section also checks ``stats_every``'s write: no host sync in the step
   (``set_sync_debug_mode("error")``), the file written from the asynchronous copy.

7. ``slo`` — throughput under a TPOT SLO in transformers' continuous batching (``generate_batch``) on the
   2-layer Qwen2-57B-A14B config, bf16, C = 1..128, unpatched / LYNX / OEA / XShare (``lynx_hf.eval.slo``): the most
   tokens/s whose TPOT meets the unpatched TPOT at C = 8, 16, 32 and multiples of its batch-1 TPOT. The CPU run
   (docs/results.md) turns compute-bound near 32 requests; a GPU should stay memory-bound far past 64.

A summary table closes the run. Exit status 1 if any check fails.

    python -m lab.gpu_check              # on a CUDA machine (prints a note and exits 0 without CUDA)
    python -m lab.gpu_check --dry-run    # CPU: each section on tiny shapes under the Triton interpreter
    python -m lab.gpu_check --sections kernels,sync --budget 300

Routing-mass price (``--full-layers``, ``lynx_hf.eval.depth``): the default's price depends on the model's MoE depth
(7/64 x 4 / L above 4 MoE layers), so a 2-layer cut patched with the default would run the price as given. Every LYNX
routing-mass config here (HF patches and the vLLM plugin's step configs) runs the price of the full model
(``lynx_hf.at_depth``): by default (``real``) the real model each section's shape is cut from (:data:`SECTION_SHAPES`:
Qwen2-57B-A14B 28 MoE layers -> 1/64, DeepSeek-V2-Lite 26; the ``compiled`` section's model and fixture A are no cut
of a real model: the price as given), ``--full-layers N`` one depth for every section, ``--full-layers cut`` the price
as given everywhere (every run before issue 52). The output says which price each section ran.

``--dry-run`` tests this script, not performance: sync detection there is a dispatch-mode check of
lynx_hf's own frames (CUDA's sync debug mode needs CUDA), the compile section uses dynamo with the eager
backend and the torch routing ops (the interpreter's kernels cannot be traced). Imports the installed
package only (``lynx_hf``, ``lynx_hf.kernels``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import statistics
import sys
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402

from lynx_hf.eval.depth import (  # noqa: E402
    add_full_layers,
    config_at_depth,
    full_depth,
    options_at_depth,
    price_label,
    price_of,
)

from .kernel_report import MODELS as KERNEL_MODELS  # noqa: E402  (name -> (H, I, N, k, rule, renorm, scale))

DRY_KERNEL_MODELS = {
    "tiny-qwen": (64, 32, 16, 4, "softmax_all", False, 1.0),
    "tiny-mixtral": (48, 32, 8, 2, "softmax_chosen", False, 1.0),
    "tiny-N60": (32, 16, 60, 4, "sigmoid", True, 2.5),
}
KERNEL_BATCHES, DRY_KERNEL_BATCHES = (1, 16, 64), (1, 5)
TPOT_BATCHES, DRY_TPOT_BATCHES = (1, 4, 16, 64), (1, 2)
SYNC_POLICIES = {
    "lynx default": dict(policy="lynx"),
    "lynx paper rule": dict(policy="lynx", mass_price=None),
    "oea k0=1": dict(policy="oea", oea_k0=1),
}
#: the routing ops and expert path of a variant (LynxConfig fields)
# the checks and timings below are of the policy's path: the cost gate forced on (section "gate" shows its decisions)
TRITON = dict(routing_backend="triton", expert_path="triton", gate="always")
TORCH = dict(routing_backend="torch", gate="always")
SUMMARY: list[tuple[str, str, str, str]] = []  # (section, check, status, detail)
#: the real model (``lynx_hf.eval.depth.REAL_MOE_LAYERS``) each model of the sections is cut from: its depth prices
#: LYNX under ``--full-layers real``; the vLLM section's layer (N 64, k 6) is DeepSeek-V2-Lite's router; the compiled
#: section's model (hidden 1024) is no real model's cut
SECTION_SHAPES = {"Qwen2-57B-A14B (2 layers)": "qwen2-57b-a14b", "DeepSeek-V2-Lite (2 layers)": "deepseek-v2-lite",
                  "vllm": "deepseek-v2-lite", "compiled": None}


def at_full_depth(args, model: str, options: dict) -> dict:
    """``options`` (``lynx_hf.patch`` keywords, or the vLLM plugin's step options) with the routing-mass price of the
    full model ``model`` (a :data:`SECTION_SHAPES` key) is cut from, at the depth ``--full-layers`` gives."""
    return options_at_depth(options, full_depth(args.full_layers, SECTION_SHAPES[model]))


def note_price(args, section: str, model: str, cut_layers: int) -> None:
    """Print, in the summary too, the routing-mass price LYNX runs in ``section`` on ``model``."""
    depth = full_depth(args.full_layers, SECTION_SHAPES[model])
    price = price_of(at_full_depth(args, model, {"policy": "lynx"}), cut_layers)
    note(section, f"{model}: LYNX routing-mass price", price_label(price, depth, cut_layers))


# ------------------------------------------------------------------------------------------- helpers
class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need: float, what: str, section: str) -> bool:
        if self.left() >= need:
            return True
        note = f"skipped: {self.left():.0f} s left of the {self.seconds:.0f} s budget, needs ~{need:.0f} s"
        print(f"  [skip] {what}: {note}", flush=True)
        SUMMARY.append((section, what, "skipped", note))
        return False


def record(section: str, name: str, ok: bool, detail: str = "") -> bool:
    print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    SUMMARY.append((section, name, "ok" if ok else "FAIL", detail))
    return ok


def note(section: str, name: str, detail: str) -> None:
    print(f"  [info] {name} {detail}", flush=True)
    SUMMARY.append((section, name, "info", detail))


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _fmt(x) -> str:
    return "?" if x is None else f"{x:.1f}"


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def free_memory(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def skewed_logits(T, N, gen, device, skew=2.0):
    """Router logits with a popular-expert bias plus token noise (a confident, skewed router)."""
    bias = torch.linspace(skew, -skew, N)[torch.randperm(N, generator=gen)]
    return (bias + torch.randn(T, N, generator=gen)).to(device)


class HostReadDetector:
    """CPU stand-in for CUDA's sync debug mode (dry run): records data-dependent aten ops issued from
    lynx_hf's own files (``.item()``, ``torch.tensor(x)`` (an H2D copy), ``nonzero``, ``is_nonzero``, ``masked_select``, ``unique``...)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        self._roots = _our_roots()
        self._bad = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
                     aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
                     aten.bincount.default, aten.equal.default,
                     aten.lift_fresh.default, aten.lift_fresh_copy.default}  # torch.tensor(host data): an H2D copy
        self.violations: list[str] = []
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in outer._bad:
                    frame = sys._getframe(1)
                    while frame is not None:
                        name = os.path.abspath(frame.f_code.co_filename)
                        if _ours(name, outer._roots):
                            outer.violations.append(f"{func} at {name}:{frame.f_lineno}")
                            break
                        frame = frame.f_back
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()


# ----------------------------------------------------------------------------------------- models
def calibrate_temperature(num_experts: int, target: float = 0.42, samples: int = 4096) -> float:
    """Scale s of N(0, 1) logits so the mean top-1 softmax probability is ``target`` (eval/bench.py's rule:
    the trained fixture's routers have mean top-1 p 0.34-0.50)."""
    gen = torch.Generator().manual_seed(1234)
    z = torch.randn(samples, num_experts, generator=gen)
    lo, hi = 0.01, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        p = torch.softmax(z * mid, dim=-1).max(dim=-1).values.mean().item()
        lo, hi = (mid, hi) if p < target else (lo, mid)
    return (lo + hi) / 2


def model_configs(dry: bool) -> dict:
    """The 2-layer configs (real sizes on GPU, tiny in the dry run), both MoE layers."""
    from transformers import DeepseekV2Config, Qwen2MoeConfig

    if dry:
        qwen = Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              shared_expert_intermediate_size=64, norm_topk_prob=False, num_hidden_layers=2,
                              vocab_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                              max_position_embeddings=256)
        dsv2 = DeepseekV2Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                n_shared_experts=1, topk_method="greedy", n_group=1, topk_group=1,
                                routed_scaling_factor=1.0, num_hidden_layers=2, first_k_dense_replace=0,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                v_head_dim=8, vocab_size=128, max_position_embeddings=256)
    else:
        qwen = Qwen2MoeConfig(hidden_size=3584, moe_intermediate_size=2560, num_experts=64, num_experts_per_tok=8,
                              shared_expert_intermediate_size=20480, norm_topk_prob=False, num_hidden_layers=2,
                              vocab_size=4096, num_attention_heads=28, num_key_value_heads=4,
                              intermediate_size=18944, max_position_embeddings=4096)
        dsv2 = DeepseekV2Config(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                                num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy", n_group=1,
                                topk_group=1, routed_scaling_factor=1.0, num_hidden_layers=2,
                                first_k_dense_replace=0, intermediate_size=10944, num_attention_heads=16,
                                num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, vocab_size=4096, max_position_embeddings=4096)
    return {"Qwen2-57B-A14B (2 layers)": qwen, "DeepSeek-V2-Lite (2 layers)": dsv2}


def build_model(config, dev, dtype):
    """Random-weight model from ``config`` on ``dev`` (never the hub), routers scaled to realistic confidence."""
    from transformers import AutoModelForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype).eval()
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts")
    h = config.hidden_size
    bound = calibrate_temperature(num_experts) * math.sqrt(3.0 / h)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1)
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                p.uniform_(-bound, bound)
    return model


def prompts(batch: int, length: int, vocab: int, dev):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (batch, length), generator=gen).to(dev)
    return ids, torch.ones_like(ids)


# ------------------------------------------------------------------------------------------- section 1
def section_kernels(args, dev, budget) -> None:
    from lynx_hf.kernels import moe, moe_naive, routing
    from lynx_hf.kernels import routing_torch as ref

    S = "kernels"
    models = DRY_KERNEL_MODELS if args.dry_run else KERNEL_MODELS
    batches = DRY_KERNEL_BATCHES if args.dry_run else KERNEL_BATCHES
    wdtype = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter has no usable bf16 tl.dot
    tol = 1e-4 if wdtype == torch.float32 else 2e-2
    for name, (H, I, N, k, rule, renorm, scale) in models.items():
        if not budget.allows(25 if not args.dry_run else 5, f"{name} kernels", S):
            return
        print(f"\n== {name}: H {H}, I {I}, N {N}, k {k}, experts {wdtype} ==", flush=True)
        gen = torch.Generator(device=dev).manual_seed(0)
        gu = torch.randn(N, 2 * I, H, generator=gen, dtype=wdtype, device=dev).mul_(H**-0.5)
        dn = torch.randn(N, H, I, generator=gen, dtype=wdtype, device=dev).mul_(I**-0.5)
        alpha, beta = ref.default_lynx_bins(N, k)
        cpu_gen = torch.Generator().manual_seed(1)
        for B in batches:
            logits = skewed_logits(B, N, cpu_gen, dev)
            idx0 = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
            vote = (torch.arange(B, device=dev) % 4 != 3) if B > 1 else torch.ones(B, dtype=torch.bool, device=dev)
            seed = torch.zeros(N, dtype=torch.bool, device=dev)
            seed[torch.randperm(N, generator=cpu_gen)[:2].to(dev)] = True
            base = vote.sum()
            tag = f"B={B}"
            got = routing.lynx_critical_set(logits, idx0, k, alpha, beta, 1.0, base, vote, seed)
            want = ref.lynx_critical_set(logits, idx0, k, alpha, beta, 1.0, base, vote, seed)
            record(S, f"{name} {tag} lynx paper rule (masks, 0-d base)", torch.equal(got, want),
                   f"|S| {int(want.sum())}")
            cover = routing.lynx_critical_set(logits, idx0, 1, alpha, beta, math.inf, vote=vote, seed=seed)
            cover_ref = ref.lynx_critical_set(logits, idx0, 1, alpha, beta, math.inf, vote=vote, seed=seed)
            record(S, f"{name} {tag} lynx cover", torch.equal(cover, cover_ref))
            grown = routing.mass_greedy_grow(logits, idx0, cover_ref, k, 0.5, vote=vote, seed=seed)
            with ref.strict_sync_free():
                grown_ref = ref.mass_greedy_grow(logits, idx0, cover_ref, k, 0.5, vote=vote, seed=seed)
            record(S, f"{name} {tag} mass greedy", torch.equal(grown, grown_ref), f"|S| {int(grown_ref.sum())}")
            oea = routing.oea_critical_set(logits, 1, vote=vote, seed=seed, topk_idx=idx0)
            oea_ref = ref.oea_critical_set(logits, 1, vote=vote, seed=seed, topk_idx=idx0)
            record(S, f"{name} {tag} oea", torch.equal(oea, oea_ref))
            idx1, w1 = routing.remap_topk(logits, grown_ref, k, rule=rule, renormalize=renorm, scale=scale,
                                          check=False, topk_idx=idx0)
            idx1_ref = ref.remap_topk(logits, grown_ref, k, topk_idx=idx0)
            w1_ref = ref.routing_weights(logits, idx1_ref, rule, renorm, scale)
            ok = torch.equal(idx1, idx1_ref) and torch.allclose(w1, w1_ref, atol=1e-5, rtol=1e-5)
            record(S, f"{name} {tag} remap + {rule}", ok, f"max |dw| {float((w1 - w1_ref).abs().max()):.1e}")
            a = moe.moe_align_block_size(idx1, N, 16)
            a_ref = moe_naive.naive_moe_align_block_size(idx1, N, 16)
            record(S, f"{name} {tag} moe_align_block_size", all(torch.equal(p, q) for p, q in zip(a, a_ref)))
            x = torch.randn(B, H, generator=gen, dtype=wdtype, device=dev)
            w = w1.to(wdtype)
            cfg = moe.moe_block_config(B, k, N, H, I, wdtype)
            out = moe.sparse_moe(x, idx1, w, gu, dn, exact_grid=False)
            err = rel_err(out, moe_naive.naive_sparse_moe(x, idx1, w, gu, dn))
            record(S, f"{name} {tag} sparse_moe {str(wdtype).split('.')[-1]}",
                   bool(torch.isfinite(out).all()) and err < tol,
                   f"rel err {err:.1e} (tol {tol:g}), blocks m{cfg['block_m']} n{cfg['block_n']} k{cfg['block_k']}")
        if not args.dry_run and name == "Qwen2-57B-A14B":
            _compiled_kernels(S, routing, moe, ref, logits, idx0, vote, seed, alpha, beta, k, x, gu, dn)
        del gu, dn
        free_memory(dev)
    if args.dry_run:
        note(S, "torch.compile of the Triton launchers", "not checked in the dry run (interpreter kernels)")


def _compiled_kernels(S, routing, moe, ref, logits, idx0, vote, seed, alpha, beta, k, x, gu, dn) -> None:
    """The decode path's Triton calls traced by dynamo (fullgraph) equal eager."""

    def step(logits, idx0, vote, seed, x):
        c = routing.lynx_critical_set(logits, idx0, 1, alpha, beta, math.inf, vote=vote, seed=seed)
        c = routing.mass_greedy_grow(logits, idx0, c, k, 0.5, vote=vote, seed=seed)
        idx, w = routing.remap_topk(logits, c, k, rule="softmax_all", check=False, topk_idx=idx0)
        return c, idx, moe.sparse_moe(x, idx, w.to(x.dtype), gu, dn, exact_grid=False)

    try:
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True)
        got = compiled(logits, idx0, vote, seed, x)
        want = step(logits, idx0, vote, seed, x)
        ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and rel_err(got[2], want[2]) < 1e-3
        record(S, "torch.compile(fullgraph) of lynx cover + mass greedy + remap + sparse_moe == eager", ok)
    except Exception as exc:  # noqa: BLE001 - reported, the script goes on
        record(S, "torch.compile(fullgraph) of the Triton launchers", False, f"{type(exc).__name__}: {exc}"[:300])


# ------------------------------------------------------------------------------------------- section 2
def _decode_steps(model, dev, batch, steps, guard):
    """Prefill, then ``steps`` decode forwards, each inside ``guard(model)`` (a context manager factory)."""
    ids, mask = prompts(batch, 8, model.config.vocab_size, dev)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            _sync(dev)
            with guard(model):
                out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(dev)


def _our_roots() -> tuple[str, ...]:
    """The folders of lynx_hf, lynx_hf.patches and lynx_hf.kernels (one folder in a wheel, three in the source
    checkout); lynx_hf.eval's frames are not the library's."""
    return tuple({os.path.dirname(os.path.abspath(importlib.util.find_spec(name).origin))
                  for name in ("lynx_hf", "lynx_hf.patches", "lynx_hf.kernels")})


_EVAL_DIR = os.path.dirname(os.path.abspath(importlib.util.find_spec("lynx_hf.eval").origin))


def _ours(path: str, roots: tuple[str, ...]) -> bool:
    """``path`` is a file of the library (in a wheel lynx_hf.eval lies inside lynx_hf's folder: not the library)."""
    return path.startswith(roots) and not path.startswith(_EVAL_DIR + os.sep)


class CudaSyncGuard:
    """``torch.cuda.set_sync_debug_mode`` over a decode forward.

    ``"error"``: any synchronizing CUDA call raises (used when the unpatched forward passes it too).
    ``"attribute"``: the ``"warn"`` mode, each sync warning attributed to the innermost Python frame
    outside torch when it is raised; syncs from lynx_hf's files (``lynx_hf/``, ``patches/``,
    ``kernels/``) are violations, others (HF's own code) are listed apart.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.ours: list[str] = []
        self.others: list[str] = []
        self._roots = _our_roots()
        self._torch = os.path.dirname(os.path.abspath(torch.__file__))

    def _attribute(self, message, category, filename, lineno, file=None, line=None):
        import traceback as tb

        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        for frame in reversed(tb.extract_stack()[:-1]):
            name = os.path.abspath(frame.filename)
            if name.startswith(self._torch) or name.endswith(("warnings.py", "gpu_check.py")):
                continue
            where = f"{name}:{frame.lineno}"
            (self.ours if _ours(name, self._roots) else self.others).append(where)
            return None
        self.others.append("?")
        return None

    def __call__(self, model):
        import contextlib
        import warnings

        @contextlib.contextmanager
        def ctx():
            if self.mode == "error":
                torch.cuda.set_sync_debug_mode("error")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                return
            self._show = warnings.showwarning
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = self._attribute
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning = self._show

        return ctx()


def section_sync(args, dev, budget, models) -> None:
    import contextlib

    import lynx_hf
    from lynx_hf.kernels.routing_torch import strict_sync_free

    S = "sync"
    name, config = next(iter(model_configs(args.dry_run).items()))
    if not budget.allows(40 if not args.dry_run else 10, f"{name} sync-free decode", S):
        return
    print(f"\n== sync-free decode: {name} ==", flush=True)
    model = models.get(name) or build_model(config, dev, torch.float32 if args.dry_run else torch.bfloat16)
    models[name] = model
    batch = 8 if args.dry_run else 16
    if dev.type == "cuda":
        try:
            _decode_steps(model, dev, batch, 1, CudaSyncGuard("error"))
            mode = "error"
            note(S, "scope", 'set_sync_debug_mode("error") over the whole decode forward (the unpatched one passes)')
        except RuntimeError as exc:
            mode = "attribute"
            probe = CudaSyncGuard("attribute")
            _decode_steps(model, dev, batch, 1, probe)
            note(S, "scope", 'the unpatched decode forward syncs in HF code, so set_sync_debug_mode("warn") with '
                             f"each sync attributed to its Python frame; unpatched: {sorted(set(probe.others))[:4]} "
                             f"({str(exc).splitlines()[0][:120]})")
    else:
        detector = HostReadDetector()

        @contextlib.contextmanager
        def guard(model):
            with strict_sync_free(), detector.mode:
                yield

        note(S, "scope", "dispatch-mode check of lynx_hf frames under strict_sync_free() (CPU dry run)")
    note_price(args, S, name, config.num_hidden_layers)
    for backend, ops in (("triton", TRITON), ("torch", TORCH)):
        for label, kwargs in SYNC_POLICIES.items():
            lynx_hf.patch(model, **at_full_depth(args, name, {**ops, **kwargs}))
            try:
                if dev.type == "cuda":
                    guard = CudaSyncGuard(mode)
                    _decode_steps(model, dev, batch, 2, guard)
                    ok = not guard.ours
                    detail = "; ".join(sorted(set(guard.ours))[:3])
                else:
                    detector.violations.clear()
                    _decode_steps(model, dev, batch, 2, guard)
                    ok, detail = not detector.violations, "; ".join(detector.violations[:3])
                summary = lynx_hf.stats(model).summary()
                ok = ok and summary["decode_steps"] >= 2
                detail = detail or (f"decode steps {summary['decode_steps']}, unique experts/layer-step "
                                    f"{_fmt(summary.get('unique_experts_before'))} -> "
                                    f"{_fmt(summary.get('unique_experts_after'))}")
            except RuntimeError as exc:
                ok, detail = False, str(exc).splitlines()[0][:300]
            finally:
                lynx_hf.unpatch(model)
            record(S, f"{label}, backend={backend}", ok, detail)


# ------------------------------------------------------------------------------------------- section 3
class StepClock:
    """Logits processor that timestamps each decode step (after a device sync)."""

    def __init__(self, dev) -> None:
        self.dev = dev
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        _sync(self.dev)
        self.stamps.append(time.perf_counter())
        return scores


def interleaved(run, variants, rounds: int, new_tokens: int, times: dict) -> None:
    """``run(variant, new_tokens)`` -> seconds per decode step: a 2-token warm-up of each variant (kernels compiled,
    caches allocated), then ``rounds`` rounds over the variants, the start rotating each round; appends to
    ``times[variant]``."""
    for v in variants:
        run(v, 2)
    names = list(variants)
    for r in range(rounds):
        for i in range(len(names)):
            v = names[(r + i) % len(names)]
            times[v].append(run(v, new_tokens))


def section_tpot(args, dev, budget, models) -> None:
    from transformers import LogitsProcessorList

    import lynx_hf

    S = "tpot"
    batches = DRY_TPOT_BATCHES if args.dry_run else TPOT_BATCHES
    new_tokens = 3 if args.dry_run else args.new_tokens
    rounds = 1 if args.dry_run else args.rounds
    # "lynx auto": the defaults with the gate forced on (expert_path "auto": the sparse kernel from
    # lynx_hf.core.AUTO_KERNEL_MIN_TOKENS decode tokens on CUDA); "lynx grouped_mm": transformers' grouped_mm always
    # "lynx default": what a user gets (the cost gate measured on the patched block: the saving timed on the experts
    # path each step size runs, with L2 flushed between calls; its decisions printed below)
    variants = {"hf": None, "lynx grouped_mm": dict(TORCH, expert_path="model"), "lynx triton": TRITON,
                "lynx auto": dict(routing_backend="auto", expert_path="auto", gate="always"),  # (a re-patch keeps
                "lynx default": dict(routing_backend="auto", expert_path="auto", gate="auto"),  # the fields not given)
                # LYNX off with the same expert kernel as "lynx triton": what the policy itself buys or costs
                "lynx off": dict(routing_backend="auto", expert_path="triton", gate="always", policy="none")}
    table = []
    for name, config in model_configs(args.dry_run).items():
        if not budget.allows(45 if not args.dry_run else 10, f"{name} TPOT", S):
            break
        print(f"\n== TPOT: {name} ==", flush=True)
        model = models.get(name) or build_model(config, dev, torch.float32 if args.dry_run else torch.bfloat16)
        models[name] = model
        note(S, f"{name} HF default experts implementation", repr(model.config._experts_implementation))
        note_price(args, S, name, config.num_hidden_layers)
        for B in batches:
            if not budget.allows(12 if not args.dry_run else 2, f"{name} B={B}", S):
                break
            ids, mask = prompts(B, 16, config.vocab_size, dev)
            times = {v: [] for v in variants}
            unique = {}

            def run(v, n_new):
                if variants[v] is None:
                    lynx_hf.unpatch(model)
                else:
                    lynx_hf.patch(model, **at_full_depth(args, name, {"policy": "lynx", **variants[v]}))
                    lynx_hf.reset_stats(model)
                clock = StepClock(dev)
                with torch.inference_mode():
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                   do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
                diffs = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
                if variants[v] is not None:
                    s = lynx_hf.stats(model).summary()
                    unique[v] = (s.get("unique_experts_before"), s.get("unique_experts_after"))
                return sum(diffs) / max(len(diffs), 1)

            try:
                interleaved(run, variants, rounds, new_tokens, times)
            except Exception as exc:  # noqa: BLE001 - reported, the script goes on
                record(S, f"{name} B={B}", False, f"{type(exc).__name__}: {exc}"[:300])
                traceback.print_exc()
                continue
            finally:
                lynx_hf.unpatch(model)
            med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
            choice = min(("lynx grouped_mm", "lynx triton"), key=lambda v: med[v])
            u = unique.get("lynx triton") or unique.get("lynx grouped_mm") or (None, None)
            from lynx_hf.core import AUTO_KERNEL_MIN_TOKENS

            picks = "triton sparse kernel" if B >= AUTO_KERNEL_MIN_TOKENS else "grouped_mm"
            line = (f"B={B:3d}: HF {med['hf']:.2f} ms | LYNX grouped_mm {med['lynx grouped_mm']:.2f} ms "
                    f"({med['lynx grouped_mm'] / med['hf']:.2f}x) | LYNX triton {med['lynx triton']:.2f} ms "
                    f"({med['lynx triton'] / med['hf']:.2f}x) | LYNX auto {med['lynx auto']:.2f} ms "
                    f"({med['lynx auto'] / med['hf']:.2f}x) | LYNX default {med['lynx default']:.2f} ms "
                    f"({med['lynx default'] / med['hf']:.2f}x) | LYNX off, same kernel {med['lynx off']:.2f} ms "
                    f"({med['lynx off'] / med['hf']:.2f}x) | unique experts/layer-step {_fmt(u[0])} -> {_fmt(u[1])} | "
                    f"faster: {'grouped_mm' if choice == 'lynx grouped_mm' else 'triton sparse kernel'}, "
                    f"auto picks: {picks}")
            note(S, f"{name} TPOT", line)
            table.append((name, B, med, choice, u))
        try:  # the default's cost gate on this model's first MoE block (measured at its first default patch above)
            from lynx_hf import gate as lgate

            lynx_hf.patch(model, **at_full_depth(args, name, {"policy": "lynx", **variants["lynx default"]}))
            planned = lgate.of(lynx_hf.state.state_of(model).blocks[0].plan)
            for b, d in sorted(planned.decisions.items()):
                if b <= 128:
                    note(S, f"{name} default gate B={b}", f"{'on' if d.on else 'off'}: cost {d.cost_ms:.4f} ms, saving "
                         f"{d.saving_ms:.4f} ms (experts {d.experts_before:.1f} -> {d.experts_after:.1f}, one expert "
                         f"{d.expert_ms:.4f} ms; {planned.source.split(',')[0]})")
        except Exception as exc:  # noqa: BLE001 - reported, the script goes on
            record(S, f"{name} default gate", False, f"{type(exc).__name__}: {exc}"[:300])
        finally:
            lynx_hf.unpatch(model)
    if table:
        print("\n  TPOT summary (ms per decode step, median of interleaved rounds):", flush=True)
        print("  | model | B | HF default | LYNX grouped_mm | LYNX triton | LYNX auto | LYNX default | LYNX off "
              "(same kernel) | unique experts | faster |", flush=True)
        print("  |---|---|---|---|---|---|---|---|---|---|", flush=True)
        for name, B, med, choice, u in table:
            print(f"  | {name} | {B} | {med['hf']:.2f} | {med['lynx grouped_mm']:.2f} | {med['lynx triton']:.2f} | "
                  f"{med['lynx auto']:.2f} | {med['lynx default']:.2f} | {med['lynx off']:.2f} | "
                  f"{_fmt(u[0])} -> {_fmt(u[1])} | "
                  f"{'grouped_mm' if choice == 'lynx grouped_mm' else 'triton'} |", flush=True)


# ------------------------------------------------------------------------------------------- section 4
def section_graphs(args, dev, budget, models) -> None:
    from transformers import CompileConfig

    import lynx_hf

    S = "graphs"
    name, config = next(iter(model_configs(args.dry_run).items()))
    if not budget.allows(150 if not args.dry_run else 20, "compiled static-cache decode with CUDA graphs", S):
        return
    print(f"\n== compiled static-cache decode: {name} ==", flush=True)
    model = models.get(name) or build_model(config, dev, torch.float32 if args.dry_run else torch.bfloat16)
    models[name] = model
    ids, mask = prompts(4, 8, config.vocab_size, dev)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
               pad_token_id=0, cache_implementation="static")
    backend = "torch" if args.dry_run else "auto"  # dry run: dynamo cannot trace the interpreter's kernels
    if args.dry_run:
        cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
        cc._compile_all_devices = True
    else:
        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
    note_price(args, S, name, config.num_hidden_layers)
    lynx_hf.patch(model, **at_full_depth(args, name, dict(policy="lynx", routing_backend=backend, gate="always")))
    try:
        if dev.type == "cuda":
            # a user's first generate after patch: on CUDA transformers compiles a static-cache decode by itself
            # (inductor, reduce-overhead: CUDA graphs); it once failed on the second replay, the telemetry made
            # inside the graph (lynx_hf.telemetry.BlockTelemetry.ensure)
            torch._dynamo.reset()
            with torch.inference_mode():
                auto = model.generate(**gen)
            lynx_hf.reset_stats(model)
        with torch.inference_mode():
            eager = model.generate(**gen, disable_compile=True)
        eager_stats = lynx_hf.stats(model).summary()
        if dev.type == "cuda":
            record(S, "first generate after patch (transformers' own compile) == eager LYNX tokens",
                   torch.equal(auto, eager), f"decode steps {eager_stats['decode_steps']}")
        lynx_hf.reset_stats(model)
        torch._dynamo.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled = model.generate(**gen, compile_config=cc)
        seconds = time.perf_counter() - t0
        stats = lynx_hf.stats(model).summary()
        ran = getattr(model, "_compiled_call", None) is not None
        same = torch.equal(compiled, eager)
        detail = (f"compiled path ran: {ran}, first call {seconds:.0f} s, decode steps {stats['decode_steps']} "
                  f"(eager {eager_stats['decode_steps']}), unique experts after {stats.get('unique_experts_after')} "
                  f"(eager {eager_stats.get('unique_experts_after')})")
        if not same:
            diff = (compiled != eager).nonzero()
            detail += f"; first differing (row, position) {diff[0].tolist() if len(diff) else '-'}"
        record(S, f"compiled ({'eager backend' if args.dry_run else 'inductor, reduce-overhead'}) == eager LYNX tokens",
               ran and same and stats["decode_steps"] == eager_stats["decode_steps"], detail)
        if dev.type == "cuda":
            from torch._dynamo.utils import counters

            skips = dict(counters.get("inductor", {}))
            note(S, "inductor counters", str({k: v for k, v in skips.items() if "cudagraph" in k}) or "{}")
    except Exception as exc:  # noqa: BLE001 - reported, the script goes on
        record(S, "compiled static-cache decode", False, f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()
    finally:
        lynx_hf.unpatch(model)


# ------------------------------------------------------------------------------------------- section 0b
def _compiled_config(dry: bool):
    """The model of section ``compiled``: a 2-layer Qwen2-MoE, small enough to compile in well under a minute."""
    from transformers import Qwen2MoeConfig

    if dry:
        return next(iter(model_configs(True).values()))
    return Qwen2MoeConfig(hidden_size=1024, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                          shared_expert_intermediate_size=1024, norm_topk_prob=False, num_hidden_layers=2,
                          vocab_size=4096, num_attention_heads=16, num_key_value_heads=4, intermediate_size=2048,
                          max_position_embeddings=512)


def _stop_tokens(new: torch.Tensor, pad: int) -> list[int]:
    """Stop tokens that finish rows of ``new`` ``[B, steps]`` (a run without stopping) at different steps: the token of
    row ``r`` at step ``1 + r % (steps - 2)`` for every fourth row, distinct, never ``pad``."""
    batch, steps = new.shape
    picked: list[int] = []
    for row in range(0, batch, 4):
        token = int(new[row, 1 + row % max(1, steps - 2)])
        if token != pad and token not in picked:
            picked.append(token)
    return picked


def _finish_steps(new: torch.Tensor, eos: list[int]) -> list[int]:
    hit = torch.isin(new, torch.tensor(eos, device=new.device))
    return sorted({int(row.nonzero()[0]) for row in hit if bool(row.any())})


def section_compiled(args, dev, budget) -> None:
    from transformers import CompileConfig

    import lynx_hf

    S = "compiled"
    if not budget.allows(200 if not args.dry_run else 20, "compiled static-cache generate, rows finishing early", S):
        return
    config = _compiled_config(args.dry_run)
    print("\n== compiled static-cache generate with rows finishing early (transformers' GPU default) ==", flush=True)
    model = build_model(config, dev, torch.float32)
    batch, new_tokens = (6, 8) if args.dry_run else (16, 20)
    ids, mask = prompts(batch, 8, config.vocab_size, dev)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
               cache_implementation="static")

    def compile_config(**kw):
        if not args.dry_run:
            return CompileConfig(**kw)  # what generate uses on CUDA: inductor, reduce-overhead (kw: fullgraph)
        cc = CompileConfig(backend="eager", mode=None, **kw)
        cc._compile_all_devices = True  # CPU: transformers compiles only when asked to
        return cc

    def run(compiled_kw=None, **kw):
        torch._dynamo.reset()
        if compiled_kw is not None and not args.dry_run:
            from torch._dynamo.utils import counters

            counters.clear()
        # eager: disable_compile (on CUDA a static-cache generate compiles unless told not to)
        extra = dict(disable_compile=True) if compiled_kw is None else \
            dict(compile_config=compile_config(**compiled_kw))
        with torch.inference_mode():
            out = model.generate(**gen, **kw, **extra)
        skips = {}
        if compiled_kw is not None and not args.dry_run:
            from torch._dynamo.utils import counters

            skips = {k: v for k, v in counters.get("inductor", {}).items() if "cudagraph" in k}
        return out, skips

    try:
        if not args.dry_run:
            plain, _ = run(eos_token_id=None)
            plain_c, skips = run({}, eos_token_id=None)
            record(S, "control: unpatched compiled == eager tokens", torch.equal(plain, plain_c),
                   f"cudagraph counters {skips or '{}'}")
        note_price(args, S, "compiled", config.num_hidden_layers)
        lynx_hf.patch(model, **at_full_depth(args, "compiled", dict(
            policy="lynx", routing_backend="torch" if args.dry_run else "auto", gate="always")))
        free, _ = run(eos_token_id=None)
        eos = _stop_tokens(free[:, ids.shape[1]:], 0)
        lynx_hf.reset_stats(model)
        eager, _ = run(eos_token_id=eos)
        eager_stats = lynx_hf.stats(model).summary()
        steps = _finish_steps(eager[:, ids.shape[1]:], eos)
        record(S, "rows finish at different steps (precondition)", len(steps) >= 2
               and eager_stats["finished_row_tokens"] > 0,
               f"stop tokens {eos}; rows finish after {steps} new tokens; eager finished-row tokens "
               f"{eager_stats['finished_row_tokens']}")
        keys = ("decode_steps", "decode_tokens", "finished_row_tokens", "unique_experts_before", "unique_experts_after")
        for label, kw in (("default CompileConfig", {}), ("fullgraph=True", dict(fullgraph=True))):
            lynx_hf.reset_stats(model)
            t0 = time.perf_counter()
            out, skips = run(kw, eos_token_id=eos)
            seconds = time.perf_counter() - t0
            stats = lynx_hf.stats(model).summary()
            ran = getattr(model, "_compiled_call", None) is not None
            differ = [key for key in keys if stats.get(key) != eager_stats.get(key)]
            detail = (f"compiled path ran: {ran}, {seconds:.0f} s; " +
                      ", ".join(f"{key} {stats.get(key)} (eager {eager_stats.get(key)})" for key in keys))
            if not torch.equal(out, eager):
                diff = (out != eager).nonzero()
                detail += f"; first differing (row, position) {diff[0].tolist()}"
            if skips:
                detail += f"; cudagraph counters {skips}"
            record(S, f"compiled LYNX ({label}) == eager LYNX with finished rows",
                   ran and torch.equal(out, eager) and not differ, detail)
    except Exception as exc:  # noqa: BLE001 - reported, the script goes on
        record(S, "compiled static-cache generate", False, f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()
    finally:
        if lynx_hf.is_patched(model):
            lynx_hf.unpatch(model)
        model = None
        free_memory(dev)


# ------------------------------------------------------------------------------------------- section 5
def section_gate(args, dev, budget) -> None:
    """The cost gate's decisions (``LynxConfig.gate="auto"``) per shape x B on this device (``lab.gate_table``):
    printed for the record (a decision is the device's, not a pass / fail); the check is that every measurement
    ran and is finite."""
    from lynx_hf import LynxConfig

    from .gate_table import BATCHES, SHAPES, table

    S = "gate"
    if not budget.allows(60 if not args.dry_run else 10, "cost gate decisions", S):
        return
    names, batches = (["fixture-a"], [4, 16]) if args.dry_run else (["fixture-a", *SHAPES], list(BATCHES))
    print(f"\n== cost gate decisions on {dev} ==", flush=True)
    rows = []
    for name in names:  # each shape's decisions for the price its full model's layers run (fixture A: whole)
        depth = full_depth(args.full_layers, name)
        config = config_at_depth(LynxConfig(gate="auto"), depth)
        whole = name == "fixture-a"  # fixture A's layer is priced as the whole 4-layer model prices it: as given
        note(S, f"{name}: LYNX routing-mass price", price_label(price_of(config, 1), depth, 4 if whole else 1, whole))
        # on CUDA also as a CUDA-graph engine (vLLM) runs the step: the routing cost of a graph replay
        for captured in (False, True) if dev.type == "cuda" else (False,):
            rows += table([name], batches, dev, config, log=lambda line: print("  " + line, flush=True),
                          captured=captured)
    for r in rows:
        note(S, f"{r['shape']}{' (graph)' if r['captured'] else ''} B={r['B']}",
             f"{'on' if r['on'] else 'off'}: cost {r['cost_ms']:.4f} ms, saving "
             f"{r['saving_ms']:.4f} ms (experts {r['experts_before']:.1f} -> {r['experts_after']:.1f}, one expert "
             f"{r['expert_ms']:.4f} ms)")
    record(S, "gate measured every shape x B", all(math.isfinite(r["cost_ms"]) and math.isfinite(r["saving_ms"])
                                                   for r in rows), f"{len(rows)} decisions")


# ------------------------------------------------------------------------------------------- section 0
VLLM_POLICIES = {"lynx default": dict(policy="lynx"), "lynx paper rule": dict(policy="lynx", mass_price=None),
                 "oea k0=1": dict(policy="oea", oea_k0=1), "none": dict(policy="none")}


def _vllm_layer(N: int, k: int):
    """One MoE layer in the plugin's (isolated) process state, as ``lynx_hf.vllm.layers.attach`` adds it for a
    vLLM ``FusedTopKRouter`` (softmax over all N, renormalized)."""
    from lynx_hf.core import WeightRule
    from lynx_hf.vllm import state

    layer = state.Layer(index=0, name="gpu_check.moe", top_k=k, num_experts=N,
                        rule=WeightRule("softmax_all", renormalize=True))
    state.STATE.layers.append(layer)
    return layer


def _vllm_routing(logits, k: int, pad):
    """vLLM's fused top-k routing (softmax, renormalized; fp32 weights, int32 ids), padding rows id -1 / weight 0."""
    vals, ids = torch.topk(logits.float(), k, dim=-1)
    weights = torch.softmax(vals, dim=-1).masked_fill(pad[:, None], 0.0)
    return weights, ids.to(torch.int32).masked_fill(pad[:, None], -1)


def _vllm_step(options: dict, N: int, k: int, dev, kinds, logits, weights, ids):
    """One layer-step through the plugin's step function on a fresh plugin state: (weights, ids, telemetry)."""
    from lynx_hf.vllm import plans, rows, state

    with state.isolated({**options, "gate": "always"}, capacity=int(kinds.shape[0])):
        layer = _vllm_layer(N, k)
        plan = plans.plan_for(layer, dev, logits.dtype, state.STATE.config.lynx)
        out_w, out_ids = plans.route(layer, plan, rows.masked_step(kinds), logits, weights, ids, False)
        return out_w, out_ids, layer.telemetry.summary()


def _same_telemetry(a: dict, b: dict) -> bool:
    """Equal counts; the routing mass kept (an fp32 sum over rows, whose order changes with the row count) to 1e-6."""
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9))
        for x, y in ((a[key], b[key]) for key in a))


def section_vllm(args, dev, budget) -> None:
    from lynx_hf.vllm.state import DECODE, PREFILL

    S = "vllm"
    if not budget.allows(60 if not args.dry_run else 15, "vLLM plugin paths (padding rows, CUDA graphs)", S):
        return
    N, k, T = (16, 4, 12) if args.dry_run else (64, 6, 48)
    print(f"\n== vLLM plugin's step function (N {N}, k {k}, T {T}; no vLLM needed) ==", flush=True)
    note_price(args, S, "vllm", 1)
    gen = torch.Generator().manual_seed(0)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[T // 3::4] = True
    pad[-2:] = True  # a padded tail, as a padded decode batch has
    pad = pad.to(dev)
    kinds = torch.full((T,), DECODE, dtype=torch.int8)
    kinds[:2] = PREFILL
    kinds = kinds.to(dev)
    keep = ~pad
    for backend in ("torch", "triton"):
        for pname, policy in VLLM_POLICIES.items():
            logits = (torch.randn(T, N, generator=gen) * 2).to(dev)
            weights, ids = _vllm_routing(logits, k, pad)
            options = at_full_depth(args, "vllm", {**policy, "routing_backend": backend})
            try:
                out_w, out_ids, tel = _vllm_step(options, N, k, dev, kinds, logits, weights, ids)
                ref_w, ref_ids, ref_tel = _vllm_step({**options, "routing_backend": "torch"}, N, k, dev, kinds[keep],
                                                     logits[keep], weights[keep], ids[keep])
                all_w, all_ids, all_tel = _vllm_step(options, N, k, dev, kinds, logits, torch.zeros_like(weights),
                                                     torch.full_like(ids, -1))
                ok = (torch.equal(out_ids[pad], ids[pad]) and torch.equal(out_w[pad], weights[pad])
                      and torch.equal(out_ids[keep], ref_ids)
                      and torch.allclose(out_w[keep], ref_w, rtol=1e-5, atol=1e-6) and _same_telemetry(tel, ref_tel)
                      and bool((all_ids == -1).all()) and all_tel["decode_steps"] == 0)
                record(S, f"padding rows excluded ({backend}, {pname})", ok,
                       f"{int(pad.sum())} of {T} rows padding; decode tokens {tel['decode_tokens']} "
                       f"(reference {ref_tel['decode_tokens']}); all-padding step untouched: "
                       f"{bool((all_ids == -1).all())}")
            except Exception as exc:  # noqa: BLE001 - reported, the script goes on
                record(S, f"padding rows excluded ({backend}, {pname})", False, f"{type(exc).__name__}: {exc}"[:400])
                traceback.print_exc()
    _vllm_graph(args, dev, N, k, T, kinds, pad)
    _vllm_stats_copy(args, dev, N, k, T, kinds)


def _vllm_stats_copy(args, dev, N, k, T, kinds) -> None:
    """``stats_every``: the end of a step with decode tokens copies the device accumulators to host
    buffers (non_blocking, a CUDA event) and writes the stats file from them once the event completed: no host sync
    inside the step (``torch.cuda.set_sync_debug_mode("error")`` around it), and the file has the step."""
    import json
    import tempfile

    from lynx_hf.vllm import plans, rows, state, steps, telemetry

    S = "vllm"
    backend = "auto" if dev.type == "cuda" else "torch"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "stats.json")
            options = at_full_depth(args, "vllm", {"policy": "lynx", "gate": "always", "routing_backend": backend,
                                                   "stats_path": path, "stats_every": 1})
            with state.isolated(options, capacity=T):
                layer = _vllm_layer(N, k)
                plan = plans.plan_for(layer, dev, torch.float32, state.STATE.config.lynx)
                logits = (torch.randn(T, N, generator=torch.Generator().manual_seed(3)) * 2).to(dev)
                weights, ids = _vllm_routing(logits, k, torch.zeros(T, dtype=torch.bool, device=dev))
                steps.write_kinds(kinds.cpu().numpy(), dev)
                plans.route(layer, plan, rows.masked_step(kinds), logits, weights, ids, dev.type == "cpu")
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    steps.end_step()  # stats due: the asynchronous copy, no host read of the accumulators
                finally:
                    if dev.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                telemetry.flush_write()
                written = json.load(open(path)) if os.path.exists(path) else None
        ok = written is not None and written["layers"][0]["decode_steps"] == 1
        record(S, "stats_every: written from an asynchronous copy, no host sync in the step", ok,
               "file written" if written is not None else "no file")
    except Exception as exc:  # noqa: BLE001 - reported, the script goes on
        record(S, "stats_every: written from an asynchronous copy, no host sync in the step", False,
               f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()


def section_torch_capture(args, dev, budget) -> None:
    """Whether the plugin's step with the torch routing ops (``routing_backend="torch"``) can be captured in a CUDA
    graph (the plugin refuses it on captured engines, since the ops create tensors from Python scalars
    on the device inside the step). Printed for the record (info): a capture that succeeds means the refusal could be
    lifted. Last: a failed capture can leave the device's capture state broken for the rest of the process."""
    from lynx_hf.vllm import plans, rows, state

    S = "torch_capture"
    if dev.type != "cuda":
        note(S, "torch routing ops under a CUDA-graph capture", "CUDA only (dry run: not captured)")
        return
    N, k, T = 64, 6, 48
    kinds = torch.full((T,), state.DECODE, dtype=torch.int8, device=dev)
    options = at_full_depth(args, "vllm", {"policy": "lynx", "gate": "always", "routing_backend": "torch"})
    with state.isolated(options, capacity=T):
        layer = _vllm_layer(N, k)
        plan = plans.plan_for(layer, dev, torch.float32, state.STATE.config.lynx)
        logits = (torch.randn(T, N, generator=torch.Generator().manual_seed(4)) * 2).to(dev)
        weights, ids = _vllm_routing(logits, k, torch.zeros(T, dtype=torch.bool, device=dev))
        for _ in range(2):
            plans.route(layer, plan, rows.masked_step(kinds), logits, weights, ids, False)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                plans.route(layer, plan, rows.masked_step(kinds), logits, weights, ids, False)
            note(S, "torch routing ops under a CUDA-graph capture", "captured: the refusal could be lifted")
        except Exception as exc:  # noqa: BLE001 - the expected outcome, printed
            note(S, "torch routing ops under a CUDA-graph capture", f"capture failed (the refusal's reason): "
                 f"{type(exc).__name__}: {exc}"[:300])


def _vllm_graph(args, dev, N, k, T, kinds, pad) -> None:
    """One layer-step captured in a CUDA graph, replayed on new inputs (the dry run calls it again instead)."""
    from lynx_hf.vllm import plans, rows, state

    S = "vllm"
    options = at_full_depth(args, "vllm", {"policy": "lynx", "gate": "always",
                                           "routing_backend": "auto" if dev.type == "cuda" else "torch"})
    gen = torch.Generator().manual_seed(1)
    static_logits = torch.zeros(T, N, device=dev)
    static_w = torch.zeros(T, k, device=dev)
    static_ids = torch.zeros(T, k, dtype=torch.int32, device=dev)
    static_kinds = kinds.clone()

    def fill(padding):
        logits = (torch.randn(T, N, generator=gen) * 2).to(dev)
        weights, ids = _vllm_routing(logits, k, padding)
        static_logits.copy_(logits)
        static_w.copy_(weights)
        static_ids.copy_(ids)
        return logits.clone(), weights.clone(), ids.clone()

    try:
        with state.isolated(options, capacity=T):
            layer = _vllm_layer(N, k)
            plan = plans.plan_for(layer, dev, torch.float32, state.STATE.config.lynx)

            def step():
                return plans.route(layer, plan, rows.masked_step(static_kinds), static_logits, static_w, static_ids,
                                   False)

            fill(pad)
            for _ in range(2):  # warm-up (Triton compiles, the accumulators are made), as vLLM warms up
                step()
            if dev.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out_w, out_ids = step()
                replay = graph.replay
            else:
                note(S, "CUDA graph", "not captured in the dry run (CPU): each replay is an eager call")
                out = {}

                def replay():
                    out["w"], out["ids"] = step()
            plans.reset_layer(layer)
            ptr = layer.telemetry.acc.data_ptr()
            same = []
            for padding in (pad, torch.zeros_like(pad)):
                logits, weights, ids = fill(padding)
                replay()
                got_w, got_ids = (out_w, out_ids) if dev.type == "cuda" else (out["w"], out["ids"])
                ref_w, ref_ids, ref_tel = _vllm_step(options, N, k, dev, static_kinds, logits, weights, ids)
                same.append(torch.equal(got_ids, ref_ids) and torch.allclose(got_w, ref_w, rtol=1e-5, atol=1e-6))
            tel = layer.telemetry.summary()
            record(S, "captured layer-step replayed == eager", all(same),
                   f"{len(same)} replays (padding rows, none); decode steps counted {tel['decode_steps']} (2)")
            plans.reset_layer(layer)
            logits, weights, ids = fill(pad)
            replay()
            _, _, ref_tel = _vllm_step(options, N, k, dev, static_kinds, logits, weights, ids)
            tel = layer.telemetry.summary()
            record(S, "telemetry reset in place, replay counts from zero",
                   layer.telemetry.acc.data_ptr() == ptr and _same_telemetry(tel, ref_tel),
                   f"same address: {layer.telemetry.acc.data_ptr() == ptr}; decode steps {tel['decode_steps']}")
            fill(torch.ones_like(pad))
            replay()
            got_ids = out_ids if dev.type == "cuda" else out["ids"]
            record(S, "all-padding replay (capture warm-up shape) untouched",
                   bool((got_ids == -1).all()) and layer.telemetry.summary()["decode_steps"] == tel["decode_steps"])
    except Exception as exc:  # noqa: BLE001 - reported, the script goes on
        record(S, "CUDA-graph capture + replay of the plugin's step", False, f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()


# ------------------------------------------------------------------------------------------------ main
# ------------------------------------------------------------------------------------------- section 6
INT4_BATCHES, DRY_INT4_BATCHES = (16, 64), (2,)


def section_int4(args, dev, budget, models) -> None:
    from types import SimpleNamespace

    from transformers import LogitsProcessorList

    import lynx_hf

    from .bench_compile import twin
    from .int4_experts import Int4Experts, quantize_experts

    S = "int4"
    name, config = next(iter(model_configs(args.dry_run).items()))  # the Qwen2-57B-A14B config
    if not budget.allows(60 if not args.dry_run else 10, f"{name} int4", S):
        return
    print(f"\n== int4 experts: {name} ==", flush=True)
    note_price(args, S, name, config.num_hidden_layers)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = models.get(name) or build_model(config, dev, dtype)
    models[name] = model
    group = next(g for g in (128, 64, 32) if config.hidden_size % g == 0 and config.moe_intermediate_size % g == 0)
    experts = model.model.layers[0].mlp.experts
    # the device packing vs the CPU kernel on the same int4 weights (4 experts), and the int4 error vs bf16
    few = SimpleNamespace(gate_up_proj=experts.gate_up_proj[:4], down_proj=experts.down_proj[:4], act_fn=experts.act_fn)
    on_dev, on_cpu = Int4Experts.from_experts(few, group, dev), Int4Experts.from_experts(few, group, "cpu")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, config.hidden_size, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(8)])
    w = torch.rand(8, 2, generator=gen)
    with torch.inference_mode():
        got = on_dev(x.to(dev), ids.to(dev), w.to(dev)).float().cpu()
        want = on_cpu(x.to(on_cpu.dtype), ids, w.to(on_cpu.dtype)).float()
        dense = experts(x.to(dev), ids.to(dev), w.to(dev).to(dtype)).float().cpu()
    err = rel_err(got, want)
    record(S, f"int4 packing on {dev.type} vs the CPU kernel", err < 2e-2, f"relative error {err:.2e} (< 2e-2)")
    note(S, "int4 vs bf16 experts", f"relative error {rel_err(got, dense):.3f} (group {group}, asymmetric)")
    quantized = twin(model)
    quantize_experts(quantized, group, dev)
    variants = {"bf16": (model, None), "bf16+lynx": (model, TORCH), "int4": (quantized, None),
                "int4+lynx": (quantized, TORCH)}
    rounds = 1 if args.dry_run else args.rounds
    new_tokens = 3 if args.dry_run else args.new_tokens
    for B in (DRY_INT4_BATCHES if args.dry_run else INT4_BATCHES):
        if not budget.allows(25 if not args.dry_run else 2, f"{name} int4 B={B}", S):
            break
        ids, mask = prompts(B, 16, config.vocab_size, dev)
        times = {v: [] for v in variants}
        unique = {}

        def run(v, n_new):
            m, options = variants[v]
            if options is None:
                lynx_hf.unpatch(m)
            else:
                lynx_hf.patch(m, **at_full_depth(args, name, {"policy": "lynx", **options}))
                lynx_hf.reset_stats(m)
            clock = StepClock(dev)
            with torch.inference_mode():
                m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
            if options is not None:
                s = lynx_hf.stats(m).summary()
                unique[v] = (s.get("unique_experts_before"), s.get("unique_experts_after"))
            diffs = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
            return sum(diffs) / max(len(diffs), 1)

        try:
            interleaved(run, variants, rounds, new_tokens, times)
        except Exception as exc:  # noqa: BLE001 - reported, the script goes on
            record(S, f"{name} int4 B={B}", False, f"{type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
            continue
        finally:
            lynx_hf.unpatch(model)
            lynx_hf.unpatch(quantized)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        u4 = unique.get("int4+lynx", (None, None))
        note(S, f"{name} int4 B={B}",
             f"ms per decode step: bf16 {med['bf16']:.2f}, bf16+LYNX {med['bf16+lynx']:.2f} "
             f"({med['bf16+lynx'] / med['bf16']:.2f}x), int4 {med['int4']:.2f} ({med['int4'] / med['bf16']:.2f}x of bf16), "
             f"int4+LYNX {med['int4+lynx']:.2f} ({med['int4+lynx'] / med['int4']:.2f}x of int4) | unique experts "
             f"{_fmt(u4[0])} -> {_fmt(u4[1])}")
    del quantized
    free_memory(dev)


def section_slo(args, dev) -> None:
    """Throughput under a TPOT SLO in transformers' continuous batching on this GPU (``lynx_hf.eval.slo``'s
    transformers engine: the Qwen2-57B-A14B config cut to 2 layers, bf16, unpatched / LYNX / OEA / XShare,
    concurrency 1..128): the table the CPU run cannot give (on the CPU the step turns compute-bound near 32 requests)."""
    from types import SimpleNamespace

    from lynx_hf.eval import slo

    S = "slo"
    print("\n== throughput under a TPOT SLO (transformers continuous batching) ==", flush=True)
    dry = args.dry_run
    opts = SimpleNamespace(layers=1 if dry else 2, vocab=256 if dry else 4096, scale=16 if dry else 1, threads=None,
                           dtype="float32" if dry else "bfloat16", device=dev, prompt_tokens=4 if dry else 16,
                           new_tokens=3 if dry else 16, rounds=1,
                           variants=["unpatched", "lynx"] if dry else list(slo.VARIANTS),
                           concurrency=[2] if dry else [1, 4, 8, 16, 32, 64, 128], cmd="lab.gpu_check slo",
                           full_layers=args.full_layers)  # the price of Qwen2-57B-A14B's depth (printed by the run)
    try:
        run = slo.run_transformers(opts)
        rows = slo.slo_rows(slo.points_of(run), at=(2,) if dry else slo.AT)
    except Exception as exc:  # noqa: BLE001 - reported, the script goes on
        record(S, "transformers continuous batching", False, f"{type(exc).__name__}: {exc}"[:300])
        traceback.print_exc()
        return
    print(slo.slo_markdown(rows) + "\n\n" + slo.curve_markdown(slo.points_of(run)), flush=True)
    for r in rows:
        if r["variant"] == "lynx" and r["slo"].startswith("TPOT"):
            note(S, f"LYNX at SLO {r['slo']}", "—" if r["ratio"] is None else
                 f"{r['ratio']:.2f}x the unpatched tokens/s ({r['tok_s']:.0f} tok/s at C={r['concurrency']})")
    free_memory(dev)


SECTIONS = ("vllm", "compiled", "kernels", "sync", "tpot", "graphs", "gate", "int4", "slo", "torch_capture")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter (tests this script)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--budget", type=float, default=450.0, help="seconds; sections that would not fit are skipped")
    p.add_argument("--new-tokens", type=int, default=12, help="decode steps timed per TPOT run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved TPOT rounds")
    add_full_layers(p, "each section's real model")
    args = p.parse_args(argv)
    SUMMARY.clear()
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    if args.dry_run:
        dev = torch.device("cpu")
        print("gpu_check --dry-run: CPU, tiny shapes, Triton interpreter (a test of this script, no timings to read)")
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device available; nothing to check (run this on a GPU machine, or --dry-run).")
            return 0
        dev = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    import transformers
    import triton

    import lynx_hf  # noqa: F401  (the installed package)

    print(f"lynx_hf {getattr(lynx_hf, '__version__', '?')}, transformers {transformers.__version__}, "
          f"triton {triton.__version__}", flush=True)
    budget = Budget(args.budget)
    models: dict = {}
    runners = {"vllm": lambda: section_vllm(args, dev, budget),
               "compiled": lambda: section_compiled(args, dev, budget),
               "kernels": lambda: section_kernels(args, dev, budget),
               "sync": lambda: section_sync(args, dev, budget, models),
               "tpot": lambda: section_tpot(args, dev, budget, models),
               "graphs": lambda: section_graphs(args, dev, budget, models),
               "gate": lambda: section_gate(args, dev, budget),
               "int4": lambda: section_int4(args, dev, budget, models),
               "slo": lambda: section_slo(args, dev) if budget.allows(10 if args.dry_run else 150, "slo", "slo")
               else None,
               "torch_capture": lambda: section_torch_capture(args, dev, budget)}
    for name in SECTIONS:
        if name not in sections:
            continue
        t0 = time.perf_counter()
        try:
            runners[name]()
        except Exception as exc:  # noqa: BLE001 - one section's crash must not hide the others
            record(name, "section crashed", False, f"{type(exc).__name__}: {exc}"[:400])
            traceback.print_exc()
        print(f"  ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    failures = [row for row in SUMMARY if row[2] == "FAIL"]
    print(f"\n## gpu_check summary ({budget.elapsed():.0f} s, budget {args.budget:.0f} s)\n")
    print("| section | check | result | detail |")
    print("|---|---|---|---|")
    for section, check, status, detail in SUMMARY:
        print(f"| {section} | {check} | {status} | {detail} |")
    print(f"\n{len(failures)} failure(s), "
          f"{sum(1 for r in SUMMARY if r[2] == 'ok')} ok, {sum(1 for r in SUMMARY if r[2] == 'skipped')} skipped")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
