"""CASES C25: a patched model's decode forward compiles with torch.compile(fullgraph=True) —
no graph break anywhere (so none inside the MoE blocks) — and transformers' own compiled static-cache
decode path (``generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))``)
runs patched and gives the tokens eager LYNX gives. On CPU, transformers compiles only when asked to
compile on all devices (``CompileConfig._compile_all_devices``)."""

import pytest
import torch
from transformers import CompileConfig, StaticCache

import lynx_hf
from helpers import families as fam


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


@pytest.mark.slow
@pytest.mark.parametrize("policy", [dict(policy="lynx"), dict(policy="oea", oea_k0=1)], ids=["lynx", "oea"])
def test_generate_compiled_static_cache_equals_eager(policy):
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(4, 5)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    lynx_hf.patch(model, **policy, gate="always")  # the subject: the compiled graph remaps on every decode step
    eager = model.generate(**gen)
    eager_stats = lynx_hf.stats(model).summary()
    lynx_hf.reset_stats(model)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless asked
    torch._dynamo.reset()
    compiled = model.generate(**gen, compile_config=config)
    stats = lynx_hf.stats(model).summary()
    assert model._compiled_call is not None  # the compiled path really ran
    lynx_hf.unpatch(model)
    assert torch.equal(compiled, eager)
    assert stats["decode_steps"] == eager_stats["decode_steps"] == 3
    assert stats["unique_experts_after"] == eager_stats["unique_experts_after"]
    assert stats["unique_experts_after"] < stats["unique_experts_before"]  # the compiled graph remaps
