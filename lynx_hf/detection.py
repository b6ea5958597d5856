"""HF step detection: which tokens of a forward are decode tokens (``docs/design.md`` "Phase detection",
"Per-token decode mask"). The :class:`~lynx_hf.core.Step` it publishes is engine-independent (``lynx_hf.core``).

A forward pre-hook on the model's decoder backbone (the module every entry point ends in:
``CausalLM.forward``, ``generate``, PEFT wrappers, continuous batching) classifies the forward's
tokens and publishes a :class:`Step`; the router hooks of the MoE blocks read it. The unit is the
token (flattened ``[B, q] -> [B*q]`` order, the order of the router's rows). Rules, first match wins:

1. **continuous batching** (transformers' ``generate_batch`` / ``cache_implementation="paged"``: one
   flattened forward ``[1, T]`` with ``cu_seq_lens_q`` / ``cu_seq_lens_k``): a request is decoding when
   its query starts at or after the end of its prompt. That is read from the scheduler's request states
   (``position_offset`` minus the query length >= ``len(initial_tokens)``) when the model's continuous
   batching manager was created through the patched ``init_continuous_batching`` (``generate_batch``,
   ``cache_implementation="paged"``, ``transformers serve``). Otherwise (a manager built before patching,
   or a forward being captured into a CUDA graph) the device rule ``1 <= q_len <= q_max`` and
   ``k_len > q_len`` is used, which also counts the *last prefill chunk of one token* of a split prompt
   as decode (the forward alone cannot tell the two apart). Tokens after ``cu_seq_lens_q[-1]``
   (static-shape padding) are not live. Finished requests leave the batch.
2. inside ``generate`` (the patched model's ``generate`` records the prompt length ``P``, whether the
   generation mode verifies candidates, and the stop tokens): a forward whose KV cache already holds
   ``>= P`` tokens is a decode step (``q_len == 1``) or, in assisted / prompt-lookup decoding, a
   verification step (``q_len > 1``: the last accepted token plus the candidates; every token is decode
   work). Shorter caches (the prompt, or its chunks with ``prefill_chunk_size``) are prefill. Rows whose
   input token is a stop token, and every later token of those rows, are finished: not live (they do not
   vote and are not counted), as ``generate``'s ``unfinished_sequences``. None under beam search.
3. any other forward (manual loops, lm-eval, teacher forcing, a compiled forward): decode iff a cache is
   present, it holds tokens and ``q_len <= q_max``; no cache, ``use_cache=False`` or a longer query is
   prefill.

The attention mask is never read (``docs/cases.md`` C1). Cache lengths come from ``Cache.get_seq_length()``, which
transformers resolves to the first layer that holds attention KV (hybrid caches with linear-attention /
Mamba layers first). ``StaticCache`` keeps its length in a 0-d device tensor: outside ``generate`` the
step's decode mask is then computed on the device (no host sync); inside ``generate`` the length is
counted on the host from the query lengths of the generation's forwards (the cache passed in by the
caller, if any, is read once when ``generate`` starts).

State: eager forwards publish the step in a ``contextvars.ContextVar`` (per thread / task, so two
threads generating on one model keep separate state, ``docs/cases.md`` C18). Code that ``torch.compile`` traces
reads a plain attribute instead (a ContextVar cannot be traced), which the pre-hook sets both when it is traced
itself (whole-model compilation) and when it runs eagerly around compiled regions (accelerate's
``compile_regions`` compiles the decoder layers, not the backbone, ``docs/cases.md`` C29). A compiled forward of
``generate`` (transformers compiles static-cache decode on accelerators by default) classifies by rule 2 all the
same: what ``generate`` knows (prompt length, stop tokens, finished rows) reaches the graph as data, tensors on the
generation's KV cache (:class:`GenerationData`, :func:`compiled_step`).

Self-check (``docs/cases.md`` C33): the pre-hook counts, on the host from what it already knows (shapes, the
cache object, the classification; never a device value), the forwards it classified, the decode ones, and the
forwards that look like decode steps but could not be classified as such (a cache on two or more rows and at
most ``q_max`` query tokens, read as empty or unreadable; inside ``generate``, a cache that reads shorter than
the prompt already fed). Two such forwards in a row with no decode step between them warn once
(:class:`~lynx_hf.errors.LynxNoDecodeWarning`) when the policy remaps; so does, at the first one, a forward made
inside the patched ``generate`` whose MoE blocks ran without the backbone's pre-hook (the backbone was never
called). The counts are in ``lynx_hf.stats(model).summary()``.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from . import policies
from .core import DECODE, MIXED, PREFILL, PREFILL_STEP, VERIFY, Step, host_reads_allowed
from .errors import LynxNoDecodeWarning

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


@dataclass
class Generation:
    """What the patched ``generate`` records for the forwards it makes (one per call, per context).

    ``prompt_length``: tokens of the prompt (``input_ids.shape[1]``, padding included); ``eos_ids``:
    stop tokens that finish a row (empty: no finished-row detection, e.g. beam search); ``verify``:
    the generation mode verifies candidates; ``held``: tokens the cache holds before the next forward,
    counted on the host (used when the cache keeps its length on the device); ``fed``: tokens the cache
    should hold after the forwards made so far (``held`` at the start plus their query lengths; host count,
    for the self-check only); ``finished [B]`` bool: rows that fed a stop token.
    """

    model_state: object  # the ModelState whose generate set it
    prompt_length: int
    eos_ids: tuple[int, ...]
    verify: bool
    held: int = 0
    fed: int = 0
    eos_tensor: torch.Tensor | None = None
    finished: torch.Tensor | None = None
    #: the token ids the generating model's forward was called with, where it is not the backbone (a VLM's
    #: ``...ForConditionalGeneration`` passes its text backbone ``inputs_embeds``): the stop tokens a row fed are read
    #: from them (:meth:`StepTracker._ids_hook`); ``None``: read the backbone's own input
    ids: torch.Tensor | None = None
    #: the :class:`GenerationData` of each cache this generation's forwards carried (activated by the eager pre-hook,
    #: deactivated when ``generate`` returns): what a compiled forward of this generation reads
    data: list = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.data is None:
            self.data = []


#: the attribute of a KV cache object that holds its :class:`GenerationData`
DATA_ATTR = "_lynx_generation"


class GenerationData:
    """What the patched ``generate`` knows of its forwards, as **data** a compiled forward reads: transformers compiles
    the decode forward of a static-cache ``generate`` (``GenerationMixin.get_compiled_call``: ``torch.compile`` of the
    model's ``__call__``, the backbone's pre-hook included; ``_valid_auto_compile_criteria``: by default on CUDA / XPU /
    NPU / TPU), and a compiled graph cannot read a ``ContextVar``. It lives on the generation's KV cache object (the
    one object every forward of the generation is handed: attribute :data:`DATA_ATTR`), so two generations on two
    caches never share it; the eager pre-hook creates it on the first forward that carries the cache inside
    ``generate`` and re-arms it in place at each later ``generate`` on the same cache.

    ``prompt_length``: 0-d int64 tensor on the model's device (``Generation.prompt_length``: a forward whose cache
    already holds that many tokens decodes); ``eos [E]`` int64 (the stop tokens; ``-1`` where there are none: no row
    finishes); ``finished [B]`` bool: rows that fed a stop token (as ``generate``'s ``unfinished_sequences``), updated
    in place by every decode forward, eager or compiled (the compiled graph mutates it, as it mutates
    ``StaticCache``'s ``cumulative_length``); the three are marked static addresses
    (``torch._dynamo.mark_static_address``) so CUDA graphs (``mode="reduce-overhead"``, ``CompileConfig``'s default)
    replay against them. ``verify`` (bool): the generation verifies candidates (``Generation.verify``). ``active``
    (bool): inside the ``generate`` that armed it (a cache returned by ``generate`` and decoded further by hand is
    classified by rule 3 of the module docstring again); a compiled graph is specialized on it (a guard), never on a
    tensor's value. ``owner``: the :class:`StepTracker` that armed it.
    """

    def __init__(self, owner, prompt_length: torch.Tensor, eos: torch.Tensor, finished: torch.Tensor,
                 verify: bool, stops: bool) -> None:
        self.owner = owner
        self.prompt_length = prompt_length
        self.eos = eos
        self.finished = finished
        self.verify = verify
        self.stops = stops  # some stop token finishes a row (else the step has no live mask, as in eager)
        self.active = True


def _arm(tracker, generation: Generation, cache, x: torch.Tensor) -> None:
    """Attach (or re-arm in place) the :class:`GenerationData` of ``generation`` on ``cache``, from the eager pre-hook
    of one of its forwards (``x``: that forward's query, ``[B, q]`` ids or ``[B, q, H]`` embeddings). No device read."""
    if x.dim() < 2 or cache is None:
        return
    data = getattr(cache, DATA_ATTR, None)
    if isinstance(data, GenerationData) and data.active and data in generation.data:
        return  # armed by this generation already
    batch, device = int(x.shape[0]), x.device
    eos = list(generation.eos_ids) or [-1]
    if isinstance(data, GenerationData) and data.finished.shape == (batch,) and data.finished.device == device \
            and data.eos.shape == (len(eos),):
        data.prompt_length.fill_(generation.prompt_length)
        data.eos.copy_(torch.tensor(eos, dtype=torch.int64), non_blocking=True)
        data.finished.zero_()
        data.owner, data.verify, data.stops, data.active = tracker, generation.verify, bool(generation.eos_ids), True
    else:
        data = GenerationData(tracker, torch.tensor(generation.prompt_length, dtype=torch.int64, device=device),
                              torch.tensor(eos, dtype=torch.int64, device=device),
                              torch.zeros(batch, dtype=torch.bool, device=device), generation.verify,
                              bool(generation.eos_ids))
        for tensor in (data.prompt_length, data.eos, data.finished):
            torch._dynamo.mark_static_address(tensor)
        try:
            setattr(cache, DATA_ATTR, data)
        except (AttributeError, TypeError):  # a cache object without attributes (a legacy tuple): eager only
            return
    generation.data.append(data)
    generation.finished = data.finished


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
    """Tokens held by ``cache``: an int, a 0-d device tensor (``StaticCache``), or ``None`` if unknown.

    ``Cache.get_seq_length()`` (transformers >= 5) reads the first layer that holds attention KV, so
    hybrid caches whose first layers are linear-attention / Mamba states (``is_linear``) or hold nothing
    (``DummyLayer``) report the attention length; sliding-window layers report every token seen
    (``cumulative_length``), not the window. A cache whose layer 0 cannot be read or reads empty is read
    at the first layer that is neither linear nor empty and holds keys (0 when none does). Legacy tuple
    caches: the key length of layer 0.
    """
    get = getattr(cache, "get_seq_length", None)
    if get is None:
        if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)) and cache[0]:
            return int(cache[0][0].shape[-2])
        return None
    try:
        length = get()
    except (ValueError, TypeError, AttributeError, IndexError):
        length = None
    if length is not None and not (isinstance(length, int) and length == 0):
        return length
    # layer 0 could not be read, or reads empty: the first readable attention layer that holds keys answers
    # (caches that cannot resolve their first attention layer; MiniMax's keeps its linear-attention states
    # beside ``layers`` and leaves the first layers empty)
    linear = list(getattr(cache, "is_linear", None) or [])
    dummy = list(getattr(cache, "is_dummy", None) or [])
    for layer in range(max(len(linear), len(getattr(cache, "layers", ()) or ()))):
        if (layer < len(linear) and linear[layer]) or (layer < len(dummy) and dummy[layer]):
            continue
        try:
            found = get(layer)
        except (ValueError, TypeError, AttributeError, IndexError):
            break
        if not (isinstance(found, int) and found == 0):
            return found
        length = found
    return length


# -- continuous batching --------------------------------------------------------------------------------
def _cu_seq_lens_k(kwargs):
    cu_k = kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):  # per layer type: the full-attention lengths when there are any
        cu_k = cu_k.get("full_attention", next(iter(cu_k.values()), None))
    return cu_k


def _request_phases(requests) -> list[tuple[int, bool]] | None:
    """``[(query_length, decoding)]`` per request of a continuous-batching forward, from the scheduler's
    request states, or ``None`` if they do not look like transformers' (then the device rule applies).

    A request decodes when its query starts at or after the end of its prompt: ``past >= prompt`` with
    ``past = state.position_offset - query_length`` (``prepare_batch_tensors`` has already advanced the
    offset by the query) and ``prompt = len(state.initial_tokens)`` (a request evicted and re-admitted
    re-prefills its generated tokens as part of its prompt: prefill work, correctly so)."""
    phases = []
    try:
        for future in requests:
            q = int(future.query_length)
            state = future.state
            past = int(state.position_offset) - q
            phases.append((q, past >= len(state.initial_tokens)))
    except (AttributeError, TypeError):
        return None
    return phases


def _continuous_batching(kwargs, num_tokens: int, device, q_max: int, requests=None) -> Step | None:
    cu_q = kwargs.get("cu_seq_lens_q")
    if not isinstance(cu_q, torch.Tensor) or cu_q.dim() != 1 or cu_q.numel() < 1:
        return None
    phases = None if requests is None else _request_phases(requests)
    if phases is not None and len(phases) <= cu_q.numel() - 1 and sum(q for q, _ in phases) <= num_tokens:
        real = sum(q for q, _ in phases)
        if not any(decoding for _, decoding in phases):
            return PREFILL_STEP  # prefill chunks only: nothing to remap
        if real == num_tokens and all(decoding for _, decoding in phases):
            return Step(DECODE)  # every token decodes, no padding
        decode = []
        for q, decoding in phases:
            decode.extend([decoding] * q)
        live = [True] * real + [False] * (num_tokens - real)
        decode.extend([False] * (num_tokens - real))
        return Step(MIXED, decode=torch.tensor(decode, device=device), live=torch.tensor(live, device=device),
                    decode_rows=sum(decode))
    cu_k = _cu_seq_lens_k(kwargs)
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


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def detect_step(args, kwargs, config, generation: Generation | None, requests=None) -> Step:
    """The :class:`Step` of a backbone forward called with ``args`` / ``kwargs``.

    ``config``: the ``LynxConfig`` (``phase``, ``q_max``, ``verify``); ``generation``: the
    :class:`Generation` of the patched ``generate`` this forward belongs to, or ``None``;
    ``requests``: the continuous-batching scheduler's requests of this forward (``FutureRequestState``
    list, in ``cu_seq_lens_q`` order), or ``None``. Updates ``generation`` (host token count, finished
    rows). Never reads a device value on the host (a cache length held in a CPU tensor is read in eager mode:
    ``kernels.routing_torch.host_reads_allowed``).
    """
    x = _query(args, kwargs)
    if x is None:
        return PREFILL_STEP
    if x.dim() >= 2:
        batch, q_len = int(x.shape[0]), int(x.shape[1])
    else:
        batch, q_len = 1, int(x.shape[0])
    num_tokens = batch * q_len
    if config.phase == "decode":  # decode emulation: every forward
        return Step(DECODE)
    cb = _continuous_batching(kwargs, num_tokens, x.device, config.q_max, requests)
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
        held = generation.held if isinstance(length, torch.Tensor) else int(length)
        generation.held = held + q_len
        if held < generation.prompt_length:  # the prompt (or a chunk of it)
            return PREFILL_STEP
        if q_len > 1:  # verification of candidates (assisted / prompt-lookup decoding)
            return Step(VERIFY) if generation.verify and config.verify else PREFILL_STEP
        tokens = x
        if x.dtype.is_floating_point and generation.ids is not None and generation.ids.shape[:1] == x.shape[:1]:
            tokens = generation.ids  # embeddings from a wrapper (a VLM): the ids its forward was given
        return Step(DECODE, live=_live_rows(generation, tokens))
    if q_len > config.q_max:
        return PREFILL_STEP
    if isinstance(length, torch.Tensor):
        if length.numel() == 1 and host_reads_allowed(length):
            # CPU, eager (StaticCache outside generate): read the one scalar, so the step has no masks and the
            # policy's one-call CPU path runs (lynx_hf.core.fused_step), the path the cost gate measured
            return Step(DECODE) if bool(length > 0) else PREFILL_STEP
        return Step(DECODE, decode=(length > 0).expand(num_tokens))
    return Step(DECODE) if length > 0 else PREFILL_STEP


def compiled_step(args, kwargs, config, tracker) -> Step:
    """The :class:`Step` of a backbone forward while ``torch.compile`` traces it (no ``ContextVar``, no host read):
    :func:`detect_step`'s rule 3, except inside a ``generate`` whose eager pre-hook armed the forward's cache with its
    :class:`GenerationData` (:func:`_arm`); there the rule of ``generate`` (rule 2) on that data, in the graph:

    - one query token per row: decode where the cache (its length a 0-d device tensor: ``StaticCache``) already holds
      ``prompt_length`` tokens (``decode [B]``, the same value on every row); rows whose input is a stop token are
      finished from then on: ``finished |= isin(input_ids[:, 0], eos) & decode`` in place, ``live = ~finished``;
    - more query tokens: a verification step where the generation verifies (``decode [T]`` as above), else prefill
      (a chunk of the prompt: ``prefill_chunk_size`` compiles the chunks too);

    so a compiled decode step classifies exactly as the eager one (``docs/decode-step.md``). ``tracker``: the
    :class:`StepTracker` whose pre-hook is traced."""
    cache = next((kwargs[name] for name in _CACHE_KWARGS if kwargs.get(name) is not None), None)
    data = getattr(cache, DATA_ATTR, None) if cache is not None else None
    if not (isinstance(data, GenerationData) and data.active and data.owner is tracker) \
            or config.phase != "auto" or isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor) \
            or kwargs.get("use_cache") is False:
        return detect_step(args, kwargs, config, None)
    x = _query(args, kwargs)
    length = cache_length(cache)
    if x is None or length is None or x.dim() < 2:
        return detect_step(args, kwargs, config, None)
    batch, q_len = int(x.shape[0]), int(x.shape[1])
    decoding = data.prompt_length <= length  # 0-d bool on the device
    if q_len > 1:
        if not (data.verify and config.verify):
            return PREFILL_STEP
        return Step(VERIFY, decode=decoding.expand(batch * q_len))
    decode = decoding.expand(batch)
    tokens = x
    ids = getattr(tracker, "_traced_ids", None)
    if x.dtype.is_floating_point and isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[0] == batch:
        tokens = ids  # embeddings from a wrapper (a VLM): the ids its traced forward was given (docs/cases.md C61)
    if not data.stops or tokens.dtype.is_floating_point or data.finished.shape[0] != batch:
        return Step(DECODE, decode=decode)
    fed = torch.isin(tokens[:, 0], data.eos) & decode
    data.finished.logical_or_(fed)
    return Step(DECODE, decode=decode, live=~data.finished)


def _live_rows(generation: Generation, x: torch.Tensor) -> torch.Tensor | None:
    """Rows that have not finished: a row finishes when its input is a stop token (the token it generated
    last), and stays finished (it then decodes pad tokens), as ``generate``'s ``unfinished_sequences``.
    Rows stopped by other criteria (``stop_strings``, a custom ``StoppingCriteria``) stay live."""
    if not generation.eos_ids or x.dtype.is_floating_point or x.dim() < 2:
        return None
    if generation.eos_tensor is None or generation.eos_tensor.device != x.device:
        generation.eos_tensor = torch.tensor(generation.eos_ids, dtype=x.dtype, device=x.device)
    fed_eos = torch.isin(x[:, 0], generation.eos_tensor)
    finished = generation.finished
    if finished is None or finished.shape != fed_eos.shape or finished.device != fed_eos.device:
        finished = fed_eos
    elif any(finished is data.finished for data in generation.data):
        finished.logical_or_(fed_eos)  # the cache's GenerationData: what a compiled forward of this generation reads
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

    ``model_state`` is the patched model's state (it has ``config``). Picklable and deep-copyable: the copy
    gets a fresh context variable, watches no continuous-batching manager (no forward is in flight
    in a copy) and starts its self-check counts at zero.
    """

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

    def __init__(self, model_state) -> None:
        self.model_state = model_state
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._var: contextvars.ContextVar = contextvars.ContextVar(f"lynx_step_{id(self)}", default=None)
        self._traced: Step = PREFILL_STEP
        # the token ids of the generating model's forward being traced (a VLM wrapper whose backbone receives
        # embeddings): what compiled_step reads the stop tokens from, as the eager step reads Generation.ids
        self._traced_ids: torch.Tensor | None = None
        self._managers: weakref.WeakSet = weakref.WeakSet()
        self._managers_lock = threading.Lock()  # watch() in the caller's thread, reads in the engine's thread
        self.reset_counts()

    def reset_counts(self) -> None:
        """Zero the self-check counts (:meth:`counts`); the warning may fire again."""
        self.forwards = 0  # eager backbone forwards classified
        self.decode_forwards = 0  # of them, with decode work (decode / verify / mixed)
        self.unclassified_forwards = 0  # decode-looking forwards that could not be classified as decode
        self._unclassified_run = 0  # unclassified forwards since the last decode forward
        self._warned = False

    def __getstate__(self):
        return {"model_state": self.model_state}

    def __setstate__(self, state):
        self.model_state = state["model_state"]
        self._init_runtime()

    @property
    def step(self) -> Step:
        """The step of the forward in flight in this context (``PREFILL_STEP`` outside any forward). In code
        ``torch.compile`` traces: the step the pre-hook last published in the plain attribute ``_traced``
        (set inside the graph when the backbone itself is compiled, by the eager pre-hook around compiled
        regions), shared by the threads of one model."""
        if torch.compiler.is_compiling():
            return self._traced
        frame = self._var.get()
        return PREFILL_STEP if frame is None else frame.step

    def watch(self, manager) -> None:
        """Read the request states of ``manager`` (a transformers ``ContinuousBatchingManager``) when
        classifying its forwards (rule 1 of the module docstring). Weakly held."""
        try:
            with self._managers_lock:
                self._managers.add(manager)
        except TypeError:  # not weak-referenceable: the device rule applies to its forwards
            pass

    def _requests(self, kwargs, device):
        """The scheduled requests of a continuous-batching forward, if a watched manager made it."""
        cache = kwargs.get("cache")
        if cache is None or "cu_seq_lens_q" not in kwargs or _capturing(device):
            return None
        with self._managers_lock:
            managers = list(self._managers)
        for manager in managers:
            processor = getattr(manager, "batch_processor", None)
            if processor is None or getattr(processor, "cache", None) is not cache:
                continue
            io = getattr(processor, "inputs_and_outputs", None)
            pairs = getattr(io, "io_pairs", None)  # asynchronous batching: the pair being computed
            if pairs is not None:
                io = getattr(pairs[io.current_pair], "host_io", None)
            return getattr(io, "requests_in_batch", None)
        return None

    def _generation(self) -> Generation | None:
        gen = _GENERATION.get()
        return gen if gen is not None and gen.model_state is self.model_state else None

    def _pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            self._traced = compiled_step(args, kwargs, self.model_state.config, self)
            return None
        x = _query(args, kwargs)
        requests = self._requests(kwargs, x.device) if x is not None else None
        generation = self._generation()
        fed = generation.fed if generation is not None else 0
        if generation is not None and x is not None:
            _arm(self, generation, next((kwargs[name] for name in _CACHE_KWARGS if kwargs.get(name) is not None),
                                        None), x)
        step = detect_step(args, kwargs, self.model_state.config, generation, requests)
        self._var.set(_Frame(step, self._var.get()))
        self._traced = step  # compiled regions inside this eager backbone (accelerate's compile_regions) read it
        self._count(step, x, kwargs, generation, fed)
        return None

    # -- self-check ------------------------------------------------------------------------------------
    def counts(self) -> dict:
        """The self-check counts since patching (or ``reset_stats``): ``backbone_forwards`` (eager forwards
        classified), ``decode_forwards`` (of them, with decode work), ``unclassified_forwards`` (forwards that
        looked like decode steps and were not classified as such)."""
        return {"backbone_forwards": self.forwards, "decode_forwards": self.decode_forwards,
                "unclassified_forwards": self.unclassified_forwards}

    def _count(self, step: Step, x, kwargs, generation: Generation | None, fed: int) -> None:
        """Host-side bookkeeping of one eager forward (shapes and Python objects only: no device read)."""
        self.forwards += 1
        q_len = int(x.shape[1]) if x is not None and x.dim() >= 2 else 1
        if generation is not None:
            generation.fed = fed + q_len
        if step.kind != PREFILL:
            self.decode_forwards += 1
            self._unclassified_run = 0
            return
        cache = next((kwargs[name] for name in _CACHE_KWARGS if kwargs.get(name) is not None), None)
        if cache is None or x is None or x.dim() < 2 or int(x.shape[0]) < 2 or kwargs.get("use_cache") is False \
                or q_len > self.model_state.config.q_max or "cu_seq_lens_q" in kwargs:
            return
        if generation is not None and fed < generation.prompt_length:
            return  # the prompt, or a chunk of it
        self.unclassified_forwards += 1
        self._unclassified_run += 1
        if self._unclassified_run >= 2:
            length = cache_length(cache)
            read = ("could not be read" if length is None else "is kept on the device"
                    if isinstance(length, torch.Tensor) else f"reads {int(length)}")
            where = (f"inside generate, after {fed} tokens were fed" if generation is not None
                     else "outside generate")
            self._warn(f"{self._unclassified_run} forwards in a row with a {type(cache).__name__} on "
                       f"{int(x.shape[0])} rows and {q_len} query token(s) were classified as prefill: the "
                       f"cache's length {read} ({where}). Likely cause: a cache class whose get_seq_length() "
                       f"does not count the tokens it holds, or a forward that passes a fresh cache each step")

    def check_outside_backbone(self) -> None:
        """Called by the first MoE block when it runs with no eager backbone forward in flight: inside this
        model's patched ``generate`` that means the backbone was never called (an entry point that bypasses
        it), so no step of that generate can be classified: counted and warned about at once."""
        if self._var.get() is not None or self._generation() is None:
            return  # a block called on its own, outside any generate: nothing to classify
        self.unclassified_forwards += 1
        self._warn("the MoE blocks ran inside generate without the decoder backbone's forward "
                   f"({type(self.model_state.backbone).__name__}) being called, so no step could be classified. "
                   "Likely cause: an entry point or wrapper that calls the layers directly")

    def _warn(self, what: str) -> None:
        if self._warned or not _remaps(self.model_state):
            return
        self._warned = True
        warnings.warn(LynxNoDecodeWarning(
            f"lynx_hf: {type(self.model_state.model).__name__} is patched with policy "
            f"{self.model_state.config.policy!r} but has seen no decode step it could remap: {what}. "
            f"Counts so far: {self.counts()}. LYNX is not acting; see docs/decode-step.md."), stacklevel=4)

    def _post_hook(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            self._traced = PREFILL_STEP
            self._traced_ids = None
            return None
        frame = self._var.get()
        if frame is not None:
            self._var.set(frame.parent)
            self._traced = PREFILL_STEP if frame.parent is None else frame.parent.step
        return None

    def _ids_hook(self, module, args, kwargs):
        """Pre-hook on the generating model where it is not the backbone (a VLM's ``...ForConditionalGeneration``,
        whose text backbone receives ``inputs_embeds``): records the token ids of this forward for the finished-row
        detection of the backbone forward inside it (:attr:`Generation.ids`; ``docs/cases.md`` C45). Traced by
        ``torch.compile`` (transformers' compiled static-cache decode of the wrapper): the ids go to a plain attribute
        the traced backbone pre-hook reads (:func:`compiled_step`; ``docs/cases.md`` C61)."""
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        ids = ids if isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point else None
        if torch.compiler.is_compiling():
            self._traced_ids = ids
            return None
        generation = self._generation()
        if generation is not None:
            generation.ids = ids
        return None

    def attach(self, backbone: torch.nn.Module) -> None:
        backbone.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        backbone.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        model = self.model_state.model
        if model is not backbone and isinstance(model, torch.nn.Module):
            model.register_forward_pre_hook(self._ids_hook, with_kwargs=True)

    def detach(self, backbone: torch.nn.Module) -> None:
        """Remove this tracker's hooks from ``backbone`` and the generating model (found by their tracker, so copies
        work too)."""
        for module in dict.fromkeys([backbone, self.model_state.model]):
            if not isinstance(module, torch.nn.Module):
                continue
            ours = [key for name in ("_forward_pre_hooks", "_forward_hooks")
                    for key, hook in getattr(module, name).items() if getattr(hook, "__self__", None) is self]
            for name in self._HOOK_DICTS:
                hooks = getattr(module, name, None)
                if hooks is None:
                    continue
                for key in ours:
                    if isinstance(hooks, set):
                        hooks.discard(key)
                    else:
                        hooks.pop(key, None)


def _remaps(model_state) -> bool:
    return policies.get(model_state.config.policy).remaps


def generation_scope(model_state, prompt_length: int, eos_ids, verify: bool, held: int = 0):
    """Context manager used by the patched ``generate``: publishes a :class:`Generation` for its forwards.

    ``held``: tokens the cache passed to ``generate`` already holds (0 for a fresh cache)."""
    return _Scope(Generation(model_state, int(prompt_length), tuple(int(i) for i in eos_ids), bool(verify), int(held),
                             fed=int(held)))


class _Scope:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._token = None

    def __enter__(self):
        self._token = _GENERATION.set(self.generation)
        return self.generation

    def __exit__(self, *exc):
        _GENERATION.reset(self._token)
        for data in self.generation.data:
            data.active = False
        return False
