"""Shared by the plugin's unit tests: describe one engine step to the plugin's process state without a runner."""

import torch

from lynx_hf.vllm import _hooks
from lynx_hf.vllm._hooks import DECODE, PADDING


def set_kinds(kinds):
    """What the hooked input preparation (``_hooks._set_step`` / ``_write_kinds``) does for a step whose tokens have
    these kinds (``_hooks.DECODE`` / ``PREFILL`` / ``PADDING``; padding rows after the step's tokens)."""
    step = _hooks.STATE.step
    buf = _hooks._buffer(torch.device("cpu"), len(kinds))
    buf.zero_()
    buf[: len(kinds)] = torch.tensor(kinds, dtype=torch.int8)
    step.num_tokens = sum(1 for k in kinds if k != PADDING)
    step.num_decode = sum(1 for k in kinds if k == DECODE)
    step.num_prefill = step.num_tokens - step.num_decode
    step.active = True
