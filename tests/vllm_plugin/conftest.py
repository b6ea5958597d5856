"""Fixtures of the plugin's unit tests (no engine): a fresh process state of the plugin per call
(``lynx_hf.vllm.state.isolated``), this process's own restored after the test."""

import contextlib
import weakref

import pytest

from lynx_hf.core import WeightRule
from lynx_hf.vllm import state


class FakeMoERunner:
    """A vLLM ``MoERunner`` stand-in (a layer keeps a weak reference to its runner; the model owns it)."""

    do_naive_dispatch_combine = False


@pytest.fixture
def plugin_state():
    """``plugin_state(options, capacity=16)`` -> ``STATE``: a fresh process state configured by ``options`` (as
    ``additional_config["lynx"]``; ``None``: the plugin off), ``capacity`` tokens per step; each call a new one."""
    with contextlib.ExitStack() as stack:
        yield lambda options, capacity=16: stack.enter_context(state.isolated(options, capacity))


@pytest.fixture
def one_layer(plugin_state):
    """``one_layer(options, num_experts=8, top_k=2, rule=softmax renormalized, runner=None, capacity=16)`` -> the
    :class:`~lynx_hf.vllm.state.Layer` of a fresh process state holding only it (index 0)."""
    held = []

    def make(options, num_experts=8, top_k=2, rule=WeightRule("softmax_all", renormalize=True), runner=None,
             capacity=16):
        st = plugin_state(options, capacity)
        runner = FakeMoERunner() if runner is None else runner
        held.append(runner)
        layer = state.Layer(index=0, name="fake", top_k=top_k, num_experts=num_experts, rule=rule,
                            runner=weakref.ref(runner))
        st.layers.append(layer)
        return layer

    return make
