"""patch / unpatch / patched / is_patched / stats / reset_stats."""

from __future__ import annotations

import contextlib
import warnings

import torch

from . import policy
from .config import LynxConfig
from .errors import LynxConfigError, NotPatchedError, UnsupportedModelError
from .layer import LAYER_ATTR, MODEL_ATTR, LynxLayer, ModelState
from .patches import find_adapter, looks_like_moe, supported_families
from .telemetry import LynxStats


def _as_config(config, overrides) -> LynxConfig:
    if config is None:
        return LynxConfig.from_dict(overrides)  # unknown names -> LynxConfigError listing the fields
    if isinstance(config, dict):
        return LynxConfig.from_dict({**config, **overrides})
    if not isinstance(config, LynxConfig):
        raise LynxConfigError(f"config must be a LynxConfig, a dict or None, got {type(config).__name__}")
    if overrides:
        return LynxConfig.from_dict({**config.to_dict(), **overrides})
    return config


def _unwrap(model):
    """The module inside a ``torch.compile`` wrapper (``OptimizedModule``), else ``model`` itself."""
    return model._orig_mod if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod") else model


def _families_text() -> str:
    return "; ".join(f"{family} ({', '.join(classes) or 'blocks with the standard router/experts contract'})"
                     for family, classes in supported_families().items())


def patch(model: torch.nn.Module, config: LynxConfig | dict | None = None, **overrides) -> torch.nn.Module:
    """Patch every supported MoE block of ``model`` in place and return ``model``.

    ``config``: a :class:`LynxConfig` (default ``LynxConfig()``: policy ``"lynx"``), a dict of its
    fields, or ``None``; keyword ``overrides`` set single fields (``patch(m, policy="oea")``).
    Patching a patched model only swaps the config (and, if it changed, resets the telemetry, so
    :func:`stats` always describes one config). Only the MoE blocks' ``forward`` (or, under
    accelerate hooks, ``_old_forward``) is swapped and two hooks are added to ``model``: no module,
    parameter or buffer is added, so ``state_dict`` and ``save_pretrained`` are unchanged (CASES C6).

    Raises :class:`UnsupportedModelError` when ``model`` has no block of a supported family (the
    message lists the families and any MoE-looking classes found), :class:`ModelConfigError` when a
    block's routing settings are inconsistent (CASES C10), :class:`LynxConfigError` for a bad config.
    """
    cfg = _as_config(config, overrides)
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"patch expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if _unwrap(model) is not model:
        warnings.warn(
            "lynx_hf: patching the module inside a torch.compile wrapper; the decode remap is data-dependent "
            "(it breaks the compiled graph), so patched MoE blocks run eagerly. Patch before compiling, or "
            "do not compile, to avoid recompilations.",
            stacklevel=2,
        )
        patch(_unwrap(model), cfg)
        return model
    _check_backend(cfg, model)
    state: ModelState | None = model.__dict__.get(MODEL_ATTR)
    if state is not None:
        if cfg != state.config:  # telemetry describes one config: start it afresh
            state.config = cfg
            for layer in state.layers:
                layer.telemetry.reset()
        return model

    found = []
    lookalikes = set()
    for name, module in model.named_modules():
        adapter = find_adapter(module)
        if adapter is not None:
            found.append((name, module, adapter))
        elif looks_like_moe(module):
            lookalikes.add(type(module).__name__)
    if not found:
        hint = f" It has MoE-looking blocks of unsupported classes: {sorted(lookalikes)}." if lookalikes else ""
        raise UnsupportedModelError(
            f"{type(model).__name__} has no MoE block of a supported family.{hint} Supported: {_families_text()}."
        )
    for name, module, adapter in found:  # validate everything before changing anything
        adapter.check_block(module, name or type(module).__name__)
    if lookalikes:
        warnings.warn(f"lynx_hf: unsupported MoE-looking blocks left unpatched: {sorted(lookalikes)}", stacklevel=2)

    state = ModelState(cfg)
    for name, module, adapter in found:
        if LAYER_ATTR in module.__dict__:
            raise UnsupportedModelError(f"{name} is already patched through another model; unpatch that one first")
        layer = LynxLayer(state, adapter, name, module)
        layer.install()
        state.layers.append(layer)
    state.tracker.attach(model)
    object.__setattr__(model, MODEL_ATTR, state)
    return model


def _check_backend(cfg: LynxConfig, model: torch.nn.Module) -> None:
    """backend="triton" on a CPU model without the interpreter fails here, not mid-generate."""
    param = next(model.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
    try:
        policy.use_triton(cfg.backend, device)
    except RuntimeError as exc:
        raise LynxConfigError(f"LynxConfig.backend={cfg.backend!r}: {exc}") from exc


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch` exactly: original forwards restored, hooks removed, no attribute left.

    A model that is not patched is returned unchanged.
    """
    inner = _unwrap(model)
    state: ModelState | None = inner.__dict__.get(MODEL_ATTR)
    if state is None:
        return model
    state.tracker.detach(inner)
    for layer in state.layers:
        layer.uninstall()
    del inner.__dict__[MODEL_ATTR]
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched by lynx_hf."""
    return MODEL_ATTR in getattr(_unwrap(model), "__dict__", {})


@contextlib.contextmanager
def patched(model: torch.nn.Module, config: LynxConfig | dict | None = None, **overrides):
    """Context manager: patch on entry; on exit unpatch (or restore the previous config if the model
    was already patched), also when the body raises."""
    previous = _state(model).config if is_patched(model) else None
    patch(model, config, **overrides)
    try:
        yield model
    finally:
        if previous is None:
            unpatch(model)
        else:
            patch(model, previous)  # restores the previous config (telemetry restarts)


def _state(model) -> ModelState:
    state = getattr(_unwrap(model), "__dict__", {}).get(MODEL_ATTR)
    if state is None:
        raise NotPatchedError("this model is not patched by lynx_hf: call lynx_hf.patch(model) first")
    return state


def config_of(model: torch.nn.Module) -> LynxConfig:
    """The :class:`LynxConfig` a patched model runs with. Raises :class:`NotPatchedError`."""
    return _state(model).config


def stats(model: torch.nn.Module) -> LynxStats:
    """Decode telemetry of a patched model (see :meth:`LynxStats.summary`). Raises :class:`NotPatchedError`."""
    state = _state(model)
    layers = [{"layer": layer.name, "num_experts": layer.num_experts, "top_k": layer.top_k, **layer.telemetry.summary()}
              for layer in state.layers]
    return LynxStats(policy=state.config.policy, layers=layers)


def reset_stats(model: torch.nn.Module) -> None:
    """Zero the telemetry of a patched model. Raises :class:`NotPatchedError`."""
    for layer in _state(model).layers:
        layer.telemetry.reset()
