"""The plugin's state in one vLLM process (driver, engine core or worker): :data:`STATE`, an instance of
:class:`ProcessState`, grouped by the job that writes each part:

- the engine's configuration, read once (:func:`resolve_config`): ``config``, ``capacity`` (tokens per step),
  ``spec_tokens``, ``tp_size`` (tensor-parallel ranks, which agree on the cost gate's decisions), ``rank``;
- the MoE layers hooked in this process (:class:`Layer`, one per vLLM ``MoERunner``; :mod:`lynx_hf.vllm.layers`)
  and the ones the cost gate bypasses (``bypassed``; :mod:`lynx_hf.vllm.plans`);
- the step mask (:class:`StepBuffer`) and the step counters (:class:`StepCounts`; :mod:`lynx_hf.vllm.steps`);
- the start (:class:`Start`: plans made before the first forward, whether the forward is compiled;
  :func:`lynx_hf.vllm.plans.before_forward`) and the liveness rule's strikes (:mod:`lynx_hf.vllm.checks`).

:func:`isolated` gives a block of code a fresh state and restores the previous one afterwards (tests, benchmarks that
drive the op without an engine). Imports no vLLM at import time.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import LynxConfigError
from ..telemetry import BlockTelemetry
from . import config as plugin_config

if TYPE_CHECKING:
    from ..core import RoutePlan, WeightRule
    from ..gate import LayerShape

logger = logging.getLogger("lynx_hf.vllm")

#: token kinds in the step buffer: no model token (padding after the step's tokens), prefill work, decode work
PADDING, PREFILL, DECODE = 0, 1, 2


@dataclass
class Layer:
    """One MoE layer of this process (a vLLM ``MoERunner``): what :func:`lynx_hf.vllm.layers.attach` reads of it,
    its plan and its telemetry."""

    index: int
    name: str
    top_k: int
    num_experts: int
    rule: WeightRule
    runner: object = None  # weakref.ref to the MoERunner (the model owns it)
    plan: RoutePlan | None = None
    #: the layer's telemetry, the experts its steps load (``BlockTelemetry.loaded``) included
    telemetry: BlockTelemetry = field(default_factory=BlockTelemetry)
    gathered: bool | None = None  # None: not checked yet; True: rows are several ranks' tokens (left alone)
    #: the layer's own ``moe_config.is_sequence_parallel``: its router sees this rank's slice of the step's rows, which
    #: the step mask (read from row 0) does not describe (left alone; refused under a remapping policy)
    sequence_parallel: bool = False
    #: the layer belongs to the engine's drafter (MTP / EAGLE / a draft model: ``get_draft_model()``, the speculator's
    #: or V1 drafter's ``model``), which runs after the target's step with rows of its own: it keeps vLLM's routing
    #: (no op), its own calls are counted in ``calls``, and it is reported apart (``drafter_layers`` in the stats)
    drafter: bool = False
    skipped: int = 0  # calls left untouched because the step's mask does not describe their rows
    scores: object = None  # selection scores (logits -> [T, N] fp32, -inf outside allowed groups); None: fp32 logits
    router_rule: object = None  # the router class's rule (lynx_hf.vllm.routers.RouterRule); None: not derived
    #: the cost gate's layer shape (H, I from the runner's FusedMoEConfig where known; None: N and k only)
    gate_shape: LayerShape | None = None
    #: True: the cost gate keeps vLLM's routing at every step size this engine can run
    #: (:func:`lynx_hf.vllm.bypass.gated_off_everywhere`), so the router runs vLLM's own routing without the op: the
    #: layer's vLLM objects are unhooked (``rehook``)
    bypass: bool = False
    #: ``rehook(layer, hooked)`` puts the plugin's wrappers on the layer's router and runner or takes them off
    #: (:func:`lynx_hf.vllm.layers.hook_layer`, set by ``attach``; ``None``: a layer without vLLM objects)
    rehook: object = None
    #: op calls of this layer (its body entered; eager and compiled forwards, not CUDA-graph replays), the count at the
    #: last worker step with decode tokens, and consecutive such steps without a call (the liveness rule per layer)
    calls: int = 0
    seen_calls: int = 0
    misses: int = 0
    #: runs of the layer's ``MoERunner`` itself (its ``_forward_impl``, which vLLM's ``moe_forward`` calls; counted
    #: outside ``torch.compile`` tracing: eager forwards, and on a GPU the body of vLLM's opaque ``moe_forward`` op in
    #: compiled forwards too; never in CUDA-graph replays), and the count at the last liveness check: a layer is flagged
    #: only where its runner ran and its op did not (a VLM's vision experts run on some steps only: ``docs/cases.md``
    #: C63). ``None``: the runner has no ``_forward_impl`` to count (the rule then compares the layers' op calls)
    runs: int | None = None
    seen_runs: int = 0
    #: ``calls`` when the current step's input preparation ran (CUDA-graph engines: a step whose forward leaves it
    #: unchanged was a replay; :func:`lynx_hf.vllm.bypass.count_replays`)
    step_calls: int = 0


@dataclass
class StepBuffer:
    """The step mask: one int8 kind per token of the current step (:data:`PADDING` / :data:`PREFILL` /
    :data:`DECODE`) in a persistent buffer on the model's device, and the host's counts of it."""

    kind: torch.Tensor | None = None      # int8 [capacity] on the model device (persistent address)
    device: torch.device | None = None    # the device ``kind`` was made for
    staging: torch.Tensor | None = None   # int8 [capacity] host copy (``kind`` itself on CPU)
    written: int = 0                      # entries of ``staging`` the last step wrote (PADDING after them)
    #: on CUDA, pinned host copies (:func:`host_buffer`; D11): the copy to ``kind`` is truly asynchronous, so the
    #: host never refills a pinned buffer whose copy may not have run yet: two of them take turns (``spare``:
    #: ``(host copy, written, event)`` of the other one), each refilled after the event recorded behind its last copy
    copied: object = None                 # the event recorded after the last copy from ``staging`` (pinned only)
    spare: tuple | None = None
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill: int = 0
    active: bool = False                  # a step's kinds are written and its forward has not ended
    dirty: bool = False                   # kinds were written since the buffer was last zeroed


@dataclass
class StepCounts:
    """Model steps the hooked input preparation classified (reset with the telemetry, except ``seen_decode``)."""

    steps: int = 0
    decode_steps: int = 0  # ... with >= 1 decode token
    mixed_steps: int = 0  # ... with decode and prefill tokens
    seen_decode: int = 0  # steps with >= 1 decode token, never reset (the liveness rule compares it)


@dataclass
class Start:
    """What :func:`lynx_hf.vllm.plans.before_forward` settles before the worker's first forward."""

    started: bool = False  # the plans were made
    #: the forward is compiled / captured (vLLM's compiled mode, CUDA graphs): each layer's ``bypass`` was read once,
    #: when it was traced, so it cannot change any more (``configure`` refuses what would need it to)
    frozen: bool = False
    #: the forward is captured in CUDA graphs (a CUDA device, ``cudagraph_mode`` not ``NONE``, not eager): replays
    #: repeat what the op did at capture (its policy, plan, gate decision, telemetry addresses), so ``configure``
    #: refuses any change of those (:data:`lynx_hf.vllm.layers.HOST_FIELDS` are read on the host every step)
    captured: bool = False
    device: torch.device | None = None  # where the plans were made (the model runner's device)
    dtype: torch.dtype | None = None  # the model's dtype (the router logits' dtype the gate measures with)


@dataclass
class ProcessState:
    """The plugin's state in this process (see the module docstring)."""

    config: plugin_config.PluginConfig | None = None  # None: the plugin is off in this engine
    resolved: bool = False  # ``config`` was read from the engine's configuration
    capacity: int = 0  # tokens per step the mask holds (max_num_batched_tokens; 0: not known)
    spec_tokens: int = 0  # speculative tokens per request (verification counts as decode work)
    tp_size: int = 1  # tensor-parallel ranks (> 1: the cost gate's decisions are agreed, lynx_hf.vllm.ranks)
    rank: int = 0
    layers: list[Layer] = field(default_factory=list)
    bypassed: tuple = ()  # the layers whose ``bypass`` is set (their gate counts the steps it skips)
    #: every layer is bypassed: no op reads the step buffer, so a step writes only its counts
    all_bypassed: bool = False
    #: (tokens, decode rows) -> steps the bypassed layers skipped since their gates last counted them
    #: (:func:`lynx_hf.vllm.bypass.skip_bypassed`: one dict update per step, not one gate call per layer)
    pending_skips: Counter = field(default_factory=Counter)
    step: StepBuffer = field(default_factory=StepBuffer)
    counts: StepCounts = field(default_factory=StepCounts)
    start: Start = field(default_factory=Start)
    strikes: int = 0  # consecutive worker steps that scheduled decode queries the hook did not report
    #: a served step is running (``WorkerWrapperBase.execute_model``): a forward outside one is a warm-up (the
    #: Worker's JIT warm-up steps its model runner itself), checked at once (``lynx_hf.vllm.install``)
    in_worker_step: bool = False
    warned: set = field(default_factory=set)
    #: a ``stats_every`` write waiting for its device-to-host copy (``lynx_hf.vllm.telemetry.PendingWrite``)
    pending_write: object = None


STATE = ProcessState()


def target_layers() -> list[Layer]:
    """The MoE layers of the model the engine serves (:attr:`ProcessState.layers` without the drafter's)."""
    return [layer for layer in STATE.layers if not layer.drafter]


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in STATE.warned:
        STATE.warned.add(key)
        logger.warning(message)


def resolve_config(vllm_config) -> plugin_config.PluginConfig | None:
    """This process's configuration, read once from ``vllm_config`` (vLLM's ``VllmConfig``: its
    ``additional_config["lynx"]``, else ``LYNX_VLLM_CONFIG``; :func:`lynx_hf.vllm.config.resolve`), with the step
    capacity (``max_num_batched_tokens``), the speculative tokens per request and the tensor-parallel size; later calls
    return it as read."""
    if not STATE.resolved:
        additional = getattr(vllm_config, "additional_config", None)
        STATE.config = plugin_config.resolve(additional if isinstance(additional, dict) else None)
        STATE.resolved = True
        scheduler = getattr(vllm_config, "scheduler_config", None)
        STATE.capacity = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
        spec = getattr(vllm_config, "speculative_config", None)
        STATE.spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        tp_size = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
        STATE.tp_size = tp_size if isinstance(tp_size, int) and tp_size > 1 else 1
        if STATE.config is not None:
            logger.info("lynx_hf.vllm: policy %s (%s)", STATE.config.lynx.policy, STATE.config.to_dict())
    return STATE.config


def new_engine(vllm_config) -> plugin_config.PluginConfig | None:
    """A worker of a new engine is being built in this process (``WorkerWrapperBase.init_worker``, before its model is
    loaded; every executor, and every engine of a process that starts several one after another, as notebooks and
    sweeps do with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): :data:`STATE` starts afresh and this engine's own
    configuration is read from ``vllm_config`` (:func:`resolve_config`). Without this a second engine kept the first
    one's configuration (``None`` where the first ran without the plugin: policy ``off``, 0 decode steps).

    Raises :class:`~lynx_hf.LynxConfigError` while MoE layers hooked by an earlier engine of this process are still
    alive (after a garbage collection): the plugin's state is per process, so two live engines in one process cannot
    each have their own; nothing is changed then."""
    if STATE.layers:
        gc.collect()  # a deleted engine's model may sit in reference cycles
        alive = [layer.name for layer in STATE.layers if layer.runner is not None and layer.runner() is not None]
        if alive:
            raise LynxConfigError(
                f"lynx_hf.vllm: a new vLLM engine is starting in this process while {len(alive)} MoE layers an "
                f"earlier engine hooked are still alive ({alive[0]}, ...): the plugin keeps one state per process, "
                "so a second live engine cannot have its own configuration. Delete the first engine first "
                "(del llm; gc.collect()), or run each engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, "
                "vLLM's default).")
    vars(STATE).clear()
    vars(STATE).update(vars(ProcessState()))
    return resolve_config(vllm_config)


@contextlib.contextmanager
def isolated(options=None, capacity: int = 0):
    """A fresh :data:`STATE` for the block (no layer, no step, nothing started), configured by ``options`` (as
    ``additional_config["lynx"]``; ``None``: the plugin off) with ``capacity`` tokens per step; the previous state is
    restored afterwards. Yields :data:`STATE` (the same object every module reads)."""
    saved = dict(vars(STATE))
    vars(STATE).update(vars(ProcessState()))
    STATE.config = plugin_config.parse(options, source="lynx_hf.vllm.state.isolated")
    STATE.resolved = True
    STATE.capacity = int(capacity)
    try:
        yield STATE
    finally:
        vars(STATE).clear()
        vars(STATE).update(saved)


def device_buffer(capacity: int, device: torch.device) -> torch.Tensor:
    """A zeroed int8 ``[capacity]`` tensor on ``device`` (the kinds buffer)."""
    return torch.zeros(capacity, dtype=torch.int8, device=device)


def host_buffer(capacity: int, pin: bool) -> torch.Tensor:
    """A zeroed int8 ``[capacity]`` host tensor, in page-locked (pinned) memory where ``pin``: a host-to-device copy
    from it is a plain DMA, truly asynchronous (from pageable memory the driver first copies it into a pinned buffer of
    its own, on the host, in the step)."""
    return torch.zeros(capacity, dtype=torch.int8, pin_memory=pin)


def pinned(device: torch.device) -> bool:
    """Whether the host copies of the kinds for ``device`` are pinned: a CUDA device (ROCm included) and a torch
    that can pin memory there."""
    return device.type == "cuda" and torch.cuda.is_available()


def buffer(device: torch.device, rows: int) -> torch.Tensor:
    """The persistent int8 kinds buffer on ``device`` (allocated zero, ``max(capacity, rows)`` long, on first use),
    and its host copies: on CPU the buffer itself; on CUDA two pinned ones that take turns (:class:`StepBuffer`,
    ``spare``; issue 54 D11, docs/cases.md C67); else one pageable one."""
    step = STATE.step
    if step.kind is None or step.device != device:
        capacity = max(STATE.capacity, rows, 1)
        step.kind, step.device = device_buffer(capacity, device), device
        step.copied = step.spare = None
        if device.type == "cpu":
            step.staging = step.kind
        elif pinned(device):
            step.staging, step.copied = host_buffer(capacity, True), torch.cuda.Event()
            step.spare = (host_buffer(capacity, True), 0, torch.cuda.Event())
        else:
            step.staging = host_buffer(capacity, False)
        step.written = 0
    return step.kind


def take_turns(step: StepBuffer) -> None:
    """Pinned host copies (``step.spare``): the other one becomes ``step.staging``, once the copy last made from it
    has run (its event: it was recorded a step ago, so the host practically never waits)."""
    host, written, copied = step.spare
    step.spare = (step.staging, step.written, step.copied)
    step.staging, step.written, step.copied = host, written, copied
    copied.synchronize()


__all__ = ["buffer", "device_buffer", "host_buffer", "pinned", "take_turns",
           "STATE", "ProcessState", "Layer", "target_layers", "StepBuffer", "StepCounts", "Start", "PADDING", "PREFILL", "DECODE",
           "warn_once", "resolve_config", "new_engine", "isolated"]
