"""The generic spec's probe accepts a rule only when it is exact (issue 38): one probe token whose experts differ
from the candidate rule's, or weights a few parts in 1e4 off on one token of an fp32 router, are refused; a rule
verified later on the router's real output (the deferred path) keeps the denominator epsilon the router uses.
Expected values come from the routers themselves (tiny models from config classes, ``lab.family_matrix``)."""

import pytest
import torch

import lynx_hf
from lab import family_matrix as fm
from lynx_hf.errors import UnsupportedModelError
from lynx_hf.patches.generic import GenericSpec, block_parts, probe_hidden

PROBE = probe_hidden(8).shape[0]  # tokens of the patch-time probe


def _glm():
    if fm.case_of("glm4_moe") is None:
        pytest.skip("this transformers has no GLM-4.5 MoE")
    return fm.build(fm.case_of("glm4_moe"))


def _moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "Glm4MoeMoE"]


def _tamper(model, change):
    """Wrap each GLM-4.5 router's forward: on a call of the probe's size, ``change(logits, weights, ids)`` edits one
    token of its output in place (what a router that differs from every candidate rule on that token returns)."""
    for block in _moe_blocks(model):
        router = block.gate
        own = router.forward

        def forward(hidden, own=own):
            logits, weights, ids = own(hidden)
            if logits.shape[0] == PROBE:
                logits, weights = logits.clone(), weights.clone()
                change(logits, weights, ids)
            return logits, weights, ids

        router.forward = forward


def test_one_probe_token_with_other_experts_is_refused():
    """One token (of the probe's 160) whose logit at an expert it did not choose is raised above its chosen ones (the
    sigmoid weights of its chosen experts unchanged): no selection rule reproduces that token, so the block is
    refused naming the 1 token. A probe that accepted one mismatch would patch a wrong rule."""
    model = _glm()
    reference = _glm()
    with lynx_hf.patched(reference):  # untampered: the selection-bias rule is verified
        pass

    def change(logits, weights, ids):
        token = PROBE - 1  # a tiny-gap token
        other = next(e for e in range(logits.shape[-1]) if e not in ids[token].tolist())
        logits[token, other] = logits[token].max() + 50.0

    _tamper(model, change)
    with pytest.raises(UnsupportedModelError, match=rf"1 of {PROBE} tokens differ"):
        lynx_hf.patch(model)
    assert not lynx_hf.is_patched(model)


def test_weights_a_few_parts_in_ten_thousand_off_on_one_token_are_refused():
    """An fp32 router whose weights on one probe token are 3e-4 (relative) away from its rule: more than 4 ulps of
    fp32 (~5e-7), far less than 4 ulps of bf16 (~3e-2): refused ("no inferred weight rule"). The tolerance is the
    router's weight dtype's, not a coarser one."""
    model = _glm()

    def change(logits, weights, ids):
        weights[0] *= 1 + 3e-4

    _tamper(model, change)
    with pytest.raises(UnsupportedModelError, match="no inferred weight rule reproduces"):
        lynx_hf.patch(model)


def test_a_deferred_verification_keeps_the_routers_denominator_epsilon():
    """LFM2-MoE renormalises with ``w / (sum + 1e-6)``; a rule verified on the router's real output (the deferred
    path: a router not materialized at patch time) keeps that epsilon, as the patch-time probe does."""
    case = fm.case_of("lfm2_moe")
    if case is None:
        pytest.skip("this transformers has no LFM2-MoE")
    model = fm.build(case)
    block = next(m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock"))
    router, _ = block_parts(block)
    hidden = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        output = router(hidden, getattr(block, "expert_bias", None))
    spec = next(s for s in lynx_hf.patches.SPECS if isinstance(s, GenericSpec))
    rule = spec.deferred_rule(block, "layer", output)
    assert rule.weight is not None and rule.weight.renorm_eps == 1e-6 and rule.weight.renormalize
