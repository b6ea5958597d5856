"""Works with what users combine it with: pipelines, dtype casts, torch.compile wrappers, no_grad /
inference_mode, training mode."""


import pytest
import torch
from transformers import pipeline

import lynx_hf
from helpers import families as fam

# policy_on_every_step (tests/conftest.py): pipelines, dtype casts and wrappers must keep remapping, which needs the
# policy on every decode step of these tiny models
pytestmark = pytest.mark.usefixtures("policy_on_every_step")



@pytest.mark.parametrize("family", ["qwen2_moe", "llama4"])
def test_text_generation_pipeline_on_patched_model(family):
    model, tok = fam.build(family), fam.tokenizer()
    texts = ["w5 w9 w11 w40", "w7 w3", "w12 w13 w14", "w50 w51 w52 w53 w54"]
    kw = dict(max_new_tokens=4, do_sample=False, batch_size=4, return_full_text=False)
    ref = pipeline("text-generation", model=model, tokenizer=tok)(texts, **kw)
    with lynx_hf.patched(model, policy="none"):
        out = pipeline("text-generation", model=model, tokenizer=tok)(texts, **kw)
        assert lynx_hf.stats(model).summary()["decode_steps"] == 3
    assert out == ref
    with lynx_hf.patched(model, policy="lynx"):
        out = pipeline("text-generation", model=model, tokenizer=tok)(texts, **kw)
        assert lynx_hf.stats(model).summary()["decode_steps"] == 3  # the pipeline's decode steps reach LYNX
    assert len(out) == 4 and all(len(o) == 1 and isinstance(o[0]["generated_text"], str) for o in out)


def test_dtype_cast_after_patch():
    model = fam.build("mixtral")
    lynx_hf.patch(model, policy="none")
    model.to(torch.bfloat16)
    ids, mask = fam.prompts(4, 5)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    lynx_hf.unpatch(model)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)
    lynx_hf.patch(model, policy="lynx")
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert lynx_hf.stats(model).summary()["decode_steps"] == 2
    lynx_hf.unpatch(model)


def test_patching_a_compiled_wrapper_warns_and_patches_the_inner_module():
    model = fam.build("mixtral")
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="torch.compile"):
        lynx_hf.patch(compiled)
    assert lynx_hf.is_patched(compiled) and lynx_hf.is_patched(model)
    lynx_hf.unpatch(compiled)
    assert not lynx_hf.is_patched(model)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_patch_and_unpatch_under_grad_modes(mode):
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(4, 5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        lynx_hf.patch(model, policy="none")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        lynx_hf.unpatch(model)
    assert torch.equal(out, ref)


def test_training_still_works_gradients_flow_through_prefill():
    """Patched models can be trained: a training forward is prefill (no cache), so gradients are the
    unpatched model's exactly; LYNX only acts in decode."""
    model = fam.build("qwen2_moe").train()
    ids, _ = fam.prompts(2, 8, left_pad=False)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with lynx_hf.patched(model, policy="lynx"):
        loss2 = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss2.backward()
    assert torch.equal(loss, loss2)
    for name, grad in ref.items():
        assert torch.equal(model.get_parameter(name).grad, grad), name


def test_device_map_single_device_keeps_hooks(tmp_path):
    """C4 (simple form): from_pretrained(device_map={"": "cpu"}); patch/unpatch keep accelerate's state."""
    from transformers import AutoModelForCausalLM

    fam.build("mixtral").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"})
    before = {n: (vars(m).get("forward"), vars(m).get("_hf_hook")) for n, m in model.named_modules()}
    ids, mask = fam.prompts(4, 5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with lynx_hf.patched(model, policy="none"):
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False), ref)
    assert {n: (vars(m).get("forward"), vars(m).get("_hf_hook")) for n, m in model.named_modules()} == before
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False), ref)
