"""One body per behaviour, run over the family registry (``helpers/families.py``; PEFT's common tester is the
model): the right spec patches exactly the MoE blocks, unpatch restores the model exactly, remapped weights follow
the family's rule, and the router-logits contract holds in decode (CASES C1)."""

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf.block import BlockRouting

# policy_on_every_step (tests/conftest.py): the subject is each family's remap against its weight rule on tiny models,
# where the cost gate (the default) keeps the policy off at many step sizes;
# test_the_default_gate_decodes_as_its_decisions_say runs the default gate on every family
pytestmark = pytest.mark.usefixtures("policy_on_every_step")

# the paper's rule without consensus: S = cover set (+ grow by score to k), forces remaps on tiny batches.
# (mass_price=None is needed: with the default mass_price, tau is unused and this would be the default.)
NO_CONSENSUS = dict(policy="lynx", mass_price=None, tau=1000.0)


def _config_id(case):
    family, kw = case
    return "-".join([family, *(f"{k}={v}" for k, v in kw.items())])


def _generate(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, **kw)


def _run_or_error(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - we compare failure modes
        return None, type(exc)


def _hooks(model):
    return {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}


@pytest.mark.parametrize("family", fam.PATCHABLE)
def test_the_right_spec_patches_only_moe_blocks(family):
    model = fam.build(family)
    lynx_hf.patch(model)
    state = model.__dict__["_lynx_state"]
    want = family if fam.FAMILIES[family].kind == "dedicated" else "generic"
    assert {block.spec.family for block in state.blocks} == {want}
    moe_blocks = [n for n, m in model.named_modules() if "experts" in dict(m.named_children())]
    assert [block.name for block in state.blocks] == moe_blocks  # dense layers (e.g. Qwen3 layer 1, V3 layer 0) untouched
    lynx_hf.unpatch(model)


@pytest.mark.parametrize("config", [dict(policy="lynx"), NO_CONSENSUS], ids=["lynx", "lynx-no-consensus"])
@pytest.mark.parametrize("family", fam.PATCHABLE)
def test_unpatch_restores_exactly(family, config):
    """Patched (a LynxConfig or keyword options), generate, unpatch: the same keys, modules, attributes, hooks
    and outputs as before; while patched, exactly the hooks patch installed; unpatching twice is a no-op."""
    model = fam.build(family)
    keys = list(model.state_dict().keys())
    modules = [(n, type(m)) for n, m in model.named_modules()]
    dicts = {n: set(vars(m)) for n, m in model.named_modules()}
    hooks = _hooks(model)
    ids, mask = fam.prompts(4, 5)
    ref = _generate(model, ids, mask, max_new_tokens=4)

    if config is NO_CONSENSUS:
        lynx_hf.patch(model, **config)
    else:
        lynx_hf.patch(model, lynx_hf.LynxConfig(**config, gate="always"))  # a value: LYNX_HF_GATE is not read
    assert lynx_hf.is_patched(model)
    assert list(model.state_dict().keys()) == keys  # C6: keys identical while patched
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    # between calls: exactly what patch installed (one forward hook per router, except where the block forward
    # is replaced (Llama-4); the step hooks on the backbone), nothing left over from the decode steps
    state = model.__dict__["_lynx_state"]
    hooked = [b for b in state.blocks if "forward" not in vars(model.get_submodule(b.name))]
    routers = {n for n, m in model.named_modules() if any(m is b.router for b in hooked)}
    backbone = next(n for n, m in model.named_modules() if m is state.backbone)
    # and a pre-hook on the generating model when it is not the backbone (the ids its forward gets: C45)
    top = next(n for n, m in model.named_modules() if m is state.model)
    assert _hooks(model) == {n: (h[0] + (n in routers) + (n == backbone), h[1] + (n == backbone) + (n == top != backbone))
                             for n, h in hooks.items()}
    lynx_hf.unpatch(model)

    assert not lynx_hf.is_patched(model)
    assert list(model.state_dict().keys()) == keys
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert {n: set(vars(m)) for n, m in model.named_modules()} == dicts  # no attribute left behind
    assert _hooks(model) == hooks
    out = _generate(model, ids, mask, max_new_tokens=4)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a, b)
    lynx_hf.unpatch(model)  # unpatching an unpatched model is a no-op
    assert not lynx_hf.is_patched(model)


@pytest.mark.parametrize("family,kw", fam.CONFIGS, ids=[_config_id(case) for case in fam.CONFIGS])
def test_remapped_weights_follow_the_family_rule(family, kw, monkeypatch):
    """Where the remap keeps a token's expert set, the recomputed weights equal the model's own (same rule, same
    dtype); every row uses k distinct experts the model's routing allows (never a group-masked one), and its
    weights are the family's rule (docs/design.md "Family rules", the registry's ``rule``) on its new set; some
    rows are remapped, some are not."""
    model = fam.build(family, **kw)
    rule = fam.FAMILIES[family].rule(model.config)
    seen = []
    real_route = BlockRouting.route

    def spy(self, step, router_logits, topk_weights, topk_idx):
        new_w, new_idx = real_route(self, step, router_logits, topk_weights, topk_idx)
        seen.append((router_logits, self.spec.selection_scores(self.router, router_logits), topk_idx, topk_weights,
                     new_idx, new_w))
        return new_w, new_idx

    monkeypatch.setattr(BlockRouting, "route", spy)
    ids, mask = fam.prompts(16, 6)
    # a config that remaps on these tiny batches: the paper's rule without consensus (S = cover + grow to k);
    # Llama-4 has k = 1 (every cover keeps the token's top-1): XShare with a one-expert budget there
    config = dict(policy="xshare", xshare_budget=1, xshare_warmup=0) if family == "llama4" else NO_CONSENSUS
    with lynx_hf.patched(model, **config):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert seen
    unchanged_rows = changed_rows = 0
    for logits, scores, idx, w, new_idx, new_w in seen:
        assert new_w.dtype == w.dtype and new_idx.shape == idx.shape
        assert bool(torch.isfinite(scores.gather(1, new_idx)).all())  # never a forbidden expert
        assert bool((new_idx.sort(dim=-1).values.diff(dim=-1) != 0).all())  # k distinct
        torch.testing.assert_close(new_w.float(), fam.rule_weights(rule, logits, new_idx), rtol=1e-5, atol=1e-6)
        for t in range(idx.shape[0]):
            if set(idx[t].tolist()) == set(new_idx[t].tolist()):
                unchanged_rows += 1
                own = dict(zip(idx[t].tolist(), w[t].float().tolist()))
                ours = dict(zip(new_idx[t].tolist(), new_w[t].float().tolist()))
                for e in own:
                    assert ours[e] == pytest.approx(own[e], rel=1e-5, abs=1e-7)
            else:
                changed_rows += 1
    assert unchanged_rows > 0 and changed_rows > 0


@pytest.mark.parametrize("family", fam.PATCHABLE)
def test_C1_router_logits_requested_in_decode(family):
    """C1: with a cache and output_router_logits=True the block keeps its contract in prefill and
    decode (the recorded router logits are the model's own); generate(output_router_logits=True) fails no
    worse patched than unpatched."""
    model = fam.build(family)
    ids, mask = fam.prompts(4, 6)
    pre = model(input_ids=ids, attention_mask=mask, use_cache=True, output_router_logits=True)
    step = ids[:, -1:]
    mask2 = torch.cat([mask, torch.ones_like(step)], dim=1)
    ref, ref_err = _run_or_error(lambda: model(
        input_ids=step, attention_mask=mask2, past_key_values=pre.past_key_values, use_cache=True,
        output_router_logits=True))
    nomask = model(input_ids=step, past_key_values=model(input_ids=ids, use_cache=True).past_key_values,
                   use_cache=True, output_router_logits=True)
    gen_ref, gen_ref_err = _run_or_error(lambda: model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_router_logits=True))
    for policy in ("none", "lynx"):
        with lynx_hf.patched(model, policy=policy):
            pre_p = model(input_ids=ids, attention_mask=mask, use_cache=True, output_router_logits=True)
            out, err = _run_or_error(lambda: model(
                input_ids=step, attention_mask=mask2, past_key_values=pre_p.past_key_values, use_cache=True,
                output_router_logits=True))
            out_nomask = model(input_ids=step, past_key_values=model(input_ids=ids, use_cache=True).past_key_values,
                               use_cache=True, output_router_logits=True)
            assert lynx_hf.stats(model).summary()["decode_steps"] == 2  # both steps seen as decode, not by mask
            gen, gen_err = _run_or_error(lambda: model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_router_logits=True))
        assert err == ref_err and gen_err == gen_ref_err  # patched fails no worse (same outcome) than unpatched
        pairs = [(out_nomask, nomask)] + ([(out, ref)] if ref_err is None else [])
        for got, want in pairs:
            assert len(got.router_logits) == len(want.router_logits) == len(pre.router_logits)
            for layer, (a, b) in enumerate(zip(got.router_logits, want.router_logits)):
                assert a.shape == b.shape
                if policy == "none" or layer == 0:  # the model's own logits (later layers see remapped inputs)
                    assert torch.equal(a, b)
            if policy == "none":
                assert torch.equal(got.logits, want.logits)
        for a, b in zip(pre_p.router_logits, pre.router_logits):
            assert torch.equal(a, b)
        if gen_ref_err is None and policy == "none":
            assert torch.equal(gen, gen_ref)
