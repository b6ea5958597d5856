"""Family specs beyond the common tester (test_every_family.py): LYNX / OEA generate on the families outside the
representative four, DeepSeek-V3's group / selection-bias cases, and the generic spec's rule inference, deferred
verification, Triton path and refusals (PhiMoE, a stated rule the router does not follow, a selection the logits
cannot reproduce)."""

import os

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf.block import BlockRouting
from lynx_hf.patches import deepseek_v3

# policy_on_every_step (tests/conftest.py): each family's remap is checked against its rule; the cost gate (the
# default) keeps the policy off at many step sizes of these tiny models (the default gate per family:
# test_family_default_gate.py)
pytestmark = pytest.mark.usefixtures("policy_on_every_step")


# the representative families run the same checks in decode/test_equivalence.py (Llama-4: k = 1, OEA k0 = 1 cannot cut)
FAMILIES = [f for f in fam.PATCHABLE if f not in fam.REPRESENTATIVE]
# the paper's rule without consensus: S = cover set (+ grow by score to k), forces remaps on tiny batches.
# (mass_price=None is needed: with the default mass_price, tau is unused and this would be the default.)
NO_CONSENSUS = dict(policy="lynx", mass_price=None, tau=1000.0)


def _generate(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", 5)
    kw.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kw)


def _spy_route(monkeypatch):
    seen = []
    real_route = BlockRouting.route

    def spy(self, step, router_logits, topk_weights, topk_idx):
        new_w, new_idx = real_route(self, step, router_logits, topk_weights, topk_idx)
        scores = self.spec.selection_scores(self.router, router_logits)
        seen.append((router_logits.float(), scores, topk_idx, topk_weights, new_idx, new_w, self.rule))
        return new_w, new_idx

    monkeypatch.setattr(BlockRouting, "route", spy)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_lynx_generate_reduces_or_keeps_unique_experts(family):
    model = fam.build(family)
    ids, mask = fam.prompts(16, 6)
    ref = _generate(model, ids, mask, max_new_tokens=4)
    for config in (dict(policy="lynx"), dict(policy="oea", oea_k0=1)):
        with lynx_hf.patched(model, **config):
            out = _generate(model, ids, mask, max_new_tokens=4)
            summary = lynx_hf.stats(model).summary()
        assert torch.equal(out.scores[0], ref.scores[0])  # the first token comes from prefill
        assert summary["decode_steps"] == 3
        assert summary["unique_experts_after"] <= summary["unique_experts_before"]
    assert summary["unique_experts_after"] < summary["unique_experts_before"]  # OEA k0=1 reduces on every family
    assert summary["remapped_fraction"] > 0 and summary["routing_mass_kept"] < 1.0


# -- DeepSeek-V3 ------------------------------------------------------------------------------------
def _v3_negative(**kw):
    """Correction bias in [-4, -3]: every corrected score sigmoid(l) + b is negative."""
    model = fam.build("deepseek_v3", **kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(-3.0 - torch.rand(b.shape, generator=g))
    return model


def test_deepseek_v3_selection_scores_reproduce_the_model_and_mask_groups():
    """All corrected scores negative: the adapter's selection scores are finite exactly on the allowed
    groups, their top-k is the model's own choice, and a masked expert never wins (a 0-filled mask
    would let it)."""
    model = _v3_negative()
    gate = model.model.layers[1].mlp.gate
    hidden = torch.randn(40, gate.hidden_dim)
    with torch.no_grad():
        logits, weights, idx = gate(hidden)
        corrected = logits.sigmoid() + gate.e_score_correction_bias
        scores = deepseek_v3.selection_scores(gate, logits)
    assert bool((corrected < 0).all())
    allowed = torch.isfinite(scores)
    assert (allowed.view(40, gate.num_group, -1).all(-1).sum(-1) == gate.topk_group).all()  # whole groups
    assert bool(allowed.gather(1, idx).all())
    own = set(map(tuple, idx.sort(-1).values.tolist()))
    ours = set(map(tuple, scores.topk(gate.top_k, dim=-1).indices.sort(-1).values.tolist()))
    assert ours == own
    zero_filled = corrected.masked_fill(~allowed, 0.0).topk(gate.top_k, dim=-1).indices
    assert not bool(allowed.gather(1, zero_filled).all())  # the bug this guards against is real here
    p = torch.sigmoid(logits.gather(1, idx))  # weights: unbiased sigmoid, renormalized, scaled
    torch.testing.assert_close(weights, p / p.sum(-1, keepdim=True) * gate.routed_scaling_factor)


@pytest.mark.parametrize("config", [dict(policy="lynx"), NO_CONSENSUS, dict(policy="oea", oea_k0=1)])
def test_deepseek_v3_negative_bias_remaps_stay_in_allowed_groups(config, monkeypatch):
    model = _v3_negative(router_scale=60.0)
    seen = _spy_route(monkeypatch)
    ids, mask = fam.prompts(16, 6)
    with lynx_hf.patched(model, **config):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        summary = lynx_hf.stats(model).summary()
    assert summary["unique_experts_after"] <= summary["unique_experts_before"]
    remapped = 0
    for logits, scores, idx, w, new_idx, new_w, rule in seen:
        assert bool(torch.isfinite(scores.gather(1, idx)).all())
        assert bool(torch.isfinite(scores.gather(1, new_idx)).all())  # masked experts never chosen
        remapped += int((new_idx.sort(-1).values != idx.sort(-1).values).any(-1).sum())
        p = torch.sigmoid(logits.gather(1, new_idx))
        torch.testing.assert_close(new_w, p / p.sum(-1, keepdim=True) * 2.5, rtol=1e-6, atol=1e-7)
    if config is NO_CONSENSUS or config["policy"] == "oea":  # default LYNX may keep every token's set
        assert remapped > 0


@pytest.mark.parametrize("kw,fields", [
    (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=8, topk_group=1), ("n_group",)),  # groups of 1
    (dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=1),
     ("n_group", "topk_group", "num_experts_per_tok")),  # 1 group of 2 cannot supply 3
    (dict(n_routed_experts=12, n_group=5), ("n_group",)),  # does not divide
    (dict(n_group=4, topk_group=5), ("topk_group",)),
])
def test_C10_deepseek_v3_inconsistent_group_routing_rejected_at_patch_time(kw, fields):
    torch.manual_seed(0)
    model = fam.deepseek_v3(**kw).eval()
    with pytest.raises(lynx_hf.ModelConfigError) as info:
        lynx_hf.patch(model)
    for field in fields:
        assert field in str(info.value)
    assert not lynx_hf.is_patched(model) and all("forward" not in vars(m) for m in model.modules())


# -- generic adapter ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", fam.GENERIC)
def test_generic_infers_and_verifies_the_weight_rule(family):
    """The rule the generic spec infers is the registry's (granitemoe: softmax over the chosen k, which no
    attribute states; flex_olmo: norm_topk_prob=False stated; hunyuan_v1_moe: always renormalized)."""
    model = fam.build(family)
    want = fam.FAMILIES[family].rule(model.config)
    lynx_hf.patch(model)
    for layer in model.__dict__["_lynx_state"].blocks:
        rule = layer.rule
        assert (rule.kind, rule.renormalize, rule.scale) == (want.kind, want.renormalize, want.scale)
        with torch.no_grad():  # k as the router itself returns it
            k = layer.router(torch.randn(4, layer.experts.gate_up_proj.shape[-1]))[2].shape[-1]
        assert (layer.num_experts, layer.top_k) == (layer.experts.num_experts, k)
    lynx_hf.unpatch(model)


def test_generic_bf16_weights_cast_like_the_model(monkeypatch):
    """GraniteMoE casts its weights to the hidden dtype: the remap does too (bf16). (Transformers 5.19's GraniteMoE
    router is refused, see tests/helpers/families.py: there the first generic family of the registry.)"""
    model = fam.build("granitemoe" if "granitemoe" in fam.GENERIC else fam.GENERIC[0], dtype=torch.bfloat16)
    seen = _spy_route(monkeypatch)
    ids, mask = fam.prompts(8, 5)
    with lynx_hf.patched(model, **NO_CONSENSUS):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert seen and all(new_w.dtype == w.dtype == torch.bfloat16 for *_, w, new_idx, new_w, rule in seen)


def test_generic_refuses_phimoe_sparsemixer_naming_the_block():
    model = fam.build("phimoe")
    with pytest.raises(lynx_hf.UnsupportedModelError, match="PhimoeSparseMoeBlock"):
        lynx_hf.patch(model)
    assert not lynx_hf.is_patched(model) and all("forward" not in vars(m) for m in model.modules())


def test_generic_follows_the_router_not_a_stated_scale_it_does_not_apply(monkeypatch):
    """A routed_scaling_factor the router does not apply (a block may apply it after the experts) is not assumed:
    the verified rule is the router's own (scale 1); weights no rule reproduces are refused."""
    model = fam.build("flex_olmo")
    model.model.layers[0].mlp.gate.routed_scaling_factor = 2.0  # stated, but the router never applies it
    with lynx_hf.patched(model):
        assert {b.rule.scale for b in model.__dict__["_lynx_state"].blocks} == {1.0}
    gate_cls = type(model.model.layers[0].mlp.gate)
    real = gate_cls.forward
    monkeypatch.setattr(gate_cls, "forward", lambda self, h: (lambda o: (o[0], o[1] ** 2, o[2]))(real(self, h)))
    with pytest.raises(lynx_hf.UnsupportedModelError, match="FlexOlmoSparseMoeBlock.*weight rule"):
        lynx_hf.patch(model)
    assert not lynx_hf.is_patched(model)


def test_generic_refuses_a_router_that_selects_by_something_else_than_its_logits(monkeypatch):
    """A selection bias (as Ernie-4.5's moe_statics or DeepSeek-V3's) cannot be reproduced from logits."""
    model = fam.build("flex_olmo")
    gate_cls = type(model.model.layers[0].mlp.gate)
    real = gate_cls.forward

    def biased(self, hidden_states):
        logits, weights, idx = real(self, hidden_states)
        return logits, weights, (idx + 1) % self.num_experts

    monkeypatch.setattr(gate_cls, "forward", biased)
    with pytest.raises(lynx_hf.UnsupportedModelError, match="FlexOlmoSparseMoeBlock.*top-3 of its logits"):
        lynx_hf.patch(model)


def test_generic_deferred_verification_runs_on_the_first_decode_call():
    """Routers not materialized at patch time (meta / offloaded) are verified on real decode outputs."""
    model = fam.build("hunyuan_v1_moe")
    ids, mask = fam.prompts(8, 5)
    ref = _generate(model, ids, mask, max_new_tokens=3)
    with lynx_hf.patched(model, policy="none"):
        blocks = model.__dict__["_lynx_state"].blocks
        for block in blocks:
            block.rule, block.rule_status = None, "pending"
        out = _generate(model, ids, mask, max_new_tokens=3)
        assert all(b.rule_status == "verified" for b in blocks)
        assert all(b.rule.kind == "softmax_all" and b.rule.renormalize for b in blocks)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_generic_triton_backend_matches_torch(monkeypatch):
    """The generic adapter's temporary experts interception runs the sparse kernel (interpreted)."""
    from lynx_hf.kernels.backend import routing_ops

    ops = routing_ops("triton")  # the (cached) namespace a plan's expert kernel is read from, per call
    calls = []
    real = ops.sparse_moe
    monkeypatch.setattr(ops, "sparse_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = fam.build("flex_olmo")
    ids, mask = fam.prompts(4, 5)
    with lynx_hf.patched(model, policy="oea", oea_k0=1, routing_backend="torch"):
        ref = _generate(model, ids, mask, max_new_tokens=2)
    assert not calls
    with lynx_hf.patched(model, policy="oea", oea_k0=1, routing_backend="triton", expert_path="triton"):
        out = _generate(model, ids, mask, max_new_tokens=2)
    assert len(calls) == 2  # one decode step x two MoE layers
    assert all("forward" not in vars(m) for m in model.modules())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
