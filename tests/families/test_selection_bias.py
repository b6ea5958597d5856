"""Selection-bias routers (``lynx_hf/selection.py``, ``docs/design.md`` "Family rules"): the generic spec finds the
bias wherever the family keeps it (a router buffer, a router submodule, the block passing it to the router),
verifies the whole rule exactly on its probe, and the policies choose among the experts the model's routing allows,
ranked by the biased scores; the weights stay the unbiased rule. CASES C32: a small bias is never accepted with a
wrong rule. Tiny models from config classes (``lab.family_matrix``)."""

import re
import warnings

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import lynx_hf
from helpers import families as fam
from lab import family_matrix as fm
from lynx_hf.block import BlockRouting
from lynx_hf.patches import deepseek_v3
from lynx_hf.patches.generic import GenericSpec, _plain_mismatch, block_parts, probe_hidden

# policy_on_every_step (tests/conftest.py): the policies must choose among the experts the model's selection-bias
# routing allows, which needs them on every decode step of these tiny models
pytestmark = pytest.mark.usefixtures("policy_on_every_step")


NO_CONSENSUS = dict(policy="lynx", mass_price=None, tau=1000.0)
# family -> (where the bias lives, score function): one of each kind the generic spec must find
BIASED = {
    "glm4_moe": ("router", "sigmoid"),  # router buffer, grouped (2 groups in the tiny config)
    "ernie4_5_moe": ("router", "softmax"),  # router submodule moe_statics, [1, N] parameter
    "minimax_m2": ("block", "sigmoid"),  # block buffer passed to the router as an argument
    "afmoe": ("block", "sigmoid"),  # block parameter passed as an argument, route_scale
    "kolibri1": ("router", "logits"),  # bias added to the raw logits
}
# a family the installed transformers does not ship (Kolibri-1 before 5.24) is not enumerated, as in the matrix
BIASED = {t: v for t, v in BIASED.items() if t in CONFIG_MAPPING_NAMES}


def _model(model_type, **kw):
    return fm.build(fm.case_of(model_type), **kw)


def _blocks(model):
    return model.__dict__["_lynx_state"].blocks


def _spy(monkeypatch):
    seen = []
    real_route = BlockRouting.route

    def spy(self, step, logits, weights, idx):
        new_w, new_idx = real_route(self, step, logits, weights, idx)
        seen.append((self, logits.float(), self._selection_scores(logits), idx, weights, new_idx, new_w))
        return new_w, new_idx

    monkeypatch.setattr(BlockRouting, "route", spy)
    return seen


def _corrected(block_state, logits):
    """The model's corrected scores, read here from the bias tensor itself (not through the spec)."""
    owner, score = BIASED[block_state.model_state.model.config.model_type]
    module = block_state.router if owner == "router" else block_state.block
    bias = next(t for n, t in [*module.named_buffers(), *module.named_parameters()]
                if n.rsplit(".", 1)[-1] in ("e_score_correction_bias", "expert_bias")).reshape(-1).float()
    p = {"sigmoid": logits.sigmoid(), "softmax": logits.softmax(-1), "logits": logits}[score]
    return p + bias


@pytest.mark.parametrize("model_type", sorted(BIASED))
def test_generic_finds_the_bias_and_policies_stay_on_the_models_ranking(model_type, monkeypatch):
    """Patched with a verified selection rule naming the bias; every decode step: the model's own experts are the
    top-k of the selection scores, the scores rank experts exactly as the corrected scores do, every remapped expert
    is one the model allows, and the remapped weights are the unbiased rule on the new set."""
    model = _model(model_type)
    owner, score = BIASED[model_type]
    seen = _spy(monkeypatch)
    ids = fm._prompts(8, 4)
    with lynx_hf.patched(model, **NO_CONSENSUS):
        for block in _blocks(model):
            assert block.spec.family == "generic" and block.selection is not None
            assert block.selection.owner == owner and block.selection.score == score
        fm._generate(model, ids)
        summary = lynx_hf.stats(model).summary()
    assert summary["unique_experts_after"] < summary["unique_experts_before"]
    remapped = 0
    for state, logits, scores, idx, w, new_idx, new_w in seen:
        corrected = _corrected(state, logits)
        allowed = torch.isfinite(scores)
        assert bool(allowed.gather(1, idx.long()).all()) and bool(allowed.gather(1, new_idx.long()).all())
        own = scores.topk(idx.shape[-1], dim=-1).values
        assert torch.equal(scores.gather(1, idx.long()).sort(-1, descending=True).values, own)
        # same order as the corrected scores on the allowed experts (a strictly increasing map)
        order = corrected.masked_fill(~allowed, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        ranked = scores.gather(1, order)
        assert bool((ranked[:, 1:] <= ranked[:, :-1]).all())
        rule = state.rule
        x = logits.gather(1, new_idx.long())
        ref = x.sigmoid() if rule.kind == "sigmoid" else logits.softmax(-1).gather(1, new_idx.long())
        if rule.renormalize:
            ref = ref / ref.sum(-1, keepdim=True)
        torch.testing.assert_close(new_w.float(), ref * rule.scale, rtol=1e-5, atol=1e-6)
        remapped += int((new_idx.sort(-1).values != idx.sort(-1).values).any(-1).sum())
    assert remapped > 0


def test_deepseek_v3_spec_and_generic_spec_apply_one_rule():
    """The dedicated DeepSeek-V3 spec and the generic spec (run on the same block) give the same selection scores:
    one selection-bias rule (``BiasedSelection``), grouped top-2-sum, sigmoid, the router's buffer."""
    from helpers import families as fam

    model = fam.build("deepseek_v3")
    block = model.model.layers[1].mlp
    spec = GenericSpec()
    inferred = spec.validate(block, "layers.1.mlp", lynx_hf.LynxConfig())
    rule, selection = inferred.weight, inferred.selection
    gate = block.gate
    assert selection == deepseek_v3.selection_rule(gate)
    assert rule == deepseek_v3.SPEC.validate(block, "layers.1.mlp", lynx_hf.LynxConfig()).weight
    logits = torch.randn(64, gate.num_experts) * 3
    torch.testing.assert_close(selection.selection_scores(logits, selection.bias(gate, block)),
                               deepseek_v3.selection_scores(gate, logits), rtol=0, atol=0)


# -- CASES C32: a small selection bias ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1e-3, 1e-4])
def test_C32_small_bias_shows_on_the_probe(scale):
    """The probe has tokens whose logit gaps are far below the bias: plain top-k does not reproduce the router there."""
    model = _model("glm4_moe")
    block = model.model.layers[0].mlp
    router, _ = block_parts(block)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts,
                                                         generator=torch.Generator().manual_seed(1)) * scale)
        logits, _, idx = router(probe_hidden(model.config.hidden_size))
    assert _plain_mismatch(logits, idx) is not None


@pytest.mark.parametrize("scale", [1e-3, 1e-4])
def test_C32_small_bias_patched_with_the_exact_rule(scale, monkeypatch):
    """GLM-4.5 with a bias of randn x scale: patched with the selection-bias rule, and the identity remap (OEA with
    oea_k0 = k) keeps every decode token's experts and the logits of unpatched generate to fp32 round-off."""
    model = _model("glm4_moe", seed=3)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(5)) * scale)
    ids = fm._prompts(16, 5, seed=2)
    ref = fm._generate(model, ids)
    seen = _spy(monkeypatch)
    with lynx_hf.patched(model, policy="oea", oea_k0=model.config.num_experts_per_tok):
        assert all(b.selection is not None and b.selection.path == "e_score_correction_bias" for b in _blocks(model))
        out = fm._generate(model, ids)
    assert seen
    for _, _, _, idx, _, new_idx, _ in seen:
        assert torch.equal(idx.sort(-1).values, new_idx.sort(-1).values)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-3, 1e-4])
@pytest.mark.parametrize("model_type", ["glm4_moe", "flex_olmo"])
def test_C32_hidden_small_bias_is_refused_naming_the_mismatch(model_type, scale, monkeypatch):
    """A bias the spec cannot see (kept in a closure; GLM-4.5 adds it on top of its own buffer, FlexOlmo has none):
    refused, never accepted with a wrong rule; the message names the block, the router and the mismatch."""
    model = _model(model_type)
    block = model.model.layers[0].mlp
    router, _ = block_parts(block)
    hidden = torch.randn(router.weight.shape[0], generator=torch.Generator().manual_seed(1)) * scale
    real = type(router).forward

    def forward(self, hidden_states):
        logits, weights, _ = real(self, hidden_states)
        corrected = logits.float().sigmoid() + getattr(self, "e_score_correction_bias", 0.0) + hidden
        idx = torch.topk(corrected, weights.shape[-1], dim=-1)[1]
        w = logits.float().sigmoid().gather(1, idx)
        return logits, (w / w.sum(-1, keepdim=True)).to(weights.dtype), idx

    monkeypatch.setattr(type(router), "forward", forward)
    with pytest.raises(lynx_hf.UnsupportedModelError) as info:
        lynx_hf.patch(model)
    text = str(info.value)
    want = {"glm4_moe": ("Glm4MoeMoE", "Glm4MoeTopkRouter", "tokens differ", "no selection rule reproduces"),
            "flex_olmo": ("FlexOlmoSparseMoeBlock", "FlexOlmoTopKRouter", "probe tokens",
                          "no selection bias was found")}[model_type]
    for part in want:
        assert part in text
    assert not lynx_hf.is_patched(model)


def test_bias_changed_after_patching_is_read_live(monkeypatch):
    """The rule holds where the bias lives, not a copy: a bias updated after patch (a load-balancing update,
    load_state_dict) is what the selection scores use."""
    model = _model("minimax_m2")
    seen = _spy(monkeypatch)
    with lynx_hf.patched(model, **NO_CONSENSUS):
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape) * 0.3)
        fm._generate(model, fm._prompts(8, 4))
    for state, logits, scores, idx, *_ in seen:
        assert torch.equal(scores.gather(1, idx.long()).sort(-1, descending=True).values,
                           scores.topk(idx.shape[-1], dim=-1).values)


@pytest.mark.parametrize("load", ["copy", "assign", "data_copy", "data_assign"])
def test_C42_an_ambiguous_probe_defers_and_verifies_again_when_the_bias_is_loaded(load):
    """CASES C42: Kolibri-1 selects on ``logits + bias``; built from its config the bias is all zero, so sigmoid +
    bias, softmax + bias and logits + bias reproduce its ids equally on the probe. The spec must not pick one (it took
    the first, sigmoid: after ``load_state_dict`` brought the real bias, OEA with k0 = k -- a remap that keeps every
    token's own top-k -- moved decode tokens off the model's experts). Now the block keeps the model's own routing
    (a warning says why), is verified again on its first large router call after the bias changed, and then
    remaps with the router's rule: OEA k0 = k gives the unpatched tokens. The bias may come by ``load_state_dict``
    (an in-place copy, or ``assign=True``) or be written through ``.data`` as several loaders do (``buf.data.copy_(w)``,
    ``buf.data = w``: neither identity nor version counter changes; before issue 44 the block stayed deferred for good,
    with no warning)."""
    if "kolibri1" not in CONFIG_MAPPING_NAMES:
        pytest.skip("transformers ships no Kolibri-1")
    model = _model("kolibri1")
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}  # the biases randn x 0.1 (fm.build)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    k = model.config.num_experts_per_tok
    ids = torch.randint(3, 100, (8, 4), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lynx_hf.patch(model, policy="oea", oea_k0=k, gate="always")
    blocks = _blocks(model)
    status = [b.rule_status for b in blocks]
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # nothing changed yet
    status_before_load = [b.rule_status for b in blocks]
    steps_before_load = lynx_hf.stats(model).summary()["decode_steps"]
    if load in ("copy", "assign"):
        model.load_state_dict(checkpoint, assign=load == "assign")
    else:
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                if load == "data_copy":
                    buf.data.copy_(checkpoint[name])
                else:
                    buf.data = checkpoint[name].clone()
    got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    steps = lynx_hf.stats(model).summary()["decode_steps"]
    lynx_hf.unpatch(model)
    assert torch.equal(got, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert steps - steps_before_load == 5  # it remapped after the load
    assert all(b.rule_status == "verified" and b.selection.score == "logits" for b in blocks)
    assert status == status_before_load == ["pending"] * len(blocks) and steps_before_load == 0
    assert any(re.search(r"3 selection rules reproduce .* constant, 0 everywhere", str(w.message)) for w in record)


def test_C42_a_deferred_block_reads_the_bias_values_only_where_no_device_sync_is_due(monkeypatch):
    """The value check of a deferred block's bias (``BlockRouting._watched_changed``) reads the tensor on the host:
    in a prefill call, or on CPU tensors in eager mode; in a decode step on the accelerator path (``strict_sync_free``:
    what a GPU runs) it compares identity, version and address only, so a decode step issues no host read for it."""
    if "kolibri1" not in CONFIG_MAPPING_NAMES:
        pytest.skip("transformers ships no Kolibri-1")
    from transformers import DynamicCache

    from lynx_hf import block as block_mod
    from lynx_hf.kernels.routing_torch import strict_sync_free

    model = _model("kolibri1")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lynx_hf.patch(model, policy="lynx", gate="always")
    assert all(b.rule_status == "pending" for b in _blocks(model))
    reads = []
    real = block_mod._digest
    monkeypatch.setattr(block_mod, "_digest", lambda t: reads.append(t.shape) or real(t))
    ids = torch.randint(3, 100, (8, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, **fam.cache_kw(model, DynamicCache(config=model.config)), use_cache=True)
        prefill_reads = len(reads)
        with strict_sync_free():
            model(input_ids=out.logits[:, -1:].argmax(-1), **fam.cache_kw(model, fam.cache_of(out)), use_cache=True)
    deferred = len(_blocks(model))
    lynx_hf.unpatch(model)
    assert prefill_reads == deferred > 0  # the prefill: one read per deferred block
    assert len(reads) == prefill_reads  # the accelerator path: no host read of the bias in a decode step


def test_C42_a_bias_written_through_data_between_cpu_decode_steps_is_noticed_at_the_next_decode_step():
    """Issue 56: a write through ``.data`` (``buf.data.copy_(w)``: identity, version and address unchanged) after the
    prefill, followed by decode steps only, on CPU in eager mode: the value check runs on the decode call (a host read
    costs no device sync there), so the block is verified at the first decode step of at least ``probe_tokens`` rows
    and routes it (its tokens counted), instead of waiting for the next prefill."""
    if "kolibri1" not in CONFIG_MAPPING_NAMES:
        pytest.skip("transformers ships no Kolibri-1")
    from transformers import DynamicCache

    model = _model("kolibri1")
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}  # the biases randn x 0.1 (fm.build)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    k = model.config.num_experts_per_tok
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lynx_hf.patch(model, policy="oea", oea_k0=k, gate="always")
    blocks = _blocks(model)
    rows = blocks[0].spec.probe_tokens
    ids = fm._prompts(rows, 4)  # ids below the tiny vocabulary (96)
    with torch.no_grad():
        out = model(input_ids=ids, **fam.cache_kw(model, DynamicCache(config=model.config)), use_cache=True)
        assert all(b.rule_status == "pending" for b in blocks)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.data.copy_(checkpoint[name])
        status, tokens = [], []
        for _ in range(2):  # decode steps only: no prefill after the write
            out = model(input_ids=out.logits[:, -1:].argmax(-1), **fam.cache_kw(model, fam.cache_of(out)),
                        use_cache=True)
            status.append([b.rule_status for b in blocks])
            tokens.append(lynx_hf.stats(model).summary()["decode_tokens"])
    lynx_hf.unpatch(model)
    assert status[0] == ["verified"] * len(blocks) and all(b.selection.score == "logits" for b in blocks)
    assert tokens == [rows, 2 * rows]  # both decode steps routed (a pending block routes nothing)
