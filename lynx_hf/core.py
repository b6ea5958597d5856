"""The engine-independent core of a decode step: what the HF path (``lynx_hf.block``) and serving-engine
plugins (``lynx_hf.vllm``) share, with no knowledge of transformers classes or of how a step was detected.

- step kinds (:data:`PREFILL`, :data:`DECODE`, :data:`VERIFY`, :data:`MIXED`) and :class:`Step`, the per-token
  description of one forward a detector publishes;
- :class:`WeightRule`, how a family weights its chosen experts;
- :class:`StepInputs` (one layer-step: the step, the router's output, the weight rule, the selection scores, the
  telemetry, a seed of the critical set) and :class:`Routed` (the routing it returns);
- :class:`RoutePlan` and :func:`make_plan`: everything one MoE layer resolves once per device, including the
  decode-step function (:attr:`RoutePlan.kernel`), chosen once like vLLM's ``CustomOp.dispatch_forward``:
  :func:`keep_routing` (the policy does not remap, or k = N), :func:`fused_step` (the policy's one-call CPU
  path exists), :func:`device_step` (the Triton backend: the whole step in one launch,
  ``lynx_hf.kernels.fused_step``) or :func:`remap_step` (the general, sync-free path); around it the **stages** handed to
  ``make_plan(config, layer, stages=...)`` (:class:`Stage`), composed once like vLLM's modular kernel: the cost gate
  (``lynx_hf.gate``), the offload resident seed (``lynx_hf.offload``), the compiled-CPU op
  (``lynx_hf.compiled_cpu``). The core imports none of them; :meth:`RoutePlan.run` runs the composition;
- :func:`remap` (the policy on the decode rows, the model's own routing on the others) and
  :func:`record_step` (telemetry of one step).

Per call the only device question is "CPU tensors in eager mode?" (:func:`host_reads_allowed`): the caller asks
it once and passes the answer (``StepInputs.host``) down to the policy's ops, the remap and the telemetry.

Everything here is sync-free on an accelerator (no ``.item()``, no data-dependent shapes): per-token choices are
merged with ``torch.where``; telemetry accumulates on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol, Sequence

import torch

from . import policies
from .kernels.backend import resolve_backend, routing_ops
from .kernels.routing_torch import host_reads_allowed, union_mask
from .kernels.step_spec import LOGITS, SCORES, FusedPolicy

if TYPE_CHECKING:
    from .config import LynxConfig

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
    live (they neither vote nor count; decode ones are remapped into the critical set). ``decode_rows``: how many
    tokens decode, where the host knows it without reading a device value (a continuous-batching scheduler's
    requests), else ``None``: a step with 0 returns at once (:meth:`RoutePlan.run`) and the cost gate decides a mixed
    step on its decode rows (``lynx_hf.gate.PlanGate.decision``).
    """

    kind: str
    decode: torch.Tensor | None = None
    live: torch.Tensor | None = None
    decode_rows: int | None = None


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


# -- one layer-step: what a decode step gets and returns ------------------------------------------------------
class StepInputs(NamedTuple):
    """One decode step of one MoE layer, as :meth:`RoutePlan.run` and its stages see it (an immutable value; a stage
    passes a changed copy on with ``_replace``).

    ``step``: the :class:`Step` (which rows decode, which are live); ``logits [T, N]``: the router logits (any float
    dtype; the weight ``rule`` is applied to them); ``weights [T, k]`` (any float dtype) / ``idx [T, k]`` (int): the
    model's own routing; ``rule``: the family's :class:`WeightRule`; ``host``: CPU tensors in eager mode (the caller's
    answer to :func:`host_reads_allowed`, asked once per step); ``scores``: ``scores(logits) -> [T, N]`` fp32 selection
    scores (``-inf``: an expert the model's routing forbids), called only when the policy runs, or ``None``: the
    scores are the logits in fp32 (the weight rule then reuses that one cast); a ``scores`` object with a method
    ``fused(device) -> (FusedSelection, bias tensor or None) or None`` describes its rule as data, which
    :func:`device_step` computes inside its kernel (``None``: it calls ``scores``); ``telemetry``: a
    ``lynx_hf.telemetry.BlockTelemetry`` to record the step into (``None``: not recorded; its ``mode`` says how
    much); ``seed [N]`` bool or ``None``: experts free this step besides the prefill tokens' (resident offloaded
    experts, ``lynx_hf.offload``), which seed the critical set.
    """

    step: Step
    logits: torch.Tensor
    weights: torch.Tensor
    idx: torch.Tensor
    rule: WeightRule
    host: bool
    scores: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    telemetry: object = None
    seed: Optional[torch.Tensor] = None


class Routed(NamedTuple):
    """What a decode step returns: ``weights [T, k]`` and ``idx [T, k]`` in the dtypes of the inputs' (the model's
    own objects where nothing was remapped), ``finite [T]`` bool (rows whose router logits were finite; ``None``:
    not computed, every row counts as finite) and ``gated_off``: the plan's cost gate is off at this step size
    (``lynx_hf.gate``), so the routing is the model's own and the caller runs the model's own experts
    implementation."""

    weights: torch.Tensor
    idx: torch.Tensor
    finite: Optional[torch.Tensor] = None
    gated_off: bool = False


#: a decode step as composed by :func:`make_plan`: ``runner(plan, inputs) -> Routed``
Runner = Callable[["RoutePlan", StepInputs], Routed]


class Stage(Protocol):
    """A decode-step feature composed into a plan by :func:`make_plan` (``stages=``), as vLLM's modular kernel composes
    its parts: the cost gate (``lynx_hf.gate.PlanGate``), the offload resident seed (``lynx_hf.offload.ResidentSeed``),
    the flatness guard (``lynx_hf.flatness``), the compiled-CPU op (``lynx_hf.compiled_cpu.CompiledCpuStep``), vLLM's
    padding rows (``lynx_hf.vllm``). The core knows none of them; each subclasses :class:`StageBase`.

    ``name``: how :meth:`RoutePlan.stage` finds it. ``remaps_only``: the stage works around the policy's remap, so
    :func:`make_plan` leaves it out of a plan that keeps the routing (its kernel :func:`keep_routing`: policy ``none``,
    k = N). ``bind(plan, inner)`` is called once, by :func:`make_plan`, with the plan (its stages not composed yet) and
    the runner below this stage (the stages after it in ``stages``, then :func:`decode_step`); it returns the runner
    that replaces ``inner`` (it calls ``inner`` or not), or ``None``: the stage does nothing for this plan and is left
    out. ``summary() -> dict or None`` (plain JSON, reported under its name by :func:`stage_report`: ``lynx_hf.stats``
    and the vLLM plugin's stats), ``reset()`` (its counters zeroed: :func:`reset_stages`) and ``note(num_tokens,
    decode_rows, steps)`` (decode steps that ran without it: a layer an engine bypasses, a CUDA-graph replay).
    """

    name: str
    remaps_only: bool

    def bind(self, plan: "RoutePlan", inner: Runner) -> Optional[Runner]: ...

    def summary(self) -> Optional[dict]: ...

    def reset(self) -> None: ...

    def note(self, num_tokens: int, decode_rows: Optional[int] = None, steps: int = 1) -> None: ...


class StageBase:
    """What every :class:`Stage` starts from: ``remaps_only`` True, and no-op :meth:`summary` (``None``: nothing to
    report), :meth:`reset` and :meth:`note`; a subclass gives ``name`` and :meth:`bind`, and overrides what it
    counts."""

    name: str = ""
    #: left out of a plan that keeps the routing (:func:`make_plan`); False for a stage every step needs
    remaps_only: bool = True

    def bind(self, plan: "RoutePlan", inner: Runner) -> Optional[Runner]:
        raise NotImplementedError(f"{type(self).__name__}.bind")

    def summary(self) -> Optional[dict]:
        """Plain JSON of what the stage counted, or ``None`` (nothing to report: left out of :func:`stage_report`)."""
        return None

    def reset(self) -> None:
        """Zero what the stage counts (its decisions and caches stay)."""

    def note(self, num_tokens: int, decode_rows: Optional[int] = None, steps: int = 1) -> None:
        """Count ``steps`` decode steps of ``num_tokens`` tokens (``decode_rows`` of them decoding; ``None``: all) that
        ran without this stage (a bypassed layer, a CUDA-graph replay)."""


def stage_report(plan: Optional["RoutePlan"]) -> dict:
    """``{stage.name: stage.summary()}`` of every stage of ``plan`` that reports (its summary not ``None``), outermost
    first; ``{}`` for no plan. The one reader of the stages' reports, for every engine."""
    out = {}
    for stage in () if plan is None else plan.stages:
        summary = stage.summary()
        if summary is not None:
            out[stage.name] = summary
    return out


def reset_stages(plan: Optional["RoutePlan"]) -> None:
    """Zero the counters of every stage of ``plan`` (:meth:`StageBase.reset`; decisions stay); nothing for no plan."""
    for stage in () if plan is None else plan.stages:
        stage.reset()


# -- the plan ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoELayer:
    """What :func:`make_plan` needs of one MoE layer: ``num_experts`` (N), ``top_k`` (k), the ``device`` its
    routing runs on (a ``torch.device`` or its name) and ``moe_layers``, how many MoE layers its model has (the depth
    the policy's parameters may scale with: ``LynxConfig.price_ref_layers``)."""

    num_experts: int
    top_k: int
    device: torch.device | str
    moe_layers: int = 1


@dataclass(frozen=True)
class RoutePlan:
    """What one MoE layer resolves once per device (at patch time; again only if its device changes).

    ``routing_backend``: ``"torch"`` or ``"triton"`` (resolved from ``LynxConfig.routing_backend``);
    ``params``: the policy's per-layer parameters (``Policy.resolve``); ``ops``: the sync-free routing ops;
    ``host_ops``: the ops for CPU tensors in eager mode (the numba twins where available, else ``ops``);
    ``fused``: the policy's one-call CPU decode step (``Policy.fused_decode``) or ``None``; ``fused_device``: the whole
    decode step in one Triton launch (``lynx_hf.kernels.fused_step.FusedStep`` of ``Policy.device_policy``; the
    policy ``"keep"`` where the plan keeps the routing: it records the telemetry) where the routing backend is Triton,
    else ``None``; ``expert_ops``: the
    Triton ops namespace whose ``sparse_moe`` computes the routed experts (``LynxConfig.expert_path == "triton"``,
    or ``"auto"`` on CUDA), else ``None``; ``kernel_min_tokens``: the fewest decode tokens a step needs for that
    kernel to run (1 when chosen explicitly; :data:`AUTO_KERNEL_MIN_TOKENS` under ``"auto"``); ``kernel``: the
    decode-step function (the module docstring), called as
    ``kernel(plan, inputs) -> Routed``; ``stages``: the :class:`Stage` objects composed around it, outermost first;
    ``runner``: that composition (:meth:`run` calls it).
    """

    device: torch.device
    routing_backend: str
    policy: policies.Policy
    params: object
    ops: object
    num_experts: int
    top_k: int
    kernel: Callable
    host_ops: object = None
    fused: object = None
    expert_ops: object = None
    kernel_min_tokens: int = 1
    stages: tuple = dataclasses.field(default=(), compare=False)
    runner: Optional[Runner] = dataclasses.field(default=None, compare=False, repr=False)
    # it holds per-thread buffers: not compared
    fused_device: object = dataclasses.field(default=None, compare=False, repr=False)

    def run(self, inputs: StepInputs) -> Routed:
        """One decode step of this layer (:class:`StepInputs` in, :class:`Routed` out): the stages, then
        :func:`decode_step`; at once the model's own routing (nothing recorded) where the host knows no token decodes
        (``Step.decode_rows == 0``). Sync-free off the host (no ``.item()``, no data-dependent shape)."""
        if inputs.step.decode_rows == 0:
            return Routed(inputs.weights, inputs.idx)
        return (self.runner or decode_step)(self, inputs)

    def keeps(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens keeps the model's routing without running the policy: the kernel
        is :func:`keep_routing` (policy ``none``, k = N), or one token under a policy with
        ``single_token_identity`` (it keeps a lone token's own top-k). A host-side answer on the static T."""
        return self.kernel is keep_routing or (num_tokens == 1 and self.policy.single_token_identity)

    def stage(self, name: str):
        """The composed stage named ``name`` (:attr:`Stage.name`), or ``None``."""
        return next((s for s in self.stages if s.name == name), None)

    @property
    def expert_kernel(self) -> bool:
        """Whether decode may run the routed experts with the sparse Triton kernel (``expert_path="triton"``, or
        ``"auto"`` on CUDA, for steps of at least :attr:`kernel_min_tokens` tokens: :meth:`uses_kernel`)."""
        return self.expert_ops is not None

    def uses_kernel(self, num_tokens: int) -> bool:
        """Whether a decode step of ``num_tokens`` tokens (the static T) runs the sparse Triton expert kernel."""
        return self.expert_ops is not None and num_tokens >= self.kernel_min_tokens

    @property
    def sparse_moe(self):
        """The sparse Triton expert kernel (``kernels.moe.sparse_moe``), or ``None``."""
        return None if self.expert_ops is None else self.expert_ops.sparse_moe


#: ``expert_path="auto"`` on CUDA runs the sparse Triton expert kernel for decode steps of at least this many tokens.
#: Measured on an H200 (``python -m lab.gpu_check --sections tpot``, eval/results/gpu_check_h200.txt; bf16, 2-layer
#: cuts, LYNX default, TPOT of eager ``generate``): Qwen2-57B-A14B at B = 1 / 4 / 16 / 64 the kernel 5.74 / 8.52 /
#: 11.79 / 8.95 ms vs transformers' grouped_mm 5.56 / 27.78 / 37.82 / 39.74 ms; DeepSeek-V2-Lite 6.08 / 9.70 / 8.93 /
#: 9.63 vs 5.55 / 22.70 / 40.86 / 38.68 ms. At B = 1 the two tie (grouped_mm 3-10 % ahead), from B = 4 the kernel wins.
AUTO_KERNEL_MIN_TOKENS = 4


def make_plan(config: "LynxConfig", layer: MoELayer, *, stages: Sequence[Stage] = ()) -> RoutePlan:
    """Resolve ``config`` (a ``LynxConfig``) for one MoE ``layer`` (:class:`MoELayer`: N experts, top-k, device):
    routing backend, policy parameters, ops, expert kernel and the decode-step function (:attr:`RoutePlan.kernel`),
    then compose ``stages`` around it (:class:`Stage`, outermost first; each bound once, here; a stage that is
    ``remaps_only`` is not bound to a plan that keeps the routing).

    ``routing_backend``: ``"auto"`` gives Triton on CUDA, torch elsewhere (a ``meta`` device: torch).
    ``expert_path``: ``"triton"`` selects the sparse Triton expert kernel for every decode step; ``"auto"`` selects it
    on CUDA for decode steps of at least :data:`AUTO_KERNEL_MIN_TOKENS` tokens, for a policy that remaps (below, and
    on other devices, the model's own experts implementation: transformers' ``grouped_mm``, ``lynx_hf.experts``);
    ``"model"`` never selects it. Raises ``RuntimeError`` when Triton cannot run on the device,
    ``TypeError`` when ``layer`` is not a :class:`MoELayer`; whatever a stage's ``bind`` raises.
    """
    if not isinstance(layer, MoELayer):
        raise TypeError(f"make_plan(config, layer, stages=...): layer must be a MoELayer, got {type(layer).__name__}")
    device = torch.device(layer.device)
    num_experts, top_k = int(layer.num_experts), int(layer.top_k)
    policy = policies.get(config.policy)
    backend = resolve_backend(config.routing_backend, device) if device.type != "meta" else "torch"
    params = policy.resolve(config, num_experts, top_k, moe_layers=int(layer.moe_layers))
    ops = routing_ops(backend)
    host_ops = routing_ops(backend, host=True) if device.type == "cpu" else ops
    fused = policy.fused_decode(params, host_ops) if device.type == "cpu" else None
    fused_device = None
    if backend == "triton" and device.type != "meta":
        keeps = not policy.remaps or top_k >= num_experts
        described = FusedPolicy("keep") if keeps else policy.device_policy(params)
        if described is not None:
            fused_device = ops.fused_step(described, num_experts, top_k)
    expert_ops, kernel_min_tokens = None, 1
    if config.expert_path == "triton" and device.type != "meta":
        expert_ops = routing_ops(resolve_backend("triton", device))
    elif config.expert_path == "auto" and device.type == "cuda" and policy.remaps:
        expert_ops, kernel_min_tokens = routing_ops("triton"), AUTO_KERNEL_MIN_TOKENS
    if not policy.remaps or top_k >= num_experts:  # every token uses every expert when k = N: nothing to remap
        kernel = keep_routing
    elif fused is not None:
        kernel = fused_step
    elif fused_device is not None:
        kernel = device_step
    else:
        kernel = remap_step
    plan = RoutePlan(device, backend, policy, params, ops, num_experts, top_k, kernel, host_ops=host_ops, fused=fused,
                     expert_ops=expert_ops, kernel_min_tokens=kernel_min_tokens, fused_device=fused_device)
    runner, bound = decode_step, []
    for stage in reversed(tuple(stages)):  # innermost first: each stage wraps what is below it
        if kernel is keep_routing and stage.remaps_only:  # nothing remaps: the stages around the remap stay out
            continue
        wrapped = stage.bind(plan, runner)
        if wrapped is not None:
            runner = wrapped
            bound.append(stage)
    return dataclasses.replace(plan, stages=tuple(reversed(bound)), runner=runner)


# -- decode-step functions (one is chosen per plan: RoutePlan.kernel) -----------------------------------------
# Each is ``kernel(plan, inputs: StepInputs) -> Routed``; ``decode_step`` runs the one of a plan below its stages.

def decode_step(plan: RoutePlan, inputs: StepInputs) -> Routed:
    """The plan's decode step below its stages: :func:`keep_routing` for a step the plan keeps
    (:meth:`RoutePlan.keeps`: a lone token under a policy that keeps it), else :attr:`RoutePlan.kernel`."""
    if plan.keeps(inputs.idx.shape[0]):
        return keep_routing(plan, inputs)
    return plan.kernel(plan, inputs)


def keep_routing(plan: RoutePlan, inputs: StepInputs) -> Routed:
    """The model's own routing, unchanged (policy ``none``, k = N, a one-token step); the step is recorded (by the
    fused device step's kernel where the plan has one: one launch)."""
    if inputs.telemetry is not None and plan.fused_device is not None:
        _launch(plan, inputs, keep=True)
    elif inputs.telemetry is not None:
        record_step(inputs.telemetry, plan.num_experts, inputs.step, inputs.idx, inputs.weights, inputs.idx, None,
                    host=inputs.host, masks=False)
    return Routed(inputs.weights, inputs.idx)


def remap_step(plan: RoutePlan, inputs: StepInputs) -> Routed:
    """The general, sync-free path: :func:`remap` (with ``inputs.seed``), then :func:`record_step`."""
    scores, logits = _selection(inputs)
    return _remap_and_record(plan, inputs, scores, logits)


def fused_step(plan: RoutePlan, inputs: StepInputs) -> Routed:
    """The policy's one-call path (``plan.fused``) on CPU in eager mode when every token decodes and nothing seeds the
    critical set; the general path otherwise, and for a step with a non-finite row (the one-call path then returns
    ``None``)."""
    scores, logits = _selection(inputs)
    step, telemetry = inputs.step, inputs.telemetry
    if inputs.host and step.decode is None and inputs.seed is None:
        count = False if telemetry is None else ("counts" if telemetry.counts_only else True)
        out = plan.fused(scores, logits, inputs.weights, inputs.idx, inputs.rule, step.live, telemetry=count,
                         verify=step.kind == VERIFY)
        if out is not None:
            new_weights, new_idx, row = out
            if row is not None:
                telemetry.add(row)
            return Routed(new_weights, new_idx)
    return _remap_and_record(plan, inputs, scores, logits)


def device_step(plan: RoutePlan, inputs: StepInputs) -> Routed:
    """The whole decode step in one Triton launch (:attr:`RoutePlan.fused_device`, ``lynx_hf.kernels.fused_step``):
    selection scores (in the kernel where ``inputs.scores`` describes its rule, else computed by it), the policy's
    critical set, remap, weight rule, merge with the rows that keep their routing, telemetry. The same routing as
    :func:`remap` + :func:`record_step`; no host read, no allocation after a step size's first step."""
    return _launch(plan, inputs, keep=False)


#: the decode-step functions by the name the cost gate's key gives them (``lynx_hf.gate.key.GateKey.step``): a key
#: names the kind of step measured, never a function, so renaming one keeps every stored decision
STEP_KINDS = {"keep": keep_routing, "fused": fused_step, "device": device_step, "remap": remap_step}


def _launch(plan: RoutePlan, inputs: StepInputs, keep: bool) -> Routed:
    step, telemetry, rule = inputs.step, inputs.telemetry, inputs.rule
    selection, bias, scores = LOGITS, None, None
    if inputs.scores is not None and not keep:
        fused = getattr(inputs.scores, "fused", None)
        described = fused(inputs.logits.device) if fused is not None else None
        if described is None:
            selection, scores = SCORES, inputs.scores(inputs.logits)
        else:
            selection, bias = described
    weights, idx = plan.fused_device(
        inputs.logits, inputs.weights, inputs.idx, rule.kind, rule.renormalize, rule.scale, rule.renorm_eps,
        decode=step.decode, live=step.live, seed=inputs.seed, selection=selection, bias=bias, scores=scores,
        acc=None if telemetry is None else telemetry.buffer(inputs.idx.device),
        counts_only=telemetry is not None and telemetry.counts_only, verify=step.kind == VERIFY, keep=keep)
    return Routed(weights, idx)


def _selection(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selection scores [T, N] fp32, the logits the weight rule reads)``: the fp32 logits twice where the scores
    are the logits (one cast)."""
    if inputs.scores is None:
        scores = inputs.logits.float()
        return scores, scores
    return inputs.scores(inputs.logits), inputs.logits


def _remap_and_record(plan: RoutePlan, inputs: StepInputs, scores, logits) -> Routed:
    new_weights, new_idx, finite = remap(plan, inputs.rule, inputs.step, scores, logits, inputs.weights, inputs.idx,
                                         host=inputs.host, seed=inputs.seed)
    if inputs.telemetry is not None:
        record_step(inputs.telemetry, plan.num_experts, inputs.step, inputs.idx, inputs.weights, new_idx, finite,
                    host=inputs.host, masks=False)
    return Routed(new_weights, new_idx, finite)


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
                                         rule.renorm_eps, topk_idx=idx64)
        return new_weights.to(weights.dtype), new_idx.to(idx.dtype), finite
    # per-token masks only where the step has them (no all-True mask is built)
    decode, live = step.decode, step.live
    remapped = finite if decode is None else decode & finite
    vote = remapped if live is None else remapped & live
    keep = ~finite if decode is None else ~decode | ~finite
    if live is not None:
        keep = keep & live
    idx64 = idx if idx.dtype == torch.int64 else idx.long()
    same = logits is scores  # the scores are the fp32 logits (StepInputs.scores None): one cast, one where
    scores = torch.where(finite[:, None], scores, torch.zeros_like(scores))
    seed = union_mask(idx64, num_experts, keep) if seed is None else union_mask(idx64, num_experts, keep) | seed
    tensors = policies.StepTensors(scores, idx64, weights, vote, seed, top_k)
    critical = plan.policy.critical_set(plan.params, ops, tensors)
    logits32 = scores if same else torch.where(finite[:, None], logits.float(),
                                               torch.zeros_like(logits, dtype=torch.float32))
    new_idx, new_weights = ops.remap(scores, critical, top_k, logits32, rule.kind, rule.renormalize, rule.scale,
                                     rule.renorm_eps, topk_idx=idx64)
    rows = remapped[:, None]
    out_idx = torch.where(rows, new_idx, idx64).to(idx.dtype)
    out_weights = torch.where(rows, new_weights.to(weights.dtype), weights)
    return out_weights, out_idx, finite


__all__ = ["PREFILL", "DECODE", "VERIFY", "MIXED", "Step", "PREFILL_STEP", "WeightRule", "StepInputs", "Routed",
           "Runner", "Stage", "StageBase", "stage_report", "reset_stages", "MoELayer", "RoutePlan", "make_plan",
           "decode_step", "keep_routing", "remap_step", "STEP_KINDS", "fused_step", "device_step", "remap",
           "record_step", "host_reads_allowed"]
