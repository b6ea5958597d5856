"""Typed errors of lynx_hf. Every error the package raises on bad input subclasses :class:`LynxError`."""

from __future__ import annotations


class LynxError(Exception):
    """Base class of every lynx_hf error."""


class LynxConfigError(LynxError, ValueError):
    """A :class:`~lynx_hf.LynxConfig` field has a bad type or value (the message names the field)."""


class UnsupportedModelError(LynxError, TypeError):
    """``patch`` found no MoE block of a supported family (the message lists the supported families
    and any MoE-looking classes it found)."""


class ModelConfigError(LynxError, ValueError):
    """The model's own config is inconsistent with its routing (e.g. DeepSeek group limits that
    cannot supply ``num_experts_per_tok`` experts, ``docs/cases.md`` C10); raised at patch time."""


class LynxHookError(LynxError, RuntimeError):
    """The vLLM plugin (``lynx_hf.vllm``) is configured in an engine but cannot tell which tokens decode: the
    worker's model runner is not one whose input preparation it hooks (raised at engine start), or requests
    are decoding while the hooked input preparation has reported no decode token for several consecutive
    steps (raised in the engine's step), or the hooks could not be installed on this vLLM at all (raised at engine
    start, on every configuration path: ``LYNX_VLLM_CONFIG`` in ``register()``, ``additional_config`` in the driver's
    ``EngineArgs.create_engine_config`` or at worker start). The message names the runner class and the hook it could
    not reach, or the installed vLLM version and why."""


class NotPatchedError(LynxError, RuntimeError):
    """An operation that needs a patched model (``stats``, ``reset_stats``) got an unpatched one."""


class LynxNoDecodeWarning(UserWarning):
    """A model patched with a remapping policy runs forwards that look like decode steps but none could be
    classified as one (a cache whose length cannot be read or reads empty, a backbone that is never called),
    so the policy is not acting. Warned once per model (again after ``reset_stats``); the message names what
    was seen and the likely cause, and ``lynx_hf.stats(model).summary()`` carries the counts
    (``docs/cases.md`` C33)."""


class LynxAccuracyWarning(UserWarning):
    """The default policy runs on a model whose routers measure flat on the first decode steps
    (``lynx_hf.flatness``): its <= 1 % ΔCE was measured on peaked routers, not on this kind. Warned once per patch,
    with the figure and the ``lynx-hf sweep`` command that measures the default on the model; nothing is changed."""
