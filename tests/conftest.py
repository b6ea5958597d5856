"""Test setup: offline hubs, the Triton interpreter (set before anything imports triton), NaN-poisoned
``torch.empty`` for kernel tests (fla-style), tiny models."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the cost gate's per-user decision cache (lynx_hf.gate.table): one folder per test session, shared by the xdist workers
# (set here, before they start), so a test never reads a decision measured outside the session and each key is
# measured once per session. The gate itself is the product default (gate="auto"): a test that needs the policy on
# every decode step of a tiny model says so (gate="always", or the `policy_on_every_step` fixture with its reason)
if "LYNX_HF_CACHE" not in os.environ:
    import tempfile

    os.environ["LYNX_HF_CACHE"] = tempfile.mkdtemp(prefix="lynx_hf_test_cache_")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# hypothesis profiles. "dev" (the default): randomized, 100 examples per unit of a property test's share. "ci" (what
# .ci/test runs: `--hypothesis-profile ci`): a fixed, smaller budget, the same examples every run (derandomized, no
# example database). A property test states its example count once, as a share of the profile's max_examples
# (helpers.strategies.fuzz: share 3.5 is 350 examples under dev, 105 under ci). Every property test here draws tensors
# whose generation hypothesis may find slow, and times kernels it does not bound: no deadline, no too_slow check.
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("dev"), max_examples=30, derandomize=True, database=None)
settings.load_profile("dev")  # `--hypothesis-profile NAME` (hypothesis' pytest plugin) loads another after this

# under pytest-xdist (`pytest -n 2`, the README's test command) each worker gets one intra-op thread: two workers with
# two threads each on a 2-core machine oversubscribe it badly
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# tests/vllm_plugin runs in the vLLM environment only (.venv-vllm, `pytest tests/vllm_plugin`; .ci/vllm_env.sh)
collect_ignore = ["vllm_plugin"]


def _poison(t: torch.Tensor) -> torch.Tensor:
    """NaN for floats, 77 for int8 (reads as True when cast to bool), True for bool, a large negative
    sentinel for other integers: any element a kernel forgets to write shows in the comparison."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.int8:
        t.fill_(77)
    else:
        t.fill_(-123456789)
    return t


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` / ``empty_like`` poisoned (fla-style) for kernel tests."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(real_empty_like(*a, **k)))
    yield


@pytest.fixture(scope="module")
def policy_on_every_step():
    """``LYNX_HF_GATE=always`` for a module (``pytestmark = pytest.mark.usefixtures("policy_on_every_step")``; module
    scope, so the module's own module-scoped fixtures see it too): every config an entry point builds from options
    that do not name ``gate`` (``patch(model)``, ``patch(model, policy=...)``, ``patched``, a dict or a config file,
    ``lynx-hf generate``, the vLLM plugin: ``LynxConfig.from_environment``) runs the policy on every decode step; a
    ``LynxConfig`` value is taken as it is (its default gate is ``"auto"``: pass ``gate="always"``). For tests whose subject is what the policy does (remap, telemetry,
    equivalence) on a tiny model, where the cost gate (the default) rightly keeps the policy off at many step sizes;
    a module that uses it says why in a comment beside its ``pytestmark``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LYNX_HF_GATE", "always")
        yield


@pytest.fixture
def fresh_gate_store(tmp_path, monkeypatch):
    """An empty per-user decision cache (``LYNX_HF_CACHE``) for the test, and the process's decision store emptied
    before and after (``lynx_hf.gate.STORE``): the cost gate measures. Yields the cache folder."""
    from lynx_hf import gate

    monkeypatch.setenv(gate.CACHE_ENV, str(tmp_path / "gate_cache"))
    gate.STORE.reset()
    yield tmp_path / "gate_cache"
    gate.STORE.reset()


@pytest.fixture
def one_thread():
    """Tiny models: intra-op threads buy nothing and oversubscribe a shared 2-core CPU badly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- fuzz counts: every example hypothesis runs is counted and reported at the end of the session ----------
_HYPOTHESIS_CASES: dict = {}


# -- long modules first: with `-n 2 --dist loadscope --no-loadscope-reorder` (.ci/test; pyproject.toml's addopts) a
# module is one unit of work and the units go to the workers in collection order (xdist's default would hand out the
# modules with the most tests first), so a long module collected last runs alone at the end. These start first, longest
# first (seconds on one worker, measured on the 2-core CI machine: newest leg `--durations`, floor leg's plugin tests);
# every other module keeps its order after them. Only the order changes, never what runs.
LONG_MODULES = (
    "tests/vllm_plugin/test_vllm_plugin.py",          # ~250 s: engines on fixture A / B, eager and compiled
    "tests/vllm_plugin/test_vllm_item7_engines.py",   # ~190 s: four engines counted call by call
    "tests/vllm_plugin/test_vllm_engines.py",         # ~160 s: TP 2, the server, the external launcher
    "tests/vllm_plugin/test_vllm_families.py",        # ~125 s
    "tests/accelerator/test_kernels_aot.py",          # ~90 s: every kernel compiled for sm_80 / sm_90
    "tests/kernels/test_kernels_moe.py",              # ~80 s: gpu_check's dry run
    "tests/tools/test_cli.py",
    "tests/patching/test_storage_matrix.py",
    "tests/tools/test_wheel.py",
    "tests/decode/test_vlm_wrappers.py",
    "tests/accelerator/test_device_step.py",
    "tests/tools/test_bench.py",
    "tests/tools/test_slo.py",
    "tests/kernels/test_fused_step.py",
    "tests/accelerator/test_compile.py",
)


def _long_first(items) -> None:
    rank = {path: i for i, path in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONG_MODULES)))   # stable


def pytest_collection_modifyitems(items):
    _long_first(items)
    for item in items:
        handle = getattr(getattr(item, "obj", None), "hypothesis", None)
        if handle is None or getattr(handle.inner_test, "_lynx_counted", False):
            continue
        inner, name = handle.inner_test, item.nodeid.split("[")[0]

        def counted(*args, _inner=inner, _name=name, **kwargs):
            _HYPOTHESIS_CASES[_name] = _HYPOTHESIS_CASES.get(_name, 0) + 1
            return _inner(*args, **kwargs)

        counted._lynx_counted = True
        handle.inner_test = counted


def pytest_terminal_summary(terminalreporter):
    if _HYPOTHESIS_CASES:
        per_test = ", ".join(f"{name.split('::')[-1]} {count}" for name, count in sorted(_HYPOTHESIS_CASES.items()))
        terminalreporter.write_line(f"hypothesis: {sum(_HYPOTHESIS_CASES.values())} generated cases in "
                                    f"{len(_HYPOTHESIS_CASES)} property tests ({per_test})")
