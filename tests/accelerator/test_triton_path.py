"""The patched blocks through the Triton kernels (interpreted on CPU, fp32) give the same tokens as
the torch path, for every family (routing kernels are exact; the sparse expert kernel is fp32)."""

import os

import pytest
import torch

import lynx_hf
import lynx_hf.state
from helpers import families as fam

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py)")


@pytest.mark.parametrize("family", fam.REPRESENTATIVE)
@pytest.mark.parametrize("policy,extra", [("lynx", {}), ("lynx", {"mass_price": None}), ("oea", {})],
                         ids=["lynx-default", "lynx-paper", "oea"])
def test_generate_triton_backend_matches_torch(family, policy, extra):
    """gate="always" on both sides: the subject is the Triton routing against the torch routing, so the policy runs at
    every decode step of both; under the default gate each backend is weighed by its own measured cost (the
    interpreter's is ~10 ms per program), and a load-dependent decision could run the policy on one side only."""
    extra = {**extra, "gate": "always"}
    model = fam.build(family)
    ids, mask = fam.prompts(4, 5)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_scores=True,
               return_dict_in_generate=True)
    with lynx_hf.patched(model, policy=policy, routing_backend="torch", **extra):
        ref = model.generate(**gen)
        ref_stats = lynx_hf.stats(model).summary()
    with lynx_hf.patched(model, policy=policy, routing_backend="triton", expert_path="triton", **extra):
        out = model.generate(**gen)
        stats = lynx_hf.stats(model).summary()
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert stats["unique_experts_after"] == ref_stats["unique_experts_after"]  # exact integer routing


def test_triton_backend_without_interpreter_on_cpu_is_a_clear_error(monkeypatch):
    """Refused at patch time (typed, naming the field); the backend is resolved once, at patch time (its
    kernels imported then), so an environment change after patch leaves decode computing what the
    torch path computes."""
    model = fam.build("mixtral")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(lynx_hf.LynxConfigError, match="backend.*TRITON_INTERPRET"):
        lynx_hf.patch(model, routing_backend="triton", expert_path="triton")
    assert not lynx_hf.is_patched(model)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lynx_hf.patch(model, routing_backend="triton", expert_path="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids, mask = fam.prompts(2, 4)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    # a re-patch keeps the fields it is not given (docs/cases.md C43): the torch path is both fields
    lynx_hf.patch(model, routing_backend="torch", expert_path="auto")
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False))
    lynx_hf.unpatch(model)


def test_kernel_runs_only_from_the_plans_token_threshold():
    """``expert_path="auto"`` on CUDA runs the sparse kernel for decode steps of at least
    ``core.AUTO_KERNEL_MIN_TOKENS`` tokens (``RoutePlan.kernel_min_tokens``): the experts implementation asks the plan
    with the step's static T. Here (CPU, interpreter) the threshold is set on an explicit-"triton" plan: a 2-row decode
    step runs the model's experts implementation, a 4-row one the kernel; tokens equal the torch path's either way."""
    import dataclasses
    import types

    from lynx_hf.core import AUTO_KERNEL_MIN_TOKENS

    model = fam.build("qwen2_moe")
    calls = []
    outs = {}
    for batch in (AUTO_KERNEL_MIN_TOKENS - 2, AUTO_KERNEL_MIN_TOKENS):
        ids, mask = fam.prompts(batch, 5)
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        # gate="always": the subject is the expert path of steps that remap (on these tiny CPU shapes the default gate
        # keeps the model's routing, and with it the model's experts implementation)
        with lynx_hf.patched(model, routing_backend="torch", gate="always"):
            ref = model.generate(**gen)
        lynx_hf.patch(model, routing_backend="torch", expert_path="triton", gate="always")
        for block in lynx_hf.state.state_of(model).blocks:
            ops = block.plan.expert_ops

            def spy(hidden, *args, _sparse=ops.sparse_moe, **kwargs):
                calls.append(hidden.shape[0])
                return _sparse(hidden, *args, **kwargs)

            block.plan = dataclasses.replace(block.plan, kernel_min_tokens=AUTO_KERNEL_MIN_TOKENS,
                                             expert_ops=types.SimpleNamespace(sparse_moe=spy))
        outs[batch] = model.generate(**gen)
        lynx_hf.unpatch(model)
        assert torch.equal(outs[batch], ref)
        assert (batch in calls) == (batch >= AUTO_KERNEL_MIN_TOKENS), (batch, calls)
    assert calls and set(calls) == {AUTO_KERNEL_MIN_TOKENS}


def test_interpreter_set_after_the_kernels_were_imported_is_refused_at_patch_time(monkeypatch):
    """A notebook sets ``TRITON_INTERPRET=1`` after importing lynx_hf: the kernels were already defined as GPU kernels
    (``@triton.jit`` picks the interpreter at definition), and the first ``generate`` failed deep inside Triton
    ("Cannot call @triton.jit'd outside of the scope of a kernel"; a fresh-user trial). Refused at patch time instead,
    typed, saying what to do; the model untouched. (Simulated: the kernel module records it was imported without.)"""
    import lynx_hf.kernels.moe as moe

    model = fam.build("qwen2_moe")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moe, "_INTERPRET", False)
    for field in ("expert_path", "routing_backend"):
        with pytest.raises(lynx_hf.LynxConfigError, match=rf"{field}='triton'.*set after lynx_hf's Triton kernels "
                                                          r"were imported.*lynx_hf.kernels.moe.*set it before"):
            lynx_hf.patch(model, **{field: "triton"})
        assert not lynx_hf.is_patched(model)
    monkeypatch.setattr(moe, "_INTERPRET", True)
    lynx_hf.patch(model, expert_path="triton")
    lynx_hf.unpatch(model)
