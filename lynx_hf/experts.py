"""Routed experts in decode, through transformers' experts-implementation interface.

After a remap the experts must read only the unique experts the step uses. transformers' own
``grouped_mm`` implementation does that (well kept, CUDA and CPU); in decode on CUDA, ``generate``
switches ``grouped_mm`` to ``batched_mm``, which copies one expert matrix per (token, slot) and gains
nothing from a remap. So, for a policy that remaps, ``patch`` calls :func:`install`: it registers the
implementation ``"lynx"`` (:data:`IMPLEMENTATION`) in ``ALL_EXPERTS_FUNCTIONS`` and
``ALL_FP8_EXPERTS_FUNCTIONS`` and sets it on the configs of the patched experts modules; :func:`remove`
(``unpatch``, or a policy that does not remap) sets the previous one back once no patched model on that config
needs it. The implementation a config had is recorded per config object (a config may be shared by several
models, ``docs/cases.md`` C28): an experts module that is not a patched block's -- another model sharing the
config -- runs it (:func:`original_implementation`). ``"lynx"`` chooses, per call:

- not a decode step -> the implementation the model had (prefill bit-identical);
- a decode step the cost gate keeps off (``LynxConfig.gate="auto"``, ``lynx_hf.gate``) -> the implementation the
  model had (the routing is the model's own too: as unpatched);
- decode with ``expert_path="triton"`` (every step), or ``"auto"`` on CUDA in a step of at least
  ``core.AUTO_KERNEL_MIN_TOKENS`` tokens (measured on an H200: from B = 4 the kernel is 3-4x faster than
  ``grouped_mm`` at Qwen2-57B / DeepSeek-V2-Lite shapes; at B = 1 they tie), the experts passed
  :func:`kernel_storage` at patch time and :func:`weights_ready` now -> the sparse Triton kernel
  :func:`lynx_hf.kernels.moe.sparse_moe`;
- decode with a plan on CUDA, the experts passed :func:`storage_reason` at patch time and
  :func:`weights_ready` now, and (under ``torch.compile``) bf16 weights -> that interface's ``grouped_mm`` (reads only
  the unique experts; compiled with other dtypes transformers falls back to a loop that syncs, which a CUDA-graph
  capture refuses: :func:`_grouped_capturable`);
- otherwise -> the implementation the model had (on CPU usually ``grouped_mm``, which already reads
  only the unique experts).

"Never silently wrong": a sparse path reads an experts module's weight tensors itself, so it
runs only when those tensors *are* the expert weights -- plain dense ``torch.Tensor`` / ``Parameter`` in
fp32/fp16/bf16, materialized on the compute device, of one of transformers' own experts classes with no
other state. Everything else (fp8 weights with block scales such as transformers' ``FP8Experts``,
bitsandbytes / GPTQ / AWQ-style quantized storage, accelerate offload (``meta`` weights behind a hook),
PEFT LoRA on the expert parameters (a ``ParamWrapper`` around the module, a parametrization while it
runs), tensor subclasses, unknown subclasses) runs the module's own forward with the remapped routing:
the routing is remapped by the router hook (``lynx_hf.block``), so the policy acts either way.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass

import torch

IMPLEMENTATION = "lynx"
EXPERTS_ATTR = "_lynx_experts"  # on an experts module: its BlockRouting, or the name of the implementation it had
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_OWN_MODULE_PREFIX = "transformers.models."  # transformers' own experts classes live in its model files
# tensors transformers' grouped_mm reads (weights, biases, the optional post-expert norm): nothing else may exist
_GROUPED_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def _interfaces():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    found = [ALL_EXPERTS_FUNCTIONS]
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        found.append(ALL_FP8_EXPERTS_FUNCTIONS)
    except ImportError:
        pass
    return found


def _base_class(cls: type) -> type:
    """``cls`` without the classes ``torch.nn.utils.parametrize`` injects (one per registration: PEFT
    registers a parametrization on every forward, so caching on them would grow without bound)."""
    while cls.__module__ == "torch.nn.utils.parametrize" and cls.__bases__:
        cls = cls.__bases__[0]
    return cls


@functools.lru_cache(maxsize=None)
def _class_dispatch(cls) -> tuple[object, object] | None:
    """``(experts_interface, original_forward)`` of a class wrapped by ``use_experts_implementation``.

    The decorator rewrites the class in place, so a class decorated twice (transformers'
    ``replace_with_fp8_linear`` decorates ``FP8Experts`` again at every FP8 model load) wraps a wrapper:
    the original forward is the innermost one (else ``"lynx"``'s own implementation would dispatch to
    ``"lynx"`` again, without end)."""
    found = None
    for klass in cls.__mro__:  # a subclass with a forward of its own may still call its base's dispatching forward
        found = _wrapper_parts(klass.__dict__.get("forward"))
        if found is not None:
            break
    if found is None:
        return None
    interface, original = found
    while (inner := _wrapper_parts(original)) is not None:
        original = inner[1]
    return interface, original


def _wrapper_parts(forward):
    if forward is None:
        return None
    try:
        nonlocals = inspect.getclosurevars(forward).nonlocals
    except (TypeError, ValueError):
        return None
    interface, original = nonlocals.get("experts_interface"), nonlocals.get("original_forward")
    if interface is None or original is None:
        return None
    return interface, original


def dispatch(module) -> tuple[object, object] | None:
    """``(interface, original forward)`` of transformers' experts-implementation dispatch of ``module``'s class (the
    ``use_experts_implementation`` decorator's closure), or ``None`` when its class does not dispatch that way."""
    return _class_dispatch(_base_class(type(module)))


def uses_interface(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` dispatches through transformers' experts-implementation interface."""
    return dispatch(experts) is not None and hasattr(experts, "config")


def unwrap(experts: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """``(module, wrappers)``: the module inside PEFT adapter wrappers that hold the experts as their base layer
    (PEFT ``ParamWrapper``, nested once per targeted parameter; found through PEFT's ``get_base_layer``
    contract), and the wrapper class names, outermost first (empty when ``experts`` is not wrapped)."""
    wrappers = []
    module = experts
    while not uses_interface(module):
        base = getattr(module, "base_layer", None)
        if not isinstance(base, torch.nn.Module) or base is module:
            break
        wrappers.append(type(module).__name__)
        module = base
    return module, wrappers


def _offloads(hook) -> bool:
    """Whether an accelerate hook (or a ``SequentialHook`` of hooks) keeps the weights elsewhere (offload)."""
    if hook is None:
        return False
    if any(_offloads(h) for h in getattr(hook, "hooks", ()) or ()):
        return True
    return bool(getattr(hook, "offload", False)) or getattr(hook, "weights_map", None) is not None


def storage_reason(experts: torch.nn.Module, names=_GROUPED_NAMES) -> str | None:
    """``None`` if code other than ``experts``' own forward may read its weight tensors, else the reason.

    Checked at patch time (a few attribute reads per block). The weights must *be* the expert weights:

    - the class is one of transformers' own (defined in ``transformers.models.*``; an unknown subclass may
      compute anything in its forward), not parametrized (PEFT LoRA on the expert parameters while it runs,
      ``torch.nn.utils.parametrize``);
    - every parameter and buffer, recursively, is one of ``names`` (anything else -- fp8 / int block scales,
      zero points, LoRA factors, activation scales -- is state only the module's forward knows);
    - each is a plain ``torch.Tensor`` / ``Parameter`` (no tensor subclass: bitsandbytes ``Params4bit``,
      torchao / GPTQ packed tensors) of a float dtype of 16 bits or more (not fp8 / int: quantized);
    - no accelerate hook that offloads them (a disk / CPU offload map keeps ``meta`` placeholders and loads
      the weights only inside the module's own forward, ``docs/cases.md`` C19).

    ``names`` (default: what transformers' ``grouped_mm`` reads) narrows what may exist; the sparse Triton
    kernel passes ``("gate_up_proj", "down_proj")``. What ``.to(dtype / device)`` changes (fp32/fp16/bf16,
    one dtype, on the compute device, never ``meta``) is checked per call by :func:`weights_ready`, so a
    model moved after patch takes the sparse path again when it can.
    """
    cls = _base_class(type(experts))
    if type(experts) is not cls or getattr(experts, "parametrizations", None):
        return "parametrized expert weights (e.g. PEFT LoRA on the expert parameters)"
    if _offloads(getattr(experts, "_hf_hook", None)):
        return "accelerate offloads the expert weights (CPU / disk offload hook)"
    tensors = [*experts.named_parameters(recurse=True), *experts.named_buffers(recurse=True)]
    if not tensors:
        return "the experts module holds no weight tensors"
    extra = sorted(name for name, _ in tensors if name not in names)
    if extra:
        return f"expert state besides the dense weights ({', '.join(extra)}: quantization scales, adapters?)"
    for name, tensor in tensors:
        if type(tensor) not in _PLAIN_TYPES:
            return f"{name} is a {type(tensor).__name__} (a tensor subclass: quantized or wrapped storage)"
        if not tensor.dtype.is_floating_point or tensor.element_size() < 2:
            return f"{name} is {tensor.dtype} (quantized storage), not a 16/32-bit float"
    if not cls.__module__.startswith(_OWN_MODULE_PREFIX):
        return (f"experts class {cls.__module__}.{cls.__qualname__} is not one of transformers' own "
                f"(its forward may differ)")
    return None


def kernel_storage(experts: torch.nn.Module) -> str | None:
    """``None`` if the sparse Triton kernel may read ``experts``' weights, else the reason it may not.

    :func:`storage_reason`, then the kernel's layout and activation (and no tensor besides ``gate_up_proj`` /
    ``down_proj``): ``gate_up_proj [N, 2I, H]`` concatenated gate-first, ``down_proj [N, H, I]``, no bias, no
    post-expert norm, the default gate ``act(gate) * up`` with SiLU (``lynx_hf.kernels.moe``). Patch time;
    :func:`weights_ready` is the per-call part.
    """
    reason = storage_reason(experts)
    if reason is not None:
        return reason
    if not getattr(experts, "has_gate", False) or getattr(experts, "is_transposed", False):
        return "layout is not gate_up [N, 2I, H] / down [N, H, I]"
    if not getattr(experts, "is_concatenated", True) or getattr(experts, "has_bias", False) \
            or getattr(experts, "has_post_expert_norm", False):
        return "interleaved gate/up, biases or a post-expert norm"
    reason = storage_reason(experts, names=("gate_up_proj", "down_proj"))
    if reason is not None:
        return reason
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return "expert weights are not 3-d stacked gate_up_proj / down_proj tensors"
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (num_experts, hidden, two_i // 2):
        return f"shapes gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} are not [N, 2I, H] / [N, H, I]"
    if getattr(type(experts), "_apply_gate", None) is not _default_apply_gate():
        return "custom gate activation"
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")):
        return "activation is not SiLU"
    return None


@functools.lru_cache(maxsize=None)
def _default_apply_gate():
    from transformers.integrations.moe import _default_apply_gate as gate

    return gate


def weights_ready(experts, hidden: torch.Tensor, names=("gate_up_proj", "down_proj")) -> bool:
    """Per-call part of the check (cheap: attribute reads): not parametrized now (PEFT registers its LoRA
    parametrization around each forward), and each of ``names`` is a plain tensor, all of one kernel dtype
    (fp32/fp16/bf16), on ``hidden``'s device (so never ``meta``, whatever moved the weights after patch)."""
    if "parametrizations" in experts._modules:
        return False
    device = hidden.device
    dtype = None
    for name in names:
        tensor = experts._parameters.get(name)
        if tensor is None:
            tensor = experts._buffers.get(name)
        if tensor is None or type(tensor) not in _PLAIN_TYPES or tensor.device != device \
                or tensor.dtype not in _KERNEL_DTYPES or (dtype is not None and tensor.dtype != dtype):
            return False
        dtype = tensor.dtype
    return True


def implementations(experts, name: str):
    """``(own, grouped, compiled_own)``: the forward function of implementation ``name`` for ``experts``' class, its
    ``grouped_mm`` (``None`` if the interface has none), and what runs for ``own`` in a compiled decode step where
    ``grouped_mm`` cannot be captured (:func:`_grouped_capturable`): ``batched_mm`` where ``name`` is ``grouped_mm``
    (what ``generate`` switches ``grouped_mm`` to for decode off CPU, ``GenerationMixin._optimize_model_for_decode``),
    else ``own``. Resolved at patch time (not traced)."""
    interface, original = dispatch(experts)
    grouped = interface.get_interface("grouped_mm", original) if "grouped_mm" in interface else None
    own = interface.get_interface(name, original)
    compiled_own = interface.get_interface("batched_mm", original) \
        if name == "grouped_mm" and "batched_mm" in interface else own
    return own, grouped, compiled_own


def _grouped_names(experts) -> tuple[str, ...]:
    return ("up_proj" if not getattr(experts, "has_gate", True) else "gate_up_proj", "down_proj")


def _lynx_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    state = self.__dict__.get(EXPERTS_ATTR)
    if not hasattr(state, "experts_impls"):  # not in a patched block (another model sharing the config, too)
        interface, original = dispatch(self)
        name = state if isinstance(state, str) else original_implementation(self)
        return interface.get_interface(name, original)(self, hidden_states, top_k_index, top_k_weights,
                                                       *args, **kwargs)
    own, grouped, compiled_own = state.experts_impls
    if own is None:  # after unpickling / deep copy: resolved again, once
        state.experts_impls = implementations(self, state.experts_path.original)
        own, grouped, compiled_own = state.experts_impls
    if args or kwargs or state.step.kind == "prefill":
        return own(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    if state.gated_off:
        # the cost gate kept the model's routing on this step (lynx_hf.gate, asked once by the router hook): its own
        # implementation, as unpatched
        return own(self, hidden_states, top_k_index, top_k_weights)
    plan = state.plan if state.plan is not None else state.resolve(hidden_states.device)  # None after a copy
    if plan.uses_kernel(hidden_states.shape[0]) and state.kernel_allowed and weights_ready(self, hidden_states):
        return plan.sparse_moe(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                               exact_grid=False)
    if plan.device.type != "cpu" and not _grouped_capturable(self):
        return compiled_own(self, hidden_states, top_k_index, top_k_weights)
    if grouped is not None and plan.device.type == "cuda" and state.grouped_allowed \
            and weights_ready(self, hidden_states, _grouped_names(self)):
        return grouped(self, hidden_states, top_k_index, top_k_weights)
    return own(self, hidden_states, top_k_index, top_k_weights)


def _grouped_capturable(experts) -> bool:
    """Whether transformers' ``grouped_mm`` runs its native kernel here: under ``torch.compile`` only for bf16 weights
    (``transformers.integrations.moe._can_use_grouped_mm``); otherwise it falls back to a per-expert loop that reads
    the group offsets on the host (``offs.tolist()``), a host sync that a CUDA-graph capture refuses (what a
    static-cache ``generate`` compiles by default on CUDA: ``CompileConfig(mode="reduce-overhead")``; seen on an H200).
    There ``batched_mm`` runs instead where the model's own is ``grouped_mm`` (:func:`implementations`)."""
    if not torch.compiler.is_compiling():
        return True
    weight = getattr(experts, "gate_up_proj", None)
    if weight is None:
        weight = getattr(experts, "down_proj", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16


def register() -> None:
    """Register :data:`IMPLEMENTATION` in transformers' experts interfaces (idempotent)."""
    for interface in _interfaces():
        if IMPLEMENTATION not in interface:
            interface.register(IMPLEMENTATION, _lynx_forward)


def _wrapped_reason(wrappers) -> str:
    return (f"the experts are wrapped by {' > '.join(wrappers)} (e.g. PEFT LoRA on the expert parameters), whose "
            f"forward changes the weights the module computes with")


# -- the implementation a config had before "lynx" ------------------------------------------------------------
# A config object may be shared by several models (``from_config(model.config)``, two models built from one
# config, a text model built from a VLM's ``text_config``), and transformers' experts dispatch reads the
# implementation from it, so switching it to "lynx" reaches every model that shares it. What each config said
# before is recorded here, keyed by the config object (configs are not hashable: by id, with a weak reference
# that drops the entry with the config), with the number of patched models that need "lynx" on it; the config
# is set back when the last of them is unpatched. "lynx" itself is never recorded as an original.
_ORIGINALS: dict[int, list] = {}  # id(config) -> [weakref(config), implementation before "lynx", models holding it]


def _entry(config):
    entry = _ORIGINALS.get(id(config))
    return entry if entry is not None and entry[0]() is config else None


def _hold(config, before: str) -> str:
    """Count one more patched model on ``config``; return the implementation ``config`` had before "lynx"
    (the one recorded by the first holder, else ``before``)."""
    entry = _entry(config)
    if entry is None:
        key = id(config)
        entry = [weakref.ref(config, lambda _, key=key: _ORIGINALS.pop(key, None)), before, 0]
        _ORIGINALS[key] = entry
    entry[2] += 1
    return entry[1]


def _release(config) -> bool:
    """One patched model less on ``config``; ``True`` when it was the last (the config may be set back)."""
    entry = _entry(config)
    if entry is None:
        return True
    entry[2] -= 1
    if entry[2] > 0:
        return False
    _ORIGINALS.pop(id(config), None)
    return True


def _default_implementation(experts) -> str:
    interface, _ = dispatch(experts)
    return "grouped_mm" if "grouped_mm" in interface else "eager"


def original_implementation(experts) -> str:
    """The experts implementation ``experts`` runs when it is not a patched block's: what its config says,
    or, when the config says ``"lynx"`` (another model sharing the config is patched, or a copy of a patched
    config), what the config said before, else transformers' default (``grouped_mm`` where the interface has
    it, else ``eager``)."""
    config = getattr(experts, "config", None)
    current = getattr(config, "_experts_implementation", None)
    if current is not None and current != IMPLEMENTATION:
        return current
    entry = _entry(config) if config is not None else None
    return entry[1] if entry is not None else _default_implementation(experts)


def adopt(state) -> None:
    """Count a copied model state (``copy.deepcopy``, ``pickle``) as a holder of the configs it switched, so that
    models sharing the copy's config find what it said before."""
    for config, before in state.experts_impl_before or ():
        if getattr(config, "_experts_implementation_internal", None) == IMPLEMENTATION:
            _hold(config, before)


@dataclass(frozen=True)
class ExpertsPath:
    """What :func:`install` decided for one patched block's experts (``BlockRouting.experts_path``):

    ``original``: the experts implementation its config named before ``"lynx"`` (``None``: the experts do not
    dispatch through transformers' experts interface, so ``"lynx"`` is not theirs); ``kernel_reason``: why the sparse
    Triton kernel may not read their weights (``None``: it may); ``grouped_reason``: the same for transformers'
    ``grouped_mm`` (``None``: it may)."""

    original: str | None
    kernel_reason: str | None
    grouped_reason: str | None


def install(state) -> tuple:
    """Install ``"lynx"`` on the model of ``state`` (a ``lynx_hf.patcher.ModelState``) for a remapping policy; returns
    one :class:`ExpertsPath` per patched block (``state.blocks``' order), or ``None`` for a block whose storage was not
    checked (neither sparse path may run): the caller hands each to its block (``BlockRouting.set_experts_path``).

    For each patched block: the experts module that dispatches through the interface (inside PEFT wrappers,
    :func:`unwrap`) gets its ``BlockRouting`` under :data:`EXPERTS_ATTR`; its path records the implementation it had
    and why a sparse path may not read its weights. Blocks whose experts do not dispatch through the interface
    (Llama-4, custom experts) get ``kernel_reason`` from their family spec's ``kernel_storage(experts)`` if it has
    one, else a reason. Every other interface-dispatching experts module of the model (they share the config whose
    implementation changes) records the implementation it had, so it keeps running it. Only the configs of the
    patched experts modules are switched to ``"lynx"``; what each had is read before, per config
    (:func:`original_implementation`: never ``"lynx"``, which a config shared with a patched model already says), and
    kept in ``state.experts_impl_before`` as ``[(config, implementation)]``. Experts modules of other models that share
    one of those configs dispatch to ``"lynx"`` too and run the recorded implementation (they are not patched blocks).
    Idempotent (an installed block's path is returned as it is); undone exactly by :func:`remove`.
    """
    model = state.model
    paths = {}
    blocks = []
    for block in state.blocks:
        inner, wrappers = unwrap(block.experts)
        if uses_interface(inner):
            blocks.append((block, inner, wrappers))
            paths[block] = block.experts_path
            continue
        check = getattr(block.spec, "kernel_storage", None)
        if wrappers:
            reason = _wrapped_reason(wrappers)
        elif check is not None:
            reason = check(block.experts)
        else:
            reason = "the experts do not dispatch through transformers' experts interface"
        paths[block] = ExpertsPath(None, reason, reason)
    if state.experts_impl_before is not None or not blocks or not hasattr(model, "set_experts_implementation"):
        return tuple(paths[block] for block in state.blocks)
    register()
    configs: dict[int, tuple] = {}  # id(config) -> (config, implementation before "lynx")
    for block, inner, wrappers in blocks:
        config = inner.config
        if id(config) not in configs:
            configs[id(config)] = (config, _hold(config, original_implementation(inner)))
        original = configs[id(config)][1]
        if wrappers:
            paths[block] = ExpertsPath(original, _wrapped_reason(wrappers), _wrapped_reason(wrappers))
        else:
            paths[block] = ExpertsPath(original, kernel_storage(inner), storage_reason(inner))
        object.__setattr__(inner, EXPERTS_ATTR, block)
    for module in model.modules():
        if EXPERTS_ATTR not in module.__dict__ and uses_interface(module):
            object.__setattr__(module, EXPERTS_ATTR, original_implementation(module))
    state.experts_impl_before = list(configs.values())
    for config, _ in state.experts_impl_before:
        config._experts_implementation_internal = IMPLEMENTATION  # this config only (sub-configs have their own)
    return tuple(paths[block] for block in state.blocks)


def remove(state) -> None:
    """Undo :func:`install`: each config the model switched says what it said before, unless another patched
    model still needs ``"lynx"`` on it (its experts, not patched any more, then run the recorded one) or the
    user set another implementation since; no attribute left on any module."""
    before, state.experts_impl_before = state.experts_impl_before, None
    if before is None:
        return
    for config, implementation in before:
        if _release(config) and config._experts_implementation_internal == IMPLEMENTATION:
            config._experts_implementation_internal = implementation
    for module in state.model.modules():
        module.__dict__.pop(EXPERTS_ATTR, None)
