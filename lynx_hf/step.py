"""Which tokens of a forward are decode tokens (DESIGN.md "Phase detection", "Per-token decode mask").

A forward pre-hook on the model's decoder backbone (the module every entry point ends in:
``CausalLM.forward``, ``generate``, PEFT wrappers, continuous batching) classifies the forward's
tokens and publishes a :class:`Step`; the router hooks of the MoE blocks read it. The unit is the
token (flattened ``[B, q] -> [B*q]`` order, the order of the router's rows):

- **continuous batching** (``cu_seq_lens_q`` / ``cu_seq_lens_k`` in the kwargs, paged cache): a
  request with ``q_len <= q_max`` new tokens and a KV history (``k_len > q_len``) is decoding; the
  other requests' tokens are prefill; padding tokens after the last request are not live;
- inside ``generate`` (the patched model's ``generate`` records its prompt length ``P``, verification
  mode and stop tokens): a forward whose KV cache already holds ``>= P`` tokens is a decode step
  (``q_len == 1``) or a verification step (``q_len > 1``: assisted / prompt-lookup decoding);
  rows whose input token is a stop / pad token (finished rows) are not live;
- any other forward (manual loops, lm-eval, teacher forcing): decode iff a cache is present, it holds
  tokens and ``q_len <= q_max``; no cache, ``use_cache=False`` or a longer query is prefill.

The attention mask is never read (CASES C1). Cache lengths that are device tensors (``StaticCache``)
are compared on the device (no host sync): the step's decode mask is then a tensor.

State: eager forwards publish the step in a ``contextvars.ContextVar`` (per thread / task, so two
threads generating on one model keep separate state, CASES C18); a forward traced by ``torch.compile``
keeps it in a plain attribute that dynamo tracks inside the graph (a ContextVar cannot be traced).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

PREFILL = "prefill"
DECODE = "decode"
VERIFY = "verify"
MIXED = "mixed"


@dataclass(frozen=True)
class Step:
    """How the router hooks treat one forward.

    ``kind``: ``"prefill"`` (nothing to do), ``"decode"`` / ``"verify"`` (every live token is a decode
    token), ``"mixed"`` (``decode`` says which). ``decode [T]`` bool or ``None`` (all tokens, unless
    ``kind`` is prefill); ``live [T]`` bool or ``None`` (all rows live): finished / padding rows are
    not live (they neither vote nor count; they are remapped into the critical set).
    """

    kind: str
    decode: torch.Tensor | None = None
    live: torch.Tensor | None = None


PREFILL_STEP = Step(PREFILL)

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


@dataclass
class Generation:
    """What the patched ``generate`` records for the forwards it makes (one per call, per context)."""

    owner: object  # the ModelState whose generate set it
    prompt_length: int
    eos_ids: tuple[int, ...]  # empty: no finished-row detection (no EOS, or beam search)
    verify: bool
    eos_tensor: torch.Tensor | None = None
    finished: torch.Tensor | None = None  # [B] bool, rows that fed an EOS token (as generate's unfinished_sequences)


_GENERATION: contextvars.ContextVar = contextvars.ContextVar("lynx_generation", default=None)


def _query(args, kwargs):
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def cache_length(cache):
    """Tokens held by ``cache``: an int, a 0-d device tensor (static caches), or ``None`` if unknown.

    Hybrid caches (linear-attention layers first) are read at their first attention layer.
    """
    get = getattr(cache, "get_seq_length", None)
    if get is None:
        if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)):
            return int(cache[0][0].shape[-2])  # legacy tuple cache
        return None
    layer = 0
    linear = getattr(cache, "is_linear", None)
    if isinstance(linear, (list, tuple)) and linear and linear[0]:
        layer = next((i for i, lin in enumerate(linear) if not lin), None)
        if layer is None:
            return None
    try:
        return get(layer) if layer else get()
    except TypeError:
        return get()


def _continuous_batching(kwargs, num_tokens: int, device, q_max: int) -> Step | None:
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if not isinstance(cu_q, torch.Tensor):
        return None
    if isinstance(cu_k, dict):
        cu_k = next(iter(cu_k.values()), None)
    if not isinstance(cu_k, torch.Tensor) or cu_k.shape != cu_q.shape:
        return None
    q_len = cu_q[1:] - cu_q[:-1]
    k_len = cu_k[1:] - cu_k[:-1]
    decoding = (q_len >= 1) & (q_len <= q_max) & (k_len > q_len)
    token = torch.arange(num_tokens, device=device)
    request = torch.searchsorted(cu_q[1:].to(device).long(), token, right=True)  # [T], n_req for padding
    live = token < cu_q[-1].to(device)
    decode = torch.cat([decoding.to(device), decoding.new_zeros(1).to(device)])[request] & live
    return Step(MIXED, decode=decode, live=live)


def detect_step(args, kwargs, config, generation: Generation | None) -> Step:
    """The :class:`Step` of a backbone forward called with ``args`` / ``kwargs``."""
    if config.phase == "never":
        return PREFILL_STEP
    x = _query(args, kwargs)
    if x is None:
        return PREFILL_STEP
    batch, q_len = (int(x.shape[0]), int(x.shape[1])) if x.dim() >= 2 else (1, int(x.shape[0]))
    num_tokens = batch * q_len
    if config.phase == "decode":  # decode emulation: every forward
        return Step(DECODE)
    cb = _continuous_batching(kwargs, num_tokens, x.device, config.q_max)
    if cb is not None:
        return cb
    if kwargs.get("use_cache") is False:
        return PREFILL_STEP
    cache = next((kwargs[name] for name in _CACHE_KWARGS if kwargs.get(name) is not None), None)
    if cache is None:
        return PREFILL_STEP
    length = cache_length(cache)
    if length is None:
        return PREFILL_STEP
    if generation is not None and not torch.compiler.is_compiling():
        if q_len > 1 and not (generation.verify and config.verify):
            return PREFILL_STEP
        kind = DECODE if q_len == 1 else VERIFY
        live = _live_rows(generation, x, q_len) if q_len == 1 else None
        if isinstance(length, torch.Tensor):
            decode = (length >= generation.prompt_length).expand(num_tokens)
            return Step(MIXED, decode=decode, live=live)
        return Step(kind, live=live) if length >= generation.prompt_length else PREFILL_STEP
    if q_len > config.q_max:
        return PREFILL_STEP
    if isinstance(length, torch.Tensor):
        return Step(MIXED, decode=(length > 0).expand(num_tokens))
    return Step(DECODE) if length > 0 else PREFILL_STEP


def _live_rows(generation: Generation, x: torch.Tensor, q_len: int) -> torch.Tensor | None:
    """Rows that have not finished: a row finishes when its input is an EOS token (the token it generated
    last), and stays finished (it then decodes pad tokens), as ``generate``'s ``unfinished_sequences``."""
    if not generation.eos_ids or x.dtype.is_floating_point or x.dim() < 2:
        return None
    if generation.eos_tensor is None or generation.eos_tensor.device != x.device:
        generation.eos_tensor = torch.tensor(generation.eos_ids, dtype=x.dtype, device=x.device)
    fed_eos = torch.isin(x[:, 0], generation.eos_tensor)
    finished = generation.finished
    if finished is None or finished.shape != fed_eos.shape or finished.device != fed_eos.device:
        finished = fed_eos
    else:
        finished = finished | fed_eos
    generation.finished = finished
    return ~finished


class _Frame:
    __slots__ = ("step", "parent")

    def __init__(self, step, parent):
        self.step = step
        self.parent = parent


class StepTracker:
    """Per-model step state; install with :meth:`attach`, remove with :meth:`detach`.

    ``owner`` is the patched model's state (it has ``config``). Picklable and deep-copyable: the copy
    gets a fresh context variable (no forward is in flight in a copy).
    """

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

    def __init__(self, owner) -> None:
        self.owner = owner
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._var: contextvars.ContextVar = contextvars.ContextVar(f"lynx_step_{id(self)}", default=None)
        self._traced: Step = PREFILL_STEP

    def __getstate__(self):
        return {"owner": self.owner}

    def __setstate__(self, state):
        self.owner = state["owner"]
        self._init_runtime()

    @property
    def step(self) -> Step:
        """The step of the forward in flight in this context (``PREFILL_STEP`` outside any forward)."""
        if torch.compiler.is_compiling():
            return self._traced
        frame = self._var.get()
        return PREFILL_STEP if frame is None else frame.step

    def _generation(self) -> Generation | None:
        gen = _GENERATION.get()
        return gen if gen is not None and gen.owner is self.owner else None

    def _pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            self._traced = detect_step(args, kwargs, self.owner.config, None)
            return None
        step = detect_step(args, kwargs, self.owner.config, self._generation())
        self._var.set(_Frame(step, self._var.get()))
        return None

    def _post_hook(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            self._traced = PREFILL_STEP
            return None
        frame = self._var.get()
        if frame is not None:
            self._var.set(frame.parent)
        return None

    def attach(self, backbone: torch.nn.Module) -> None:
        backbone.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        backbone.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)

    def detach(self, backbone: torch.nn.Module) -> None:
        """Remove this tracker's hooks from ``backbone`` (found by owner, so copies work too)."""
        ours = [key for name in ("_forward_pre_hooks", "_forward_hooks")
                for key, hook in getattr(backbone, name).items() if getattr(hook, "__self__", None) is self]
        for name in self._HOOK_DICTS:
            hooks = getattr(backbone, name, None)
            if hooks is None:
                continue
            for key in ours:
                if isinstance(hooks, set):
                    hooks.discard(key)
                else:
                    hooks.pop(key, None)


def generation_scope(owner, prompt_length: int, eos_ids, verify: bool):
    """Context manager used by the patched ``generate``: publishes a :class:`Generation` for its forwards."""
    return _Scope(Generation(owner, int(prompt_length), tuple(int(i) for i in eos_ids), bool(verify)))


class _Scope:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._token = None

    def __enter__(self):
        self._token = _GENERATION.set(self.generation)
        return self.generation

    def __exit__(self, *exc):
        _GENERATION.reset(self._token)
        return False
