"""What a plan resolves once (``lynx_hf.core.make_plan``): the routing backend, the expert path and the decode-step
function. ``expert_path="auto"`` selects the sparse Triton expert kernel on CUDA for decode steps of at least
``AUTO_KERNEL_MIN_TOKENS`` tokens (measured on an H200: from B = 4 the kernel is 3-4x faster than transformers'
``grouped_mm``, at B = 1 they tie); ``expert_path="triton"`` selects it for every step, ``"model"`` never. Plans are
resolved without running anything on the device."""

import torch

from lynx_hf import LynxConfig
from lynx_hf.core import AUTO_KERNEL_MIN_TOKENS, MoELayer, fused_step, keep_routing, make_plan, remap_step
from lynx_hf.kernels import routing_cpu


def test_auto_on_cuda_routes_with_triton_and_runs_the_kernel_from_four_tokens():
    plan = make_plan(LynxConfig(), MoELayer(8, 2, torch.device("cuda")))  # the default config
    assert plan.routing_backend == "triton" and plan.expert_kernel is True and plan.sparse_moe is not None
    assert AUTO_KERNEL_MIN_TOKENS == 4 and plan.kernel_min_tokens == AUTO_KERNEL_MIN_TOKENS
    assert [plan.uses_kernel(t) for t in (1, 2, 3, 4, 64)] == [False, False, False, True, True]


def test_auto_keeps_the_model_experts_where_nothing_is_remapped():
    cuda = torch.device("cuda")
    assert make_plan(LynxConfig(policy="none"), MoELayer(8, 2, cuda)).expert_kernel is False
    assert make_plan(LynxConfig(expert_path="model"), MoELayer(8, 2, cuda)).expert_kernel is False


def test_explicit_triton_selects_the_sparse_expert_kernel():
    plan = make_plan(LynxConfig(routing_backend="triton", expert_path="triton"), MoELayer(8, 2, torch.device("cuda")))
    assert plan.routing_backend == "triton" and plan.expert_kernel is True
    assert plan.kernel_min_tokens == 1 and plan.uses_kernel(1)


def test_expert_path_is_independent_of_the_routing_backend():
    plan = make_plan(LynxConfig(routing_backend="torch", expert_path="triton"), MoELayer(8, 2, torch.device("cuda")))
    assert plan.routing_backend == "torch" and plan.expert_kernel is True
    plan = make_plan(LynxConfig(routing_backend="triton", expert_path="model"), MoELayer(8, 2, torch.device("cuda")))
    assert plan.routing_backend == "triton" and plan.expert_kernel is False


def test_cpu_never_uses_the_kernel_unless_asked():
    assert make_plan(LynxConfig(), MoELayer(8, 2, torch.device("cpu"))).expert_kernel is False
    assert make_plan(LynxConfig(routing_backend="torch"), MoELayer(8, 2, "meta")).expert_kernel is False
    # on CUDA the expert path does not follow the routing backend: torch routing ops, the kernel from 4 tokens
    plan = make_plan(LynxConfig(routing_backend="torch"), MoELayer(8, 2, torch.device("cuda")))
    assert plan.routing_backend == "torch" and plan.uses_kernel(4) and not plan.uses_kernel(3)


# -- the decode-step function: chosen once per plan --------------------------------------------------------
def test_step_function_is_chosen_once_from_policy_shape_and_device():
    layer = MoELayer(8, 2, "cpu")
    assert make_plan(LynxConfig(policy="none"), layer).kernel is keep_routing  # nothing to remap
    assert make_plan(LynxConfig(), MoELayer(4, 4, "cpu")).kernel is keep_routing  # k = N: every token, every expert
    cpu = make_plan(LynxConfig(), layer)
    assert cpu.kernel is (fused_step if routing_cpu.AVAILABLE else remap_step)  # the one-call CPU path
    assert (cpu.fused is not None) == routing_cpu.AVAILABLE
    assert make_plan(LynxConfig(mass_price=None), layer).kernel is remap_step  # paper rule: no fused path
    assert make_plan(LynxConfig(policy="oea"), layer).kernel is remap_step
    cuda = make_plan(LynxConfig(routing_backend="torch"), MoELayer(8, 2, torch.device("cuda")))
    assert cuda.kernel is remap_step and cuda.fused is None and cuda.host_ops is cuda.ops  # no host reads off CPU


def test_host_ops_are_the_numba_twins_on_cpu():
    plan = make_plan(LynxConfig(routing_backend="torch"), MoELayer(8, 2, "cpu"))
    if routing_cpu.AVAILABLE:
        assert plan.host_ops.lynx_critical_set is routing_cpu.lynx_critical_set
        assert plan.host_ops.lynx_mass_decode is routing_cpu.lynx_mass_decode
    assert plan.ops.lynx_mass_decode is None  # the sync-free ops never read the host
