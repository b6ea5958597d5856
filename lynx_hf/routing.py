"""The one interception point: post-process a MoE block's routing in decode (DESIGN.md "Direction").

A decode step flows: backbone pre-hook (``lynx_hf.step``: which tokens decode) -> the block's own
forward -> its router -> **router forward hook** (:meth:`BlockRouting.router_hook`: fp32 selection
scores, policy critical set, remap, family weight rule, merged per token with the model's own
routing) -> the block's own forward calls the model's own experts with that routing (through
transformers' experts-implementation interface, see ``lynx_hf.experts``) -> output.

Nothing here knows HF class names: the family spec (``lynx_hf.patches``) says which child is the
router, how to get selection scores and which weight rule to reproduce. Llama-4 is the one family
whose block forward is replaced (HF computes its experts densely); it calls :meth:`BlockRouting.route`.

Everything in a decode step is sync-free (no ``.item()``, no data-dependent shapes): per-token
choices are merged with ``torch.where``; telemetry accumulates on the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import policies
from .kernels.backend import resolve_backend, routing_ops
from .kernels.routing_torch import host_reads_allowed, union_mask
from .step import PREFILL, VERIFY, Step
from .telemetry import BlockTelemetry

BLOCK_ATTR = "_lynx_block"  # on a Llama-4 block whose forward is swapped (removed by unpatch)


@dataclass(frozen=True)
class RoutePlan:
    """What a block resolved once (at patch time, again only if its device changes)."""

    device: torch.device
    backend: str  # "torch" | "triton"
    policy: policies.Policy
    params: object
    ops: object
    # the sparse Triton expert kernel runs only when chosen explicitly (``backend="triton"``); ``"auto"`` on
    # CUDA uses transformers' ``grouped_mm`` until a GPU run measures which is faster per shape [issue 12 item 5]
    expert_kernel: bool = False
    # the policy's one-call CPU decode step (Policy.fused_decode), or None [issue 12: routing overhead on CPU]
    fused: object = None


class BlockRouting:
    """The patch state of one MoE block (plain Python object, never a module)."""

    def __init__(self, owner, spec, name: str, block: torch.nn.Module) -> None:
        self.owner = owner  # lynx_hf.patcher.ModelState
        self.spec = spec
        self.name = name
        self.block = block
        self.router = spec.router_of(block)
        self.experts = spec.experts_of(block)
        self.num_experts, self.top_k = spec.shape(block)
        self.rule = spec.weight_rule(block)  # None: verified on the first decode call (generic spec)
        self.identity = self.top_k >= self.num_experts  # every token uses every expert: nothing to remap
        # (and a step of one token keeps its own top-k under every shipped policy: skipped statically)
        self.telemetry = BlockTelemetry()
        self.plan: RoutePlan | None = None
        self.original_impl: str | None = None  # the experts implementation before "lynx" (lynx_hf.experts)
        self.experts_impls = (None, None)  # its forward function and the interface's grouped_mm
        self.kernel_reason: str | None = "not checked"  # why the sparse kernel may not read the experts
        self.grouped_reason: str | None = "not checked"  # why grouped_mm may not (lynx_hf.experts.install) [issue 15]
        self._forward_attr = None  # (attribute, had instance value, previous value) for Llama-4

    def __getstate__(self):  # pickle / deepcopy: the spec by family, the plan re-resolved on first use
        state = dict(self.__dict__)
        state["spec"] = self.spec.family
        state["plan"] = None
        state["experts_impls"] = (None, None)  # functions local to transformers' decorator: resolved again [issue 15]
        return state

    def __setstate__(self, state):
        from .patches import SPECS

        state["spec"] = next(spec for spec in SPECS if spec.family == state["spec"])
        self.__dict__.update(state)
        if state.get("original_impl") is not None:  # the copied config names "lynx": a fresh process needs it [issue 15]
            from .experts import register

            register()

    # -- resolution ----------------------------------------------------------------------------
    def resolve(self, device: torch.device | None = None) -> RoutePlan:
        """Resolve backend, policy parameters and kernels for ``device`` (default: the router's)."""
        if device is None:
            device = _param_device(self.router) or _param_device(self.block) or torch.device("cpu")
        self.plan = make_plan(self.owner.config, self.num_experts, self.top_k, device)
        return self.plan

    def _plan_for(self, device: torch.device) -> RoutePlan:
        plan = self.plan
        if plan is None or plan.device != device:
            plan = self.resolve(device)
        return plan

    # -- installation ------------------------------------------------------------------------------
    def install(self) -> None:
        if self.spec.decode_forward is not None:
            self._install_forward()
        else:
            self.router.register_forward_hook(self.router_hook)

    def uninstall(self) -> None:
        if self.spec.decode_forward is not None:
            self._uninstall_forward()
            return
        hooks = self.router._forward_hooks
        for key in [k for k, hook in hooks.items() if getattr(hook, "__self__", None) is self]:
            del hooks[key]

    def _install_forward(self) -> None:
        block = self.block
        # accelerate hooks wrap ``forward`` and call ``_old_forward``: swap that one so hooks stay.
        attr = "_old_forward" if hasattr(block, "_hf_hook") and "_old_forward" in block.__dict__ else "forward"
        had = attr in block.__dict__
        previous = block.__dict__.get(attr)
        self._forward_attr = (attr, had, previous)
        object.__setattr__(block, attr, SwappedForward(self))
        object.__setattr__(block, BLOCK_ATTR, self)

    def _uninstall_forward(self) -> None:
        block = self.block
        attr, had, previous = self._forward_attr
        for where in ("forward", "_old_forward"):
            current = block.__dict__.get(where)
            if not (isinstance(current, SwappedForward) and current.state is self):
                continue
            if where != attr:  # accelerate wrapped our forward after patch: put the original under it
                object.__setattr__(block, where, previous if had else type(block).forward.__get__(block))
            elif had:
                object.__setattr__(block, where, previous)
            else:
                del block.__dict__[where]
            break
        block.__dict__.pop(BLOCK_ATTR, None)

    def original_forward(self, *args, **kwargs):
        """The block's forward as it was before patching (Llama-4 only)."""
        attr, had, previous = self._forward_attr
        if had:
            return previous(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)

    # -- decode ------------------------------------------------------------------------------------
    @property
    def step(self) -> Step:
        return self.owner.tracker.step

    def router_hook(self, module, args, output):
        """Forward hook on the router: the remapped ``(router_logits, weights, indices)`` in decode, else
        ``None`` (the router's own output object, untouched)."""
        if not self.rule and not self._verify_deferred(output):  # None: not verified yet; False: refused
            return None
        step = self.step
        if step.kind == PREFILL:
            return None
        logits, weights, idx = self.spec.unpack(output)
        new_weights, new_idx = self.route(step, logits, weights, idx)
        if new_idx is idx:
            return None
        return self.spec.repack(output, logits, new_weights, new_idx)

    def _verify_deferred(self, output) -> bool:
        """Generic spec, router not materialized at patch time (accelerate offload): verify its rule on its
        real output, on the first call (prefill or decode) with at least as many tokens as the patch-time
        probe (``spec.probe_tokens``). Until then the block keeps the model's own routing: a check on a few
        tokens proves little (a group-limited or bias-corrected router can agree with plain top-k on one
        token by chance). A refusal warns once and the block keeps the model's own routing for good."""
        from .errors import UnsupportedModelError

        if self.rule is False:
            return False
        logits = output[0] if isinstance(output, (tuple, list)) and output else None
        if isinstance(logits, torch.Tensor) and logits.dim() >= 1 and \
                logits.shape[0] < getattr(self.spec, "probe_tokens", 1):
            return False
        try:
            self.rule = self.spec.deferred_rule(self.block, self.name, output)
            self.num_experts, self.top_k = self.spec.shape(self.block)
            return True
        except UnsupportedModelError as exc:
            warnings.warn(f"lynx_hf: {exc}; this block keeps the model's own routing", stacklevel=3)
            self.rule = False
            return False

    def route(self, step: Step, logits: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
        """``(weights, idx)`` for one step: the policy's remap on the decode tokens, the model's own on the
        others. ``logits [T, N]``, ``weights [T, k]`` (any float dtype), ``idx [T, k]`` int."""
        cfg = self.owner.config
        plan = self._plan_for(logits.device)
        if not plan.policy.remaps or self.identity or (idx.shape[0] == 1 and plan.policy.single_token_identity):
            if cfg.telemetry:
                self._record(step, idx, weights, idx, None)
            return weights, idx
        scores = self.spec.selection_scores(self.router, logits)
        if plan.fused is not None and step.decode is None and host_reads_allowed(logits):
            # CPU eager, every token decodes: the policy's one-call path (None: a non-finite row, see below)
            out = plan.fused(scores, logits, weights, idx, self.rule, step.live, telemetry=cfg.telemetry,
                             verify=step.kind == VERIFY)
            if out is not None:
                new_weights, new_idx, row = out
                if row is not None:
                    self.telemetry.add(row)
                return new_weights, new_idx
        new_weights, new_idx, finite = remap(plan, self.rule, step, scores, logits, weights, idx)
        if cfg.telemetry:
            self._record(step, idx, weights, new_idx, finite)
        return new_weights, new_idx

    def _record(self, step: Step, idx, weights, new_idx, finite) -> None:
        record_step(self.telemetry, self.num_experts, step, idx, weights, new_idx, finite)


@torch.no_grad()
def record_step(telemetry, num_experts: int, step: Step, idx, weights, new_idx, finite):
    """Accumulate one step of one MoE layer into ``telemetry`` (a ``BlockTelemetry``), on the device:
    live decode tokens are counted (before ``idx [T, k]`` / ``weights [T, k]``, after ``new_idx``), prefill
    and finished rows separately, ``finite [T]`` bool (or ``None``) flags the non-finite fallback. Shared by
    the HF path and serving-engine plugins (``lynx_hf.vllm``). Returns ``(counted, live)``, ``[T]`` bool."""
    num_tokens = idx.shape[0]
    dev = idx.device
    decode = torch.ones(num_tokens, dtype=torch.bool, device=dev) if step.decode is None else step.decode
    live = torch.ones(num_tokens, dtype=torch.bool, device=dev) if step.live is None else step.live
    counted = decode & live
    telemetry.record(
        num_experts, idx, weights, new_idx, counted,
        verify=step.kind == VERIFY,
        prefill_rows=None if step.decode is None else ~decode & live,
        finished_rows=None if step.live is None else decode & ~live,
        fallback=None if finite is None else (counted & ~finite).any(),
    )
    return counted, live


def make_plan(config, num_experts: int, top_k: int, device: torch.device) -> RoutePlan:
    """Resolve a config for one MoE layer of ``num_experts`` experts, top-``top_k``, on ``device``:
    backend, policy parameters, kernels (also used by serving-engine plugins, ``lynx_hf.vllm``)."""
    device = torch.device(device)
    policy = policies.get(config.policy)
    backend = resolve_backend(config.backend, device) if device.type != "meta" else "torch"
    params = policy.resolve(config, num_experts, top_k)
    ops = routing_ops(backend)
    return RoutePlan(device, backend, policy, params, ops,
                     expert_kernel=backend == "triton" and config.backend == "triton",
                     fused=policy.fused_decode(params, ops))


def remap(plan: RoutePlan, rule, step: Step, scores, logits, weights, idx):
    """The policy's routing for the decode tokens of ``step``, the model's own for the others.

    ``scores [T, N]`` fp32 selection scores (``-inf``: forbidden), ``logits [T, N]`` the router logits
    (the weight ``rule`` is applied to them), ``weights`` / ``idx [T, k]`` the model's own routing.
    Returns ``(weights [T, k] in weights.dtype, idx [T, k] in idx.dtype, finite [T] bool)``. Rows whose
    router logits are not finite keep the model's routing (counted as fallbacks) and, like prefill
    rows, seed the critical set with their experts; finished rows are remapped into the set but do
    not vote. Sync-free. The engine-independent core: the HF router hook and the vLLM plugin call it.
    """
    num_tokens, num_experts = logits.shape
    top_k = idx.shape[-1]
    dev = logits.device
    finite = torch.isfinite(logits).all(dim=-1)
    if step.decode is None and step.live is None and host_reads_allowed(logits) and bool(finite.all()):
        # CPU, eager: every token decodes and is finite (one memory read, no device): no masks to merge
        idx64 = idx if idx.dtype == torch.int64 else idx.long()
        critical = plan.policy.critical_set(plan.params, plan.ops,
                                            policies.StepTensors(scores, idx64, weights, None, None, top_k))
        logits32 = logits if logits.dtype == torch.float32 else logits.float()
        new_idx, new_weights = plan.ops.remap(scores, critical, top_k, logits32, rule.rule, rule.renormalize,
                                              rule.scale)
        return new_weights.to(weights.dtype), new_idx.to(idx.dtype), finite
    decode = torch.ones(num_tokens, dtype=torch.bool, device=dev) if step.decode is None else step.decode
    live = torch.ones(num_tokens, dtype=torch.bool, device=dev) if step.live is None else step.live
    remapped = decode & finite
    vote = remapped & live
    keep = (~decode | ~finite) & live
    idx64 = idx.long()
    scores = torch.where(finite[:, None], scores, torch.zeros_like(scores))
    seed = union_mask(idx64, num_experts, keep)
    tensors = policies.StepTensors(scores, idx64, weights, vote, seed, top_k)
    critical = plan.policy.critical_set(plan.params, plan.ops, tensors)
    logits32 = torch.where(finite[:, None], logits.float(), torch.zeros_like(logits, dtype=torch.float32))
    new_idx, new_weights = plan.ops.remap(scores, critical, top_k, logits32, rule.rule, rule.renormalize, rule.scale)
    rows = remapped[:, None]
    out_idx = torch.where(rows, new_idx, idx64).to(idx.dtype)
    out_weights = torch.where(rows, new_weights.to(weights.dtype), weights)
    return out_weights, out_idx, finite


def _param_device(module) -> torch.device | None:
    for p in module.parameters(recurse=True):
        return p.device
    return None


class SwappedForward:
    """The ``forward`` of a block whose family replaces it in decode (Llama-4); the block's own in prefill."""

    def __init__(self, state: BlockRouting) -> None:
        self.state = state

    def __call__(self, *args, **kwargs):
        state = self.state
        step = state.step
        if step.kind == PREFILL:
            return state.original_forward(*args, **kwargs)
        return state.spec.decode_forward(state, step, *args, **kwargs)
