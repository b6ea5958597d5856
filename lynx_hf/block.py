"""The HF block state: one patched MoE block's routing interception (``docs/design.md`` "Direction").

A decode step flows: backbone pre-hook (``lynx_hf.detection``: which tokens decode) -> the block's own
forward -> its router -> **router forward hook** (:meth:`BlockRouting.router_hook`: the plan's decode-step
function, ``lynx_hf.core``: fp32 selection scores, policy critical set, remap, family weight rule, merged
per token with the model's own routing) -> the block's own forward calls the model's own experts with that
routing (through transformers' experts-implementation interface, see ``lynx_hf.experts``) -> output.

Nothing here knows HF class names: the family spec (``lynx_hf.patches``) says which child is the
router, how to get selection scores and which weight rule to reproduce. Llama-4 is the one family
whose block forward is replaced (HF computes its experts densely); it calls :meth:`BlockRouting.route`.
"""

from __future__ import annotations

import hashlib
import warnings

import torch

from . import gate
from .core import (
    PREFILL,
    PREFILL_STEP,
    MoELayer,
    RoutePlan,
    Step,
    StepInputs,
    host_reads_allowed,
    make_plan,
)
from .errors import UnsupportedModelError
from .experts import ExpertsPath, implementations, register, unwrap
from .kernels.step_spec import FusedSelection
from .patches import SPECS
from .patches.base import fp32_logits  # the family specs' default selection scores (the logits in fp32)
from .patches.generic import AmbiguousRule
from .selection import live_tensor
from .telemetry import BlockTelemetry, mode_of

BLOCK_ATTR = "_lynx_block"  # on a Llama-4 block whose forward is swapped (removed by unpatch)

#: ``BlockRouting.rule_status``: the weight rule is known (``rule`` set), not verified yet (the router was
#: not materialized at patch time: verified on its first large enough call), or refused (the block keeps
#: the model's own routing for good)
RULE_VERIFIED, RULE_PENDING, RULE_REFUSED = "verified", "pending", "refused"


class BlockRouting:
    """The patch state of one MoE block (plain Python object, never a module): its routing. Every attribute is set in
    ``__init__``; the features write only the ones declared for them there (``offload``, ``offload_reason``:
    ``lynx_hf.offload``; the experts path: ``lynx_hf.experts``). What the cost gate weighs of the block is read by
    ``lynx_hf.facts`` (a ``lynx_hf.gate.LayerFacts``)."""

    def __init__(self, model_state, spec, name: str, block: torch.nn.Module, rule) -> None:
        """``rule``: the block's ``lynx_hf.patches.base.BlockRule``, what ``spec.validate`` returned for it."""
        self.model_state = model_state  # lynx_hf.patcher.ModelState
        self.spec = spec  # the family spec (lynx_hf.patches.FamilySpec)
        self.name = name
        self.block = block
        self.router = spec.router_of(block)
        self.experts = spec.experts_of(block)
        self.num_experts, self.top_k = rule.num_experts, rule.top_k
        self.rule = rule.weight  # None until verified (generic family spec, router not materialized)
        # the generic spec's verified selection-bias rule (lynx_hf/selection.py), None: spec.selection_scores
        self.selection = rule.selection
        self.rule_status = RULE_VERIFIED if self.rule is not None else RULE_PENDING
        # why verification is deferred though the router is materialized (the probe could not tell candidate rules
        # apart, docs/cases.md C42), the (module, path) of the tensors that depends on, and their fingerprint when it
        # was last found ambiguous: verified again only once one of them changes (load_state_dict)
        self.pending_reason: str | None = rule.pending_reason
        self.watch: tuple = rule.watch
        self.watched = self._fingerprint() if rule.watch else None
        self.telemetry = BlockTelemetry()
        self.plan: RoutePlan | None = None
        # what lynx_hf.experts.install decided for the experts (lynx_hf.experts.ExpertsPath: the implementation they
        # had, why a sparse path may not read their weights; None: not checked, neither sparse path runs), and the
        # functions of that implementation (its forward, the interface's grouped_mm, the compiled one), resolved once
        self.experts_path = None
        self.experts_impls = (None, None, None)
        self._forward_attr = None  # (attribute, had instance value, previous value) for Llama-4
        # experts offloaded by accelerate (lynx_hf.offload.install / remove): the OffloadedExperts reading them per
        # expert (None: not read per expert) and why not (None: they are, or not looked at)
        self.offload = None
        self.offload_reason: str | None = None
        # the cost gate kept the model's own routing on the last decode step (lynx_hf.gate: Routed.gated_off), so the
        # "lynx" experts implementation runs the model's own (lynx_hf.experts); set by the router hook every decode step
        self.gated_off = False
        # a copy's cost-gate decisions (key, decisions, source) from the block it was copied from (__getstate__),
        # taken by its gate where the copy's key differs from that one at most in the thread count (lynx_hf.gate)
        self.carried_gate = None

    @property
    def kernel_allowed(self) -> bool:
        """Whether the sparse Triton kernel may read the experts' weights (checked at patch time: ``experts_path``)."""
        return self.experts_path is not None and self.experts_path.kernel_reason is None

    @property
    def grouped_allowed(self) -> bool:
        """Whether transformers' ``grouped_mm`` may read the experts' weights (checked at patch time)."""
        return self.experts_path is not None and self.experts_path.grouped_reason is None

    def set_experts_path(self, path) -> None:
        """Take what ``lynx_hf.experts.install`` decided for this block's experts (an ``ExpertsPath`` or ``None``); the
        functions of its implementation are resolved now where the experts dispatch through the interface."""
        self.experts_path = path
        self.experts_impls = (None, None, None)
        if path is not None and path.original is not None:
            self.experts_impls = implementations(unwrap(self.experts)[0], path.original)

    def __getstate__(self):  # pickle / deepcopy: the family spec by family name, the plan re-resolved on first use
        state = dict(self.__dict__)
        state["spec"] = self.spec.family
        # the cost gate's decisions travel with the copy (docs/cases.md C59): resolved again at another thread count
        # the copy would look up or measure another key inside its first generate and could decide otherwise
        planned = gate.of(self.plan)
        if planned is not None and planned.key is not None:
            state["carried_gate"] = (planned.key, dict(planned.decisions), planned.source)
        state["plan"] = None
        state["experts_impls"] = (None, None, None)  # functions local to transformers' decorator: resolved again
        return state

    def __setstate__(self, state):
        state["spec"] = next(spec for spec in SPECS if spec.family == state["spec"])
        # a state pickled before these attributes existed
        state.pop("extra_expert_ms", None)  # pickled before the transfer cost moved to lynx_hf.facts.layer_facts
        if "experts_path" not in state:  # pickled before lynx_hf.experts.install returned an ExpertsPath
            old = [state.pop(name, None) for name in ("original_impl", "kernel_reason", "grouped_reason")]
            state["experts_path"] = ExpertsPath(*old) if state.pop("storage_checked", False) else None
        for name, value in (("selection", None), ("offload", None), ("offload_reason", None), ("gated_off", False),
                            ("pending_reason", None), ("watch", ()), ("watched", None), ("carried_gate", None)):
            state.setdefault(name, value)
        self.__dict__.update(state)
        self.experts_impls = (None, None, None)  # resolved again on first use (a state pickled with two entries too)
        if state.get("experts_path") is not None and state["experts_path"].original is not None:
            # the copied config names "lynx": a fresh process needs it
            register()

    def prepare_telemetry(self) -> None:
        """Allocate the telemetry accumulators on the router's device now, outside any compiled region
        (:meth:`lynx_hf.telemetry.BlockTelemetry.ensure`; a router without parameters: left to the first step)."""
        device = _param_device(self.router)
        if device is not None:
            self.telemetry.ensure(device)

    # -- resolution ----------------------------------------------------------------------------
    def resolve(self, device: torch.device | None = None) -> RoutePlan:
        """Resolve the plan for ``device`` (default: the router's): backend, policy parameters, kernels, decode-step
        function (``lynx_hf.core.make_plan``) and the stages the patcher composes around it
        (``lynx_hf.patcher.PLAN_STAGES``: each feature's ``fn(block, config)``)."""
        if device is None:
            device = _param_device(self.router) or _param_device(self.block) or torch.device("cpu")
        config = self.model_state.config
        stages = [stage for make in self.model_state.plan_stages if (stage := make(self, config)) is not None]
        self.plan = make_plan(config, MoELayer(self.num_experts, self.top_k, device,
                                               moe_layers=len(self.model_state.blocks)), stages=stages)
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
        return self.model_state.tracker.step

    def router_hook(self, module, args, output):
        """Forward hook on the router: the remapped ``(router_logits, weights, indices)`` in decode, else
        ``None`` (the router's own output object, untouched)."""
        if self.rule_status != RULE_VERIFIED and not self._verify_deferred(output):
            self._note_unrouted(output)
            return None
        step = self.step
        if step.kind == PREFILL:
            self.check_entry(step)
            return None
        logits, weights, idx = self.spec.unpack(output)
        new_weights, new_idx = self.route(step, logits, weights, idx)
        if new_idx is idx:
            return None
        return self.spec.repack(output, logits, new_weights, new_idx)

    def check_entry(self, step: Step) -> None:
        """Self-check of the first patched block, in eager code: ran with no backbone forward in flight
        (``StepTracker.check_outside_backbone``)."""
        if step is PREFILL_STEP and not torch.compiler.is_compiling() and self.model_state.blocks \
                and self.model_state.blocks[0] is self:
            self.model_state.tracker.check_outside_backbone()

    def _verify_deferred(self, output) -> bool:
        """Generic spec, router not materialized at patch time (accelerate offload): verify its rule on its
        real output, on the first call (prefill or decode) with at least as many tokens as the patch-time
        probe (``spec.probe_tokens``). Until then the block keeps the model's own routing: a check on a few
        tokens proves little (a group-limited or bias-corrected router can agree with plain top-k on one
        token by chance). A refusal warns once and the block keeps the model's own routing for good.
        Also a router whose patch-time probe could not tell candidate rules apart (:attr:`pending_reason`,
        ``docs/cases.md`` C42): verified again only once a tensor it depends on changed (:attr:`watch`, e.g. the
        selection bias after ``load_state_dict``), on this output and else on the probe through the router; while
        still ambiguous the block keeps the model's own routing."""
        if self.rule_status == RULE_REFUSED:
            return False
        logits = output[0] if isinstance(output, (tuple, list)) and output else None
        if isinstance(logits, torch.Tensor) and logits.dim() >= 1 and \
                logits.shape[0] < getattr(self.spec, "probe_tokens", 1):
            return False
        if self.watch and not self._watched_changed(output):
            return False  # ambiguous, and nothing it depends on changed since: no new evidence
        try:
            verified = self.spec.deferred_rule(self.block, self.name, output)
        except AmbiguousRule as exc:  # still ambiguous: keep the model's routing, ask again after the next change
            self.pending_reason, self.watch = str(exc), exc.watch or self.watch
            self.watched = self._fingerprint()
            return False
        except UnsupportedModelError as exc:
            warnings.warn(f"lynx_hf: {exc}; this block keeps the model's own routing", stacklevel=3)
            self.rule_status = RULE_REFUSED
            return False
        self.rule, self.selection = verified.weight, verified.selection
        self.pending_reason, self.watch, self.watched = None, (), None
        shape = (verified.num_experts, verified.top_k)
        if shape != (self.num_experts, self.top_k):  # the plan was made for the patch-time shape
            self.num_experts, self.top_k = shape
            self.plan = None
        self.rule_status = RULE_VERIFIED
        return True

    def _fingerprint(self, values: bool = True) -> tuple:
        """What the deferral of this block depends on (:attr:`watch`), per watched tensor: its identity, version counter
        and storage address (host-side integers, no device read: ``load_state_dict`` bumps the version, ``assign=True``
        replaces the tensor, ``buf.data = w`` its storage) and, with ``values``, a digest of its bytes (one host read of
        the tensor, a few KB: a write through ``.data`` -- ``buf.data.copy_(w)``, as several loaders do -- changes
        neither identity, version nor address, ``docs/cases.md`` C42). ``((id, version, data_ptr, digest or None) or
        None, ...)``; ``None`` for a tensor that is gone (an inference tensor has no version counter: version -1)."""
        out = []
        for module, path in self.watch:
            try:
                tensor = live_tensor(module, path)
            except AttributeError:  # gone
                out.append(None)
                continue
            try:
                version = tensor._version
            except RuntimeError:  # an inference tensor (no version counter)
                version = -1
            out.append((id(tensor), version, tensor.data_ptr(), _digest(tensor) if values else None))
        return tuple(out)

    def _watched_changed(self, output) -> bool:
        """Whether a watched tensor changed since the deferral was last decided (:attr:`watched`). The identity /
        version / address part is compared on every call; the values are read only where a host read costs no
        device sync in a decode step: a prefill call (every ``generate`` starts with one), or CPU tensors in eager
        mode; never while ``torch.compile`` traces."""
        cheap = self._fingerprint(values=False)
        watched = self.watched or ()
        if len(cheap) != len(watched) or any(
                (now is None) != (then is None) or (now is not None and now[:3] != then[:3])
                for now, then in zip(cheap, watched)):
            return True
        if torch.compiler.is_compiling():
            return False
        logits = output[0] if isinstance(output, (tuple, list)) and output else None
        reads = self.step.kind == PREFILL or (isinstance(logits, torch.Tensor) and host_reads_allowed(logits))
        return reads and self._fingerprint() != self.watched

    def _note_unrouted(self, output) -> None:
        """A decode call the router hook does not route (the rule not verified): the experts implementation still asks
        whether the cost gate is off at this step size, so that is noted here (``gated_off``)."""
        idx = output[2] if isinstance(output, (tuple, list)) and len(output) > 2 else None
        if self.step.kind == PREFILL or not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            return
        planned = gate.of(self._plan_for(idx.device))
        self.gated_off = planned is not None and not planned.decision(idx.shape[0]).on

    def route(self, step: Step, logits: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
        """``(weights, idx)`` for one step: the policy's remap on the decode tokens, the model's own on the
        others. ``logits [T, N]``, ``weights [T, k]`` (any float dtype), ``idx [T, k]`` int. Runs the plan
        (``lynx_hf.core.RoutePlan.run``: its stages, then its decode-step function); a step of one token keeps its
        own top-k under every policy with ``single_token_identity``, so it keeps the model's routing. Where the plan's
        cost gate (``LynxConfig.gate="auto"``, ``lynx_hf.gate``) is off for this step's T tokens, the model's own
        routing is returned unchanged (the same objects), no telemetry is recorded (the step is counted by the gate)
        and :attr:`gated_off` is set for the experts implementation."""
        plan = self._plan_for(logits.device)
        out = plan.run(StepInputs(step, logits, weights, idx, self.rule, host_reads_allowed(logits), self._scores_fn(),
                                  self._telemetry()))
        self.gated_off = out.gated_off
        return out.weights, out.idx

    def _telemetry(self):
        """The block's ``BlockTelemetry`` in the mode ``LynxConfig.telemetry`` asks for, or ``None`` (off)."""
        mode = mode_of(self.model_state.config.telemetry)
        if mode is None:
            return None
        telemetry = self.telemetry
        if telemetry.mode != mode:
            telemetry.mode = mode
        return telemetry

    def _scores_fn(self):
        """``StepInputs.scores``: ``None`` where the scores are the router logits in fp32 (so the weight rule reuses
        them), else a :class:`SelectionScores` of this block."""
        if self.selection is None and self.spec.selection_scores is fp32_logits:
            return None
        return SelectionScores(self)

    def fused_selection(self, device: torch.device):
        """This block's selection rule as data for the fused device step (``lynx_hf.core.device_step``):
        ``(FusedSelection, bias tensor or None)``, or ``None`` where it cannot be described (the family spec gives no
        ``fused_selection_of``) or its bias is not a resident ``[N]`` float tensor on ``device`` (an offloaded one):
        the step then computes the scores with :meth:`_selection_scores`."""
        rule = self.selection
        if rule is None:
            describe = self.spec.fused_selection_of
            rule = describe(self.router) if describe is not None else None
        if rule is None or isinstance(rule, FusedSelection):
            return None if rule is None else (rule, None)
        bias = rule.bias_tensor(self.router, self.block)
        if bias is not None and (bias.device != device or not bias.is_floating_point()
                                 or bias.numel() != self.num_experts or bias.shape[-1] != self.num_experts):
            return None
        return rule.fused(), bias

    def _selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 selection scores ``[T, N]`` of the router logits ``[T, N]`` (``-inf``: an expert the model's own
        routing forbids): the block's selection-bias rule with the live bias, else the family spec's."""
        if self.selection is not None:
            bias = self.selection.bias(self.router, self.block, logits.shape[-1])
            return self.selection.selection_scores(logits, bias)
        return self.spec.selection_scores(self.router, logits)


class SelectionScores:
    """``StepInputs.scores`` of a block (``lynx_hf.core``): called, its fp32 selection scores ``[T, N]`` of the router
    logits (:meth:`BlockRouting._selection_scores`); :meth:`fused`, the same rule as data for the fused device step
    (:meth:`BlockRouting.fused_selection`)."""

    __slots__ = ("state",)

    def __init__(self, state: BlockRouting) -> None:
        self.state = state

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.state._selection_scores(logits)

    def fused(self, device: torch.device):
        return self.state.fused_selection(device)


def _digest(tensor: torch.Tensor) -> str:
    """A digest of ``tensor``'s bytes (its dtype and shape included): one host read (a selection bias: a few KB)."""
    flat = tensor.detach().reshape(-1).contiguous()
    raw = flat.view(torch.uint8) if flat.element_size() > 0 and flat.numel() else flat
    return hashlib.blake2b(raw.cpu().numpy().tobytes() + f"{tensor.dtype}{tuple(tensor.shape)}".encode(),
                           digest_size=16).hexdigest()


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
            state.check_entry(step)
            return state.original_forward(*args, **kwargs)
        return state.spec.decode_forward(state, step, *args, **kwargs)
