"""Plugin configuration: a :class:`~lynx_hf.LynxConfig` plus the plugin's own options.

Sources, in order (the first that is set wins):

1. vLLM's ``additional_config={"lynx": {...}}`` (``--additional-config '{"lynx": {...}}'`` on the CLI);
2. the environment variable ``LYNX_VLLM_CONFIG``: a JSON object, e.g. ``'{"policy": "lynx"}'``.

Keys are :class:`~lynx_hf.LynxConfig` fields, plus the plugin-only keys in :data:`PLUGIN_KEYS`. Values
may be JSON-typed (``0.5``, ``null``, ``true``) or strings (``"0.5"``, ``"None"``, ``"true"``): they go
through :meth:`LynxConfig.from_options`, the parsing path of the CLI and of lm-eval's ``model_args``.
``"config_file": PATH`` reads a config file first (:meth:`LynxConfig.from_file`, e.g. the ``lynx_config.json``
of ``lynx-hf sweep --model``); the other keys override its fields. ``LYNX_VLLM_CONFIG`` may also be the file's
path itself (a value that does not start with ``{`` or ``[``): ``LYNX_VLLM_CONFIG=lynx_config.json``.
Nothing set (or ``LYNX_VLLM_CONFIG`` empty) means the plugin is off. This module imports no vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..config import LynxConfig
from ..errors import LynxConfigError

ENV_VAR = "LYNX_VLLM_CONFIG"
ADDITIONAL_CONFIG_KEY = "lynx"
#: keys of the plugin's own, not LynxConfig fields
PLUGIN_KEYS = ("stats_path", "stats_every", "config_file")


@dataclass(frozen=True)
class PluginConfig:
    """``lynx``: the policy; ``stats_path``: JSON file each worker writes its telemetry to (``{rank}``
    in the path is replaced by the worker's rank; otherwise ranks > 0 append ``.rank<r>``), or ``None``;
    ``stats_every``: also write it every this many steps that hold decode tokens (0: only when
    :func:`lynx_hf.vllm.stats` asks)."""

    lynx: LynxConfig = field(default_factory=LynxConfig)
    stats_path: str | None = None
    stats_every: int = 0

    def to_dict(self) -> dict:
        out = self.lynx.to_dict()
        if self.stats_path is not None:
            out["stats_path"] = self.stats_path
        if self.stats_every:
            out["stats_every"] = self.stats_every
        return out


def parse(value, source: str = ENV_VAR) -> PluginConfig | None:
    """``PluginConfig`` from a JSON string or a dict; ``None`` for ``None`` / ``""``.

    A string that does not start with ``{`` or ``[`` (JSON) is the path of a config file (as ``{"config_file": value}``).
    Raises :class:`~lynx_hf.LynxConfigError` naming ``source`` for bad JSON, a non-object, an unknown
    key, a bad value or a config file that is missing or invalid."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str) and not value.lstrip().startswith(("{", "[")):
        value = {"config_file": value.strip()}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise LynxConfigError(f"{source} is not valid JSON ({exc}): {value!r}") from None
    if isinstance(value, LynxConfig):
        return PluginConfig(lynx=value)
    if not isinstance(value, dict):
        raise LynxConfigError(f"{source} must be a JSON object of LynxConfig fields, got {value!r}")
    values = dict(value)
    config_file = values.pop("config_file", None)
    stats_path = values.pop("stats_path", None)
    stats_every = values.pop("stats_every", 0)
    if isinstance(stats_every, str) and stats_every.strip().isdigit():
        stats_every = int(stats_every)
    if stats_path is not None and not isinstance(stats_path, str):
        raise LynxConfigError(f"{source}: stats_path must be a string path, got {stats_path!r}")
    if isinstance(stats_every, bool) or not isinstance(stats_every, int) or stats_every < 0:
        raise LynxConfigError(f"{source}: stats_every must be an int >= 0, got {stats_every!r}")
    if config_file is not None and not isinstance(config_file, str):
        raise LynxConfigError(f"{source}: config_file must be a string path, got {config_file!r}")
    try:
        base = LynxConfig.from_file(config_file) if config_file is not None else None
        lynx = LynxConfig.from_options(values, base=base)
    except FileNotFoundError as exc:
        raise LynxConfigError(f"{source}: config_file: {exc}") from None
    except LynxConfigError as exc:
        raise LynxConfigError(f"{source}: {exc}") from None
    return PluginConfig(lynx=lynx, stats_path=stats_path, stats_every=stats_every)


def resolve(additional_config=None, environ=None) -> PluginConfig | None:
    """The plugin's configuration for one engine: ``additional_config["lynx"]`` if present, else the
    environment variable; ``None`` when neither is set (plugin off)."""
    if isinstance(additional_config, dict) and additional_config.get(ADDITIONAL_CONFIG_KEY) is not None:
        return parse(additional_config[ADDITIONAL_CONFIG_KEY], source='additional_config["lynx"]')
    environ = os.environ if environ is None else environ
    return parse(environ.get(ENV_VAR), source=ENV_VAR)
