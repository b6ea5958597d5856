"""patch / unpatch / patched / is_patched / config_of / stats / reset_stats."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import types
import warnings

import torch

from . import compiled_cpu, facts, flatness, gate, offload, policies
from . import experts as experts_impl
from .block import BlockRouting
from .config import LynxConfig
from .core import reset_stages, stage_report
from .detection import StepTracker, cache_length, generation_scope
from .errors import LynxConfigError, UnsupportedModelError
from .kernels.backend import resolve_backend
from .patches import find_spec, looks_like_moe, supported_families, why_unsupported
from .state import MODEL_ATTR
from .state import find_state as _find_state
from .state import state_of as _state
from .state import unwrap as _unwrap
from .telemetry import LynxStats, mode_of

#: the decode-step features composed into every patched block's plan (``lynx_hf.core.make_plan``'s ``stages``),
#: outermost first; each ``fn(block, config) -> lynx_hf.core.Stage or None`` (``None``: not for this block). A new
#: decode-step feature is one module with such a function, plus one line here.
PLAN_STAGES = (
    flatness.plan_stage,  # router flatness on the first decode steps, warned where the default is unmeasured
    facts.plan_stage,  # the cost gate (lynx_hf.gate; LynxConfig.gate="auto")
    offload.plan_stage,  # resident offloaded experts seed the critical set (lynx_hf.offload)
    compiled_cpu.plan_stage,  # torch.compile on CPU: the eager step as one opaque op (lynx_hf.compiled_cpu)
)


class ModelState:
    """Everything ``patch`` attached to one model; removed whole by ``unpatch``.

    ``backbone``: the module every forward of the model ends in (the step hooks live there);
    ``model``: the module whose ``generate`` runs (its ``generate`` is wrapped; the state lives there).
    """

    #: what each block's plan composes (:data:`PLAN_STAGES`; a class attribute: never pickled)
    plan_stages = PLAN_STAGES

    def __init__(self, config: LynxConfig, backbone: torch.nn.Module, model: torch.nn.Module) -> None:
        self.config = config
        self.backbone = backbone
        self.model = model
        self.tracker = StepTracker(self)
        self.blocks: list[BlockRouting] = []
        # [(config, implementation before "lynx")] while the "lynx" experts implementation is installed
        self.experts_impl_before: list | None = None
        self.gate_note: str | None = None  # the cost gate's patch-time note last warned (lynx_hf.gate.patch_note)
        self.flatness = None  # the router-flatness probe (lynx_hf.flatness.ModelFlatness), made by its plan stage

    def __setstate__(self, state):  # deepcopy / pickle: the copy holds the (copied) configs it switched
        self.__dict__.setdefault("gate_note", None)  # a state pickled before the attribute existed
        self.__dict__.setdefault("flatness", None)
        self.__dict__.update(state)
        experts_impl.adopt(self)


class _BoundMethod(functools.partial):
    """An instance attribute shadowing one of the model's class methods: ``_BoundMethod(func, model)`` calls
    ``func(model, *args, **kwargs)``, ``func`` a module-level function of ``(model, *args, **kwargs)``. Shaped
    both as a bound method (``__self__`` is the model it is installed on, ``__func__`` the function) and as a
    ``functools.partial`` whose first argument is the model, so code that copies a model and rebinds the copy's
    bound methods and partials to the copy gets a method of the copy: accelerate's ``compile_regions`` builds a
    new root this way (``docs/cases.md`` C29; accelerate <= 1.15 rebinds whatever has ``__func__`` / ``__self__``,
    1.16 rebinds ``types.MethodType`` and ``functools.partial`` instances). ``copy.deepcopy`` / ``pickle`` carry
    the model argument to the copy (``partial``'s own reduce); each function finds the :class:`ModelState` on the
    model it runs on."""

    @property
    def __self__(self) -> torch.nn.Module:
        return self.args[0]

    @property
    def __func__(self):
        return self.func


def _installed_func(value):
    """The module-level function behind an installed method ``value`` (a :class:`_BoundMethod`, or the bound
    method / plain ``functools.partial`` a copying tool rebound it to), else ``None``."""
    if isinstance(value, functools.partial):
        return value.func
    return getattr(value, "__func__", None)


def _patched_generate(model, *args, **kwargs):
    """The patched model's ``generate``: records, for the forwards it makes (``lynx_hf.detection``), the prompt
    length (``input_ids`` / ``inputs`` / ``inputs_embeds``, ``shape[1]``), the tokens the caller's
    ``past_key_values`` already holds (read once, here), and the stop tokens that finish a row and whether the
    generation mode verifies candidates, as ``generate`` itself resolves them (:func:`_generation_settings`);
    then calls the class's ``generate`` on ``model`` unchanged."""
    original = type(model).generate.__get__(model)
    state = model.__dict__.get(MODEL_ATTR)
    if state is None:  # a copy that kept the method but not the state
        return original(*args, **kwargs)
    prompt = next((kwargs[name] for name in ("input_ids", "inputs")
                   if isinstance(kwargs.get(name), torch.Tensor)), None)
    if prompt is None and args and isinstance(args[0], torch.Tensor):
        prompt = args[0]
    if prompt is None and isinstance(kwargs.get("inputs_embeds"), torch.Tensor):
        prompt = kwargs["inputs_embeds"]
    if prompt is None or prompt.dim() < 2:
        return original(*args, **kwargs)
    held = 0
    cache = next((kwargs[name] for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None)
    if cache is not None:
        length = cache_length(cache)
        held = int(length) if length is not None else 0  # once per call (a StaticCache: one host read)
    eos_ids, verify = _generation_settings(model, args, kwargs)
    _prepare_telemetry(state)  # before generate may compile the decode step (a static cache on CUDA)
    with generation_scope(state, prompt.shape[1], eos_ids, verify, held):
        return original(*args, **kwargs)


def _patched_init_continuous_batching(model, *args, **kwargs):
    """The patched model's ``init_continuous_batching`` (the entry point of ``generate_batch``,
    ``cache_implementation="paged"`` and ``transformers serve``): the manager it returns is watched by the
    step tracker, whose hook then reads the scheduler's request states to tell a request's last prefill
    chunk from its decode tokens (``lynx_hf.detection``, rule 1)."""
    manager = type(model).init_continuous_batching(model, *args, **kwargs)
    state = model.__dict__.get(MODEL_ATTR)
    if state is not None:
        state.tracker.watch(manager)
    return manager


_MODEL_METHODS = {"generate": _patched_generate, "init_continuous_batching": _patched_init_continuous_batching}


def _install_model_methods(state: ModelState) -> None:
    """Instance attributes shadowing the model's class methods (removed exactly by :func:`_remove_model_methods`)."""
    if not _has_generate(state.model):
        return
    for name, func in _MODEL_METHODS.items():
        if callable(getattr(type(state.model), name, None)) and name not in state.model.__dict__:
            object.__setattr__(state.model, name, _BoundMethod(func, state.model))


def _remove_model_methods(module: torch.nn.Module) -> None:
    """Remove the methods :func:`_install_model_methods` put on ``module`` (or a copy of it rebound them to)."""
    for name, func in _MODEL_METHODS.items():
        if _installed_func(module.__dict__.get(name)) is func:
            del module.__dict__[name]


def _generation_settings(model, args, kwargs) -> tuple[list[int], bool]:
    """``(eos_ids, verify)`` of one ``generate(*args, **kwargs)`` call on ``model``, from the generation config
    ``generate`` itself builds (``GenerationMixin._prepare_generation_config``: the passed ``generation_config``,
    its unset fields filled from ``model.generation_config``, then the call's keyword arguments, an explicit
    ``None`` included) and the mode it picks (``GenerationConfig.get_generation_mode``).

    ``eos_ids``: the stop tokens that finish a row (``eos_token_id``; none when it resolves to ``None``, i.e.
    EOS stopping off, and none under beam search, whose rows are beams that reorder). ``verify``: the mode is
    assisted generation (a draft model, prompt lookup, early exit or multi-token prediction with greedy or
    sampling), whose forwards verify candidate tokens. Where that resolution is not available (a model
    without it, a ``generate`` whose signature differs) the same merge is done here."""
    resolved = assistant = None
    try:
        signature = inspect.signature(type(model).generate)
        bound = signature.bind(model, *args, **kwargs)
        params = dict(bound.arguments)
        extra = {}
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                extra = dict(params.pop(name, {}))
        assistant = params.get("assistant_model")
        for name in ("tokenizer", "assistant_tokenizer"):  # generate takes these out before resolving
            extra.pop(name, None)
        resolved, _ = model._prepare_generation_config(params.get("generation_config"), **extra)
        mode = str(getattr(resolved.get_generation_mode(assistant), "value", ""))
    except Exception:  # noqa: BLE001 -- fall back to the same merge, done here
        resolved, mode = _merged_generation_config(model, args, kwargs), None
        assistant = kwargs.get("assistant_model")
    num_beams = getattr(resolved, "num_beams", None) or 1
    beams = "beam" in mode if mode is not None else num_beams > 1
    if mode is not None:
        verify = mode == "assisted_generation"
    else:
        verify = not beams and (assistant is not None or any(
            getattr(resolved, name, None) not in (None, False)
            for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")))
    if beams:
        return [], verify
    value = getattr(resolved, "eos_token_id", None)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    return [int(i) for i in ids if not isinstance(i, bool) and int(i) >= 0], verify


def _merged_generation_config(model, args, kwargs):
    """The fields :func:`_generation_settings` reads, merged as ``generate`` does: a keyword argument (an explicit
    ``None`` too) over the passed ``generation_config`` over ``model.generation_config``."""
    passed = kwargs.get("generation_config")
    if passed is None and len(args) > 1 and not isinstance(args[1], torch.Tensor):
        passed = args[1]
    own = getattr(model, "generation_config", None)
    merged = types.SimpleNamespace()
    for name in ("num_beams", "eos_token_id", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp"):
        if name in kwargs:
            value = kwargs[name]
        else:
            value = getattr(passed, name, None)
            if value is None:
                value = getattr(own, name, None)
        setattr(merged, name, value)
    return merged


def _as_config(config, overrides, current: LynxConfig | None = None) -> LynxConfig:
    """The config ``patch(model, config, **overrides)`` asks for. ``current``: the config of the model when it is
    already patched; a partial configuration (``config`` ``None`` or a dict, and the keyword ``overrides``) applies
    on top of it (``docs/cases.md`` C43), a complete one (a :class:`LynxConfig`, a config file) replaces it. A model
    not yet patched starts from :meth:`LynxConfig.from_environment` (``gate`` from ``LYNX_HF_GATE`` where set) for
    the fields a partial configuration or a file does not name; a :class:`LynxConfig` is taken as it is."""
    if config is None:
        base = current
    elif isinstance(config, (str, os.PathLike)):  # a config file (LynxConfig.to_file, lynx-hf sweep's lynx_config.json)
        base = LynxConfig.from_file(config)
    elif isinstance(config, dict):  # unknown names -> LynxConfigError listing the fields
        base = LynxConfig.from_dict(config, base=current or LynxConfig.from_environment())
    elif isinstance(config, LynxConfig):
        base = config
    else:
        raise LynxConfigError(f"config must be a LynxConfig, a dict, a config file path or None, got "
                              f"{type(config).__name__}")
    if overrides or base is None:
        return LynxConfig.from_dict(overrides, base=base or LynxConfig.from_environment())
    return base


def _families_text() -> str:
    return "; ".join(f"{family} ({', '.join(classes) or 'blocks with the standard router/experts contract'})"
                     for family, classes in supported_families().items())


def _backbone_and_model(model: torch.nn.Module, names: list[str]):
    """The deepest module holding every MoE block (a ``PreTrainedModel`` if there is one: the decoder
    backbone) and the outermost module above it that generates (a ``GenerationMixin``: the generating model, whose
    ``generate`` the user calls; a VLM wrapper holding a ``...ForCausalLM`` generates through the wrapper, Llama-4
    on transformers 5.19, ``docs/cases.md`` C45)."""
    from transformers import GenerationMixin, PreTrainedModel

    containing = [(name, module) for name, module in model.named_modules()
                  if all(n == name or n.startswith(name + ".") or not name for n in names)]
    pretrained = [(name, m) for name, m in containing if isinstance(m, PreTrainedModel)]
    backbone_name, backbone = max(pretrained or containing, key=lambda item: len(item[0]) + 1 if item[0] else 0)
    generating = [(name, m) for name, m in containing if isinstance(m, GenerationMixin)
                  and (not name or backbone_name == name or backbone_name.startswith(name + "."))]
    top = min(generating, key=lambda item: len(item[0]) + 1 if item[0] else 0)[1] if generating else backbone
    return backbone, top


def patch(model: torch.nn.Module, config: LynxConfig | dict | str | os.PathLike | None = None,
          **overrides) -> torch.nn.Module:
    """Patch every supported MoE block of ``model`` in place and return ``model``.

    ``config``: a :class:`LynxConfig` (taken as it is), or a partial configuration (default: ``LynxConfig()``,
    policy ``"lynx"``, with ``gate`` from the environment variable ``LYNX_HF_GATE`` where set and not named,
    :meth:`LynxConfig.from_environment`): a dict of its fields, the path (``str`` / ``PathLike``) of a JSON config file (:meth:`LynxConfig.from_file`, e.g. the
    ``lynx_config.json`` that ``lynx-hf sweep`` writes), or ``None``; keyword ``overrides`` set single fields
    on top of it (``patch(m, policy="oea")``, ``patch(m, "lynx_config.json", telemetry=False)``).
    ``model`` may be a transformers model or any module holding one (a PEFT ``PeftModel``, a
    ``torch.compile`` wrapper): the model that actually runs is patched. Patching a patched model only
    swaps the config (re-validated; the telemetry restarts if it changed): keyword ``overrides`` and a dict
    ``config`` apply on top of the config it runs with (``patch(m, policy="none")`` keeps its ``gate``,
    ``telemetry``, ``expert_cache_bytes``, ...); a :class:`LynxConfig` or a config file replaces it whole.

    What it installs (all removed by :func:`unpatch`; no module, parameter or buffer is added, so
    ``state_dict`` and ``save_pretrained`` are unchanged, ``docs/cases.md`` C6): a forward hook on each MoE
    block's router (Llama-4: the block's ``forward``), a pre/post forward hook on the decoder backbone,
    an instance ``generate`` on the model that owns it, and, for a policy that remaps, the experts
    implementation ``"lynx"`` (``lynx_hf.experts``).

    Raises :class:`UnsupportedModelError` when ``model`` has no block of a supported family (the
    message lists the families and any MoE-looking classes found) or when the module holding its blocks is a
    container that is never called (its decode steps could not be classified), :class:`ModelConfigError` when a
    block's routing settings are inconsistent or refuse the policy (``docs/cases.md`` C10, C26),
    :class:`LynxConfigError` for a bad config (a config file: also when it is not JSON or has an unknown
    field; ``FileNotFoundError`` when it is missing; a ``gate_table`` that is missing, of another format or holds an
    entry that is not a valid decision) or a routing backend / expert path that cannot run on the
    model's device. Every error leaves the model as it was: one raised while the plans are made (the cost gate's
    measurement included) undoes the patch; on a patched model the config it ran keeps running.
    """
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"patch expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    inner = _unwrap(model)
    state = _find_state(inner)
    cfg = _as_config(config, overrides, None if state is None else state.config)
    if inner is not model:
        warnings.warn(
            "lynx_hf: patching the module inside a torch.compile wrapper; compiled graphs traced before the "
            "patch do not see it (they recompile on the next call if their guards notice). Patch before compiling.",
            stacklevel=2,
        )
    _check_backend(cfg, inner)
    _check_gate_table(cfg)
    if state is not None:
        _reconfigure(state, cfg)
        return model

    found, lookalikes, reasons = [], set(), {}
    for name, module in inner.named_modules():
        spec = find_spec(module)
        if spec is not None:
            found.append((name, module, spec))
        elif looks_like_moe(module):
            lookalikes.add(type(module).__name__)
            reasons.setdefault(type(module).__name__, why_unsupported(module))
    if not found:
        hint = (f" It has MoE-looking blocks of unsupported classes: {sorted(lookalikes)}. Why: "
                f"{'; '.join(reasons[c] for c in sorted(reasons))}." if lookalikes else
                " No module has an `experts` child or an MoE-like class name.")
        raise UnsupportedModelError(
            f"{type(inner).__name__} has no MoE block of a supported family.{hint} Supported: {_families_text()}."
        )
    # validate everything before changing anything; each block's routing rule (N, k, weight and selection rule)
    rules = [spec.validate(module, name or type(module).__name__, cfg) for name, module, spec in found]
    if lookalikes:
        warnings.warn(f"lynx_hf: unsupported MoE-looking blocks left unpatched: {sorted(lookalikes)}", stacklevel=2)

    backbone, generating = _backbone_and_model(inner, [name for name, _, _ in found])
    if getattr(type(backbone), "forward", None) is torch.nn.Module.forward:
        raise UnsupportedModelError(
            f"the MoE blocks of {type(inner).__name__} are not all under one module with a forward of its own (the "
            f"deepest module holding them, {type(backbone).__name__}, is never called), so lynx_hf cannot classify "
            f"their decode steps; patch the model that runs them")
    if cfg.phase == "auto" and any(module is backbone for _, module, _ in found):
        # a lone block (or a decoder layer holding one) never receives the KV cache: every forward would read as
        # prefill and nothing would be remapped, silently (docs/cases.md C33)
        raise UnsupportedModelError(
            f"{type(inner).__name__} holds a single MoE block ({type(backbone).__name__}) and no decoder backbone, so "
            f"its forwards carry no KV cache and lynx_hf cannot tell decode steps from prefill; patch the model (or "
            f"its decoder backbone) that runs the block, or force decode with LynxConfig(phase='decode')")
    state = ModelState(cfg, backbone, generating)
    for (name, module, spec), rule in zip(found, rules):
        state.blocks.append(BlockRouting(state, spec, name or type(module).__name__, module, rule))
    for block in state.blocks:
        block.install()
    pending = [block for block in state.blocks if block.pending_reason]
    if pending:  # docs/cases.md C42: never a rule the probe could not tell from another
        warnings.warn(
            f"lynx_hf: {len(pending)}/{len(state.blocks)} MoE blocks keep the model's own routing for now: "
            f"{pending[0].pending_reason}; each is verified again on its first router call of at least "
            f"{pending[0].spec.probe_tokens} tokens after that tensor changes (e.g. load_state_dict with the "
            f"checkpoint's values), and remaps from then on", UserWarning, stacklevel=2)
    state.tracker.attach(backbone)
    _install_model_methods(state)  # generate, init_continuous_batching
    object.__setattr__(generating, MODEL_ATTR, state)
    _sync_experts_impl(state)
    offload.install(state)  # offloaded experts read per expert in decode
    try:
        _resolve(state)
        _prepare_telemetry(state)
    except BaseException:  # never a half-patched model (docs/cases.md C56): everything installed above is undone
        unpatch(inner)
        raise
    return model


def _prepare_telemetry(state: ModelState) -> None:
    """Allocate each block's telemetry accumulators on its router's device, eagerly (patch time and every patched
    ``generate``: the model may have moved since), so that no compiled decode step creates them
    (:meth:`lynx_hf.telemetry.BlockTelemetry.ensure`)."""
    for block in state.blocks:
        block.prepare_telemetry()


def _resolve(state: ModelState) -> None:
    """Make every block's plan (its stages, the cost gate's decisions included: once per block, after offload is
    attached), then say where the cost gate keeps the model's routing."""
    for block in state.blocks:
        block.resolve()
    _note_gate(state)
    _note_table(state)
    _note_oea(state)


def _note_oea(state: ModelState) -> None:
    """Warn when OEA's ``oea_k0`` is at least every MoE layer's k: it is clipped to k at run time (docs/policies.md),
    so every token keeps its whole top-k and the policy changes nothing (a typo such as ``oea_k0=99`` would otherwise
    run silently as the model's own routing)."""
    cfg = state.config
    ks = sorted({b.top_k for b in state.blocks})
    if cfg.policy == "oea" and ks and cfg.oea_k0 >= ks[-1]:
        warnings.warn(f"lynx_hf: oea_k0={cfg.oea_k0} is at least every MoE layer's top-k ({', '.join(map(str, ks))}): "
                      f"it is clipped to k, every token keeps its top-k, and OEA changes nothing; oea_k0 < k "
                      f"remaps", UserWarning, stacklevel=4)


def _note_table(state: ModelState) -> None:
    """Warn when the user's decision table (``LynxConfig.gate_table``) holds no entry for any layer of the model: its
    decisions were measured for another key (dtype, thread count, device, policy, ...; ``lynx-hf tune`` prints the
    key's), so every layer's come from elsewhere (docs/cases.md C60)."""
    table = state.config.gate_table
    gates = [g for g in (gate.of(b.plan) for b in state.blocks) if g is not None and g.key is not None]
    if table is None or not gates or any(g.source == f"table {table}" for g in gates):
        return
    try:
        entries = gate.STORE.user_table(table).entries.values()
        seen = sorted({(str(e.get("key", {}).get("dtype")), e.get("key", {}).get("threads"))
                       for e in entries if isinstance(e, dict)}, key=str)
    except (OSError, ValueError, AttributeError):
        seen = []
    mine = sorted({(g.key.dtype, g.key.threads) for g in gates}, key=str)
    words = lambda pairs: ", ".join(f"{d.removeprefix('torch.')} at {t} threads" for d, t in pairs) or "none"  # noqa: E731
    warnings.warn(f"lynx_hf: the gate table {table} matches none of this model's {len(gates)} gated MoE layers, so "
                  f"their decisions come from elsewhere ({gates[0].source}); its entries are for {words(seen)}, this "
                  f"model's layers are {words(mine)} (lynx-hf tune --dtype / torch.set_num_threads make the table "
                  f"for the key the model runs with)", UserWarning, stacklevel=4)


def _note_gate(state: ModelState) -> None:
    """Warn when the cost gate measured at patch time switches the policy off somewhere: once per patch, and on a
    reconfiguration only when the note changed (``lynx_hf.patched(model, policy="none")`` and back, as ``lynx-hf
    generate`` does for its reference, does not repeat it)."""
    note = gate.patch_note([gate.of(b.plan) for b in state.blocks])
    if note and note != state.gate_note:
        warnings.warn(note, UserWarning, stacklevel=4)  # _note_gate < _resolve < patch / _reconfigure
    if note:
        state.gate_note = note


def _has_generate(module) -> bool:
    from transformers import GenerationMixin

    return isinstance(module, GenerationMixin)


def _reconfigure(state: ModelState, cfg: LynxConfig) -> None:
    if cfg == state.config:
        return
    for block in state.blocks:  # the new config's checks; each block keeps the routing rule resolved at patch time
        block.spec.validate(block.block, block.name, cfg)
    previous, state.config = state.config, cfg
    state.tracker.reset_counts()
    for block in state.blocks:
        block.telemetry.reset()  # telemetry describes one config
        block.carried_gate = None  # a copy's decisions were its original's config's: a new config decides anew
    try:
        _sync_experts_impl(state)
        offload.install(state)  # again: the cache budget or offload path may have changed
        _resolve(state)
    except BaseException:  # the model keeps running the config it had (docs/cases.md C56)
        state.config = previous
        _sync_experts_impl(state)
        offload.install(state)
        _resolve(state)
        raise


def _sync_experts_impl(state: ModelState) -> None:
    """Install the ``"lynx"`` experts implementation iff the policy remaps (see ``lynx_hf.experts``)."""
    # which experts module gets which implementation, and why a sparse path may not read its weights, is
    # decided in lynx_hf.experts.install / remove (PEFT wrappers unwrapped, other experts modules sharing the
    # config keep the implementation they had).
    if policies.get(state.config.policy).remaps:
        for block, path in zip(state.blocks, experts_impl.install(state)):
            block.set_experts_path(path)
    else:
        experts_impl.remove(state)


def _check_backend(cfg: LynxConfig, model: torch.nn.Module) -> None:
    """routing_backend / expert_path "triton" on a CPU model without the interpreter fails here, not mid-generate."""
    param = next(model.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
    for name, value in (("routing_backend", cfg.routing_backend), ("expert_path", cfg.expert_path)):
        try:
            resolve_backend(value if value != "model" else "torch", device)
        except RuntimeError as exc:
            other = "'torch' or 'auto'" if name == "routing_backend" else "'auto' or 'model'"
            raise LynxConfigError(f"LynxConfig.{name}={value!r}: {exc}; or {name}={other}") from exc


def _check_gate_table(cfg: LynxConfig) -> None:
    """A ``gate_table`` that is missing, not a decision table, of another format or holding one entry that is not a
    valid decision (every entry is checked: ``lynx_hf.gate.table.decode_entry``) fails here, before anything changes
    (docs/cases.md C56)."""
    if cfg.gate_table is None:
        return
    try:
        gate.STORE.user_table(cfg.gate_table)
    except (OSError, ValueError) as exc:
        raise LynxConfigError(f"LynxConfig.gate_table={cfg.gate_table!r}: {exc}") from exc


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch` exactly: original forwards and experts implementation restored, hooks removed,
    no attribute left. A model that is not patched is returned unchanged. A copy that shares the patched
    model's modules (accelerate's ``compile_regions`` root) may be given too: both are unpatched."""
    state = _find_state(model)
    if state is None:
        return model
    offload.remove(state)  # accelerate's forward objects back on the offloaded experts modules
    if state.experts_impl_before is not None:
        experts_impl.remove(state)
    state.tracker.detach(state.backbone)
    for block in state.blocks:
        block.uninstall()
    holders = [state.model] + [m for m in _unwrap(model).modules()
                               if m is not state.model and m.__dict__.get(MODEL_ATTR) is state]
    for holder in holders:
        _remove_model_methods(holder)
        holder.__dict__.pop(MODEL_ATTR, None)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a model inside it) is currently patched by lynx_hf."""
    return _find_state(model) is not None


@contextlib.contextmanager
def patched(model: torch.nn.Module, config: LynxConfig | dict | None = None, **overrides):
    """Context manager: patch on entry (:func:`patch`: on a patched model ``overrides`` and a dict ``config`` apply on
    top of its current config); on exit unpatch (or restore the previous config if the model was already
    patched), also when the body raises."""
    previous = _state(model).config if is_patched(model) else None
    patch(model, config, **overrides)
    try:
        yield model
    finally:
        if previous is None:
            unpatch(model)
        else:
            patch(model, previous)  # restores the previous config (telemetry restarts)


def config_of(model: torch.nn.Module) -> LynxConfig:
    """The :class:`LynxConfig` a patched model runs with. Raises :class:`NotPatchedError`."""
    return _state(model).config


def stats(model: torch.nn.Module) -> LynxStats:
    """Decode telemetry of a patched model (see :meth:`LynxStats.summary`). Raises :class:`NotPatchedError`."""
    state = _state(model)
    layers = [{"layer": b.name, "num_experts": b.num_experts, "top_k": b.top_k, **b.telemetry.summary(),
               **offload.layer_summary(b), **_stage_summaries(state.config, b.plan)} for b in state.blocks]
    return LynxStats(policy=state.config.policy, layers=layers, detection=state.tracker.counts(),
                     telemetry=mode_of(state.config.telemetry))


def reset_stats(model: torch.nn.Module) -> None:
    """Zero the telemetry and the decode-step detector's counts of a patched model (its no-decode warning may
    fire again), and every plan stage's counters (``Stage.reset``). Raises :class:`NotPatchedError`."""
    state = _state(model)
    state.tracker.reset_counts()
    offload.reset(state)
    for block in state.blocks:
        block.telemetry.reset()
        reset_stages(block.plan)


def _stage_summaries(config: LynxConfig, plan) -> dict:
    """``{stage.name: stage.summary()}`` of every stage of ``plan`` that reports (``Stage.summary``), with a
    ``"gate"`` entry always: ``{"gate": "always"}`` where the policy runs on every decode step (``gate="always"``, or
    a plan that never remaps)."""
    out = {"gate": gate.report_without_gate(config)}
    out.update(stage_report(plan))
    return out
