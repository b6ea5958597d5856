"""CASES C25: a patched model's decode forward compiles with torch.compile(fullgraph=True) —
no graph break anywhere (so none inside the MoE blocks) — and transformers' own compiled static-cache
decode path (``generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))``)
runs patched and gives the tokens eager LYNX gives. On CPU, transformers compiles only when asked to
compile on all devices (``CompileConfig._compile_all_devices``)."""

import contextlib

import pytest
import torch
from transformers import CompileConfig, StaticCache

import lynx_hf
import lynx_hf.detection
import lynx_hf.state
from helpers import families as fam
from lynx_hf.kernels.routing_torch import strict_sync_free


def _decode_inputs(model):
    ids, mask = fam.prompts(4, 5)
    cache = StaticCache(config=model.config, max_cache_len=12)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **fam.cache_kw(model, cache), use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return dict(input_ids=nxt, attention_mask=mask, **fam.cache_kw(model, fam.cache_of(out)), use_cache=True)


@pytest.mark.parametrize("family", fam.PATCHABLE)
def test_patched_decode_forward_has_no_graph_break(family):
    model = fam.build(family)
    lynx_hf.patch(model, policy="lynx")
    inputs = _decode_inputs(model)
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(**inputs)
    lynx_hf.unpatch(model)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


#: stop tokens of the 8 prompts below whose LYNX continuations hit them at different steps (rows finish after 1, 2, 3,
#: 5 and 7 new tokens; 3 rows never do), checked in the test
EOS = [23, 73, 4]


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    dict(policy="lynx", fullgraph=True, strict=False),  # CPU: the eager step as one op (lynx_hf.compiled_cpu)
    dict(policy="oea", oea_k0=1, fullgraph=False, strict=False),
    dict(policy="lynx", fullgraph=True, strict=True),  # the accelerator path: the sync-free step traced into the graph
], ids=["lynx-fullgraph", "oea", "lynx-fullgraph-sync-free"])
def test_generate_compiled_static_cache_equals_eager(case):
    """transformers compiles a static-cache ``generate``'s decode forward on an accelerator by default; the finished
    rows (fed a stop token) reach the compiled graph as data (``lynx_hf.detection.GenerationData``), so compiled and
    eager LYNX agree token for token and count for count with rows finishing at different steps, over more decode
    steps than rows. (Before: the traced pre-hook had no generation information and every finished row voted: on
    these inputs compiled LYNX counted 64 decode tokens and 0 finished-row tokens where eager counts 23 and 41.)"""
    case = dict(case)
    fullgraph, strict = case.pop("fullgraph"), case.pop("strict")
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 5)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, cache_implementation="static",
               eos_token_id=EOS, pad_token_id=0)
    lynx_hf.patch(model, **case, gate="always")  # the subject: the compiled graph remaps on every decode step
    with strict_sync_free() if strict else contextlib.nullcontext():
        eager = model.generate(**gen)
        eager_stats = lynx_hf.stats(model).summary()
        lynx_hf.reset_stats(model)
        config = CompileConfig(fullgraph=fullgraph)
        config._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless asked
        torch._dynamo.reset()
        compiled = model.generate(**gen, compile_config=config)
    stats = lynx_hf.stats(model).summary()
    assert model._compiled_call is not None  # the compiled path really ran
    lynx_hf.unpatch(model)
    new = eager[:, ids.shape[1]:]
    finished_at = {int(torch.isin(row, torch.tensor(EOS)).nonzero()[0]) for row in new if torch.isin(row, torch.tensor(
        EOS)).any()}
    assert len(finished_at) >= 3 and new.shape[1] > new.shape[0], "rows must finish at different steps"
    assert eager_stats["finished_row_tokens"] > 0 and eager_stats["decode_steps"] == new.shape[1] - 1
    assert torch.equal(compiled, eager)
    for key in ("decode_steps", "decode_tokens", "finished_row_tokens", "unique_experts_before",
                "unique_experts_after"):
        assert stats[key] == eager_stats[key], key
    assert stats["unique_experts_after"] < stats["unique_experts_before"]  # the compiled graph remaps


def test_compiled_generate_first_keeps_the_telemetry_made_at_patch_time():
    """A user's first ``generate`` after ``patch`` is the compiled one (transformers compiles a static-cache generate
    on CUDA by itself). The telemetry accumulators must exist before it, made eagerly at patch time on the router's
    device: created lazily inside the compiled decode step they were an output of the CUDA graph, overwritten by the
    next replay ("accessing tensor output of CUDAGraphs that has been overwritten", lab.gpu_check on an H200). The
    compiled graph adds into that same memory, and counts what an eager generate on a fresh patch counts."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 5)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
               pad_token_id=0)
    lynx_hf.patch(model, policy="lynx", gate="always")
    state = lynx_hf.state.state_of(model)
    accs = [block.telemetry.acc for block in state.blocks]
    assert all(acc is not None and acc.device == block.router.weight.device and not acc.any()
               for acc, block in zip(accs, state.blocks))
    ptrs = [acc.data_ptr() for acc in accs]
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = model.generate(**gen, compile_config=config)
    assert model._compiled_call is not None
    assert [block.telemetry.acc.data_ptr() for block in state.blocks] == ptrs  # the same memory, added into
    stats = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    lynx_hf.patch(model, policy="lynx", gate="always")
    eager = model.generate(**gen)
    eager_stats = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    assert torch.equal(compiled, eager)
    assert eager_stats["decode_steps"] == gen["max_new_tokens"] - 1
    for key in ("decode_steps", "decode_tokens", "unique_experts_before", "unique_experts_after"):
        assert stats[key] == eager_stats[key], key


@pytest.mark.slow
def test_compiled_generate_data_is_rearmed_and_released():
    """The compiled graph serves a second ``generate`` with other stop tokens (the data are values, read each call: no
    stale finished row), and the cache ``generate`` returns no longer carries active generation data."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 5)
    lynx_hf.patch(model, policy="lynx", gate="always")
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static",
               pad_token_id=0)
    runs = {}
    torch._dynamo.reset()
    for eos in ([23, 73, 4], [87, 53]):
        for compiled in (False, True):
            lynx_hf.reset_stats(model)
            out = model.generate(**gen, eos_token_id=eos, compile_config=config if compiled else None,
                                 return_dict_in_generate=True)
            runs[tuple(eos), compiled] = out.sequences, lynx_hf.stats(model).summary()["finished_row_tokens"]
        assert torch.equal(runs[tuple(eos), True][0], runs[tuple(eos), False][0])
        assert runs[tuple(eos), True][1] == runs[tuple(eos), False][1] > 0
    data = getattr(fam.cache_of(out), lynx_hf.detection.DATA_ATTR)
    assert not data.active  # released when generate returned
    lynx_hf.unpatch(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_decode_on_cuda_uses_grouped_mm_only_where_it_is_capturable(dtype, monkeypatch):
    """transformers' ``grouped_mm`` under ``torch.compile`` runs its native kernel for bf16 weights only; for other
    dtypes it falls back to a loop that reads the group offsets on the host (``offs.tolist()``), which the CUDA-graph
    capture of a compiled static-cache ``generate`` (``mode="reduce-overhead"``, the default on CUDA) refuses: seen on an
    H200 (issue 44), fp32 LYNX failed there while the unpatched model (``batched_mm`` in decode) ran. The ``"lynx"``
    experts implementation then runs ``batched_mm`` (what ``generate`` itself switches ``grouped_mm`` to for decode);
    eager decode and bf16 keep ``grouped_mm``. Driven on CPU with the step's device and the tracer stubbed."""
    import types

    from lynx_hf import experts as experts_mod
    from lynx_hf.core import DECODE, Step

    model = fam.build("qwen2_moe").to(dtype)
    lynx_hf.patch(model, policy="lynx", gate="always")
    block = lynx_hf.patcher._state(model).blocks[0]
    own, grouped, compiled_own = block.experts_impls
    assert own.__name__ == "grouped_mm_experts_forward" and compiled_own.__name__ == "batched_mm_experts_forward"
    called = []
    spy = lambda name: lambda *a, **k: called.append(name) or a[1]  # noqa: E731
    state = types.SimpleNamespace(experts_impls=(spy("own"), spy("grouped"), spy("batched")),
                                  step=Step(DECODE), gated_off=False, kernel_allowed=False, grouped_allowed=True,
                                  plan=types.SimpleNamespace(device=torch.device("cuda"), expert_kernel=False,
                                                             uses_kernel=lambda num_tokens: False))
    experts = block.experts
    monkeypatch.setitem(experts.__dict__, experts_mod.EXPERTS_ATTR, state)
    monkeypatch.setattr(experts_mod, "weights_ready", lambda *a, **k: True)
    hidden, idx, weights = torch.zeros(2, 32, dtype=dtype), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    experts_mod._lynx_forward(experts, hidden, idx, weights)  # eager: grouped_mm reads only the unique experts
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    experts_mod._lynx_forward(experts, hidden, idx, weights)
    lynx_hf.unpatch(model)
    assert called == ["grouped", "grouped" if dtype == torch.bfloat16 else "batched"]


def test_the_telemetry_is_made_on_each_routers_own_device():
    """The accumulators made eagerly (patch time, each patched ``generate``) live on the block's router's device. A
    CPU-only suite has two devices to tell apart, the CPU and ``meta`` (a module not materialized yet, skipped: its
    accumulators wait), so the two blocks of a tiny Qwen2-MoE are split across them: block 0's router on the CPU and
    its experts on meta (made, on the CPU), block 1's router on meta and its experts on the CPU (none yet). The test
    above compares the CPU with the CPU (issue 56)."""
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="always")
    state = lynx_hf.state.state_of(model)
    first, second = state.blocks
    first.experts.to("meta")
    second.router.to("meta")
    for block in state.blocks:
        block.telemetry.acc = None
    lynx_hf.patcher._prepare_telemetry(state)
    made = [block.telemetry.acc for block in state.blocks]
    lynx_hf.unpatch(model)
    assert made[0] is not None and made[0].device == torch.device("cpu") and not made[0].any()
    assert made[1] is None
