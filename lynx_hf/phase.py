"""Decode detection from the KV-cache length (DESIGN.md "Phase detection").

A forward pre-hook on the patched model reads the cache and the query length; decode ⇔ a cache is
present, its ``get_seq_length()`` > 0 and the query length <= ``q_max``. No cache, ``use_cache=False``
and plain forwards (lm-eval loglikelihood) are prefill. The attention mask is never read (CASES C1).
The phase lives in a per-model ``contextvars.ContextVar``, set by the pre-hook and reset by a forward
hook registered with ``always_call=True`` (it runs even when the forward raises).
"""

from __future__ import annotations

import contextvars
import copy

import torch

PREFILL = "prefill"
DECODE = "decode"

_CACHE_KWARGS = ("past_key_values", "cache", "past_key_value")


def _query_length(args, kwargs) -> int | None:
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if value is not None:
            return int(value.shape[1]) if value.dim() >= 2 else 1
    if args and isinstance(args[0], torch.Tensor):
        return int(args[0].shape[1]) if args[0].dim() >= 2 else 1
    return None


def _cache_length(cache) -> int:
    get = getattr(cache, "get_seq_length", None)
    if get is None:
        if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)):
            return int(cache[0][0].shape[-2])  # legacy tuple cache
        return 0
    length = get()
    return int(length.item()) if isinstance(length, torch.Tensor) else int(length)


def detect_phase(args, kwargs, q_max: int) -> str:
    """``"decode"`` or ``"prefill"`` for a model forward called with ``args``/``kwargs``."""
    if kwargs.get("use_cache") is False:
        return PREFILL
    cache = None
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            cache = kwargs[name]
            break
    if cache is None:
        return PREFILL
    q_len = _query_length(args, kwargs)
    if q_len is None or q_len > q_max:
        return PREFILL
    return DECODE if _cache_length(cache) > 0 else PREFILL


class PhaseTracker:
    """Per-model phase state; install with :meth:`attach`, remove with :meth:`detach`.

    ``owner`` is any object with a ``config`` attribute (a :class:`~lynx_hf.LynxConfig`). Survives
    ``copy.deepcopy`` of the model: the copy gets its own context variable and hooks.
    """

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

    def __init__(self, owner):
        self.owner = owner
        self._var: contextvars.ContextVar = contextvars.ContextVar(f"lynx_phase_{id(self)}", default=PREFILL)
        self._tokens: list = []

    def __deepcopy__(self, memo):
        new = PhaseTracker.__new__(PhaseTracker)
        memo[id(self)] = new
        new.__init__(copy.deepcopy(self.owner, memo))
        return new

    @property
    def phase(self) -> str:
        cfg = self.owner.config
        if cfg.phase == "never":
            return PREFILL
        if cfg.phase == "decode":
            return DECODE
        return self._var.get()

    def _pre_hook(self, module, args, kwargs):
        self._tokens.append(self._var.set(detect_phase(args, kwargs, self.owner.config.q_max)))

    def _post_hook(self, module, args, kwargs, output):
        if self._tokens:
            self._var.reset(self._tokens.pop())

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)

    def detach(self, model: torch.nn.Module) -> None:
        """Remove this tracker's hooks from ``model`` (found by owner, so deep copies work too)."""
        ours = [key for name in ("_forward_pre_hooks", "_forward_hooks")
                for key, hook in getattr(model, name).items() if getattr(hook, "__self__", None) is self]
        for name in self._HOOK_DICTS:
            hooks = getattr(model, name, None)
            if hooks is None:
                continue
            for key in ours:
                if isinstance(hooks, set):
                    hooks.discard(key)
                else:
                    hooks.pop(key, None)
