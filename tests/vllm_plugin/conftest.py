"""Fixtures of the plugin's unit tests (no engine): a fresh process state of the plugin per call
(``lynx_hf.vllm.state.isolated``), this process's own restored after the test."""

import contextlib
import weakref

import pytest

from lynx_hf.core import WeightRule
from lynx_hf.vllm import state
from plugin_steps import moe_config


class FakeMoERunner:
    """A vLLM ``MoERunner`` stand-in (a layer keeps a weak reference to its runner; the model owns it)."""

    do_naive_dispatch_combine = False
    moe_config = moe_config()


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


def decision(on: bool):
    """A fixed cost-gate decision (no timing): on = a saving of 4 x 1 ms against a cost of 1 ms (> the margin); off =
    nothing saved."""
    from lynx_hf import gate

    return gate.decide(1.0, 4.0 if on else 0.0, 1.0, margin=gate.TUNING.margin)


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    """An empty per-user decision cache (``$LYNX_HF_CACHE``) and store for the test (the process's store forgets what
    it read, before and after), so every gate of the test gets its decisions from the measurement."""
    from lynx_hf import gate

    monkeypatch.setenv(gate.CACHE_ENV, str(tmp_path / "gate_cache"))
    gate.STORE.reset()
    yield tmp_path / "gate_cache"
    gate.STORE.reset()


@pytest.fixture
def fixed_gate(monkeypatch, fresh_store):
    """``fixed_gate(on)``: the cost gate's measurement replaced by fixed decisions (:func:`decision`), ``on`` a bool
    (every bucket) or a set of buckets it is on at; each call starts from an empty store and cache, so gates made after
    it get these decisions. Returns the list of gates measured (one entry per measurement)."""
    from lynx_hf import gate
    from lynx_hf.gate import stage as gate_stage

    calls, installs = [], []

    def install(on):
        installs.append(on)
        monkeypatch.setenv(gate.CACHE_ENV, str(fresh_store / f"install{len(installs)}"))
        gate.STORE.reset()

        def measure_layer(planned, expert_times, tuning=gate.TUNING):
            calls.append(planned)
            return {b: decision(on if isinstance(on, bool) else b in on) for b in tuning.buckets}

        monkeypatch.setattr(gate_stage, "measure_layer", measure_layer)
        return calls

    return install
