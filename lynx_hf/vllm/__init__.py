"""LYNX inside vLLM: a plugin under the entry-point group ``vllm.general_plugins``.

vLLM calls :func:`register` in every process it starts (driver, engine core, workers). The plugin
is **off** unless configured, per engine, by either

- ``LLM(..., additional_config={"lynx": {"policy": "lynx"}})`` (CLI: ``--additional-config``), or
- the environment variable ``LYNX_VLLM_CONFIG='{"policy": "lynx"}'``

(a JSON object of :class:`~lynx_hf.LynxConfig` fields plus ``stats_path`` / ``stats_every``, see
:mod:`lynx_hf.vllm.config`; ``additional_config`` wins). A bad value raises
:class:`~lynx_hf.LynxConfigError` when the engine is created, before any engine process starts.
Once on, every MoE layer remaps the routing of its **decode** tokens with the configured policy
(the same core as the HF path, ``lynx_hf.core``): prefill tokens of a mixed
(chunked-prefill) step keep vLLM's routing and their experts seed the critical set; weights are
recomputed in fp32 with the router's own rule. Telemetry and run-time switching: ::

    from lynx_hf import vllm as lynx_vllm
    lynx_vllm.stats(llm)[0]["summary"]     # rank 0: unique experts per MoE layer per decode step
    lynx_vllm.configure(llm, {"policy": "oea", "oea_k0": 1})   # same engine, another policy

Importing this module never imports vLLM; a missing vLLM makes :func:`register` a no-op.

The package, by job (each module's docstring says more): :mod:`~lynx_hf.vllm.config` (the configuration),
:mod:`~lynx_hf.vllm.compat` (vLLM releases, the wrap helper, the raise-at-start guard), :mod:`~lynx_hf.vllm.install`
(the table of hooked vLLM methods), :mod:`~lynx_hf.vllm.state` (the per-process state),
:mod:`~lynx_hf.vllm.layers` (hooking each MoE layer's router; ``configure``), :mod:`~lynx_hf.vllm.routers` (each
router class's rules), :mod:`~lynx_hf.vllm.steps` (the step mask, model runners V1 / V2),
:mod:`~lynx_hf.vllm.runners` (the runners hooked by release), :mod:`~lynx_hf.vllm.op` (the custom op),
:mod:`~lynx_hf.vllm.plans` (each layer's plan and its cost gate: every call into the core, the op's one call per
step), :mod:`~lynx_hf.vllm.rows` (which rows of a call the step describes: decode, padding, gathered),
:mod:`~lynx_hf.vllm.bypass` (where the gate keeps vLLM's routing without the op, and the counts of those steps),
:mod:`~lynx_hf.vllm.ranks` (the ranks' agreement), :mod:`~lynx_hf.vllm.checks` (start check, liveness),
:mod:`~lynx_hf.vllm.telemetry` (snapshot, reset, stats file). ``config``, ``compat``, ``state``, ``steps``,
``runners``, ``rows``, ``bypass``, ``plans``, ``checks`` and ``telemetry`` import no vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from ..errors import LynxConfigError
from .config import ADDITIONAL_CONFIG_KEY, ENV_VAR, PLUGIN_KEYS, PluginConfig, parse, resolve

logger = logging.getLogger("lynx_hf.vllm")

__all__ = ["register", "stats", "reset_stats", "configure", "ENV_VAR", "ADDITIONAL_CONFIG_KEY",
           "PLUGIN_KEYS", "PluginConfig", "parse", "resolve"]


def register() -> None:
    """Entry point (``vllm.general_plugins``). Validates ``LYNX_VLLM_CONFIG`` (raising
    :class:`~lynx_hf.LynxConfigError`, which aborts engine start) and installs the hooks; they stay
    dormant in engines that are not configured. Without vLLM: returns.

    With a vLLM the hooks cannot be installed on (:func:`lynx_hf.vllm.install.install` raises ``ImportError`` /
    ``AttributeError``): configured by ``LYNX_VLLM_CONFIG``, raises :class:`~lynx_hf.LynxHookError` naming the
    installed vLLM version now; otherwise logs a warning and remembers the failure
    (:func:`lynx_hf.vllm.compat.guard`), so an engine configured by ``additional_config={"lynx": {...}}`` raises
    the same error when its configuration is first seen (the driver's ``EngineArgs.create_engine_config``, a
    worker's start), and an engine without a lynx configuration starts as without the plugin."""
    configured = parse(os.environ.get(ENV_VAR))  # raises on a bad value
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # no vLLM (or only a namespace directory named vllm)
        return
    from . import compat

    try:
        from . import install

        install.install()
    except (ImportError, AttributeError) as exc:
        error = compat.unsupported(exc)
        if configured is not None:
            raise error from exc
        first = compat.failure() is None  # vLLM calls register() again in the same process: warn once
        guarded = compat.guard(error)
        if first:
            logger.warning("lynx_hf.vllm: the plugin cannot hook this vLLM (%s); an engine configured for it will "
                           "raise at start (%s)", exc, ", ".join(guarded) or "no place to check a configuration found")


def stats(llm) -> list[dict]:
    """Telemetry of every worker of ``llm`` (a ``vllm.LLM``), one dict per worker (see
    :func:`lynx_hf.vllm.stats.snapshot`): ``rank``, ``config``, ``steps`` / ``decode_steps`` /
    ``mixed_steps``, ``layers`` (per MoE layer) and ``summary`` (means over layers, the keys of
    ``lynx_hf.stats(model).summary()``: ``unique_experts_before`` / ``_after`` per decode step,
    ``ratio``, ``remapped_fraction``, ``routing_mass_kept``, ``decode_tokens``, ... plus
    ``loaded_experts_before`` / ``_after``: experts of all live tokens of steps with decode tokens).
    Each worker also writes it to ``stats_path`` when configured. An engine started without the
    plugin returns ``config: None`` and no layers."""
    return list(llm.collective_rpc("lynx_stats"))


def reset_stats(llm) -> None:
    """Zero the telemetry of every worker of ``llm``."""
    llm.collective_rpc("lynx_reset_stats")


def configure(llm, options) -> None:
    """Switch the policy of a running engine ``llm`` (its workers re-resolve their per-layer plans;
    the telemetry restarts). ``options``: a dict (or JSON string) as ``additional_config["lynx"]``.

    Raises :class:`~lynx_hf.LynxConfigError` for a bad value (checked here first) or when the engine
    was started without the plugin (its MoE layers were not hooked; start it with
    ``additional_config={"lynx": {...}}``, e.g. ``{"policy": "none"}``)."""
    if parse(options, source="lynx_hf.vllm.configure") is None:
        raise LynxConfigError("lynx_hf.vllm.configure: empty configuration (use policy 'none')")
    done = list(llm.collective_rpc("lynx_configure", args=(options,)))
    if not all(done):
        raise LynxConfigError("lynx_hf.vllm.configure: the plugin is off in this engine (no MoE layer hooked); "
                              "start it with additional_config={'lynx': {...}}")

