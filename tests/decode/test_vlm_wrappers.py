"""Every MoE VLM wrapper transformers ships decodes text as its text class does (CASES C45, issue 37).

One parametrized test over the image-text-to-text ``...ForConditionalGeneration`` classes whose text config is an
MoE family (:data:`VLMS`, enumerated from transformers' auto mappings and ``lab.family_matrix``). Each is built tiny
(tiny vision tower from its own vision config, the text model of ``lab.family_matrix.build``) holding the same
language-model weights as its text class. Text-only inputs:

(a) policy ``none`` through the wrapper: greedy ``generate`` bit-identical to the unpatched wrapper;
(b) LYNX with finished rows (two rows hit an EOS early): where a text causal LM ships, sequences, scores and
    ``decode_tokens`` / ``finished_row_tokens`` equal the text class's with the same weights; where none ships (the
    wrapper's LM head has no text twin), live rows' tokens counted from the sequences are the decode tokens and
    finished rows' tokens the rest;
(c) prompt-lookup decoding (verify forwards) through the wrapper: ``verify_tokens`` / ``decode_tokens`` equal the
    text class's (or, without a text class, the q > 1 forwards the backbone got);
(d) continuous batching (``generate_batch``): equal to the text class's (or decode tokens = every generated token
    after the first), or transformers' own refusal for that wrapper recorded (:data:`CB_REFUSED`).

Families ``lynx_hf.patch`` refuses (as their text class is refused, docs/families-matrix.md) are checked for the
typed refusal and an untouched wrapper. What transformers itself fails or refuses is recorded per release
(:data:`UPSTREAM_BROKEN`: an explicit strict ``xfail`` naming the bug, so the release that fixes it fails the test until
the record is updated; :data:`CB_REFUSED`), never skipped by a version test.

A toy wrapper (:class:`ToyWrapper`: a ``GenerationMixin`` holding a ``...ForCausalLM``, the nesting of Llama-4's
wrapper) checks on every release that the outermost generating model is the one patched (issue 47).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
import transformers

import lynx_hf
from helpers import families as fam
from lynx_hf.errors import UnsupportedModelError

#: this transformers' "major.minor" (the records below are keyed by it)
RELEASE = ".".join(transformers.__version__.split(".")[:2])
NO_CONSENSUS = dict(policy="lynx", gate="always", mass_price=None, tau=1000.0)
NEW = 6
#: model type -> how the wrapper is checked: "pair" (a text causal LM ships: compared with it), "alone" (only a text
#: decoder ships: the wrapper's own counts), "refused" (patch refuses the text family: typed error)
VLMS = {
    "aria": "pair", "deepseek_ocr2": "alone", "ernie4_5_vl_moe": "alone", "glm4v_moe": "alone",
    "glm5_next": "alone", "hy_v4_vl": "alone", "llama4": "pair", "minimax_m3_vl": "pair",
    "mistral_large4": "alone", "qwen3_5_moe": "pair", "qwen3_vl_moe": "alone", "qwen4_exp": "pair",
    "unlimited_ocr": "alone", "inkling2": "pair", "inkling2_loop": "pair", "muse_spark": "alone",
    "dots3_note": "pair", "gemma4": "refused", "inkling_mm_model": "refused",
}
#: wrappers whose own text-only ``generate`` transformers breaks, unpatched: model type -> {release: the bug}. The
#: test is an ``xfail(strict=True, raises=AttributeError)`` there, after checking that patching changes nothing about
#: the failure; on other releases the wrapper is checked in full (Llama-4: 5.19 and 5.25 generate)
UPSTREAM_BROKEN = {
    "llama4": {"5.24": "transformers 5.24: Llama4ForConditionalGeneration.forward reads `image_outputs` off its "
                       "language model's MoeCausalLMOutputWithPast on a text-only forward (AttributeError), "
                       "unpatched; fixed in 5.25"},
}
#: wrappers whose ``generate_batch`` transformers itself refuses on text-only requests: model type -> exception type
#: (its paged cache has no layer of that attention kind; raised unpatched as under LYNX, by the text class too). The
#: same on 5.19, 5.24 and 5.25 for the families each ships
CB_REFUSED = {"llama4": "chunked_attention", "qwen3_5_moe": "linear_attention", "qwen4_exp": "linear_attention", "glm5_next": "linear_attention",
              "hy_v4_vl": "indexed_attention", "mistral_large4": "indexed_attention",
              "unlimited_ocr": "reference_sliding_attention", "inkling2": "hybrid_sliding",
              "inkling2_loop": "hybrid_sliding", "dots3_note": "indexed_attention"}
#: vision-config sizes (fields the class does not know are dropped; nested sub-configs shrunk the same way)
VISION = dict(depth=1, num_hidden_layers=1, num_layers=1, hidden_size=16, intermediate_size=16, num_heads=2,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, temporal_patch_size=1,
              spatial_merge_size=1, num_position_embeddings=16, deepstack_visual_indexes=[], projection_dim=16,
              encoder_layers=1, decoder_layers=1, encoder_hidden_size=16, output_channels=16, d_model=16,
              encoder_attention_heads=2, encoder_ffn_dim=16, mlp_dim=16, global_attn_indexes=[0], num_pos_feats=8,
              vision_output_dim=16, embed_dim=16, hidden_dim=16, adapter_in_dim=16, adapter_merge_size=1,
              adapter_input_size=16)
#: families whose text config does not survive ``to_dict`` (Gemma-4's per-layer configs): passed as a copy
TEXT_CONFIG_OBJECT = ("gemma4",)
#: per-family vision fields beyond :data:`VISION` (a validator ties them to the text width or the depth)
VISION_KEEP = {"muse_spark": ("num_hidden_layers", "num_layers", "depth"), "dots3_note": ("num_hidden_layers",),
               "inkling_mm_model": tuple(VISION)}
#: wrappers whose vision tower cannot be built tiny (Inkling's vision config computes layer widths the tiny sizes
#: break; its defaults are GBs): built on the meta device, the language model's weights assigned (refusal check only)
META = ("inkling_mm_model",)
#: per-family sizes beyond :data:`VISION` (sub-config name, or "" for the wrapper's own config -> fields)
EXTRA = {"muse_spark": {"audio_config": dict(hidden_sizes=[8, 8, 8, 8]), "": dict(projector_hidden_size=16)}}


def _shrink(cfg, model_type: str, text_hidden: int):
    d = cfg.to_dict()
    out = {}
    for key, value in d.items():
        try:
            sub = getattr(cfg, key, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute (heterogeneous config) refuses global access
            sub = None
        if hasattr(sub, "to_dict") and not isinstance(sub, type):
            out[key] = _shrink(sub, model_type, text_hidden).to_dict()
        elif key in VISION and key not in VISION_KEEP.get(model_type, ()):
            out[key] = VISION[key]
        elif key in ("text_hidden_size", "out_hidden_size", "adapter_out_dim"):  # the encoder output is scattered onto text embeddings
            out[key] = text_hidden
    try:
        return type(cfg)(**{**d, **out})
    except Exception:  # noqa: BLE001 - a class whose dict does not round-trip: only the tiny fields
        return type(cfg)(**out)


def _wrapper_class(model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto as ma

    name = ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type) or \
        ma.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


def build_pair(model_type: str):
    """``(text, vlm)``: the tiny text class of ``lab.family_matrix`` and the wrapper holding its language-model
    weights (vision tower and projector tiny, unused by text-only generate)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from lab import family_matrix as fm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = fm.build(fm.case_of(model_type))
        default = CONFIG_MAPPING[model_type]()
        kw = {"text_config": text.config.to_dict() if model_type not in TEXT_CONFIG_OBJECT else copy.deepcopy(text.config)}
        for name in getattr(default, "sub_configs", {}):
            sub = getattr(default, name, None)
            if name != "text_config" and hasattr(sub, "to_dict"):
                kw[name] = _shrink(sub, model_type, text.config.hidden_size).to_dict()
        for name, fields in EXTRA.get(model_type, {}).items():
            if name:
                kw[name] = {**kw[name], **fields}
            else:
                kw.update(fields)
        torch.manual_seed(0)
        with torch.device("meta") if model_type in META else contextlib.nullcontext():
            vlm = _wrapper_class(model_type)._from_config(CONFIG_MAPPING[model_type](**kw), dtype=torch.float32)
        vlm.eval()
    inner = text.model if hasattr(text, "lm_head") else text
    prefix = next(n for n, m in vlm.named_modules() if type(m) is type(inner))
    head = next(n for n, m in vlm.named_modules() if m is vlm.get_output_embeddings())
    weights = {}
    for key, value in text.state_dict().items():
        if inner is not text and key.startswith("model."):
            weights[f"{prefix}.{key[len('model.'):]}"] = value
        elif inner is text:
            weights[f"{prefix}.{key}"] = value
        else:
            weights[key.replace("lm_head", head, 1)] = value  # the LM head
    missing, unexpected = vlm.load_state_dict(weights, strict=False, assign=model_type in META)
    assert not unexpected, unexpected
    assert not [k for k in missing if k.startswith(prefix + ".")], missing
    return text, vlm


def _ids(batch: int, length: int, seed: int):
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def _gen(model, ids, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return model.generate(input_ids=ids, do_sample=False, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True, **kw)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def _live_tokens(sequences, prompt: int, eos) -> int:
    count = 0
    for row in sequences.tolist():
        for t in range(prompt + 1, len(row)):
            if row[t - 1] in eos:
                break
            count += 1
    return count


def _counts(model):
    s = lynx_hf.stats(model).summary()
    return {k: s[k] for k in ("decode_tokens", "finished_row_tokens", "verify_tokens", "decode_steps")}


def _lynx(model, fn):
    with lynx_hf.patched(model, **NO_CONSENSUS):
        out = fn()
        return out, _counts(model)


def _cb(model):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [_ids(1, 3 + 2 * i, 20 + i)[0].tolist() for i in range(4)]
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=128)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {k: list(v.generated_tokens) for k, v in out.items()}


def _params():
    """One parameter per wrapper; an explicit strict ``xfail`` naming the bug where :data:`UPSTREAM_BROKEN` records
    transformers breaking it on this release."""
    out = []
    for model_type in sorted(VLMS):
        bug = UPSTREAM_BROKEN.get(model_type, {}).get(RELEASE)
        marks = () if bug is None else pytest.mark.xfail(strict=True, raises=AttributeError, reason=bug)
        out.append(pytest.param(model_type, marks=marks))
    return out


@pytest.mark.parametrize("model_type", _params())
def test_C45_every_moe_vlm_wrapper_decodes_as_its_text_class(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:  # an older transformers (the floor leg): the family is not shipped
        pytest.skip(f"{model_type} is not in this transformers")
    text, vlm = build_pair(model_type)
    ids = _ids(6, 5, 1)
    if VLMS[model_type] == "refused":
        before = {k: v.clone() for k, v in vlm.state_dict().items()}
        with pytest.raises(UnsupportedModelError):  # a LynxError, as the text class's refusal
            lynx_hf.patch(vlm)
        assert not lynx_hf.is_patched(vlm) and not vlm._forward_pre_hooks
        assert all(v.is_meta or torch.equal(v, before[k]) for k, v in vlm.state_dict().items())
        return
    try:  # a family lynx_hf refuses on this release (Aria on 5.19) is refused through the wrapper too
        lynx_hf.unpatch(lynx_hf.patch(text))
    except UnsupportedModelError:
        with pytest.raises(UnsupportedModelError):
            lynx_hf.patch(vlm)
        return
    try:
        plain = _gen(vlm, ids)
    except AttributeError as exc:  # transformers' own failure, unpatched
        if RELEASE in UPSTREAM_BROKEN.get(model_type, {}):  # the recorded bug: patched, the same failure
            for policy in ("none", "lynx"):
                with lynx_hf.patched(vlm, policy=policy, gate="always"), \
                        pytest.raises(AttributeError, match=re.escape(str(exc))):
                    _gen(vlm, ids)
            assert not lynx_hf.is_patched(vlm)
        raise  # the strict xfail where recorded, a failure anywhere else
    pair = VLMS[model_type] == "pair"

    # (a) policy none: bit-identical to the unpatched wrapper
    with lynx_hf.patched(vlm, policy="none"):
        _same(_gen(vlm, ids), plain)
    if pair:
        _same(_gen(text, ids), plain)  # the same weights: the text class generates the same

    # (b) LYNX, two rows finish early
    eos = [int(plain.sequences[0, 6]), int(plain.sequences[3, 7])]
    got, got_n = _lynx(vlm, lambda: _gen(vlm, ids, eos_token_id=eos))
    steps = got.sequences.shape[1] - ids.shape[1] - 1
    live = _live_tokens(got.sequences, ids.shape[1], eos)
    assert live < 6 * steps
    assert got_n["decode_tokens"] == live and got_n["finished_row_tokens"] == 6 * steps - live
    if pair:
        want, want_n = _lynx(text, lambda: _gen(text, ids, eos_token_id=eos))
        _same(got, want)
        assert got_n == want_n

    # (c) prompt lookup: verify forwards through the wrapper
    look = torch.arange(3, 90).roll(7)[None]  # every token a model can pick is in the prompt: candidates each step
    refusal = _lookup_refusal(vlm, look)  # e.g. linear-attention / recurrent layers ("stateful"), read unpatched
    if refusal is not None:  # transformers refuses assisted generation here: the same refusal under LYNX
        for model in (vlm, text) if pair else (vlm,):
            own = _lookup_refusal(model, look)  # its message names the model's class
            assert own is not None and type(own) is type(refusal)
            with lynx_hf.patched(model, **NO_CONSENSUS), pytest.raises(type(own)) as exc:
                _gen(model, look, max_new_tokens=8, eos_token_id=None, prompt_lookup_num_tokens=3)
            assert str(exc.value) == str(own)
    else:
        _check_verify(vlm, text if pair else None, look)
    _check_cb(model_type, vlm, text if pair else None)


def _lookup_refusal(model, look):
    """The error transformers' own prompt-lookup generate raises on the unpatched ``model`` (``ValueError``: e.g.
    models with state), or ``None`` where it runs."""
    try:
        _gen(model, look, max_new_tokens=2, eos_token_id=None, prompt_lookup_num_tokens=3)
    except ValueError as exc:
        return exc
    return None


def _check_verify(vlm, text, look):
    qs = []
    with lynx_hf.patched(vlm, **NO_CONSENSUS):
        back = lynx_hf.patcher._state(vlm).backbone
        handle = back.register_forward_pre_hook(
            lambda m, a, k: qs.append((k.get("inputs_embeds") if k.get("inputs_embeds") is not None
                                       else k.get("input_ids")).shape[1]), with_kwargs=True)
        try:
            vgot = _gen(vlm, look, max_new_tokens=8, eos_token_id=None, prompt_lookup_num_tokens=3)
        finally:
            handle.remove()
        vgot_n = _counts(vlm)
    later = qs[1:]
    assert vgot_n["verify_tokens"] == sum(q for q in later if q > 1) > 0
    assert vgot_n["decode_tokens"] == sum(later)
    if text is not None:
        vwant, vwant_n = _lynx(text, lambda: _gen(text, look, max_new_tokens=8, eos_token_id=None,
                                                  prompt_lookup_num_tokens=3))
        _same(vgot, vwant)
        assert vgot_n == vwant_n


def _check_cb(model_type, vlm, text):
    """(d) continuous batching through the wrapper, or transformers' own refusal of it."""
    try:
        _cb(vlm)
        refused = None
    except ValueError as exc:  # transformers' paged cache has no layer of this kind
        assert "Invalid layer type" in str(exc), exc
        refused = str(exc).rsplit(": ", 1)[-1]
    assert refused == CB_REFUSED.get(model_type)
    if refused is not None:  # transformers' refusal: unpatched and under LYNX, the text class's the same
        match = f"Invalid layer type: {refused}"
        for model in (vlm, text) if text is not None else (vlm,):
            with pytest.raises(ValueError, match=match):
                _cb(model)
            with pytest.raises(ValueError, match=match):
                _lynx(model, lambda: _cb(model))  # noqa: B023 - called at once
        return
    cgot, cgot_n = _lynx(vlm, lambda: _cb(vlm))
    assert cgot_n["decode_tokens"] == sum(len(v) - 1 for v in cgot.values())
    if text is not None:
        cwant, cwant_n = _lynx(text, lambda: _cb(text))
        assert cgot == cwant and cgot_n == cwant_n


# -- a GenerationMixin holding a ...ForCausalLM, on every release (issue 47) --------------------------------------------
class ToyWrapper(transformers.PreTrainedModel, transformers.GenerationMixin):
    """The smallest wrapper nesting two generating models, as Llama-4's ``...ForConditionalGeneration`` holds a
    ``Llama4ForCausalLM``: its forward passes the token ids and everything ``generate`` gives to the causal LM it
    holds (``lm``, sharing its config), whose own ``generate`` is never called. The user calls ``ToyWrapper.generate``,
    so that is the one a patch must watch (the outermost ``GenerationMixin`` above the decoder backbone)."""

    _supports_sdpa = True
    _supports_attention_backend = True

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:  # transformers reads this off the source of the class's module
        return True

    def __init__(self, lm):
        super().__init__(lm.config)
        self.lm = lm

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):  # generate passes logits_to_keep if named here
        return self.lm(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)


def test_C45_a_generation_mixin_holding_a_causal_lm_is_patched_where_generate_is_called():
    """Issue 47: patching :class:`ToyWrapper` watches the wrapper's ``generate`` (the outermost generating model),
    not the inner ``Qwen2MoeForCausalLM``'s, which the wrapper never calls. Expected values worked independently:
    (a) LYNX with two rows finishing early: the sequences and scores equal the inner model's own patched run (the same
    module), and ``decode_tokens`` / ``finished_row_tokens`` are the live / finished rows' tokens counted from the
    sequences (a patch that watched the inner ``generate`` sees no stop tokens: every row's tokens count as live);
    (b) prompt lookup through the wrapper: ``verify_tokens`` equal the inner model's and are > 0 (unwatched: the
    verify forwards are not known as such). Runs on every release (Llama-4's wrapper, the one shipped nesting, is
    broken upstream on 5.24: :data:`UPSTREAM_BROKEN`)."""
    text = fam.build("qwen2_moe")
    wrapper = ToyWrapper(text).eval()
    ids = _ids(6, 5, 1)
    plain = _gen(wrapper, ids)
    _same(plain, _gen(text, ids))  # the wrapper generates as the model it holds
    eos = [int(plain.sequences[1, 6]), int(plain.sequences[4, 5])]  # rows 1 and 4 finish early
    want, want_n = _lynx(text, lambda: _gen(text, ids, eos_token_id=eos))
    got, got_n = _lynx(wrapper, lambda: _gen(wrapper, ids, eos_token_id=eos))
    _same(got, want)
    steps = got.sequences.shape[1] - ids.shape[1] - 1
    live = _live_tokens(got.sequences, ids.shape[1], eos)
    assert 0 < live < 6 * steps
    assert (got_n["decode_tokens"], got_n["finished_row_tokens"]) == (live, 6 * steps - live)
    assert got_n == want_n
    assert not lynx_hf.is_patched(wrapper) and not lynx_hf.is_patched(text)

    look = torch.arange(3, fam.VOCAB).roll(7)[None]  # every token is in the prompt: candidates each step
    vwant, vwant_n = _lynx(text, lambda: _gen(text, look, max_new_tokens=8, eos_token_id=None,
                                              prompt_lookup_num_tokens=3))
    vgot, vgot_n = _lynx(wrapper, lambda: _gen(wrapper, look, max_new_tokens=8, eos_token_id=None,
                                               prompt_lookup_num_tokens=3))
    _same(vgot, vwant)
    assert vgot_n == vwant_n and vgot_n["verify_tokens"] > 0


# -- compiled static-cache generate of a wrapper whose backbone receives embeddings (CASES C61) ----------------------
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "llama4"])
def test_C61_compiled_static_cache_generate_of_a_vlm_wrapper_equals_eager(model_type):
    """CASES C61: the wrapper's text backbone gets ``inputs_embeds``, so in a compiled decode step the stop tokens are
    read from the ids the wrapper's traced forward was given (as the eager step reads them). Two rows finish early
    (their stop tokens taken from the unpatched run). Expected: the eager ``decode_tokens`` are the live rows' tokens
    counted from the sequences, and the compiled static-cache ``generate`` gives the same tokens and the same counts.
    Before: the compiled step had no live mask (Qwen3-VL-MoE: 30 decode tokens compiled where eager counts 17,
    finished 0 vs 13). transformers 5.25 never compiles a Llama-4 model's decode (``get_compiled_call`` returns
    ``__call__`` for it): there the wrapper's call is compiled as ``get_compiled_call`` compiles any other model's."""
    from transformers import CompileConfig

    _, vlm = build_pair(model_type)
    ids = _ids(6, 5, 1)
    gen = dict(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, cache_implementation="static")
    plain = vlm.generate(**gen)
    eos = [int(plain[1, 6]), int(plain[4, 7])]  # rows 1 and 4 (at least) finish early
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless asked
    own, used, forced = vlm.get_compiled_call, [], []

    def compiled_call(cfg):  # what generate runs its decode forwards with (recorded: the compiled path really ran)
        fn = own(cfg)
        if fn == vlm.__call__:  # Llama-4 on transformers 5.25
            if not forced:
                forced.append(torch.compile(vlm.__call__, **cfg.to_dict()))
            fn = forced[0]
        used.append(fn)
        return fn

    vlm.get_compiled_call = compiled_call
    with lynx_hf.patched(vlm, **NO_CONSENSUS):
        eager = vlm.generate(**gen, eos_token_id=eos)
        want = _counts(vlm)
        lynx_hf.reset_stats(vlm)
        torch._dynamo.reset()
        compiled = vlm.generate(**gen, eos_token_id=eos, compile_config=config)
        got = _counts(vlm)
    vlm.__dict__.pop("get_compiled_call", None)
    assert used and all(fn != vlm.__call__ for fn in used)
    steps = NEW - 1
    live = _live_tokens(eager, ids.shape[1], eos)
    assert 0 < live < 6 * steps
    assert (want["decode_tokens"], want["finished_row_tokens"]) == (live, 6 * steps - live)
    assert torch.equal(compiled, eager)
    assert got == want
