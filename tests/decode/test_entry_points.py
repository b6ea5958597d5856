"""Every entry point remaps as specified or says why not (CASES C28-C31, C33).

Each input is compared with the equivalent call: a model sharing its config object with a patched one (C28)
against the first model and the unpatched model; accelerate's regional compilation in both orders (C29)
against eager LYNX; a partial ``generation_config`` (C30) and ``eos_token_id=None`` (C31) against the
equivalent keyword call; and the no-decode self-check (C33) where decode detection is deliberately broken,
silent where it is not."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import lynx_hf
from helpers import families as fam
from lynx_hf import detection
from lynx_hf.errors import LynxNoDecodeWarning, UnsupportedModelError

# policy_on_every_step (tests/conftest.py): each entry point must remap as the equivalent call does (C28-C31, C33),
# which needs the policy on every decode step; the cost gate (the default) keeps it off at many step sizes of these
# tiny models
pytestmark = pytest.mark.usefixtures("policy_on_every_step")


NEW = 4


def _generate(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kw)


def _same_run(a, b, atol=0.0):
    """Same tokens and the same scores (bit-identical unless ``atol``: a traced graph may round differently)."""
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores)
    for x, y in zip(a.scores, b.scores):
        assert torch.equal(x, y) if not atol else torch.allclose(x, y, rtol=0.0, atol=atol)


def _telemetry(model):
    summary = lynx_hf.stats(model).summary()
    return {k: v for k, v in summary.items() if k != "per_layer"}


# -- C28: config objects shared between models ------------------------------------------------------------
def test_C28_model_from_a_patched_models_config_patches_and_matches_the_first():
    ids, mask = fam.prompts(6, 5)
    first = fam.build("qwen2_moe")
    plain = _generate(first, ids, mask)
    implementation = first.config._experts_implementation
    lynx_hf.patch(first)
    want = _generate(first, ids, mask)
    want_stats = _telemetry(first)

    second = AutoModelForCausalLM.from_config(first.config).eval()  # shares the config, which says "lynx"
    assert second.config is first.config
    second.load_state_dict(first.state_dict())
    _same_run(_generate(second, ids, mask), plain)  # unpatched: its own experts implementation, not "lynx"

    lynx_hf.patch(second)  # used to record "lynx" as its original implementation: RecursionError
    got = _generate(second, ids, mask)
    _same_run(got, want)
    assert _telemetry(second) == want_stats
    assert want_stats["unique_experts_after"] < want_stats["unique_experts_before"]

    lynx_hf.unpatch(first)  # the second model still needs "lynx" on the shared config
    lynx_hf.reset_stats(second)
    _same_run(_generate(second, ids, mask), want)
    _same_run(_generate(first, ids, mask), plain)
    lynx_hf.unpatch(second)
    assert first.config._experts_implementation == implementation
    _same_run(_generate(second, ids, mask), plain)


@pytest.fixture
def spy_implementation():
    """An experts implementation ``"spy"`` (transformers' ``grouped_mm``, recording which modules ran it)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    seen = []

    def spy(module, *args, **kwargs):
        seen.append(module)
        return grouped_mm_experts_forward(module, *args, **kwargs)

    ALL_EXPERTS_FUNCTIONS._global_mapping["spy"] = spy
    yield seen
    del ALL_EXPERTS_FUNCTIONS._global_mapping["spy"]


def test_C28_unpatched_sibling_sharing_the_config_keeps_its_own_implementation(spy_implementation):
    ids, mask = fam.prompts(6, 5)
    patched = fam.build("mixtral")
    sibling = type(patched)(patched.config).eval()  # two models built from one config object
    sibling.load_state_dict(patched.state_dict())
    patched.config._experts_implementation = "spy"
    plain = _generate(sibling, ids, mask)

    lynx_hf.patch(patched, policy="lynx")
    spy_implementation.clear()
    _same_run(_generate(sibling, ids, mask), plain)
    experts = {id(m) for m in sibling.modules() if type(m).__name__.endswith("Experts")}
    assert experts and {id(m) for m in spy_implementation} == experts  # the sibling ran "spy", every step
    assert not lynx_hf.is_patched(sibling)

    spy_implementation.clear()
    remapped = _generate(patched, ids, mask)
    assert {id(m) for m in spy_implementation} & {id(m) for m in patched.modules()}  # its prefill too
    stats = _telemetry(patched)
    assert stats["decode_steps"] == NEW - 1 and stats["unique_experts_after"] < stats["unique_experts_before"]
    assert not torch.equal(torch.stack(remapped.scores), torch.stack(plain.scores))
    lynx_hf.unpatch(patched)
    assert patched.config._experts_implementation == "spy"
    _same_run(_generate(patched, ids, mask), plain)


def _tiny_vlm():
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=fam.VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=256,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16, deepstack_visual_indexes=[])
    vlm = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in vlm.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(20.0)
    return vlm


def test_C28_text_model_built_from_a_patched_vlms_text_config():
    from transformers import DynamicCache, Qwen3VLMoeTextModel

    vlm = _tiny_vlm()
    ids, mask = fam.prompts(6, 5, left_pad=False)
    text = Qwen3VLMoeTextModel(vlm.config.text_config).eval()
    text.load_state_dict(vlm.model.language_model.state_dict())

    def decode(model):
        with torch.no_grad():
            out = model(input_ids=ids, **fam.cache_kw(model, DynamicCache(config=model.config)), use_cache=True)
            step = model(input_ids=ids[:, -1:], **fam.cache_kw(model, fam.cache_of(out)), use_cache=True)
        return out.last_hidden_state, step.last_hidden_state

    plain = decode(text)
    implementation = text.config._experts_implementation
    lynx_hf.patch(vlm)
    assert text.config is vlm.config.text_config and text.config._experts_implementation == "lynx"
    assert all(torch.equal(a, b) for a, b in zip(decode(text), plain))  # the unpatched text model: its own
    lynx_hf.patch(text)  # no RecursionError
    prefill, step = decode(text)
    assert torch.equal(prefill, plain[0])  # prefill bit-identical
    stats = _telemetry(text)
    assert stats["decode_steps"] == 1 and stats["unique_experts_after"] < stats["unique_experts_before"]
    assert not torch.equal(step, plain[1])
    lynx_hf.unpatch(vlm)
    lynx_hf.unpatch(text)
    assert text.config._experts_implementation == implementation
    assert all(torch.equal(a, b) for a, b in zip(decode(text), plain))


# -- C29: accelerate's regional compilation, either order ---------------------------------------------------
class CountingBackend:
    """A ``torch.compile`` backend that runs the traced graph as is and counts graphs and calls."""

    def __init__(self):
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return graph.forward(*args)

        return run


@pytest.mark.parametrize("order", ["patch_then_compile_regions", "compile_regions_then_patch"])
def test_C29_compiled_regions_run_and_remap_like_eager_lynx(order):
    from accelerate.utils import compile_regions

    ids, mask = fam.prompts(6, 5)
    eager = fam.build("mixtral")
    lynx_hf.patch(eager)
    want = _generate(eager, ids, mask)
    want_stats = _telemetry(eager)

    model = fam.build("mixtral")
    backend = CountingBackend()
    torch._dynamo.reset()
    # every call of a region must run a compiled graph (no silent eager fallback at the recompile limit)
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        if order == "patch_then_compile_regions":
            lynx_hf.patch(model)
            compiled = compile_regions(model, backend=backend)
        else:
            compiled = compile_regions(model, backend=backend)
            lynx_hf.patch(compiled)
        assert compiled is not model
        got = _generate(compiled, ids, mask)
    layers = model.config.num_hidden_layers
    assert backend.graphs > 0 and backend.calls >= NEW * layers  # the compiled layers ran in every forward
    _same_run(got, want, atol=1e-5)
    stats = _telemetry(compiled)
    for key in ("policy", "telemetry"):  # the strings; the rest are numbers
        assert stats.pop(key) == want_stats.pop(key)
    assert stats == pytest.approx(want_stats, rel=1e-6)  # counts exact; routing mass summed in another order
    assert stats["decode_steps"] == NEW - 1 and stats["unique_experts_after"] < stats["unique_experts_before"]
    lynx_hf.unpatch(compiled)
    assert not lynx_hf.is_patched(compiled) and not lynx_hf.is_patched(model)
    torch._dynamo.reset()


# -- C30 / C31: generation settings as generate resolves them ------------------------------------------------
def _model_whose_eos_a_row_emits(ids, mask):
    """A tiny model whose ``generation_config.eos_token_id`` is a token one row generates early (so that EOS
    stops that row), and a token no row generates."""
    model = fam.build("qwen2_moe")
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    new = free[:, ids.shape[1]:]
    model.generation_config.eos_token_id = int(new[0, 1])
    never = max(t for t in range(3, fam.VOCAB) if not (free == t).any())
    return model, int(new[0, 1]), never


def test_C30_partial_generation_config_reads_the_models_eos_like_the_keyword_call():
    ids, mask = fam.prompts(6, 5)
    model, eos, _ = _model_whose_eos_a_row_emits(ids, mask)
    lynx_hf.patch(model)
    keyword = _generate(model, ids, mask, max_new_tokens=6)
    keyword_stats = _telemetry(model)
    assert keyword_stats["finished_row_tokens"] > 0  # the model's EOS stopped a row
    lynx_hf.reset_stats(model)
    config = GenerationConfig(max_new_tokens=6, do_sample=False)  # no EOS field: generate fills it from the model
    passed = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_scores=True,
                            return_dict_in_generate=True)
    _same_run(passed, keyword)
    assert _telemetry(model) == keyword_stats
    lynx_hf.reset_stats(model)
    positional = model.generate(ids, config, attention_mask=mask, output_scores=True, return_dict_in_generate=True)
    _same_run(positional, keyword)
    assert _telemetry(model) == keyword_stats


def test_C31_eos_none_keeps_rows_that_emit_the_models_eos_live():
    ids, mask = fam.prompts(6, 5)
    model, eos, never = _model_whose_eos_a_row_emits(ids, mask)
    lynx_hf.patch(model)
    off = _generate(model, ids, mask, max_new_tokens=6, eos_token_id=None)
    off_stats = _telemetry(model)
    assert (off.sequences[:, ids.shape[1]:] == eos).any()  # a row emitted the model's EOS and went on
    lynx_hf.reset_stats(model)
    equivalent = _generate(model, ids, mask, max_new_tokens=6, eos_token_id=never)
    _same_run(off, equivalent)
    assert _telemetry(model) == off_stats
    assert off_stats["finished_row_tokens"] == 0


# -- C33: the no-decode self-check ---------------------------------------------------------------------------
def test_C33_unreadable_cache_length_warns_once_with_counts(monkeypatch):
    ids, mask = fam.prompts(6, 5)
    model = fam.build("mixtral")
    lynx_hf.patch(model)
    monkeypatch.setattr(detection, "cache_length", lambda cache: None)  # detection cannot read any cache
    with pytest.warns(LynxNoDecodeWarning, match="could not be read") as record:
        _generate(model, ids, mask)
        _generate(model, ids, mask)
    assert len([w for w in record if issubclass(w.category, LynxNoDecodeWarning)]) == 1  # once
    stats = _telemetry(model)
    assert stats["decode_steps"] == 0 and stats["decode_forwards"] == 0
    assert stats["backbone_forwards"] == 2 * NEW and stats["unclassified_forwards"] == 2 * (NEW - 1)


def test_C33_cache_reading_empty_warns_outside_generate_and_not_under_policy_none(monkeypatch):
    from transformers import DynamicCache

    ids, mask = fam.prompts(6, 5)
    model = fam.build("mixtral")

    def decode_loop():
        out = model(input_ids=ids, attention_mask=mask, **fam.cache_kw(model, DynamicCache(config=model.config)),
                    use_cache=True)
        step_mask = mask
        for _ in range(3):
            step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
            out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=step_mask,
                        **fam.cache_kw(model, fam.cache_of(out)), use_cache=True)

    monkeypatch.setattr(detection, "cache_length", lambda cache: 0)
    lynx_hf.patch(model, policy="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LynxNoDecodeWarning)
        decode_loop()  # policy none does not remap: nothing to warn about
    assert _telemetry(model)["unclassified_forwards"] == 3
    lynx_hf.patch(model, policy="lynx")
    with pytest.warns(LynxNoDecodeWarning, match="reads 0"):
        decode_loop()


def test_C33_backbone_never_called_warns_at_the_first_forward():
    ids, mask = fam.prompts(6, 5)
    model = fam.build("mixtral")
    lynx_hf.patch(model)
    state = lynx_hf.patcher._state(model)
    state.tracker.detach(state.backbone)  # the backbone's forward no longer reaches the detector
    with pytest.warns(LynxNoDecodeWarning, match="without the decoder backbone"):
        _generate(model, ids, mask, max_new_tokens=1)
    assert _telemetry(model)["unclassified_forwards"] == 1
    state.tracker.attach(state.backbone)
    lynx_hf.unpatch(model)


def test_C33_blocks_under_a_container_that_is_never_called_are_refused_at_patch_time():
    both = torch.nn.ModuleList([fam.build("mixtral"), fam.build("mixtral", seed=1)])
    with pytest.raises(UnsupportedModelError, match="never called"):
        lynx_hf.patch(both)
    assert not lynx_hf.is_patched(both)
    assert all(not hook for m in both.modules() for hook in (m._forward_hooks, m._forward_pre_hooks))


@pytest.mark.parametrize("part", ["decoder_layer", "moe_block"])
def test_C33_a_lone_block_or_decoder_layer_is_refused_unless_decode_is_forced(part):
    """A decoder layer (or its MoE block) patched on its own: the detection hook would sit on the block, whose
    forward never receives the KV cache, so every step would read as prefill (a silent no-op)."""
    model = fam.build("mixtral")
    module = model.model.layers[0] if part == "decoder_layer" else model.model.layers[0].mlp
    with pytest.raises(UnsupportedModelError, match="single MoE block"):
        lynx_hf.patch(module)
    assert not lynx_hf.is_patched(module)
    assert all(not hook for m in model.modules() for hook in (m._forward_hooks, m._forward_pre_hooks))
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = block(hidden)
        lynx_hf.patch(module, phase="decode")  # decode emulation needs no cache: accepted
        block(hidden)
        assert lynx_hf.stats(module).summary()["decode_steps"] == 1
        lynx_hf.unpatch(module)
        assert torch.equal(block(hidden), ref) and not lynx_hf.is_patched(module)


@pytest.mark.parametrize("prompt_length", [1, 5])
def test_C33_silent_where_decode_is_detected(prompt_length):
    ids, mask = fam.prompts(6, prompt_length, left_pad=prompt_length > 1)
    model = fam.build("mixtral")
    lynx_hf.patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LynxNoDecodeWarning)
        _generate(model, ids, mask)
    stats = _telemetry(model)
    assert stats["decode_forwards"] == stats["decode_steps"] == NEW - 1
    assert stats["backbone_forwards"] == NEW
    assert stats["unclassified_forwards"] == 0  # a one-token prompt is known to be the prompt inside generate


def test_cache_length_reads_the_first_layer_holding_keys():
    """A cache whose layer 0 is empty while a later layer holds keys (MiniMax keeps its linear-attention states
    beside ``layers``): ``get_seq_length()`` reads 0, the length is the later layer's; an empty cache reads 0."""
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.zeros(2, 1, 5, 4)
    cache.update(keys, keys, layer_idx=1)
    assert cache.get_seq_length() == 0
    assert detection.cache_length(cache) == 5
    assert detection.cache_length(DynamicCache()) == 0


# -- a VLM wrapper decodes as its text class (docs/cases.md C45) ----------------------------------------------------
NO_CONSENSUS = dict(policy="lynx", gate="always", mass_price=None, tau=1000.0)


def _minimax_m3_pair():
    """MiniMax-M3-VL's text causal LM (tiny, ``lab.family_matrix``) and its ``...ForConditionalGeneration`` holding
    the same weights (the vision tower and projector unused by text-only generate)."""
    from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as cm
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    from lab import family_matrix as fm

    text = fm.build(fm.case_of("minimax_m3_vl"))
    vision = cm.MiniMaxM3VLVisionConfig(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4)
    vlm = mm.MiniMaxM3SparseForConditionalGeneration(
        cm.MiniMaxM3VLConfig(text_config=text.config.to_dict(), vision_config=vision.to_dict())).eval()
    weights = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in text.state_dict().items()}
    _, unexpected = vlm.load_state_dict(weights, strict=False)
    assert not unexpected
    return text, vlm


def _finished_aware_run(model, ids, eos):
    with lynx_hf.patched(model, **NO_CONSENSUS):
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=eos,
                             output_scores=True, return_dict_in_generate=True)
        return out, lynx_hf.stats(model).summary()


def _live_tokens(sequences, prompt: int, eos) -> int:
    """Decode tokens of live rows, counted from the sequences: a row stops voting once it fed a stop token."""
    count = 0
    for row in sequences.tolist():
        for t in range(prompt + 1, len(row)):  # the forward feeding token t - 1 (the first decode step feeds prompt)
            if row[t - 1] in eos:
                break
            count += 1
    return count


def test_C45_vlm_wrapper_decodes_as_its_text_class_finished_rows_included():
    """CASES C45: a VLM's ``...ForConditionalGeneration`` passes its text backbone ``inputs_embeds``, so the stop
    tokens rows fed were invisible and finished rows kept voting under LYNX (scores ~0.5 away from the text class on
    this pair). The generating model's forward now records the ids for the backbone's step (``detection``): the
    wrapper gives the text class's sequences and scores, and counts only live rows' decode tokens."""
    pytest.importorskip("transformers.models.minimax_m3_vl")
    text, vlm = _minimax_m3_pair()
    ids = torch.randint(3, 100, (8, 4), generator=torch.Generator().manual_seed(0))
    plain = text.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(plain, vlm.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    eos = [int(plain[0, 5]), int(plain[3, 4])]  # rows 0 and 3 finish early
    (want, want_stats), (got, got_stats) = _finished_aware_run(text, ids, eos), _finished_aware_run(vlm, ids, eos)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
    live = _live_tokens(want.sequences, ids.shape[1], eos)
    assert live < 8 * 7 and got_stats["decode_tokens"] == want_stats["decode_tokens"] == live
    assert not lynx_hf.is_patched(vlm) and not vlm._forward_pre_hooks  # the ids hook is gone with the patch


def test_C45_qwen3_vl_moe_wrapper_counts_only_live_rows():
    """CASES C45 on Qwen3-VL-MoE (no text causal LM class ships): through the wrapper, rows that fed a stop token
    stop voting, as counted from the generated sequences."""
    vlm = _tiny_vlm()
    ids = torch.randint(3, fam.VOCAB, (6, 5), generator=torch.Generator().manual_seed(1))
    plain = vlm.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    eos = [int(plain[1, 6]), int(plain[4, 5])]
    out, stats = _finished_aware_run(vlm, ids, eos)
    live = _live_tokens(out.sequences, ids.shape[1], eos)
    assert live < 6 * 7 and stats["decode_tokens"] == live


def test_C33_self_check_threshold_two_in_a_row_and_reset_by_a_decode_forward(monkeypatch):
    """Issue 38: the no-decode warning fires at the 2nd unclassified decode-looking forward in a row (not the 3rd),
    and a decode forward in between resets the run: unclassified, decode, unclassified, decode, unclassified is
    silent; one more unclassified warns ("2 forwards in a row"). Forwards outside generate, the cache's length read
    as 0 on the steps chosen to be unclassified."""
    from transformers import DynamicCache

    ids, mask = fam.prompts(6, 5)
    model = fam.build("mixtral")
    lynx_hf.patch(model, policy="lynx")
    real, zero = detection.cache_length, {"on": False}
    monkeypatch.setattr(detection, "cache_length", lambda cache: 0 if zero["on"] else real(cache))
    state = {"out": model(input_ids=ids, attention_mask=mask, use_cache=True,
                          **fam.cache_kw(model, DynamicCache(config=model.config))), "mask": mask}

    def step(unclassified: bool):
        zero["on"] = unclassified
        state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], 1)
        state["out"] = model(input_ids=state["out"].logits[:, -1:].argmax(-1), attention_mask=state["mask"],
                             use_cache=True, **fam.cache_kw(model, fam.cache_of(state["out"])))

    with warnings.catch_warnings():
        warnings.simplefilter("error", LynxNoDecodeWarning)
        for unclassified in (True, False, True, False, True):
            step(unclassified)
    counts = _telemetry(model)
    assert counts["unclassified_forwards"] == 3 and counts["decode_forwards"] == 2
    with pytest.warns(LynxNoDecodeWarning, match="2 forwards in a row"):
        step(True)
    lynx_hf.unpatch(model)
