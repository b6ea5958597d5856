"""The engine-independent core of a decode step: what the HF path (``lynx_hf.block``) and serving-engine
plugins (``lynx_hf.vllm``) share, with no knowledge of transformers classes or of how a step was detected.

- step kinds (:data:`PREFILL`, :data:`DECODE`, :data:`VERIFY`, :data:`MIXED`) and :class:`Step`, the per-token
  description of one forward a detector publishes;
- :class:`WeightRule`, how a family weights its chosen experts;
- :class:`RoutePlan` and :func:`make_plan`: everything one MoE layer resolves once per device, including the
  decode-step function (:attr:`RoutePlan.step_fn`), chosen once like vLLM's ``CustomOp.dispatch_forward``:
  :func:`keep_routing` (the policy does not remap, or k = N), :func:`fused_step` (the policy's one-call CPU
  path exists) or :func:`remap_step` (the general, sync-free path);
- :func:`remap` (the policy on the decode rows, the model's own routing on the others) and
  :func:`record_step` (telemetry of one step).

Per call the only device question is "CPU tensors in eager mode?" (:func:`host_reads_allowed`): the caller asks
it once and passes the answer (``host``) down to the policy's ops, the remap and the telemetry.

Everything here is sync-free on an accelerator (no ``.item()``, no data-dependent shapes): per-token choices are
merged with ``torch.where``; telemetry accumulates on the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import policies
from .kernels import telemetry_slots as _slots
from .kernels.backend import resolve_backend, routing_ops
from .kernels.routing_torch import _STRICT, host_reads_allowed, union_mask

# -- step kinds -------------------------------------------------------------------------------------------
PREFILL = "prefill"
DECODE = "decode"
VERIFY = "verify"
MIXED = "mixed"


@dataclass(frozen=True)
class Step:
    """How the routing treats one forward.

    ``kind``: ``"prefill"`` (nothing to do), ``"decode"`` (one new token per row, or a continuous-batching
    forward in which every token decodes), ``"verify"`` (a verification forward of assisted / prompt-lookup
    decoding: every token is decode work), ``"mixed"`` (a continuous-batching forward with prefill tokens
    or padding beside its decode tokens: ``decode`` says which). ``decode [T]`` bool or ``None``
    (every token is a decode token, unless ``kind`` is prefill); for ``decode`` / ``verify`` it is a
    tensor only when the cache length lives on the device (``StaticCache`` outside ``generate``).
    ``live [T]`` bool or ``None`` (all rows live): tokens of finished rows and padding tokens are not
    live (they neither vote nor count; decode ones are remapped into the critical set).
    """

    kind: str
    decode: torch.Tensor | None = None
    live: torch.Tensor | None = None


PREFILL_STEP = Step(PREFILL)


# -- weight rules ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightRule:
    """How a family weights its chosen experts (``docs/design.md`` "Family rules").

    ``kind``: one of ``kernels.routing_torch.WEIGHT_RULES`` (``"softmax_all"``: softmax over all N logits,
    picked; ``"softmax_chosen"``: softmax over the chosen k; ``"sigmoid"``: sigmoid of each chosen logit);
    ``renormalize``: divide by the sum over the chosen k plus ``renorm_eps`` (a denominator epsilon some
    families add: LFM2-MoE ``1e-6``; 0 divides by the sum alone); ``scale``: multiply by it
    (``routed_scaling_factor``). Weights are computed in fp32 and cast to the dtype of the router's own
    weights (what each family does).
    """

    kind: str
    renormalize: bool = False
    scale: float = 1.0
    renorm_eps: float = 0.0


# -- the plan ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutePlan:
    """What one MoE layer resolves once per device (at patch time; again only if its device changes).

    ``routing_backend``: ``"torch"`` or ``"triton"`` (resolved from ``LynxConfig.routing_backend``);
    ``params``: the policy's per-layer parameters (``Policy.resolve``); ``ops``: the sync-free routing ops;
    ``host_ops``: the ops for CPU tensors in eager mode (the numba twins where available, else ``ops``);
    ``fused``: the policy's one-call CPU decode step (``Policy.fused_decode``) or ``None``; ``expert_ops``: the
    Triton ops namespace whose ``sparse_moe`` computes the routed experts when ``LynxConfig.expert_path ==
    "triton"``, else ``None``;
    ``step_fn``: the decode-step function (see the module docstring), called as
    ``step_fn(plan, rule, step, selection_scores, logits, weights, idx, host, telemetry=None)``;
    ``gate``: the cost gate (``lynx_hf.gate.PlanGate``, ``LynxConfig.gate="auto"``) whose ``on(T)`` says whether
    ``step_fn`` runs on a step of T tokens (else the model's own routing, no telemetry), or ``None``: always runs.
    """

    device: torch.device
    routing_backend: str
    policy: policies.Policy
    params: object
    ops: object
    num_experts: int
    top_k: int
    step_fn: Callable
    host_ops: object = None
    fused: object = None
    expert_ops: object = None
    gate: object = None
    #: the key of this plan in the registry the compiled CPU step (:func:`compiled_cpu_step`) looks it up in (a
    #: ``torch.compile`` graph carries an int, not the plan); 0: not registered (made outside :func:`make_plan`)
    handle: int = dataclasses.field(default=0, compare=False)

    @property
    def expert_kernel(self) -> bool:
        """Whether decode runs the routed experts with the sparse Triton kernel (``expert_path="triton"``)."""
        return self.expert_ops is not None

    @property
    def sparse_moe(self):
        """The sparse Triton expert kernel (``kernels.moe.sparse_moe``), or ``None``."""
        return None if self.expert_ops is None else self.expert_ops.sparse_moe


def make_plan(config, num_experts: int, top_k: int, device: torch.device, shape=None,
              extra_expert_ms: float = 0.0, expert_fn=None, route_fn=None) -> RoutePlan:
    """Resolve ``config`` (a ``LynxConfig``) for one MoE layer of ``num_experts`` experts, top-``top_k``, on
    ``device``: routing backend, policy parameters, ops, expert kernel and the decode-step function.

    ``routing_backend``: ``"auto"`` gives Triton on CUDA, torch elsewhere (a ``meta`` device: torch).
    ``expert_path``: ``"triton"`` selects the sparse Triton expert kernel; ``"auto"`` / ``"model"`` keep the
    model's own experts implementation (transformers' ``grouped_mm`` on CUDA, ``lynx_hf.experts``) until a GPU
    run measures which is faster per shape. ``shape``: the layer's ``lynx_hf.gate.LayerShape`` (H, I, dtypes); with
    ``config.gate == "auto"`` the plan gets a cost gate (``lynx_hf.gate.plan_gate``: measured here, once per shape
    in-process; ``extra_expert_ms``: a further cost per expert read, e.g. an offloaded expert's transfer, added to the
    saving; ``expert_fn`` / ``route_fn``: the engine's experts path and per-step routing path the gate times,
    ``lynx_hf.gate.PlanGate``), without it (or ``gate="always"``) none. Raises ``RuntimeError`` when Triton cannot run on ``device``.
    """
    device = torch.device(device)
    policy = policies.get(config.policy)
    backend = resolve_backend(config.routing_backend, device) if device.type != "meta" else "torch"
    params = policy.resolve(config, num_experts, top_k)
    ops = routing_ops(backend)
    host_ops = routing_ops(backend, host=True) if device.type == "cpu" else ops
    fused = policy.fused_decode(params, host_ops) if device.type == "cpu" else None
    expert_ops = None
    if config.expert_path == "triton" and device.type != "meta":
        expert_ops = routing_ops(resolve_backend("triton", device))
    if not policy.remaps or top_k >= num_experts:  # every token uses every expert when k = N: nothing to remap
        step_fn = keep_routing
    elif fused is not None:
        step_fn = fused_step
    else:
        step_fn = remap_step
    plan = RoutePlan(device, backend, policy, params, ops, int(num_experts), int(top_k), step_fn,
                     host_ops=host_ops, fused=fused, expert_ops=expert_ops)
    if shape is not None and getattr(config, "gate", "always") == "auto":
        from .gate import plan_gate

        gate = plan_gate(config, plan, shape, extra_expert_ms=extra_expert_ms, expert_fn=expert_fn, route_fn=route_fn)
        if gate is not None:
            plan = dataclasses.replace(plan, gate=gate)
    plan = dataclasses.replace(plan, handle=next(_HANDLES))
    _PLANS[plan.handle] = plan
    return plan


def fp32_scores(logits: torch.Tensor) -> torch.Tensor:
    """Selection scores ``[T, N]`` fp32 of a router whose scores are its logits (softmax / sigmoid routers without
    group limits or selection bias): ``logits.float()``. Passed as ``selection_scores`` to a decode-step function it
    also says that the scores *are* the fp32 logits, so the weight rule reuses them (one cast per step, not two)."""
    return logits.float()


# -- decode-step functions (one is chosen per plan) ----------------------------------------------------------
# Each takes ``(plan, rule, step, selection_scores, logits, weights, idx, host, telemetry=None)``:
# ``selection_scores(logits) -> [T, N]`` fp32 scores (called only when the policy runs), ``logits [T, N]``,
# ``weights`` / ``idx [T, k]`` the model's own routing, ``host`` the caller's answer to ``host_reads_allowed``,
# ``telemetry`` a ``BlockTelemetry`` to record into (``None``: not recorded; its ``mode`` says how much). Returns
# ``(weights [T, k], idx [T, k], finite [T] bool or None)`` in the dtypes of the inputs.

def keep_routing(plan, rule, step, selection_scores, logits, weights, idx, host, telemetry=None):
    """The model's own routing, unchanged (policy ``none``, k = N, a one-token step)."""
    if telemetry is not None:
        record_step(telemetry, plan.num_experts, step, idx, weights, idx, None, host=host, masks=False)
    return weights, idx, None


def remap_step(plan, rule, step, selection_scores, logits, weights, idx, host, telemetry=None, seed=None):
    """The general path: :func:`remap`, then :func:`record_step`. ``seed [N]`` bool: experts free this step
    besides the prefill tokens' (resident offloaded experts, ``lynx_hf.offload``), or ``None``. Traced by
    ``torch.compile`` on CPU: one opaque call of this same eager code (:func:`compiled_cpu_step`)."""
    if not host and _compiled_cpu(plan, logits):
        return compiled_cpu_step(plan, rule, step, selection_scores, logits, weights, idx, telemetry, seed)
    scores = selection_scores(logits)
    return _remap_and_record(plan, rule, step, scores, scores if selection_scores is fp32_scores else logits, weights,
                             idx, host, telemetry, seed=seed)


def fused_step(plan, rule, step, selection_scores, logits, weights, idx, host, telemetry=None):
    """The policy's one-call path (``plan.fused``) on CPU in eager mode when every token decodes; the general
    path otherwise, and for a step with a non-finite row (the one-call path then returns ``None``). Traced by
    ``torch.compile`` on CPU: one opaque call of this same eager code (:func:`compiled_cpu_step`)."""
    if not host and _compiled_cpu(plan, logits):
        return compiled_cpu_step(plan, rule, step, selection_scores, logits, weights, idx, telemetry)
    scores = selection_scores(logits)
    if selection_scores is fp32_scores:
        logits = scores  # the same values in fp32: the weight rule needs no second cast
    if host and step.decode is None:
        count = False if telemetry is None else ("counts" if telemetry.counts_only else True)
        out = plan.fused(scores, logits, weights, idx, rule, step.live, telemetry=count, verify=step.kind == VERIFY)
        if out is not None:
            new_weights, new_idx, row = out
            if row is not None:
                telemetry.add(row)
            return new_weights, new_idx, None
    return _remap_and_record(plan, rule, step, scores, logits, weights, idx, host, telemetry)


def _remap_and_record(plan, rule, step, scores, logits, weights, idx, host, telemetry, seed=None):
    new_weights, new_idx, finite = remap(plan, rule, step, scores, logits, weights, idx, host=host, seed=seed)
    if telemetry is not None:
        record_step(telemetry, plan.num_experts, step, idx, weights, new_idx, finite, host=host, masks=False)
    return new_weights, new_idx, finite


@torch.no_grad()
def record_step(telemetry, num_experts: int, step: Step, idx, weights, new_idx, finite, host: bool | None = None,
                masks: bool = True):
    """Accumulate one step of one MoE layer into ``telemetry`` (a ``BlockTelemetry``), on the device:
    live decode tokens are counted (before ``idx [T, k]`` / ``weights [T, k]``, after ``new_idx``), prefill
    and finished rows separately, ``finite [T]`` bool (or ``None``) flags the non-finite fallback. ``host``:
    CPU tensors in eager mode (``None``: asked here). Shared by the HF path and serving-engine plugins
    (``lynx_hf.vllm``). Returns ``(counted, live)``, ``[T]`` bool; with ``masks=False`` ``None`` (no mask is
    built for a step whose ``decode`` / ``live`` are ``None``: every row counts)."""
    decode, live = step.decode, step.live
    if decode is None:
        counted = live
    else:
        counted = decode if live is None else decode & live
    telemetry.record(
        num_experts, idx, weights, new_idx, counted,
        verify=step.kind == VERIFY,
        prefill_rows=None if decode is None else (~decode if live is None else ~decode & live),
        finished_rows=None if live is None else (~live if decode is None else decode & ~live),
        fallback=None if finite is None else (~finite if counted is None else counted & ~finite).any(),
        host=host,
    )
    if not masks:
        return None
    num_tokens, dev = idx.shape[0], idx.device
    if counted is None:
        counted = torch.ones(num_tokens, dtype=torch.bool, device=dev)
    return counted, (torch.ones(num_tokens, dtype=torch.bool, device=dev) if live is None else live)


def remap(plan: RoutePlan, rule: WeightRule, step: Step, scores, logits, weights, idx, host: bool | None = None,
          seed: torch.Tensor | None = None):
    """The policy's routing for the decode tokens of ``step``, the model's own for the others.

    ``scores [T, N]`` fp32 selection scores (``-inf``: forbidden), ``logits [T, N]`` the router logits
    (the weight ``rule`` is applied to them; ``scores`` itself where the scores are the fp32 logits: no second cast),
    ``weights`` / ``idx [T, k]`` the model's own routing; ``host``:
    CPU tensors in eager mode (``None``: asked here). Returns ``(weights [T, k] in weights.dtype,
    idx [T, k] in idx.dtype, finite [T] bool)``. Rows whose router logits are not finite keep the model's
    routing (counted as fallbacks) and, like prefill rows, seed the critical set with their experts;
    finished rows are remapped into the set but do not vote. ``seed [N]`` bool (or ``None``): more experts that
    are free this step (resident offloaded experts, ``lynx_hf.offload``): they seed the critical set too.
    Sync-free off the host.
    """
    if host is None:
        host = host_reads_allowed(logits)
    ops = plan.host_ops if host and plan.host_ops is not None else plan.ops
    num_experts = logits.shape[-1]
    top_k = idx.shape[-1]
    finite = torch.isfinite(logits).all(dim=-1)
    if step.decode is None and step.live is None and seed is None and host and bool(finite.all()):
        # CPU, eager: every token decodes and is finite (one memory read, no device): no masks to merge
        idx64 = idx if idx.dtype == torch.int64 else idx.long()
        critical = plan.policy.critical_set(plan.params, ops,
                                            policies.StepTensors(scores, idx64, weights, None, None, top_k))
        logits32 = scores if logits is scores else logits if logits.dtype == torch.float32 else logits.float()
        new_idx, new_weights = ops.remap(scores, critical, top_k, logits32, rule.kind, rule.renormalize, rule.scale,
                                         rule.renorm_eps)
        return new_weights.to(weights.dtype), new_idx.to(idx.dtype), finite
    # per-token masks only where the step has them (no all-True mask is built)
    decode, live = step.decode, step.live
    remapped = finite if decode is None else decode & finite
    vote = remapped if live is None else remapped & live
    keep = ~finite if decode is None else ~decode | ~finite
    if live is not None:
        keep = keep & live
    idx64 = idx if idx.dtype == torch.int64 else idx.long()
    same = logits is scores  # the scores are the fp32 logits (core.fp32_scores): one cast, one where
    scores = torch.where(finite[:, None], scores, torch.zeros_like(scores))
    seed = union_mask(idx64, num_experts, keep) if seed is None else union_mask(idx64, num_experts, keep) | seed
    tensors = policies.StepTensors(scores, idx64, weights, vote, seed, top_k)
    critical = plan.policy.critical_set(plan.params, ops, tensors)
    logits32 = scores if same else torch.where(finite[:, None], logits.float(),
                                               torch.zeros_like(logits, dtype=torch.float32))
    new_idx, new_weights = ops.remap(scores, critical, top_k, logits32, rule.kind, rule.renormalize, rule.scale,
                                     rule.renorm_eps)
    rows = remapped[:, None]
    out_idx = torch.where(rows, new_idx, idx64).to(idx.dtype)
    out_weights = torch.where(rows, new_weights.to(weights.dtype), weights)
    return out_weights, out_idx, finite


# -- torch.compile on CPU: the eager decode step as one opaque op ---------------------------------------------
#: plan registry of the compiled CPU step: handle -> RoutePlan (weak: a plan dies with its layer)
_PLANS: "weakref.WeakValueDictionary[int, RoutePlan]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _compiled_cpu(plan: RoutePlan, logits: torch.Tensor) -> bool:
    """Whether this step is being traced by ``torch.compile`` on CPU for a registered plan (outside
    ``kernels.routing_torch.strict_sync_free``, without autograd): then the decode step is the opaque op."""
    return (plan.device.type == "cpu" and plan.handle > 0 and not _STRICT[0]
            and torch.compiler.is_compiling() and not logits.requires_grad)


@torch.library.custom_op("lynx_hf::cpu_decode_step", mutates_args=(), device_types="cpu")
def _cpu_decode_step(handle: int, kind: str, decode: Optional[torch.Tensor], live: Optional[torch.Tensor],
                     scores: torch.Tensor, logits: torch.Tensor, same_scores: bool, weights: torch.Tensor,
                     idx: torch.Tensor, rule_kind: str, renormalize: bool, scale: float, renorm_eps: float,
                     telemetry: str, seed: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager CPU decode step of plan ``handle`` (:func:`compiled_cpu_step` documents it); returns
    ``(weights [T, k], idx [T, k], finite [T] bool, telemetry row fp64 [NUM_SLOTS])``, new tensors."""
    from .telemetry import BlockTelemetry

    plan = _PLANS[handle]
    rule = WeightRule(rule_kind, renormalize, scale, renorm_eps)
    if decode is not None and bool(decode.all()) and (live is None or bool(live.all())):
        decode = live = None  # every row a live decode token (read on the host here): the plain step, one call
        kind = DECODE if kind == MIXED else kind
    step = Step(kind, decode, live)
    scratch = BlockTelemetry(telemetry) if telemetry else None
    select = fp32_scores if same_scores else (lambda _logits: scores)
    if seed is not None:  # resident offloaded experts (lynx_hf.offload's seeded remap_step)
        out = remap_step(plan, rule, step, select, logits, weights, idx, True, scratch, seed=seed)
    else:
        out = plan.step_fn(plan, rule, step, select, logits, weights, idx, True, scratch)
    new_weights, new_idx, finite = out
    if finite is None:
        finite = torch.ones(idx.shape[0], dtype=torch.bool)
    row = scratch.acc if scratch is not None and scratch.acc is not None else \
        torch.zeros(_slots.NUM_SLOTS, dtype=torch.float64)
    return (new_weights.clone() if new_weights is weights else new_weights,
            new_idx.clone() if new_idx is idx else new_idx, finite, row)


@_cpu_decode_step.register_fake
def _cpu_decode_step_fake(handle, kind, decode, live, scores, logits, same_scores, weights, idx, rule_kind,
                          renormalize, scale, renorm_eps, telemetry, seed):
    return (torch.empty_like(weights), torch.empty_like(idx), idx.new_empty(idx.shape[0], dtype=torch.bool),
            idx.new_empty(_slots.NUM_SLOTS, dtype=torch.float64))


def compiled_cpu_step(plan: RoutePlan, rule: WeightRule, step: Step, selection_scores, logits, weights, idx,
                      telemetry=None, seed=None):
    """The decode-step function as ``torch.compile`` sees it on CPU: the selection scores are traced, the rest (the
    plan's eager step: the policy's one-call path or the host ops, the remap, the weight rule, the telemetry row) is
    one opaque custom op ``torch.ops.lynx_hf.cpu_decode_step``, so a compiled step runs the same code and gives the
    same integers as an eager one, instead of the sync-free device path unrolled into the graph (the mass-greedy
    loop's min(N, T k) rounds: ~950 ops per layer-step, measured slower than the experts it saves on small models,
    ``eval/bench_compile.py``). A step whose device decode mask (``StaticCache`` length on the device) is all True
    with every row live runs as a plain decode step inside the op (read on the host there). Arguments and return as
    the decode-step functions (module comment above :func:`keep_routing`); ``seed [N]`` bool or ``None``
    (:func:`remap_step`). The telemetry row is added to ``telemetry`` in the graph."""
    scores = selection_scores(logits)
    same = selection_scores is fp32_scores
    mode = "" if telemetry is None else telemetry.mode
    new_weights, new_idx, finite, row = torch.ops.lynx_hf.cpu_decode_step(
        plan.handle, step.kind, step.decode, step.live, scores, scores if same else logits, same, weights, idx,
        rule.kind, bool(rule.renormalize), float(rule.scale), float(rule.renorm_eps), mode, seed)
    if telemetry is not None:
        telemetry.add(row)
    return new_weights, new_idx, finite


__all__ = ["PREFILL", "DECODE", "VERIFY", "MIXED", "Step", "PREFILL_STEP", "WeightRule", "RoutePlan", "make_plan",
           "keep_routing", "remap_step", "fused_step", "compiled_cpu_step", "remap", "record_step", "host_reads_allowed", "fp32_scores"]
