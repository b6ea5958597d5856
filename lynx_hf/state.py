"""Where a patched model keeps its ``lynx_hf.patcher.ModelState``: one attribute on the module whose ``generate``
runs (or the decoder backbone), found from the model or any module holding it. Shared by the patcher and the
features that answer per model (``lynx_hf.offload.transfer_ms``), so neither imports the other."""

from __future__ import annotations

import torch

from .errors import NotPatchedError

#: on the module whose generate runs (or the backbone): the ModelState
MODEL_ATTR = "_lynx_state"


def unwrap(model):
    """The module inside a ``torch.compile`` wrapper (``OptimizedModule``), else ``model`` itself."""
    return model._orig_mod if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod") else model


def find_state(model):
    """The ``ModelState`` of ``model`` (a module, or a ``torch.compile`` wrapper of one) or of a module inside it;
    ``None`` when it is not patched (or not a module)."""
    model = unwrap(model)
    if not isinstance(model, torch.nn.Module):
        return None
    for module in model.modules():
        state = module.__dict__.get(MODEL_ATTR)
        if state is not None:
            return state
    return None


def state_of(model):
    """:func:`find_state`, raising :class:`lynx_hf.errors.NotPatchedError` when ``model`` is not patched."""
    state = find_state(model)
    if state is None:
        raise NotPatchedError("this model is not patched by lynx_hf: call lynx_hf.patch(model) first")
    return state


__all__ = ["MODEL_ATTR", "unwrap", "find_state", "state_of"]
