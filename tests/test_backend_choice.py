"""Which expert path a backend choice resolves to (issue 12 item 5): ``auto`` never selects the sparse
Triton expert kernel (transformers' ``grouped_mm`` is the CUDA path until a GPU run measures both);
``backend="triton"`` selects it explicitly. The plan is resolved without running anything on the device."""

import torch

from lynx_hf import LynxConfig
from lynx_hf.routing import make_plan


def test_auto_on_cuda_routes_with_triton_but_keeps_transformers_experts():
    plan = make_plan(LynxConfig(backend="auto"), 8, 2, torch.device("cuda"))
    assert plan.backend == "triton" and plan.expert_kernel is False


def test_explicit_triton_selects_the_sparse_expert_kernel():
    plan = make_plan(LynxConfig(backend="triton"), 8, 2, torch.device("cuda"))
    assert plan.backend == "triton" and plan.expert_kernel is True


def test_cpu_never_uses_the_kernel_unless_asked():
    assert make_plan(LynxConfig(), 8, 2, torch.device("cpu")).expert_kernel is False
    assert make_plan(LynxConfig(backend="torch"), 8, 2, torch.device("cuda")).expert_kernel is False
