"""Family matrix: every MoE family the installed transformers ships, built tiny, patched or refused.

Enumerated from transformers itself (``CONFIG_MAPPING_NAMES``, not a hand list): every model type whose config
(or, for a multimodal family, whose ``text_config``) has more than one expert (``num_experts``,
``n_routed_experts``, ``num_local_experts``, ...) or declares such a field / an MoE switch with a dense default
(dots.llm1, Hunyuan-V1-MoE, Gemma-4), built as its causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; a multimodal
family's text causal LM, not its ``...ForConditionalGeneration``), else as its text decoder. One model class is one
implementation (``sarvam_moe`` builds a ``Glm4MoeForCausalLM``: counted once). Encoder-decoders (Switch, NLLB-MoE),
encoder-only models (mapped to encoder heads and no generation head: the OpenAI privacy filter) and types without
a decoder class are listed as not decoders and not counted (docs/families.md "Census").

Each implementation is built tiny from its config class (:func:`tiny_config`: 2 layers, hidden 32, 8 experts,
top-2, 2 groups where the family groups; random weights, routers scaled x20 for realistic confidence, every
selection bias (``e_score_correction_bias``, ``expert_bias``) set to randn x 0.1 as in real checkpoints), then
(:func:`check`) either

- **patches**: policy ``none`` bit-identical to unpatched (greedy ``generate`` scores, or a manual decode loop's
  hidden states for a text decoder), ``unpatch`` clean (state-dict keys, hooks, instance attributes, outputs),
  and LYNX (the paper's rule without consensus: ``mass_price=None, tau=1000``) reduces the unique experts per
  decode step in ``generate`` and in a manual decode loop; or
- **refuses** with a typed :class:`lynx_hf.LynxError` and an untouched model.

Usage::

    python -m lab.family_matrix                   # writes docs/families-matrix.md
    python -m lab.family_matrix --out FILE.md
    python -m lab.family_matrix --only glm4_moe minimax_m2

``tests/families/test_family_matrix.py`` runs :func:`check` on every implementation.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
import warnings
from dataclasses import dataclass, field

import torch

#: config fields whose value > 1 marks an MoE config
MOE_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_routed_experts",
              "n_experts")
#: boolean config fields that turn a family's MoE block on (default off: Gemma-4)
MOE_SWITCHES = ("enable_moe_block",)
#: transformers' auto mappings of text-generation heads / of encoder-only heads (:func:`_encoder_only`)
GENERATION_HEADS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES")
ENCODER_HEADS = ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                 "MODEL_FOR_MASKED_LM_MAPPING_NAMES")
#: selection-bias tensors set non-zero after building (as trained checkpoints have them)
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")
VOCAB = 96
#: the tiny sizes (passed to the config class; fields it does not know are dropped)
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=128,
    num_experts=8, n_routed_experts=8, num_local_experts=8, moe_num_experts=8, num_routed_experts=8, n_experts=8,
    num_experts_per_tok=2, moe_topk=2, moe_k=2, top_k=2, n_group=2, topk_group=1, n_shared_experts=1,
    num_shared_experts=1, first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], num_dense_layers=0,
    first_k_dense=0, moe_layer_freq=1, moe_layer_start_index=0,
    shared_expert_intermediate_size=16, moe_shared_expert_intermediate_size=16,
    kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, qk_head_dim=16,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_n_heads=8, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
    expert_layer_offset=0, full_attention_interval=2, mamba_d_head=8, mamba_head_dim=8, ssm_state_size=8, mamba_d_state=8, n_groups=1,
    expand=2, conv_kernel=4, mamba_d_conv=4, chunk_size=16, sliding_window=64,
    linear_head_dim=8, linear_num_heads=4, ffn_hidden_size=32, expert_ffn_hidden_size=16, zero_expert_num=2,
    unpadded_vocab_size=VOCAB, enable_moe_block=True, top_k_experts=2,  # Inkling2's LM head width (default 200058: generate would pick ids past the embedding)
)
#: tiny-config values a family needs beyond :data:`TINY` (model type -> fields): per-layer kinds its config class
#: does not derive, a switch that turns its MoE on
OVERRIDES = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "doge": dict(is_moe=True),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "mistral4": dict(qk_rope_head_dim=8, qk_nope_head_dim=8, head_dim=16),
    "glm5_next": dict(qk_rope_head_dim=0, qk_nope_head_dim=16),
    "qwen4_exp": dict(indexer_budget=16, indexer_compress_ratio=4, indexer_n_heads=2, indexer_kv_heads=1,
                      indexer_head_dim=8),
    "ernie4_5_vl_moe": dict(head_dim=128),  # its 3-d rotary sections need the full head size
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),
    "longcat_flash": dict(num_layers=1),  # its depth field (each layer holds two attention + MLP sublayers)
    # sliding-attention layers use twice the key/value heads: with 4 query heads, 4 KV heads gave 8 there and
    # num_key_value_groups 4 // 8 = 0 (no keys at all)
    "mimo_v2_flash": dict(num_key_value_heads=2),
    # its NVFP4 key/value rounding needs head_dim % 16 == 0; its indexer at most the query heads per key head (5.25)
    "kolibri1_1": dict(head_dim=16, index_num_heads=1),
}
_ROUTER_WEIGHTS = ("gate.weight", "router.weight", "gate.wg.weight", "router.gate.weight", "router.proj.weight")
# the paper's rule without consensus: S = cover set grown to k (remaps on tiny batches); the cost gate forced on (a
# check that the remap runs must not depend on this machine's timing)
REMAP = dict(policy="lynx", mass_price=None, tau=1000.0, gate="always")


@dataclass
class Case:
    """One implementation: ``model_type`` (its first model type), the config class, the model class to build,
    ``text``: built as a multimodal family's text decoder; ``aliases``: other model types building it."""

    model_type: str
    config_cls: type
    model_cls: type | None
    text: bool = False
    aliases: list = field(default_factory=list)
    why_not: str = ""  # set when the family is not a decoder lynx_hf could patch (encoder-decoder, encoder)


@dataclass
class Row:
    """The outcome for one :class:`Case`: ``status`` ``"dedicated"`` / ``"generic"`` / ``"refused"`` /
    ``"not built"`` / ``"not a decoder"`` / ``"FAILED"`` (a check did not hold), ``reason`` in words."""

    case: Case
    status: str
    reason: str = ""
    blocks: tuple = ()
    seconds: float = 0.0
    failures: list = field(default_factory=list)


def _get(config, name):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute (heterogeneous configs) refuses global access
        return "per-layer"


def _is_moe(config) -> bool:
    """An MoE config: an expert count > 1 (or per layer), or a class that declares an expert count / MoE switch
    whose default is dense (dots.llm1: ``n_routed_experts=None``, Hunyuan-V1-MoE: ``num_experts=1``, Gemma-4:
    ``enable_moe_block=False``): the family ships an MoE implementation either way."""
    for name in MOE_FIELDS:
        value = _get(config, name)
        if (isinstance(value, int) and not isinstance(value, bool) and value > 1) or value == "per-layer" \
                or isinstance(value, list):
            return True
    try:
        declared = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    except Exception:  # noqa: BLE001 - a config that cannot serialise itself declares nothing readable
        return False
    return bool(declared & {*MOE_FIELDS, *MOE_SWITCHES})


def _encoder_only(*model_types) -> bool:
    """Transformers maps these model types to encoder heads (token / sequence classification, masked LM) and to
    no generation head (causal LM, image-text-to-text, multimodal LM, seq2seq): an encoder, not text generation
    (OpenAI privacy filter: a bidirectional MoE token classifier)."""
    from transformers.models.auto import modeling_auto as ma

    def mapped(names):
        return any(t in getattr(ma, n, {}) for n in names for t in model_types if t)

    return mapped(ENCODER_HEADS) and not mapped(GENERATION_HEADS)


def case_of(model_type: str) -> Case | None:
    """The :class:`Case` of one model type (``None``: not an MoE config, or one that cannot be built with its
    defaults)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def model_class(name):
        return getattr(transformers, name, None) if isinstance(name, str) else None

    with _quiet():
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that cannot be built with defaults is not enumerable
            return None
        text_config = _get(config, "text_config")
        if _is_moe(config):
            target, text = config, False
        elif text_config is not None and text_config != "per-layer" and _is_moe(text_config):
            target, text = text_config, True
        else:
            return None
        model_cls = model_class(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type))
        if text and model_cls is not None and getattr(model_cls, "config_class", None) not in (None, type(target)):
            model_cls = None  # the multimodal model (Gemma-4's ...ForConditionalGeneration): its text model instead
        if model_cls is None and text:
            model_cls = model_class(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(target, "model_type", None)))
        if model_cls is None and not getattr(config, "is_encoder_decoder", False):
            model_cls = _text_decoder(type(target))
    if _encoder_only(model_type, getattr(target, "model_type", None)):
        return Case(model_type, type(target), None, text, why_not="encoder-only (token / sequence classification "
                    "heads, no text-generation head): not text generation, nothing to decode")
    if model_cls is None:
        why = "encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "no causal LM or text decoder"
        return Case(model_type, type(target), None, text, why_not=why)
    return Case(model_type, type(target), model_cls, text)


def discover() -> list[Case]:
    """Every MoE decoder implementation of the installed transformers, one :class:`Case` per model class (the
    model types building the same class are its ``aliases``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    by_class: dict = {}
    cases = []
    for model_type in CONFIG_MAPPING_NAMES:
        case = case_of(model_type)
        if case is None:
            continue
        if case.model_cls is not None and case.model_cls in by_class:
            by_class[case.model_cls].aliases.append(model_type)
            continue
        if case.model_cls is not None:
            by_class[case.model_cls] = case
        cases.append(case)
    return cases


def _text_decoder(config_cls):
    """The decoder class of ``config_cls`` in its modeling module: a ``...ForCausalLM``, else a ``...TextModel``,
    else a ``...Model`` that is no vision / audio / encoder part (``None`` if there is none)."""
    import importlib
    import inspect

    from transformers import PreTrainedModel

    try:
        module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = [obj for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, PreTrainedModel)
             and getattr(obj, "config_class", None) is config_cls]
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        for obj in found:
            name = obj.__name__
            if name.endswith(suffix) and not any(w in name for w in ("Vision", "Audio", "Encoder", "Talker",
                                                                       "Pretrained", "PreTrained")):
                return obj
    return None


@contextlib.contextmanager
def _quiet():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def tiny_config(config_cls, **extra):
    """A tiny config of ``config_cls``: :data:`TINY` (and ``extra``) where the class knows the field; per-layer
    type lists are rebuilt for the tiny depth with one layer of each of the first two kinds the class uses (so a
    hybrid model keeps an attention layer) and every MLP sparse."""
    mrope = extra.pop("mrope", None)
    keep_types = extra.pop("keep_types", False)
    default = config_cls()
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    kwargs = {k: v for k, v in {**TINY, **extra}.items() if k in known}
    for name, value in list(kwargs.items()):  # per-layer lists (ERNIE-4.5-VL's moe_intermediate_size)
        current = _get(default, name)
        if isinstance(current, list) and current and not isinstance(value, list):
            kwargs[name] = [value] * len(current)
    for name in ("layer_types", "mlp_layer_types"):
        if name in known and not keep_types:
            kwargs[name] = None
    if mrope is not None and isinstance(_get(default, "rope_parameters"), dict):
        kwargs["rope_parameters"] = _scaled_mrope(dict(default.rope_parameters), mrope)
    model_type = str(getattr(config_cls, "model_type", ""))
    kwargs.update(OVERRIDES.get(model_type) or OVERRIDES.get(model_type.removesuffix("_text"), {}))
    kinds = list(dict.fromkeys(_get(default, "layer_types") or []))
    if keep_types and kinds and "layer_types" in known:  # a class that does not derive them: one of each kind
        attention = [k for k in kinds if "attention" in k and "linear" not in k] or kinds[-1:]
        other = [k for k in kinds if k != attention[0]] or attention
        kwargs["layer_types"] = [other[0], attention[0]][:TINY["num_hidden_layers"]]
    try:
        config = config_cls(**kwargs)
    except Exception:  # noqa: BLE001 - retry without the per-layer list reset
        for name in ("layer_types", "mlp_layer_types"):
            kwargs.pop(name, None)
        config = config_cls(**kwargs)
    layers = config.num_hidden_layers
    if isinstance(_get(config, "layer_types"), list) and len(kinds) > 1 and "layer_types" in vars(config):
        attention = [k for k in kinds if "attention" in k and "linear" not in k] or kinds[1:]
        other = [k for k in kinds if k != attention[0]]
        config.layer_types = ([other[0]] + [attention[0]] * (layers - 1))[:layers]
    mlp_kinds = list(dict.fromkeys(_get(default, "mlp_layer_types") or []))
    sparse = [k for k in mlp_kinds if "sparse" in k or "moe" in k.lower()]
    if sparse and isinstance(_get(config, "mlp_layer_types"), list):
        config.mlp_layer_types = [sparse[0]] * layers
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = _get(config, name)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, TINY[name])
    if mrope is not None and isinstance(_get(config, "rope_parameters"), dict):
        config.rope_parameters = _scaled_mrope(dict(config.rope_parameters), mrope)
    return config


def _scaled_mrope(rope: dict, need: int) -> dict:
    """``rope`` with its ``mrope_section`` (transformers' default ``[8, 12, 12]`` when absent) rescaled to sum to
    ``need`` (the rotary half-size the model checks)."""
    section = rope.get("mrope_section") or [8, 12, 12]
    total = sum(section)
    new = [max(1, round(x * need / total)) for x in section]
    new[-1] += need - sum(new)
    return {**rope, "mrope_section": new}


def build(case: Case, seed: int = 0):
    """The tiny model of ``case`` in eval mode (routers x20, selection biases randn x 0.1)."""
    import re

    extra = {}
    for _ in range(3):  # a config validator may name the one value it accepts
        torch.manual_seed(seed)
        try:
            with _quiet():
                config = tiny_config(case.config_cls, **dict(extra))
                model = case.model_cls._from_config(config, dtype=torch.float32)
                with torch.no_grad():
                    model(input_ids=_prompts(1, 3))
            break
        except Exception as exc:  # noqa: BLE001
            text = str(exc)
            if "num_experts_per_tok=1" in text and "num_experts_per_tok" not in extra:
                extra["num_experts_per_tok"] = 1
                continue
            match = re.search(r"split_sizes to sum exactly to (\d+)", text)
            if match and "mrope" not in extra:
                extra["mrope"] = int(match.group(1))
                continue
            if "mrope_section" in text and "qk_rope_head_dim // 2" in text and "mrope" not in extra:
                extra["mrope"] = TINY["qk_rope_head_dim"] // 2
                continue
            if "keep_types" not in extra:  # a model that needs the class's own per-layer type lists
                extra["keep_types"] = True
                continue
            raise
    model = model.float().eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_ROUTER_WEIGHTS) and p.dim() == 2 and p.shape[0] > 1:
                if not bool(p.any()):  # a router some families initialise to zero (AFMoE): random, as trained
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                p.mul_(20.0)
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.rsplit(".", 1)[-1] in BIAS_NAMES:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return model


def _prompts(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def _generate(model, ids):
    with _quiet():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)


def _out(result):
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return result[0]


def _manual_loop(model, ids, steps: int = 3):
    """Prefill, then ``steps`` decode steps feeding fixed tokens with the cache: the outputs of every forward."""
    import inspect

    # transformers >= 5.24 names the cache argument ``cache`` (``past_key_values`` warns); older ones do not
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    outs = []
    with _quiet(), torch.no_grad():
        result = model(input_ids=ids, use_cache=True)
        outs.append(_out(result))
        cache = result.past_key_values
        for step in range(steps):
            nxt = _prompts(ids.shape[0], 1, seed=100 + step)
            result = model(input_ids=nxt, **{name: cache}, use_cache=True)
            cache = result.past_key_values
            outs.append(_out(result))
    return outs


def _snapshot(model):
    return (list(model.state_dict()), {n: (len(m._forward_hooks), len(m._forward_pre_hooks), set(vars(m)))
                                       for n, m in model.named_modules()})


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def check(case: Case) -> Row:
    """Build ``case`` tiny and run the matrix checks (see the module docstring); never raises."""
    import lynx_hf

    start = time.perf_counter()
    if case.model_cls is None:
        return Row(case, "not a decoder", case.why_not)
    try:
        model = build(case)
    except Exception as exc:  # noqa: BLE001 - reported as a row
        return Row(case, "not built", f"{type(exc).__name__}: {str(exc)[:200]}", seconds=time.perf_counter() - start)
    generates = hasattr(model, "generate") and getattr(model, "can_generate", lambda: False)()
    ids = _prompts(8, 4)
    failures = []
    try:
        ref_loop = _manual_loop(model, ids)
        ref_gen = _generate(model, ids) if generates else None
    except Exception as exc:  # noqa: BLE001
        return Row(case, "not built", f"the unpatched model does not run: {type(exc).__name__}: {str(exc)[:200]}",
                   seconds=time.perf_counter() - start)
    before = _snapshot(model)
    try:
        with _quiet():
            lynx_hf.patch(model, policy="none")
    except lynx_hf.LynxError as exc:
        if lynx_hf.is_patched(model) or _snapshot(model) != before or not _same(_manual_loop(model, ids), ref_loop):
            failures.append("refused but the model was changed")
        return Row(case, "FAILED" if failures else "refused", f"{type(exc).__name__}: {exc}", failures=failures,
                   seconds=time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - an untyped error is a failure of the matrix
        return Row(case, "FAILED", f"untyped {type(exc).__name__}: {exc}", failures=["untyped error"],
                   seconds=time.perf_counter() - start)
    state = model.__dict__.get("_lynx_state") or next(
        (m.__dict__["_lynx_state"] for m in model.modules() if "_lynx_state" in m.__dict__), None)
    kinds = sorted({b.spec.family for b in state.blocks})
    blocks = tuple(sorted({type(b.block).__name__ for b in state.blocks}))
    status = "generic" if kinds == ["generic"] else "dedicated"
    rules = sorted({_rule_text(b) for b in state.blocks})
    try:
        if not _same(_manual_loop(model, ids), ref_loop):
            failures.append("policy none changed a manual decode loop")
        if generates:
            got = _generate(model, ids)
            if not (torch.equal(got.sequences, ref_gen.sequences) and _same(got.scores, ref_gen.scores)):
                failures.append("policy none changed generate")
        with _quiet():
            lynx_hf.patch(model, **REMAP)
        for where, run in (("generate", (lambda: _generate(model, ids)) if generates else None),
                           ("manual decode loop", lambda: _manual_loop(model, ids))):
            if run is None:
                continue
            lynx_hf.reset_stats(model)
            run()
            summary = lynx_hf.stats(model).summary()
            if not summary["decode_steps"] or not summary["unique_experts_after"] < summary["unique_experts_before"]:
                failures.append(f"LYNX did not reduce unique experts in {where} ({summary['unique_experts_before']}"
                                f" -> {summary['unique_experts_after']}, {summary['decode_steps']} decode steps)")
        lynx_hf.unpatch(model)
        if _snapshot(model) != before or not _same(_manual_loop(model, ids), ref_loop):
            failures.append("unpatch did not restore the model")
    except Exception as exc:  # noqa: BLE001
        failures.append(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            lynx_hf.unpatch(model)
    return Row(case, "FAILED" if failures else status, "; ".join(rules), blocks, time.perf_counter() - start,
               failures)


def _rule_text(block) -> str:
    rule = block.rule
    text = f"{rule.kind}" + (", renormalised" if rule.renormalize else "") + \
        (f" (sum + {rule.renorm_eps:g})" if rule.renorm_eps else "") + \
        (f", x{rule.scale:g}" if rule.scale != 1.0 else "")
    if block.selection is not None:
        text = f"{block.selection.describe()}; weights {text}"
    return text


def run(only=None) -> list[Row]:
    cases = discover()
    if only:
        cases = [c for c in cases if c.model_type in only or set(c.aliases) & set(only)]
    with contextlib.redirect_stderr(io.StringIO()):
        return [check(case) for case in cases]


def table(rows: list[Row]) -> str:
    """The markdown report: headline counts, then one line per implementation."""
    import transformers

    impl = [r for r in rows if r.status not in ("not a decoder",)]
    patched = [r for r in impl if r.status in ("dedicated", "generic")]
    count = {s: sum(r.status == s for r in rows) for s in ("dedicated", "generic", "refused", "not built", "FAILED",
                                                          "not a decoder")}
    lines = [
        "# Family matrix (generated)",
        "",
        f"Generated by `python -m lab.family_matrix` on transformers {transformers.__version__}; the same "
        "checks run in `tests/families/test_family_matrix.py`. Every MoE family transformers ships, built tiny "
        "(2 layers, hidden 32, 8 experts, top-2, selection biases randn x 0.1): **patched** means policy `none` "
        "bit-identical, `unpatch` clean and LYNX reducing unique experts in `generate` and a manual decode loop; "
        "**refused** means a typed error and an untouched model.",
        "",
        f"**{len(patched)} of {len(impl)} implementations patched** ({count['dedicated']} dedicated, "
        f"{count['generic']} generic), {count['refused']} refused, {count['not built']} not built tiny, "
        f"{count['FAILED']} failing a check; {count['not a decoder']} MoE model types are not decoders.",
        "",
        "| family (model types) | model class | result | blocks | rule / reason |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        names = ", ".join([r.case.model_type, *r.case.aliases])
        cls = r.case.model_cls.__name__ if r.case.model_cls else "—"
        reason = (r.reason + ("; FAILED: " + "; ".join(r.failures) if r.failures else "")).replace("|", "/")
        reason = reason.replace("\n", " ")
        if len(reason) > 400:
            reason = reason[:400] + "…"
        lines.append(f"| {names} | `{cls}` | {r.status} | {', '.join(f'`{b}`' for b in r.blocks)} | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from . import ROOT

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="markdown file (default: docs/families-matrix.md of the checkout)")
    parser.add_argument("--only", nargs="*", default=None, help="model types to run")
    args = parser.parse_args(argv)
    rows = run(args.only)
    text = table(rows)
    out = args.out or (ROOT / "docs" / "families-matrix.md" if not args.only else None)
    if out is None:
        print(text)
    else:
        with open(out, "w") as f:
            f.write(text)
        print(text.split("\n\n")[2])
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
