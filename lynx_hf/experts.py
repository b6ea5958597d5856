"""Routed experts in decode, through transformers' experts-implementation interface.

After a remap the experts must read only the unique experts the step uses. transformers' own
``grouped_mm`` implementation does that (well kept, CUDA and CPU); in decode on CUDA, ``generate``
switches ``grouped_mm`` to ``batched_mm``, which copies one expert matrix per (token, slot) and gains
nothing from a remap. So, for a policy that remaps, ``patch`` registers the implementation
``"lynx"`` (:data:`IMPLEMENTATION`) in ``ALL_EXPERTS_FUNCTIONS`` and ``ALL_FP8_EXPERTS_FUNCTIONS`` and
sets it with ``model.set_experts_implementation``; ``unpatch`` sets the previous one back. It chooses,
per call:

- not a decode step -> the implementation the model had (prefill bit-identical);
- decode, ``backend="triton"`` and the experts are plain dense float tensors on the compute device
  in the layout and activation the kernel implements (:func:`kernel_storage`) -> the sparse Triton
  kernel :func:`lynx_hf.kernels.moe.sparse_moe`;
- decode on CUDA -> that interface's ``grouped_mm`` (reads only the unique experts);
- otherwise -> the implementation the model had (on CPU: ``grouped_mm``, which already reads only
  the unique experts).

Experts that are not plain dense tensors (fp8 with scales, bitsandbytes / GPTQ / AWQ replacements,
accelerate offload, PEFT-wrapped or parametrized weights, unknown subclasses) always run their own
implementation with the remapped routing (issue: "never silently wrong").
"""

from __future__ import annotations

import functools
import inspect

import torch

IMPLEMENTATION = "lynx"
EXPERTS_ATTR = "_lynx_experts"  # on an experts module of a patched block: its BlockRouting
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interfaces():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    found = [ALL_EXPERTS_FUNCTIONS]
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        found.append(ALL_FP8_EXPERTS_FUNCTIONS)
    except ImportError:
        pass
    return found


@functools.lru_cache(maxsize=None)
def _class_dispatch(cls) -> tuple[object, object] | None:
    """``(experts_interface, original_forward)`` of a class wrapped by ``use_experts_implementation``."""
    forward = getattr(cls, "forward", None)
    try:
        nonlocals = inspect.getclosurevars(forward).nonlocals
    except (TypeError, ValueError):
        return None
    interface, original = nonlocals.get("experts_interface"), nonlocals.get("original_forward")
    if interface is None or original is None:
        return None
    return interface, original


def uses_interface(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` dispatches through transformers' experts-implementation interface."""
    return _class_dispatch(type(experts)) is not None and hasattr(experts, "config")


def kernel_storage(experts: torch.nn.Module) -> str | None:
    """``None`` if the sparse Triton kernel may read ``experts``' weights, else the reason it may not.

    Static part of the check (done at patch time): the standard layout (``gate_up_proj [N, 2I, H]``
    concatenated gate-first, ``down_proj [N, H, I]``, no bias, no post-expert norm), SiLU gate, plain
    ``torch.Tensor`` / ``Parameter`` storage in fp32/fp16/bf16, no parametrization (PEFT
    ``target_parameters``), no accelerate offload hook. :func:`kernel_applies` adds the cheap per-call
    device check.
    """
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (type(gate_up) in (torch.Tensor, torch.nn.Parameter) and type(down) in (torch.Tensor, torch.nn.Parameter)):
        return "expert weights are not plain tensors"
    if gate_up.dtype not in _KERNEL_DTYPES or down.dtype != gate_up.dtype:
        return f"expert weights are {gate_up.dtype}/{down.dtype} (quantized or mixed), not fp32/fp16/bf16"
    if gate_up.dim() != 3 or down.dim() != 3:
        return "expert weights are not 3-d stacked tensors"
    if not getattr(experts, "has_gate", False) or getattr(experts, "is_transposed", False):
        return "layout is not gate_up [N, 2I, H] / down [N, H, I]"
    if not getattr(experts, "is_concatenated", True) or getattr(experts, "has_bias", False) \
            or getattr(experts, "has_post_expert_norm", False):
        return "interleaved gate/up, biases or a post-expert norm"
    if type(experts)._apply_gate is not _default_apply_gate():
        return "custom gate activation"
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")):
        return "activation is not SiLU"
    if getattr(experts, "parametrizations", None):
        return "parametrized expert weights (e.g. PEFT LoRA on the experts)"
    if hasattr(experts, "_hf_hook"):
        return "accelerate hook on the experts (offloaded weights)"
    return None


@functools.lru_cache(maxsize=None)
def _default_apply_gate():
    from transformers.integrations.moe import _default_apply_gate as gate

    return gate


def kernel_applies(experts, hidden: torch.Tensor) -> bool:
    """Per-call part of the check: the weights are on the compute device (never ``meta``)."""
    return experts.gate_up_proj.device == hidden.device and experts.down_proj.device == hidden.device


def implementations(experts, name: str):
    """``(own, grouped)``: the forward function of implementation ``name`` for ``experts``' class and its
    ``grouped_mm`` (``None`` if the interface has none). Resolved at patch time (not traced)."""
    interface, original = _class_dispatch(type(experts))
    grouped = interface.get_interface("grouped_mm", original) if "grouped_mm" in interface else None
    return interface.get_interface(name, original), grouped


def _lynx_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    state = self.__dict__.get(EXPERTS_ATTR)
    if state is None:  # shares the config of a patched model but is not patched itself: HF's default
        interface, original = _class_dispatch(type(self))
        return interface.get_interface("grouped_mm" if "grouped_mm" in interface else "eager", original)(
            self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    own, grouped = state.experts_impls
    if args or kwargs or state.step.kind == "prefill":
        return own(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    plan = state.plan
    if plan is not None and plan.backend == "triton" and state.kernel_reason is None \
            and kernel_applies(self, hidden_states):
        return plan.ops.sparse_moe(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                   exact_grid=False)
    if grouped is not None and hidden_states.device.type == "cuda":
        return grouped(self, hidden_states, top_k_index, top_k_weights)
    return own(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register :data:`IMPLEMENTATION` in transformers' experts interfaces (idempotent)."""
    for interface in _interfaces():
        if IMPLEMENTATION not in interface:
            interface.register(IMPLEMENTATION, _lynx_forward)
