"""The fused device decode step on patched models (``lynx_hf.core.device_step``: the plan's decode step on the Triton
backend, interpreted here on CPU tensors, as on CUDA): chosen at patch time, generating the same tokens and telemetry
as the torch path for every seed family, DeepSeek-V3 and the generic spec's selection-bias routers, and adding at most
a handful of dispatched ops + launches per MoE layer-step (``lab.step_ops``; ``docs/cases.md`` C65)."""

import os

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import lynx_hf
from helpers import families as fam
from lab import family_matrix as fm
from lab import step_ops
from lynx_hf import core
from lynx_hf.kernels import fused_step
from lynx_hf.state import state_of

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py)")

#: gate="always" below: the subject is what the step computes and dispatches on every decode step; on these tiny CPU
#: models the default cost gate rightly keeps the policy off at many step sizes
ALWAYS = {"gate": "always"}
POLICIES = [("lynx", {}), ("lynx", {"mass_price": None}), ("oea", {}), ("xshare", {})]


def test_the_triton_backend_plans_the_fused_step_and_the_torch_backend_does_not():
    model = fam.build("qwen2_moe")
    for policy, kw in POLICIES + [("none", {})]:
        lynx_hf.patch(model, policy=policy, routing_backend="triton", **ALWAYS, **kw)
        for block in state_of(model).blocks:
            plan = block.resolve()
            assert isinstance(plan.fused_device, fused_step.FusedStep)
            want = core.keep_routing if policy == "none" else core.device_step
            assert plan.kernel is want
            assert plan.fused_device.policy.kind == ("keep" if policy == "none" else plan.policy.device_policy(
                plan.params).kind)
        lynx_hf.patch(model, policy=policy, routing_backend="torch", **ALWAYS, **kw)
        assert all(block.resolve().fused_device is None for block in state_of(model).blocks)
    lynx_hf.unpatch(model)


def _generate(model, batch=6, tokens=4, **patch_kw):
    """Tokens, scores and stats of a greedy generate under ``lynx_hf.patched(**patch_kw)``, and how many fused steps
    ran."""
    calls = []
    real = fused_step.FusedStep.__call__

    def spy(self, *args, **kwargs):
        calls.append(self.policy.kind)
        return real(self, *args, **kwargs)

    ids, mask = fam.prompts(batch, 5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_step.FusedStep, "__call__", spy)
        with lynx_hf.patched(model, **patch_kw):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            stats = lynx_hf.stats(model).summary()
    return out, stats, calls


def _assert_same_generation(model, **kw):
    ref, ref_stats, none_calls = _generate(model, routing_backend="torch", **ALWAYS, **kw)
    out, stats, calls = _generate(model, routing_backend="triton", **ALWAYS, **kw)
    assert not none_calls and calls, "the fused step ran on the Triton backend only"
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for key in ("decode_steps", "unique_experts_before", "unique_experts_after", "decode_tokens", "fallbacks",
                "finished_row_tokens"):
        assert stats[key] == ref_stats[key], key
    assert stats["routing_mass_kept"] == pytest.approx(ref_stats["routing_mass_kept"], rel=1e-5)
    return stats


@pytest.mark.parametrize("family", fam.REPRESENTATIVE + ("deepseek_v3",))
@pytest.mark.parametrize("policy,kw", POLICIES, ids=["lynx-default", "lynx-paper", "oea", "xshare"])
def test_generate_with_the_fused_step_equals_the_torch_path(family, policy, kw):
    """Every seed family (DeepSeek-V2 group-limited here) and DeepSeek-V3 (selection bias, groups), every policy."""
    stats = _assert_same_generation(fam.build(family), policy=policy, **kw)
    assert stats["decode_steps"] > 0


def test_bf16_weights_round_as_torch_casts_them():
    """A bf16 model: the fused step's routing weights are rounded to nearest even as the torch path's ``.to(bf16)``
    (the interpreter's own fp32 -> bf16 cast truncates: tokens drifted apart before)."""
    _assert_same_generation(fam.build("qwen2_moe", dtype=torch.bfloat16), policy="lynx")


@pytest.mark.parametrize("model_type", [t for t in ("glm4_moe", "ernie4_5_moe", "minimax_m2", "kolibri1")
                                        if t in CONFIG_MAPPING_NAMES])
def test_generic_selection_bias_routers_run_their_rule_in_the_kernel(model_type, monkeypatch):
    """The generic spec's selection-bias rules (router / block bias, [1, N] bias, sigmoid / softmax / logits score,
    groups) are described to the kernel (``BlockRouting.fused_selection``), not computed in torch."""
    from lynx_hf.block import BlockRouting

    model = fm.build(fm.case_of(model_type))
    described = []
    real = BlockRouting.fused_selection
    monkeypatch.setattr(BlockRouting, "fused_selection",
                        lambda self, device: described.append(r := real(self, device)) or r)
    _assert_same_generation(model, policy="lynx")
    assert described and all(d is not None and d[0].kind == "biased" for d in described)


def test_finished_rows_and_left_padding(monkeypatch):
    """Rows that emit EOS early keep decoding pad tokens without voting (C2, C30); left-padded prompts."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(6, 5)
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)[:, -1]
    eos = int(first[0])  # row 0 emits it at once: a finished row from the first decode step
    stats = {}
    for backend in ("torch", "triton"):
        with lynx_hf.patched(model, routing_backend=backend, **ALWAYS):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0)
            stats[backend] = (out, lynx_hf.stats(model).summary())
    assert torch.equal(stats["torch"][0], stats["triton"][0])
    assert stats["triton"][1]["finished_row_tokens"] == stats["torch"][1]["finished_row_tokens"] > 0
    assert stats["triton"][1]["unique_experts_after"] == stats["torch"][1]["unique_experts_after"]


def test_verify_steps_of_prompt_lookup_decoding():
    """Assisted decoding's verification forwards (q_len > 1, every token decode work, ``Step.kind == "verify"``)."""
    model = fam.build("mixtral")
    ids, mask = fam.prompts(1, 8, left_pad=False)
    ids = torch.cat([ids, ids[:, :4]], dim=1)  # a repeat for the prompt lookup to find
    out = {}
    for backend in ("torch", "triton"):
        with lynx_hf.patched(model, routing_backend=backend, q_max=4, **ALWAYS):
            seq = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3)
            out[backend] = (seq, lynx_hf.stats(model).summary())
    assert torch.equal(out["torch"][0], out["triton"][0])
    assert out["triton"][1]["verify_tokens"] == out["torch"][1]["verify_tokens"] > 0
    assert out["triton"][1]["unique_experts_after"] == out["torch"][1]["unique_experts_after"]


# -- the count (lab.step_ops): ops + launches one patched layer adds to a decode step ----------------------------
@pytest.mark.parametrize("label,family,overrides", [m for m in step_ops.MODELS if m[1] != "llama4"],
                         ids=[m[0] for m in step_ops.MODELS if m[1] != "llama4"])
def test_C65_a_patched_layer_adds_at_most_four_ops_per_decode_step(label, family, overrides):
    """Qwen2-MoE, Mixtral, DeepSeek-V2 (greedy, group-limited), DeepSeek-V3 at N 64, k 8, B 16, the model's own
    experts on both sides: the default policy, the paper rule and OEA add at most 4 dispatched ops + Triton launches
    (one launch: the fused step) to one block forward; the step-by-step path added 70-130."""
    model = step_ops.build(family, **overrides)
    for policy in ({}, {"mass_price": None}, {"policy": "oea"}):
        extra, plain, patched = step_ops.extra_per_step(model, 16, **policy)
        assert extra <= 4, (label, policy, extra, patched.ops - plain.ops, patched.launches)
        assert sum(patched.launches.values()) >= 1  # the policy ran (not a no-op)
    with step_ops.step_by_step():  # the counter sees what the fused step removed
        before, _, _ = step_ops.extra_per_step(model, 16)
    assert before > 40


def test_C65_llama4_routing_adds_at_most_four_ops_per_decode_step():
    """Llama-4's block forward is replaced in decode (HF computes every expert densely), so the block counts differ by
    the expert computation; its routing adds the router's own top-k and gather (HF's router does not return the ids)
    and the fused step's launch: policy ``none`` (the dense experts kept) adds exactly that, and LYNX's further ops
    are the sparse expert path's (no routing op among them)."""
    model = step_ops.build("llama4")
    none, plain, patched_none = step_ops.extra_per_step(model, 16, policy="none")
    assert none <= 4 and sum(patched_none.launches.values()) == 1
    extra, _, patched = step_ops.extra_per_step(model, 16)
    added = patched.ops - patched_none.ops
    routing_ops = {"where", "sum", "mul", "eq", "ne", "lt", "ge", "sigmoid", "softmax", "exp", "log", "topk",
                   "argmax", "scatter", "scatter_add", "max", "min", "any", "all", "isfinite", "stack", "cat"}
    assert not set(added) & routing_ops, added
    assert sum(patched.launches.values()) == 1
