"""Patched vs unpatched on tiny random models of every family: prefill and no-cache forwards are
bit-identical under every policy; policy "none" decode is bit-identical; generate works patched
(greedy, sampling, beam search, DynamicCache, StaticCache, left padding, batch 1)."""

import pytest
import torch

import lynx_hf
import tiny_models as tm
import tiny_models_extra as tx

FAMILIES = list(tm.FAMILIES)
# the seed families plus the issue-7 adapters (dedicated and generic): the same bit-identity suite
ALL_FAMILIES = {**{f: tm for f in tm.FAMILIES}, **{f: tx for f in (*tx.DEDICATED, *tx.GENERIC)}}
POLICIES = ["lynx", "oea", "none"]


def _generate(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", 5)
    kw.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, output_scores=True,
                          return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
@pytest.mark.parametrize("policy", POLICIES)
def test_forward_without_cache_is_bit_identical(family, policy):
    builders = ALL_FAMILIES[family]
    model = builders.build(family)
    ids, mask = builders.prompts(6, 7)
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_cached = model(input_ids=ids, attention_mask=mask, use_cache=True).logits  # prefill with a cache
    with lynx_hf.patched(model, policy=policy):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out_cached = model(input_ids=ids, attention_mask=mask, use_cache=True).logits
        plain = model(ids).logits  # plain forward (lm-eval loglikelihood style)
        assert lynx_hf.stats(model).summary()["decode_steps"] == 0
    assert torch.equal(out, ref)
    assert torch.equal(out_cached, ref_cached)
    assert torch.equal(plain, model(ids).logits)


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_policy_none_decode_is_bit_identical(family):
    builders = ALL_FAMILIES[family]
    model = builders.build(family)
    ids, mask = builders.prompts(8, 6)
    ref = _generate(model, ids, mask)
    with lynx_hf.patched(model, policy="none"):
        out = _generate(model, ids, mask)
        summary = lynx_hf.stats(model).summary()
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a, b)
    assert summary["decode_steps"] == 4  # 5 new tokens = 1 prefill + 4 decode steps
    assert summary["unique_experts_after"] == summary["unique_experts_before"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_lynx_decode_changes_logits_only_after_prefill(family):
    """The first generated token comes from prefill: identical under LYNX; later ones may differ."""
    model = tm.build(family)
    ids, mask = tm.prompts(16, 6)
    ref = _generate(model, ids, mask)
    with lynx_hf.patched(model, policy="lynx"):
        out = _generate(model, ids, mask)
        summary = lynx_hf.stats(model).summary()
    assert torch.equal(out.scores[0], ref.scores[0])
    assert torch.equal(out.sequences[:, : ids.shape[1] + 1], ref.sequences[:, : ids.shape[1] + 1])
    assert summary["decode_steps"] == 4
    assert summary["unique_experts_after"] <= summary["unique_experts_before"]
    assert 0.0 < summary["routing_mass_kept"] <= 1.0 + 1e-9


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "mode",
    [dict(do_sample=False), dict(do_sample=True, top_k=20, temperature=0.9), dict(num_beams=3, do_sample=False),
     dict(do_sample=False, cache_implementation="static")],
    ids=["greedy", "sample", "beam", "static_cache"],
)
def test_generate_modes_run_patched_and_match_with_policy_none(family, mode):
    model = tm.build(family)
    ids, mask = tm.prompts(4, 6)
    torch.manual_seed(1)
    ref = _generate(model, ids, mask, **mode).sequences
    with lynx_hf.patched(model, policy="none"):
        torch.manual_seed(1)
        none = _generate(model, ids, mask, **mode).sequences
        steps = lynx_hf.stats(model).summary()["decode_steps"]
    assert torch.equal(none, ref)
    assert steps == 4  # decode detected for every mode, StaticCache included
    with lynx_hf.patched(model, policy="lynx"):
        torch.manual_seed(1)
        out = _generate(model, ids, mask, **mode).sequences
        assert lynx_hf.stats(model).summary()["decode_steps"] == 4
    assert out.shape == ref.shape


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["lynx", "oea"])
def test_batch_of_one_keeps_each_tokens_top_k(family, policy):
    """With B = 1 the critical set is the token's own top-k: decode is unchanged."""
    model = tm.build(family)
    ids = tm.prompts(1, 6, left_pad=False)[0]
    ref = _generate(model, ids, torch.ones_like(ids), max_new_tokens=6)
    with lynx_hf.patched(model, policy=policy, k0=1):
        out = _generate(model, ids, torch.ones_like(ids), max_new_tokens=6)
        summary = lynx_hf.stats(model).summary()
    assert torch.equal(out.sequences, ref.sequences)
    assert summary["remapped_fraction"] == 0.0
    assert summary["routing_mass_kept"] == pytest.approx(1.0)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # same experts; weights recomputed in fp32


@pytest.mark.parametrize("family", FAMILIES)
def test_C2_left_padding_does_not_change_real_rows(family):
    """C2: a left-padded row decodes like the same prompt alone (no pad) under policy none, and LYNX
    decodes a left-padded batch whose finished rows keep emitting pad tokens without error."""
    model = tm.build(family)
    ids, mask = tm.prompts(4, 7)
    row = 1  # left-padded row
    real = ids[row : row + 1, mask[row].bool()]
    with lynx_hf.patched(model, policy="none"):
        batched = _generate(model, ids, mask).sequences[row, ids.shape[1]:]
        alone = _generate(model, real, torch.ones_like(real)).sequences[0, real.shape[1]:]
    assert torch.equal(batched, alone)
    with lynx_hf.patched(model, policy="lynx"):
        out = _generate(model, ids, mask, max_new_tokens=8, eos_token_id=ids[0, -1].item(), pad_token_id=0)
    assert out.sequences.shape[0] == 4


def test_lynx_reduces_unique_experts_at_batch_16():
    """On a batch of 16 decode tokens LYNX touches fewer distinct experts than the model's own routing."""
    ratios = {}
    for family in FAMILIES:
        model = tm.build(family)
        ids, mask = tm.prompts(16, 6)
        with lynx_hf.patched(model, policy="lynx"):
            _generate(model, ids, mask, max_new_tokens=6)
            s = lynx_hf.stats(model).summary()
        ratios[family] = (s["unique_experts_before"], s["unique_experts_after"])
        print(f"{family}: unique experts/layer/step {s['unique_experts_before']:.2f} -> {s['unique_experts_after']:.2f}"
              f" (mass kept {s['routing_mass_kept']:.3f})")
    assert all(after <= before for before, after in ratios.values())
    assert any(after < before for before, after in ratios.values())
