"""Serving-shaped batches: every way transformers runs decode is seen token by token.

- one test per cache type (dynamic, static, sliding, quantized, offloaded, hybrid, paged): every decode
  forward is counted (against a count of the backbone's forwards taken by the test itself) and policy
  ``none`` is bit-identical to the unpatched model (sequences and scores);
- continuous batching (``generate_batch`` on fixture A, 16 requests of mixed lengths): decode tokens
  counted exactly, unique experts among decode tokens down >= 40 % with the default, prefill tokens'
  routing bit-identical to unpatched (router outputs captured per forward in both runs), policy none
  identical end to end; a prompt split so that its last chunk is one token stays prefill;
- verification forwards (prompt lookup, assisted decoding with a draft model) are decode work without
  ``q_max``; finished rows neither vote nor count; threads (CASES C18), PEFT (C21) and wrappers.

Ground truth never comes from lynx_hf: forwards are counted by the test's own hooks, prompt/decode tokens
of a continuous-batching forward from the positions and the test's own prompts.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

import lynx_hf
from helpers import families as fam
from lynx_hf import detection as lstep
from lynx_hf.config import LynxConfig
from lynx_hf.eval import FIXTURES_DIR

# policy_on_every_step (tests/conftest.py): each cache type / serving path is checked token by token against the
# policy's remap; on tiny models and fixture A the cost gate (the default) keeps the policy off at many step sizes
# (the default gate on these paths: test_decode_default_gate.py)
pytestmark = pytest.mark.usefixtures("policy_on_every_step")


FIXTURE_A = FIXTURES_DIR / "qwen2moe-tiny"
FIXTURE_B = FIXTURES_DIR / "mixtral-tiny"


def load(path=FIXTURE_A):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def summary(model) -> dict:
    return lynx_hf.stats(model).summary()


class ForwardLog:
    """The backbone's forwards as the test sees them: query length, and for a continuous-batching forward its
    segments (``cu_seq_lens_q``), positions, tokens and the request id of each segment (read from the
    manager the test captured, for identity only)."""

    def __init__(self, backbone: torch.nn.Module, managers=None) -> None:
        self.forwards: list[dict] = []
        self.managers = managers
        self.handle = backbone.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs["inputs_embeds"]
        entry = {"batch": int(x.shape[0]), "q": int(x.shape[1])}
        if "cu_seq_lens_q" in kwargs:
            entry["cu_q"] = kwargs["cu_seq_lens_q"].tolist()
            entry["positions"] = kwargs["position_ids"][0].tolist()
            entry["tokens"] = kwargs["input_ids"][0].tolist()
            if self.managers:
                io = self.managers[-1].batch_processor.inputs_and_outputs
                entry["requests"] = [f.state.request_id for f in io.requests_in_batch]
        self.forwards.append(entry)

    def close(self):
        self.handle.remove()


def _greedy(model, ids, mask, new_tokens, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, **kw)


def _assert_same_generation(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a, b)


# -- 1. every cache type ----------------------------------------------------------------------------------------
def _sliding_qwen2_moe():
    # window 4 < prompt 6 + 6 new tokens: the window is full during decode (the sliding layer's own length stops
    # growing at the window while get_seq_length keeps counting); layer 0 full attention, layers 1-2 sliding
    return fam.build("qwen2_moe", use_sliding_window=True, sliding_window=4, max_window_layers=1)


def _hybrid_qwen3_next():
    """Qwen3-Next: layer 0 is linear attention (gated DeltaNet: conv + recurrent state, no KV), layer 1 full
    attention; every layer is a sparse MoE block. The cache's layer 0 holds no sequence length."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=fam.VOCAB, hidden_size=32, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                          intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] > 1:
                p.mul_(20.0)
    return model


CACHE_CASES = {
    "dynamic": (lambda: fam.build("qwen2_moe"), {}),
    "static": (lambda: fam.build("qwen2_moe"), dict(cache_implementation="static")),
    "sliding_dynamic": (_sliding_qwen2_moe, {}),
    "sliding_static": (_sliding_qwen2_moe, dict(cache_implementation="static")),
    # transformers' QuantizedCache with its built-in fp8 backend (the quanto / hqq backends need packages that
    # are not installed here; every backend stores its length the same way: cumulative_length, an int)
    "quantized_fp8": (lambda: fam.build("qwen2_moe"), dict(cache_implementation="quantized",
                                                         cache_config={"backend": "fp8"})),
    "offloaded": (lambda: fam.build("qwen2_moe"), dict(cache_implementation="offloaded")),
    "hybrid_linear_first": (_hybrid_qwen3_next, {}),
}


class _NoopStream:
    """Stand-in for the CUDA streams transformers' offloaded cache synchronizes on (``Cache.update`` calls
    ``torch.cuda.default_stream`` unconditionally, so ``cache_implementation="offloaded"`` needs CUDA)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_every_decode_step_is_seen_and_policy_none_is_bit_identical(case, one_thread, monkeypatch):
    build, gen_kw = CACHE_CASES[case]
    if gen_kw.get("cache_implementation") == "offloaded" and not torch.cuda.is_available():
        # on CPU the stream objects become no-ops; the cache's own offload / prefetch of every layer still runs
        # (moves to "cpu" and back to the layer's device) and its lengths come from the offloaded layers
        monkeypatch.setattr(torch.cuda, "default_stream", lambda *a, **k: _NoopStream())
        monkeypatch.setattr(torch, "Stream", _NoopStream)
    model = build()
    batch, prompt, new = 8, 6, 6
    ids, mask = fam.prompts(batch, prompt)
    try:
        ref = _greedy(model, ids, mask, new, **gen_kw)
    except ValueError as exc:  # unpatched: this transformers lacks the cache kind, before lynx_hf is involved
        if "Unknown quantization backend" not in str(exc):
            raise
        pytest.xfail(f"transformers {transformers.__version__} has no {gen_kw.get('cache_config')} QuantizedCache "
                     f"backend (unpatched generate raises: {exc}); the main venv's 5.24 has it")
    with lynx_hf.patched(model, policy="none"):
        log = ForwardLog(lynx_hf.patcher._state(model).backbone)
        out = _greedy(model, ids, mask, new, **gen_kw)
        log.close()
        seen = summary(model)
    _assert_same_generation(out, ref)
    # hand count: `new` tokens = 1 prefill forward (q = prompt) + new - 1 decode forwards of one token per row
    assert [f["q"] for f in log.forwards] == [prompt] + [1] * (new - 1)
    assert seen["decode_steps"] == new - 1
    assert seen["decode_tokens"] == batch * (new - 1)
    assert seen["verify_tokens"] == 0 and seen["prefill_tokens_in_mixed_steps"] == 0
    with lynx_hf.patched(model, policy="lynx"):
        lynx = _greedy(model, ids, mask, new, **gen_kw)
        acted = summary(model)
    assert acted["decode_steps"] == new - 1
    assert acted["remapped_fraction"] > 0  # the decode steps were remapped, not only counted
    assert torch.equal(lynx.scores[0], ref.scores[0])  # the first token comes from prefill: untouched


def test_cache_length_reads_the_first_attention_layer_of_a_hybrid_cache():
    """``cache_length`` on caches whose layer 0 holds no attention KV: transformers' own resolution, and a
    cache that cannot resolve it itself (raises for layer 0) read at its first attention layer."""
    from transformers import DynamicCache

    model = _hybrid_qwen3_next()
    cache = DynamicCache(config=model.config)
    assert cache.is_linear[:2] == [True, False]
    assert lstep.cache_length(cache) == 0
    model(input_ids=torch.tensor([[5, 6, 7]]), **fam.cache_kw(model, cache), use_cache=True)
    assert lstep.cache_length(cache) == 3

    class OldHybrid:  # layer 0 linear and get_seq_length(0) refuses, as some remote-code hybrid caches do
        is_linear = [True, True, False]
        is_dummy = [False, False, False]

        def get_seq_length(self, layer_idx=0):
            if layer_idx < 2:
                raise ValueError("linear layer has no sequence length")
            return 11

    assert lstep.cache_length(OldHybrid()) == 11
    assert lstep.cache_length(((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)),)) == 4  # legacy tuples
    assert lstep.cache_length(object()) is None


def test_static_cache_outside_generate_is_classified_on_the_device():
    """A manual decode loop with a StaticCache: the length is a device tensor; the decode mask is computed from
    it (no host read): the prefill forward decodes nothing, the next one-token forward decodes every row."""
    from transformers import StaticCache

    model = fam.build("qwen2_moe")
    ids = fam.prompts(4, 5, left_pad=False)[0]
    cache = StaticCache(config=model.config, max_cache_len=16)
    with lynx_hf.patched(model, policy="lynx"):
        out = model(input_ids=ids, **fam.cache_kw(model, cache), use_cache=True)
        assert summary(model)["decode_steps"] == 0
        assert summary(model)["prefill_tokens_in_mixed_steps"] == 0  # a prefill forward is not a mixed step
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=nxt, **fam.cache_kw(model, cache), use_cache=True, position_ids=torch.full((4, 1), 5))
        seen = summary(model)
    assert seen["decode_steps"] == 1 and seen["decode_tokens"] == 4


# -- 2. continuous batching --------------------------------------------------------------------------------------
class RouterLog:
    """Every router output of every MoE block, per forward, in call order (hooks added after patching see the
    remapped routing)."""

    def __init__(self, model) -> None:
        self.calls: dict[str, list] = {}
        self.handles = []
        for name, module in model.named_modules():
            if type(module).__name__ == "Qwen2MoeTopKRouter":
                self.calls[name] = []
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args, output):
            logits, weights, idx = output
            self.calls[name].append((logits.detach().clone(), weights.detach().clone(), idx.detach().clone()))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _cb_prompts(count=16, seed=0):
    """Token ids of ``count`` prompts of lengths 3, 5, 7, ... from the fixture's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (3 + 2 * i,), generator=g).tolist() for i in range(count)]


def _run_cb(model, prompts, new_tokens, eos=-1, **cb_kw):
    """``generate_batch`` as a user calls it; records the backbone's forwards (with each segment's request id,
    from the manager captured through the model class's ``init_continuous_batching``) and every router output."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    cb = ContinuousBatchingConfig(**{"num_blocks": 64, "max_batch_tokens": 512, **cb_kw})  # small static buffers: fast on CPU
    state = lynx_hf.patcher._find_state(model)
    backbone = state.backbone if state is not None else model.model
    managers = []
    cls = type(model)
    original = cls.init_continuous_batching

    def recording(self, *args, **kwargs):
        managers.append(original(self, *args, **kwargs))
        return managers[-1]

    log, routers = ForwardLog(backbone, managers), RouterLog(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "init_continuous_batching", recording)
        try:
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
        finally:
            log.close()
            routers.close()
    assert len(out) == len(prompts) and managers, "continuous batching lost requests"
    return out, log, routers


def _truth(log, prompts):
    """Per forward: ``[T]`` bool, True for decode tokens: a token at or after the end of its request's prompt
    (position >= len(prompt), with the test's own prompts; request ``req_i`` is ``prompts[i]``)."""
    masks = []
    for f in log.forwards:
        decode = [False] * len(f["tokens"])
        for request, start, end in zip(f["requests"], f["cu_q"][:-1], f["cu_q"][1:]):
            length = len(prompts[int(request.split("_")[1])])
            for t in range(start, end):
                decode[t] = f["positions"][t] >= length
        masks.append(torch.tensor(decode))
    return masks


@pytest.fixture(scope="module")
def cb_runs():
    """Fixture A, 16 requests of lengths 3..33 (288 prompt tokens), 8 new tokens each, EOS disabled (every
    request runs to the end, so the scheduler makes the same forwards in every run).

    ``chunked``: a token budget of 64 per forward: prompts are chunked and share forwards with other requests'
    decode tokens (mixed steps): unpatched, policy none, default LYNX. ``default``: a budget of 512: every
    prompt is prefilled in the first forward, then 16 requests decode together: unpatched, default LYNX."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load()
    prompts = _cb_prompts()
    runs = {}
    for budget, policies in (("chunked", ("none", "lynx")), ("default", ("lynx",))):
        tokens = 64 if budget == "chunked" else 512
        runs[budget] = {"unpatched": _run_cb(model, prompts, 8, max_batch_tokens=tokens)}
        for policy in policies:
            raw = RouterLog(model)  # added before patching: sees each router's own output, before the remap
            with lynx_hf.patched(model, policy=policy):
                runs[budget][policy] = (*_run_cb(model, prompts, 8, max_batch_tokens=tokens), summary(model), raw)
            raw.close()
    torch.set_num_threads(threads)
    return prompts, runs


def test_continuous_batching_policy_none_is_identical_end_to_end(cb_runs):
    prompts, runs = cb_runs
    out, log, routers = runs["chunked"]["unpatched"]
    out_n, log_n, routers_n, seen, _ = runs["chunked"]["none"]
    assert {k: v.generated_tokens for k, v in out_n.items()} == {k: v.generated_tokens for k, v in out.items()}
    assert [f["cu_q"] for f in log_n.forwards] == [f["cu_q"] for f in log.forwards]
    for name, calls in routers.calls.items():
        assert len(routers_n.calls[name]) == len(calls)
        for (l, w, i), (ln, wn, in_) in zip(calls, routers_n.calls[name]):
            assert torch.equal(l, ln) and torch.equal(w, wn) and torch.equal(i, in_)
    truth = _truth(log, prompts)
    mixed = [m for m in truth if m.any() and not m.all()]
    assert mixed, "no forward mixed prefill and decode tokens: the case is not exercised"
    assert seen["decode_tokens"] == sum(int(m.sum()) for m in truth) == 16 * (8 - 1)
    assert seen["decode_steps"] == sum(bool(m.any()) for m in truth)
    assert seen["prefill_tokens_in_mixed_steps"] == sum(int((~m).sum()) for m in mixed) > 0


@pytest.mark.parametrize("budget", ["chunked", "default"])
def test_continuous_batching_lynx_keeps_prefill_routing_and_remaps_decode(cb_runs, budget):
    """Prefill tokens keep their routing: in every layer the remap leaves their router output rows bit-identical
    (raw router output vs what the block uses, same run). Against the unpatched run: identical experts and
    weights up to fp32 rounding; bit-identical where the step has no decode token, and in the first MoE layer
    (same inputs). In a mixed step, deeper layers see last-ulp differences (measured <= 1e-6): the experts of
    layer l run as grouped matmuls over all the step's tokens, and the decode tokens moved between experts,
    which changes the groups' sizes and so the floating-point blocking of the prefill tokens' rows."""
    prompts, runs = cb_runs
    out, log, routers = runs[budget]["unpatched"]
    out_l, log_l, routers_l, seen, raw = runs[budget]["lynx"]
    # EOS disabled and prompt lengths fixed: the scheduler makes the same forwards whatever tokens are generated
    assert [f["cu_q"] for f in log_l.forwards] == [f["cu_q"] for f in log.forwards]
    assert [f["positions"] for f in log_l.forwards] == [f["positions"] for f in log.forwards]
    truth = _truth(log, prompts)
    assert seen["decode_tokens"] == 16 * (8 - 1)
    assert seen["decode_steps"] == sum(bool(m.any()) for m in truth)
    changed = 0
    first = next(iter(routers.calls))
    for name, calls in routers.calls.items():
        for forward, ((l, w, i), (ll, wl, il), (lr, wr, ir)) in enumerate(zip(calls, routers_l.calls[name],
                                                                               raw.calls[name])):
            prefill = ~truth[forward]
            # the remap never touches a prefill row (same run: the router's own output vs the routing used)
            assert torch.equal(ll[prefill], lr[prefill]) and torch.equal(il[prefill], ir[prefill])
            assert torch.equal(wl[prefill], wr[prefill]), (name, forward)
            # against the unpatched run
            assert torch.equal(i[prefill], il[prefill]), (name, forward)
            if name == first or prefill.all():
                assert torch.equal(l[prefill], ll[prefill]) and torch.equal(w[prefill], wl[prefill]), (name, forward)
            else:
                torch.testing.assert_close(ll[prefill], l[prefill], rtol=0, atol=1e-5)
                torch.testing.assert_close(wl[prefill], w[prefill], rtol=0, atol=1e-5)
            changed += int((ir[~prefill].sort(-1).values != il[~prefill].sort(-1).values).any(-1).sum())
    assert changed > 0  # decode tokens were remapped


def test_continuous_batching_16_requests_cut_unique_experts_by_40_percent(cb_runs):
    """The bar, on the default engine shape (prompts prefilled together, then 16 requests decoding):
    unique experts per layer among decode tokens down >= 40 % with the default LynxConfig."""
    seen = cb_runs[1]["default"]["lynx"][3]
    assert seen["decode_steps"] == 8 - 1
    assert seen["ratio"] <= 0.60, seen


def test_one_token_last_prefill_chunk_is_prefill(one_thread):
    """A prompt longer than the batch token budget is split; a last chunk of one token has q_len 1 and a KV
    history, like a decode token. The scheduler's request states tell them apart: it stays prefill."""
    model = load()
    prompts = [list(range(10, 19))]  # 9 tokens, budget 8 -> chunks of 8 and 1
    with lynx_hf.patched(model, policy="lynx"):
        out, log, _ = _run_cb(model, prompts, 4, max_batch_tokens=8)
        seen = summary(model)
    assert [f["cu_q"] for f in log.forwards][:2] == [[0, 8], [0, 1]]  # the split really happened
    assert log.forwards[1]["positions"] == [8]  # the last prompt token, with 8 tokens of KV history
    assert _truth(log, prompts)[1].tolist() == [False]
    assert seen["decode_tokens"] == 4 - 1  # not 4: the one-token chunk is not counted as decode
    assert seen["decode_steps"] == 4 - 1


def test_device_rule_alone_would_count_a_one_token_chunk_as_decode():
    """The documented limit of the forward-only rule (used when no request states are available): a request
    with q_len 1 and k_len 9 looks like decode; with the request states it is prefill."""
    cfg = LynxConfig()
    kwargs = {"input_ids": torch.tensor([[7, 8, 9]]), "cu_seq_lens_q": torch.tensor([0, 1, 3]),
              "cu_seq_lens_k": {"full_attention": torch.tensor([0, 9, 11])}, "position_ids": torch.tensor([[8, 0, 1]])}
    device_rule = lstep.detect_step((), kwargs, cfg, None)
    assert device_rule.decode.tolist() == [True, False, False]

    class State:
        def __init__(self, prompt, offset):
            self.initial_tokens, self.position_offset = list(range(prompt)), offset

    class Future:
        def __init__(self, q, state):
            self.query_length, self.state = q, state

    last_chunk = [Future(1, State(prompt=9, offset=9)), Future(2, State(prompt=2, offset=2))]
    assert lstep.detect_step((), kwargs, cfg, None, last_chunk).kind == "prefill"  # no decode token at all
    decoding = [Future(1, State(prompt=8, offset=9)), Future(2, State(prompt=2, offset=2))]
    step = lstep.detect_step((), kwargs, cfg, None, decoding)
    assert step.decode.tolist() == [True, False, False] and step.live.tolist() == [True, True, True]
    all_decode = [Future(1, State(prompt=8, offset=9)), Future(1, State(prompt=3, offset=5))]
    two = {**kwargs, "input_ids": torch.tensor([[7, 8]]), "cu_seq_lens_q": torch.tensor([0, 1, 2])}
    assert lstep.detect_step((), two, cfg, None, all_decode) == lstep.Step("decode")  # pure decode, no mask
    # static-shape padding: tokens after the last request are not live and never decode
    padded = {**kwargs, "input_ids": torch.tensor([[7, 8, 9, 0]]), "cu_seq_lens_q": torch.tensor([0, 1, 3, 3])}
    step = lstep.detect_step((), padded, cfg, None, decoding)
    assert step.live.tolist() == [True, True, True, False] and step.decode.tolist() == [True, False, False, False]
    step = lstep.detect_step((), {**padded, "cu_seq_lens_k": {"full_attention": torch.tensor([0, 9, 11, 11])}},
                             cfg, None)
    assert step.live.tolist() == [True, True, True, False] and step.decode.tolist() == [True, False, False, False]


def test_continuous_batching_finished_requests_leave_and_are_not_counted(one_thread):
    """With EOS on, requests finish at different steps and leave the batch: the decode tokens counted are exactly
    the tokens the live requests fed (each request: generated tokens - 1)."""
    model = load()
    prompts = _cb_prompts(8, seed=3)
    with lynx_hf.patched(model, policy="lynx"):
        out, log, _ = _run_cb(model, prompts, 12, eos=[int(t) for t in range(0, 4096, 7)])
        seen = summary(model)
    lengths = [len(r.generated_tokens) for r in out.values()]
    assert min(lengths) < 12 <= max(lengths), lengths  # some finished early: the case is exercised
    assert seen["decode_tokens"] == sum(n - 1 for n in lengths)
    assert seen["finished_row_tokens"] == 0


def test_generate_with_paged_cache_implementation(one_thread):
    """``generate(cache_implementation="paged")`` (transformers switches to continuous batching): decode seen,
    policy none identical."""
    model = load()
    ids = torch.tensor([p[:5] for p in _cb_prompts(5, seed=5)[1:]])  # 4 rows of 5 tokens, no padding
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0, cache_implementation="paged",
              continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512))
    ref = model.generate(ids, **kw)
    with lynx_hf.patched(model, policy="none"):
        out = model.generate(ids, **kw)
        seen = summary(model)
    assert torch.equal(out, ref)
    assert seen["decode_tokens"] == 4 * (5 - 1)


# -- 3. verification forwards --------------------------------------------------------------------------------------
def _code_prompt(tok):
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return"
    return tok(text, return_tensors="pt").input_ids


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant_model"])
def test_verify_forwards_are_decode_work_without_q_max(mode, one_thread):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE_A)
    model = load()
    ids = _code_prompt(tok)
    kw = dict(max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True,
              eos_token_id=None, pad_token_id=0)
    if mode == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 4
    else:
        kw["assistant_model"] = load(FIXTURE_B)  # same tokenizer (both fixtures share it)
    ref = model.generate(ids, **kw)
    with lynx_hf.patched(model, policy="none"):
        log = ForwardLog(lynx_hf.patcher._state(model).backbone)
        out = model.generate(ids, **kw)
        log.close()
        seen = summary(model)
    assert torch.equal(out.sequences, ref.sequences)
    qs = [f["q"] for f in log.forwards]
    assert qs[0] >= ids.shape[1]  # first forward: the prompt (with its first candidates)
    later = qs[1:]
    assert any(q > 1 for q in later), qs  # candidates were verified: the case is exercised
    assert seen["decode_steps"] == len(later)  # every forward after the prompt's
    assert seen["decode_tokens"] == sum(later)
    assert seen["verify_tokens"] == sum(q for q in later if q > 1)
    with lynx_hf.patched(model, policy="none", verify=False):
        assert lynx_hf.config_of(model).q_max == 1  # the default: no query length was guessed
        model.generate(ids, **kw)
        off = summary(model)
    assert off["verify_tokens"] == 0 and off["decode_tokens"] == sum(1 for q in later if q == 1)


def test_verify_forward_is_remapped_under_lynx(one_thread):
    """A verification forward of 1 + 4 tokens of one row is a batch of 5 decode tokens: LYNX reduces its unique
    experts (a single-token step would keep its own top-k)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE_A)
    model = load()
    ids = _code_prompt(tok)
    with lynx_hf.patched(model, policy="lynx"):
        model.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4, eos_token_id=None,
                       pad_token_id=0)
        seen = summary(model)
    assert seen["verify_tokens"] > 0
    assert seen["unique_experts_after"] < seen["unique_experts_before"]


# -- 4. finished rows ------------------------------------------------------------------------------------------------
def test_finished_row_does_not_vote_and_is_not_counted(one_thread):
    """B = 2, same prompt length (no padding). Row 1's first generated token is made the EOS, so row 1 finishes
    after one token and then feeds EOS / pad. Row 0's routing under LYNX must equal its routing alone (B = 1) at
    every decode step; the control (row 1 not finished: EOS suppressed) shows that a voting neighbour does
    change row 0's experts, so the comparison can fail."""
    model = load()
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(5, 4000, (2, 9), generator=g)
    new = 8
    free = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    eos = int(free[1, 0])

    def routed(batch, **gen_kw):
        with lynx_hf.patched(model, policy="lynx"):
            routers = RouterLog(model)
            out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                 **gen_kw)
            routers.close()
            seen = summary(model)
        # decode forwards only (call 0 is the prefill); row 0 of each [B, k] routing, as a set
        experts = {name: [calls[c][2][0].sort().values for c in range(1, len(calls))]
                   for name, calls in routers.calls.items()}
        return out, experts, seen

    alone, alone_experts, alone_seen = routed(ids[:1], eos_token_id=eos)
    pair, pair_experts, pair_seen = routed(ids, eos_token_id=eos)
    _, control_experts, _ = routed(ids, min_new_tokens=new)
    assert pair.sequences[1, ids.shape[1]] == eos  # row 1 finished after its first token
    assert len(alone.scores) == len(pair.scores) > 2  # row 0 kept decoding
    assert torch.equal(pair.sequences[0], alone.sequences[0])
    for name in alone_experts:
        assert len(alone_experts[name]) == len(pair_experts[name])
        for a, b in zip(alone_experts[name], pair_experts[name]):
            assert torch.equal(a, b), name
    for a, b in zip(alone.scores, pair.scores):
        torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)  # batched matmul: last-bit differences only
    differs = any(not torch.equal(a, b) for name in alone_experts
                  for a, b in zip(alone_experts[name], control_experts[name]))
    assert differs, "control: a voting neighbour must change row 0's critical set, else the test proves nothing"
    # telemetry: row 1 fed a token at every decode step, none counted as a decode token
    steps = len(pair.scores) - 1
    assert pair_seen["decode_tokens"] == alone_seen["decode_tokens"] == steps
    assert pair_seen["finished_row_tokens"] == steps and alone_seen["finished_row_tokens"] == 0
    assert pair_seen["unique_experts_before"] == alone_seen["unique_experts_before"]


def test_live_rows_follow_generates_unfinished_sequences():
    """Hand-worked: EOS = 2. A row that fed EOS stays finished even when it later feeds other tokens (pad)."""
    gen = lstep.Generation(model_state=None, prompt_length=3, eos_ids=(2,), verify=False)
    steps = [[5, 2, 7], [2, 0, 9], [0, 0, 2], [0, 0, 0]]
    live = [lstep._live_rows(gen, torch.tensor([[t] for t in row])).tolist() for row in steps]
    assert live == [[True, False, True], [False, False, True], [False, False, False], [False, False, False]]
    assert lstep._live_rows(lstep.Generation(None, 3, (), False), torch.tensor([[2]])) is None  # no EOS: all live


# -- 5. threads and wrappers -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["none", "lynx"])
def test_C18_two_threads_generate_on_one_patched_model(policy, one_thread):
    model = load()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(5, 4000, (4, 7), generator=g) for _ in range(2)]
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with lynx_hf.patched(model, policy=policy):
        single = [model.generate(b, attention_mask=torch.ones_like(b), **kw) for b in batches]
        results, errors = [None, None], []
        barrier = threading.Barrier(2)

        def work(i):
            try:
                barrier.wait()
                for _ in range(2):  # two rounds so the threads' steps interleave
                    results[i] = model.generate(batches[i], attention_mask=torch.ones_like(batches[i]), **kw)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for got, want in zip(results, single):
        assert torch.equal(got, want)
    if policy == "none":
        ref = [model.generate(b, attention_mask=torch.ones_like(b), **kw) for b in batches]
        assert all(torch.equal(a, b) for a, b in zip(single, ref))


def _module_snapshot(model):
    return {name: (type(m), sorted(m.__dict__), {k: len(getattr(m, k)) for k in
                   ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                    "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")})
            for name, m in model.named_modules()}


def test_C21_patch_peft_model_sees_and_remaps_decode(one_thread):
    peft = pytest.importorskip("peft")
    model = load()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(model, lora).eval()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 4000, (16, 6), generator=g)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
              do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ref = pm.generate(**kw)
    before_modules, before_state = _module_snapshot(pm), {k: v.clone() for k, v in pm.state_dict().items()}
    lynx_hf.patch(pm, policy="none")
    _assert_same_generation(pm.generate(**kw), ref)
    assert summary(pm)["decode_steps"] == 5
    lynx_hf.patch(pm, policy="lynx")
    pm.generate(**kw)
    seen = summary(pm)
    assert seen["decode_steps"] == 5 and seen["decode_tokens"] == 16 * 5
    assert seen["remapped_fraction"] > 0 and seen["ratio"] < 1
    lynx_hf.unpatch(pm)
    assert _module_snapshot(pm) == before_modules
    after = pm.state_dict()
    assert after.keys() == before_state.keys() and all(torch.equal(after[k], before_state[k]) for k in after)
    _assert_same_generation(pm.generate(**kw), ref)


def test_generic_wrapper_holding_the_model_patches_the_model_that_runs(one_thread):
    class Holder(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def generate(self, *args, **kwargs):
            return self.lm.generate(*args, **kwargs)

    model = load()
    holder = Holder(model)
    ids = fam.prompts(8, 6, left_pad=False)[0] + 10
    ref = _greedy(model, ids, torch.ones_like(ids), 5, pad_token_id=0)
    before = _module_snapshot(holder)
    lynx_hf.patch(holder, policy="none")
    _assert_same_generation(_greedy(holder, ids, torch.ones_like(ids), 5, pad_token_id=0), ref)
    assert summary(holder)["decode_steps"] == 4 and summary(holder)["decode_tokens"] == 8 * 4
    lynx_hf.unpatch(holder)
    assert _module_snapshot(holder) == before
