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


class NotPatchedError(LynxError, RuntimeError):
    """An operation that needs a patched model (``stats``, ``reset_stats``) got an unpatched one."""
