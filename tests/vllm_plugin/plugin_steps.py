"""Shared by the plugin's unit tests: describe one engine step to the plugin without a model runner."""

from lynx_hf.vllm import steps
from lynx_hf.vllm.state import PADDING


def set_kinds(kinds):
    """What the hooked input preparation does for a step whose tokens have these kinds (``DECODE`` / ``PREFILL``;
    trailing ``PADDING`` rows are rows a padded forward adds after the step's tokens: not written)."""
    live = list(kinds)
    while live and live[-1] == PADDING:
        live.pop()
    assert PADDING not in live, "padding rows come after the step's tokens"
    steps.write_kinds(live, "cpu")
