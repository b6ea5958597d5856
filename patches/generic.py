"""Generic family spec: any transformers 5.x MoE block with the standard router/experts contract.

A block qualifies (structurally, no class names) when it has

- a child ``gate`` or ``router`` that returns ``(router_logits [T, N], routing_weights [T, k],
  selected_experts [T, k])``, called by the block on its hidden states (and, for some families, a selection
  bias the block owns: MiniMax-M2, LFM2-MoE, AFMoE pass it as an argument), and
- a child ``experts`` of stacked 3-D weights (``gate_up_proj`` or, not gated, ``up_proj``, and ``down_proj``) with
  an int ``num_experts``, called as ``experts(hidden, top_k_index, top_k_weights)`` (built by
  ``transformers.integrations.moe.use_experts_implementation``, or with a forward of its own: Beam, Step-3.7),

and no dedicated family spec claims it (the generic spec is last in ``SPECS``).

The routing rule is inferred, then verified (:meth:`GenericSpec.validate`). The probe: ``[1, T, H]`` hidden
states (:func:`probe_hidden`: 64 random tokens plus 16 at each of six smaller scales down to 1e-6, so logit
gaps get smaller than any selection bias, in the router's dtype) run through the *block* with a hook on its
router, which records the router's own inputs and output (a block that cannot run on hidden states alone: the
router is called directly, on ``[T, H]``, then ``[1, T, H]``). Two parts:

1. **Selection.** A selection bias is looked for by name (``e_score_correction_bias``, ``expert_bias``, ...,
   ``N`` elements) on the router and its submodules (ERNIE-4.5's ``moe_statics``), on the block, and among the
   tensors the block passes to the router. With one, the rule is :class:`BiasedSelection` (``score(logits) +
   bias``, grouped where ``n_group`` / ``topk_group`` say so; score function stated by a ``scoring_func``-like
   field, else sigmoid then softmax; group score top-2 sum then max); without one, plain top-k of the logits
   (or of their softmax / sigmoid, in fp32 or the logits' dtype: the model's own ops). A rule is accepted only
   if its top-k reproduces the router's own ids **exactly** on every probe token (the corrected scores of the
   chosen set equal the k best, value for value: exact ties are no mismatch, any bias or group effect is).
2. **Weights.** The router/block/config state what they can (``norm_topk_prob`` -> renormalise,
   ``routed_scaling_factor`` / ``route_scale`` -> scale, a ``scoring_func``-like field -> softmax or sigmoid);
   the rest is enumerated (softmax / sigmoid, renormalise or not, the stated scale, 1 (the block scales after
   the experts) or the ratio the probe shows; a renormalising rule also with a denominator epsilon, ``w / (sum +
   eps)``: 0, 1e-6 (LFM2-MoE) or the one the probe shows). A rule must reproduce the router's own weights, applied by
   ``routing_weights`` to the model's own logits and ids and cast to the router's weight dtype, to 4 ulps of
   that dtype (fp32 round-off for fp32 routers).

Otherwise ``patch`` refuses with :class:`lynx_hf.UnsupportedModelError` naming the block and router classes,
the rule that did not fit (how many probe tokens, which candidates) and what would be needed. A router whose
weights are not materialized at patch time (meta / offloaded) is verified on its first call of at least 16
tokens instead, on the real outputs; if that fails the block keeps the model's own routing (a warning says so).
A probe that more than one selection rule fits exactly (a constant selection bias: every score function then picks
the same experts) raises :class:`AmbiguousRule` inside the spec: the block is patched with its rule deferred (the
model's own routing, a warning at patch time) and verified again once the bias it depends on changes
(``lynx_hf.block.BlockRouting``; ``docs/cases.md`` C42).

Never a raw error: the probe's hidden size comes from the config's ``hidden_size`` (else the router weight,
else the expert layout, transposed or not: GPT-OSS stores ``gate_up_proj [N, H, 2I]``), in the router's dtype
(not the experts': fp8 experts); a router that fails on the probe, returns another tuple, ids out of range or
non-finite logits is refused with the reason.

Experts: whatever their storage, the block's own forward calls them with the remapped routing; a sparse
path reads their weights only when ``lynx_hf.experts`` finds them plain (GPT-OSS's transposed, biased,
clamped-SwiGLU experts run transformers' own implementation).

Selection scores handed to the policies: the fp32 router logits for plain top-k routers; for selection-bias
routers :meth:`BiasedSelection.selection_scores` (``log(score + bias - min(bias))``, ``-inf`` outside the
token's allowed groups), so LYNX / OEA / XShare choose among the experts the model's routing allows, ranked
as the model ranks them.

Decode: like every family, the block's own forward runs; the core's router hook post-processes the
router's output and the experts run through transformers' experts interface (``lynx_hf.experts``).

Verified by the test suite (tests/families/: test_every_family.py, test_family_specs.py, test_family_matrix.py
over every MoE family transformers ships, test_selection_bias.py).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from ..core import WeightRule
from ..errors import UnsupportedModelError
from ..experts import unwrap
from ..kernels.routing_torch import routing_weights
from ..selection import GROUP_SCORES, SCORE_FNS, BiasedSelection, live_tensor
from .base import BlockRule, FamilySpec

_PROBE_TOKENS = 16  # the fewest tokens a deferred verification trusts (real router outputs)
_PROBE_RANDOM = 64  # unit-scale random tokens of the patch-time probe
_PROBE_SCALES = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)  # then 16 tokens at each smaller scale: tiny logit gaps
_ROUTER_NAMES = ("gate", "router")
_SCORE_FN_FIELDS = ("scoring_func", "score_func", "score_function", "gating_func", "router_score_function")
_SCALE_FIELDS = ("routed_scaling_factor", "route_scale", "routed_scale", "moe_routed_scaling_factor")
_GROUP_FIELDS = ("n_group", "num_group", "num_expert_group", "n_expert_groups")
_TOPK_GROUP_FIELDS = ("topk_group", "num_limited_groups", "topk_groups")
#: attribute names of a selection bias (load-balancing correction added to the scores before top-k)
BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "score_correction_bias", "expert_score_bias",
              "router_bias", "selection_bias")


@dataclass(frozen=True)
class InferredRule:
    """A verified rule of one block: the weight rule (``kind`` a ``WEIGHT_RULES`` name, ``renormalize``,
    ``scale``), the router's k and the selection (``None``: plain top-k of the logits)."""

    kind: str
    renormalize: bool
    scale: float
    top_k: int
    selection: BiasedSelection | None = None
    renorm_eps: float = 0.0


class AmbiguousRule(UnsupportedModelError):
    """Several candidate selection rules reproduce the router's ids equally on the probe (e.g. a selection bias that
    is all zero, as in a model built from its config before ``load_state_dict``: sigmoid + bias, softmax + bias and
    logits + bias then pick the same experts), so the probe cannot tell which one the router applies; they differ
    once the bias changes (``docs/cases.md`` C42). ``watch``: ``(module, dotted path)`` of the tensors they depend
    on; ``candidates``: the rules that fit."""

    def __init__(self, message: str, watch: tuple = (), candidates: tuple = ()) -> None:
        super().__init__(message)
        self.watch = tuple(watch)
        self.candidates = tuple(candidates)


def _block_rule(num_experts: int, top_k: int, rule: InferredRule | None, ambiguous: AmbiguousRule | None = None
                ) -> BlockRule:
    """The :class:`~lynx_hf.patches.base.BlockRule` of a verified ``rule`` (``None``: verification deferred;
    ``ambiguous``: why, when the probe could not tell rules apart)."""
    if rule is None:
        if ambiguous is not None:
            return BlockRule(num_experts, top_k, None, pending_reason=str(ambiguous), watch=ambiguous.watch)
        return BlockRule(num_experts, top_k, None)
    return BlockRule(num_experts, top_k, WeightRule(rule.kind, rule.renormalize, rule.scale, rule.renorm_eps),
                     rule.selection)


#: denominator epsilons of renormalising routers tried besides 0 (LFM2-MoE adds 1e-6; the DeepSeek-V3 copies' 1e-20
#: is below fp32 round-off of a sum of k probabilities and fits as 0)
_RENORM_EPS = (1e-6,)


def _renorm_epsilons(logits, idx, kind: str, scale: float, weights) -> tuple:
    """The denominator epsilons to try for a renormalising rule: 0, :data:`_RENORM_EPS` and the one the probe
    shows (``scale * sum / weights - sum`` per chosen weight, median, rounded to 2 significant digits; kept when
    positive and small against the sums, so an exact fit is still required to accept it)."""
    raw = routing_weights(logits, idx, kind, False, 1.0).float()
    total = raw.sum(dim=-1, keepdim=True)
    shown = ((scale * raw / weights.float().clamp_min(1e-30)) - total).median().item()
    found = [0.0, *_RENORM_EPS]
    if 0.0 < shown < 1e-2 and shown == shown:
        found.append(float(f"{shown:.2g}"))
    return tuple(dict.fromkeys(found))


def probe_hidden(hidden_dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The patch-time probe ``[T, H]``: :data:`_PROBE_RANDOM` unit-scale tokens, then 16 at each of
    :data:`_PROBE_SCALES` (seeded). On the small ones the router's logit gaps are far below any selection bias,
    so a bias decides the top-k there and a rule that ignores it cannot reproduce the ids."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(_PROBE_RANDOM, hidden_dim, generator=g)]
    parts += [torch.randn(_PROBE_TOKENS, hidden_dim, generator=g) * scale for scale in _PROBE_SCALES]
    return torch.cat(parts).to(device=device, dtype=dtype)


def block_parts(module: torch.nn.Module):
    """``(router, experts)`` of a block with the standard contract, else ``(None, None)``. ``experts`` is the
    experts module itself, inside PEFT adapter wrappers (PEFT LoRA on the expert parameters wraps it in
    ``ParamWrapper`` layers; ``lynx_hf.experts.unwrap``); the block's child is :meth:`GenericSpec.experts_of`."""
    children = dict(module.named_children())
    child = children.get("experts")
    if child is None:
        return None, None
    experts = unwrap(child)[0]
    if not _is_standard_experts(experts):
        return None, None
    for name in _ROUTER_NAMES:
        router = children.get(name)
        if isinstance(router, torch.nn.Module) and router is not child:
            return router, experts
    return None, None


def _is_standard_experts(experts) -> bool:
    """Experts called as ``experts(hidden, top_k_index, top_k_weights)`` with an int ``num_experts``: stacked 3-d
    ``gate_up_proj`` (gated) or ``up_proj`` (not gated: NemotronH, built with
    ``use_experts_implementation(has_gate=False)``) beside a 3-d ``down_proj``, built by ``use_experts_implementation``
    (``has_gate`` / ``is_transposed`` set) or with a forward of their own (Beam, Step-3.7); or packed / quantized
    experts (:func:`_is_packed_experts`). Either way the block calls them with the routing the router hook returns."""
    if not isinstance(getattr(experts, "num_experts", None), int):
        return False
    up = _up_weight(experts)
    down = getattr(experts, "down_proj", None)
    if isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3:
        return True
    return _is_packed_experts(experts)


#: the experts interface's parameters (transformers 5: ``use_experts_implementation``): how packed experts are known
_EXPERTS_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def _is_packed_experts(experts) -> bool:
    """Experts whose weights are packed or quantized (int4 in PyTorch's tinygemm layout, ``lab/int4_experts.py``;
    buffers of scales and zero points; no 3-d float ``gate_up_proj`` / ``down_proj``): known by the experts
    interface's signature, ``forward(hidden_states, top_k_index, top_k_weights)``. Their sizes are never read from
    the weights: the hidden size comes from the config, the router or the experts' ``hidden_dim``
    (:func:`_hidden_dim`), N from ``num_experts``, k from the router's output on the probe."""
    try:
        params = list(inspect.signature(experts.forward).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(params[:3]) == _EXPERTS_ARGS


def _up_weight(experts):
    """``gate_up_proj`` (gated experts), else ``up_proj`` (up / down only), else ``None``."""
    for name in ("gate_up_proj", "up_proj"):
        value = getattr(experts, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _hidden_dim(block, router, experts) -> int | None:
    """The hidden size the router reads: the config's ``hidden_size``, else a 2-d router weight's input size, else
    the experts' own ``hidden_dim`` / ``hidden_size``, else the expert layout (``gate_up_proj [N, 2I, H]``, or
    ``[N, H, 2I]`` when ``is_transposed``: GPT-OSS); ``None`` when none says (packed experts in a block without
    any of the others)."""
    for owner in (getattr(experts, "config", None), getattr(block, "config", None)):
        value = getattr(owner, "hidden_size", None)
        if isinstance(value, int) and value > 0:
            return value
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[-1])
    for name in ("hidden_dim", "hidden_size"):
        value = getattr(experts, name, None)
        if isinstance(value, int) and value > 0:
            return value
    gate_up = _up_weight(experts)
    if gate_up is None or gate_up.dim() != 3:
        return None
    return int(gate_up.shape[-2] if getattr(experts, "is_transposed", False) else gate_up.shape[-1])


def _on_meta(experts) -> bool:
    """Whether the experts' weights (plain or packed: any parameter or buffer) are not materialized here."""
    return any(t.device.type == "meta" for t in itertools.chain(experts.parameters(), experts.buffers()))


def _stated(block, router, experts, names):
    """The first of ``names`` found on the router, the block, then the model config."""
    for owner in (router, block, getattr(experts, "config", None), getattr(block, "config", None)):
        if owner is None:
            continue
        for field in names:
            value = getattr(owner, field, None)
            if value is not None:
                return value
    return None


def _find_biases(block, router, num_experts: int) -> list[tuple[str, str, torch.Tensor]]:
    """``[(owner, path, tensor)]``: float tensors of ``num_experts`` elements named like a selection bias
    (:data:`BIAS_NAMES`) on the router (recursively: ERNIE-4.5 keeps it in ``gate.moe_statics``), then on the
    block itself (not inside its experts or shared experts)."""
    found = []
    for owner, module, recurse in (("router", router, True), ("block", block, False)):
        for path, tensor in itertools.chain(module.named_parameters(recurse=recurse),
                                            module.named_buffers(recurse=recurse)):
            if (path.rsplit(".", 1)[-1] in BIAS_NAMES and tensor.is_floating_point()
                    and tensor.numel() == num_experts):
                found.append((owner, path, tensor))
    return found


def _path_of(block, tensor) -> str | None:
    """The dotted path of ``tensor`` among the block's parameters and buffers, else ``None``."""
    for path, t in itertools.chain(block.named_parameters(), block.named_buffers()):
        if t is tensor:
            return path
    return None


def _capture(block, router, probe):
    """Run the block on ``probe`` (``[1, T, H]``) with a hook on its router; fall back to calling the router on
    ``[T, H]``, then ``[1, T, H]``. Returns ``((args, kwargs, output) | None, [failure texts])``: the router's
    first call as the block makes it (inputs and output)."""
    calls, failures = [], []

    def hook(module, args, kwargs, output):
        if not calls:
            calls.append((args, kwargs, output))

    handle = router.register_forward_hook(hook, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            try:
                block(probe.unsqueeze(0))
            except Exception as exc:  # noqa: BLE001 - a foreign block: any failure means "call the router"
                failures.append(f"the block on [1, {probe.shape[0]}, {probe.shape[1]}]: {type(exc).__name__}: {exc}")
            for x in (probe, probe.unsqueeze(0)):
                if calls:
                    break
                try:
                    router(x)
                except Exception as exc:  # noqa: BLE001 - reported in the refusal
                    failures.append(f"the router on {list(x.shape)}: {type(exc).__name__}: {exc}")
    finally:
        handle.remove()
    return (calls[0] if calls else None), failures


def _needs(router) -> str:
    """What a router that fails on hidden states alone needs, from its ``forward`` signature (for messages)."""
    import inspect

    try:
        params = list(inspect.signature(router.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "other inputs"
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any("input_ids" in name for name in required):
        return f"other inputs: input_ids (hash routing; its forward takes {required})"
    return f"other inputs ({required})" if required else "other inputs"


def _plain_mismatch(logits: torch.Tensor, idx: torch.Tensor) -> tuple[str, int] | None:
    """Plain top-k: ``None`` if the ids are the top-k of the logits, their softmax or their sigmoid (in fp32 or
    the logits' dtype, exact ties allowed), else ``(description, tokens that do not fit the closest)``."""
    top_k = idx.shape[-1]
    best = None
    dtypes = (torch.float32,) if logits.dtype == torch.float32 else (torch.float32, logits.dtype)
    for name, dtype in itertools.product(("logits", "softmax", "sigmoid"), dtypes):
        x = logits.to(dtype)
        score = x if name == "logits" else (torch.softmax(x, dim=-1) if name == "softmax" else x.sigmoid())
        chosen = score.gather(1, idx).sort(dim=-1, descending=True).values
        bad = int((chosen != score.topk(top_k, dim=-1).values).any(dim=-1).sum())
        if bad == 0:
            return None
        if best is None or bad < best[1]:
            best = (f"top-{top_k} of {name} ({str(dtype).replace('torch.', '')})", bad)
    return best


@dataclass(frozen=True)
class GenericSpec(FamilySpec):
    """Any block with the standard router/experts contract that no dedicated spec claims (``exclude``: the dedicated
    specs, which keep their blocks). Holds no per-block state: :meth:`validate` returns the inferred rule."""

    family: str = "generic"
    block_classes: tuple = ()
    weight_rule_of: Callable | None = None  # inferred per block (:meth:`validate`), not stated
    exclude: tuple = ()

    #: tokens a router output needs before a deferred verification trusts it
    probe_tokens = _PROBE_TOKENS

    def matches(self, module):
        if any(spec.matches(module) for spec in self.exclude):
            return False
        router, _ = block_parts(module)
        return router is not None

    def router_of(self, block):
        return block_parts(block)[0]

    def experts_of(self, block):
        return getattr(block, self.experts)  # the child the block calls (a PEFT wrapper included)

    def shape(self, block):
        """``(N, k)`` as the block states them (the experts' ``num_experts``; ``top_k`` / ``num_experts_per_tok`` /
        ``moe_topk`` on the router, the block or the config). Raises ``UnsupportedModelError`` without a k."""
        router, experts = block_parts(block)
        top_k = _stated(block, router, experts, ("top_k", "num_experts_per_tok", "moe_topk"))
        if not isinstance(top_k, int):
            raise UnsupportedModelError(
                f"{type(block).__name__} (router {type(router).__name__}): cannot find the router's top_k (no "
                f"top_k / num_experts_per_tok / moe_topk on the router, the block or the config)")
        return experts.num_experts, top_k

    def validate(self, block, name, config) -> BlockRule:
        """Infer the routing rule and verify it on the probe, then the shared checks (k in 1..N); returns the
        :class:`~lynx_hf.patches.base.BlockRule` (its ``weight`` ``None`` when the router or experts are not
        materialized here: verified on the first large enough call, :meth:`deferred_rule`). Raises
        :class:`UnsupportedModelError`, never a raw error: a router that cannot run on the probe, an output of another
        form, a selection or weights no rule reproduces are each refused with the block and router classes and the
        reason."""
        router, experts = block_parts(block)
        who = f"{name} ({type(block).__name__}, router {type(router).__name__})"
        weight = next(router.parameters(), None)
        ambiguous = None
        if weight is None or weight.device.type == "meta" or _on_meta(experts):
            rule = None  # not materialized here: verify on the first decode call
        else:
            hidden_dim = _hidden_dim(block, router, experts)
            if hidden_dim is None:
                raise UnsupportedModelError(
                    f"{who}: cannot tell the hidden size (no hidden_size in the config, no 2-d router weight, expert "
                    f"layout unknown); the generic family spec cannot probe its router"
                )
            dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 else torch.float32
            probe = probe_hidden(hidden_dim, dtype, weight.device)
            call, failures = _capture(block, router, probe)
            if call is None:
                raise UnsupportedModelError(
                    f"{who}: calling the router on hidden states [{probe.shape[0]}, {hidden_dim}] failed "
                    f"({'; '.join(failures)}); it needs {_needs(router)}, which the generic family spec cannot "
                    f"supply (a dedicated family spec is needed)"
                )
            args, kwargs, output = call
            passed = [t for t in (*args[1:], *kwargs.values()) if isinstance(t, torch.Tensor)]
            try:
                rule = self.verify(block, name, output, passed=passed)
            except AmbiguousRule as exc:  # deferred: verified again once the tensors it depends on change
                rule, ambiguous = None, exc
        num_experts = experts.num_experts
        top_k = rule.top_k if rule is not None else self.shape(block)[1]
        self.check_routing(block, name, config, num_experts, top_k)
        return _block_rule(num_experts, top_k, rule, ambiguous)

    def deferred_rule(self, block, name, output) -> BlockRule:
        """The :class:`~lynx_hf.patches.base.BlockRule` verified on the router's real ``output`` (its first call
        of at least :attr:`probe_tokens` tokens, a router not materialized at patch time). Raises
        :class:`UnsupportedModelError`."""
        try:
            rule = self.verify(block, name, output)
        except AmbiguousRule:
            # real tokens rarely sit at the tiny logit gaps where a bias decides: the patch-time probe, on the router
            # as it is now (its own forward, no module hooks), tells the rules apart if anything can
            rule = self.verify(block, name, self._probe_router(block, output))
        return _block_rule(block_parts(block)[1].num_experts, rule.top_k, rule)

    def _probe_router(self, block, output):
        """The router's output on the patch-time probe (:func:`probe_hidden`), called through its ``forward`` (an
        accelerate hook's too; no module hooks, so the block's own router hook does not run), on the device and in the
        dtype of ``output``'s logits' router; ``output`` itself when that call fails."""
        router, experts = block_parts(block)
        hidden_dim = _hidden_dim(block, router, experts)
        weight = next(router.parameters(), None)
        if hidden_dim is None or weight is None:
            return output
        dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 else torch.float32
        probe = probe_hidden(hidden_dim, dtype, output[0].device)
        with torch.no_grad():
            for x in (probe, probe.unsqueeze(0)):
                try:
                    return router.forward(x)
                except Exception:  # noqa: BLE001 - a router that needs more than hidden states: keep the output
                    continue
        return output

    def verify(self, block, name, output, passed=()) -> InferredRule:
        """The rule that reproduces ``output`` (the router's own ``(logits [T, N], weights [T, k], ids [T, k])``;
        ``passed``: the tensors the block passed to the router besides the hidden states), or raise
        ``UnsupportedModelError``."""
        router, experts = block_parts(block)
        who = f"{name} ({type(block).__name__}, router {type(router).__name__})"
        try:
            return self._verify(who, block, router, experts, output, passed)
        except UnsupportedModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - a foreign router's output that breaks the check is a refusal
            raise UnsupportedModelError(
                f"{who}: checking the router's output failed ({type(exc).__name__}: {exc}); the generic family spec "
                f"cannot patch it (a dedicated family spec is needed)"
            ) from exc

    def _selection(self, who, block, router, experts, logits, idx, passed) -> BiasedSelection | None:
        """The selection rule that reproduces the router's ids ``idx`` exactly (``None``: plain top-k)."""
        num_experts, top_k = logits.shape[-1], idx.shape[-1]
        biases = [(owner, path) for owner, path, _ in _find_biases(block, router, num_experts)]
        for tensor in passed:  # a bias the block passes to the router (MiniMax-M2, LFM2-MoE, AFMoE)
            if not (tensor.is_floating_point() and tensor.numel() == num_experts):
                continue
            path = _path_of(block, tensor)
            if path is None:
                raise UnsupportedModelError(
                    f"{who}: the block passes the router a tensor of {num_experts} values that is not one of its "
                    f"parameters or buffers; a selection bias must live on the router or the block to be read in "
                    f"decode (a dedicated family spec is needed)")
            biases = [("block", path, True)] + [b for b in biases if b != ("block", path)]
        n_group = _stated(block, router, experts, _GROUP_FIELDS)
        topk_group = _stated(block, router, experts, _TOPK_GROUP_FIELDS)
        grouped = isinstance(n_group, int) and n_group > 1 and isinstance(topk_group, int)
        if grouped and (num_experts % n_group or not 1 <= topk_group <= n_group):
            raise UnsupportedModelError(
                f"{who}: group routing n_group={n_group}, topk_group={topk_group} does not fit {num_experts} experts "
                f"(n_group must divide N, topk_group be in 1..n_group)")
        if not biases:
            plain = _plain_mismatch(logits, idx)
            if plain is None:
                return None
            if not grouped:
                raise UnsupportedModelError(
                    f"{who}: the router's experts are not the top-{top_k} of its logits on {plain[1]} of "
                    f"{logits.shape[0]} probe tokens (closest rule: {plain[0]}) and no selection bias was found "
                    f"(looked for {', '.join(BIAS_NAMES)} on the router and the block, and for tensors the block "
                    f"passes to it); a selection rule with sampling, noise or a bias kept elsewhere needs a "
                    f"dedicated family spec")
        score_fn = _stated(block, router, experts, _SCORE_FN_FIELDS)
        score_fns = ([score_fn.lower(), "logits"] if isinstance(score_fn, str) and score_fn.lower() in SCORE_FNS
                     else SCORE_FNS)
        candidates = []
        for bias in biases or [("none", "", False)]:
            owner, path, passes = (*bias, False)[:3]
            for fn in score_fns:
                for group_score in (GROUP_SCORES if grouped else GROUP_SCORES[:1]):
                    candidates.append(BiasedSelection(fn, owner, path, n_group if grouped else 1,
                                                      topk_group if grouped else 1, group_score, passes))
        offloaded = [f"{o}.{p}" for o, p, t in _find_biases(block, router, num_experts)
                     if live_tensor(router if o == "router" else block, p).device.type == "meta"]
        if offloaded:
            raise UnsupportedModelError(
                f"{who}: its selection bias {offloaded} is not materialized (offloaded), so the selection scores "
                f"could not be read in decode; load the model without offloading the router to patch it")
        tried, fit = [], []
        for selection in candidates:
            bias = selection.bias(router, block, num_experts).to(logits.device)
            bad = int(selection.mismatches(logits, bias, idx).sum())
            if bad == 0:
                fit.append((selection, bias))
            tried.append(f"{selection.describe()}: {bad} of {logits.shape[0]} tokens differ")
        if len(fit) > 1 and fit[0][0].owner != "none":
            # more than one rule reproduces every probe token: the probe cannot tell which the router applies, and
            # they differ on other inputs or once the bias changes; never pick one (docs/cases.md C42)
            constant = bool((fit[0][1] == fit[0][1].reshape(-1)[0]).all())
            why = (f" (its selection bias {fit[0][0].owner}.{fit[0][0].path} is constant, "
                   f"{float(fit[0][1].reshape(-1)[0]):g} everywhere: a model built from its config before its "
                   f"weights are loaded?)" if constant else "")
            watch = tuple(dict.fromkeys((router if sel.owner == "router" else block, sel.path) for sel, _ in fit))
            raise AmbiguousRule(
                f"{who}: {len(fit)} selection rules reproduce the router's experts equally on the probe "
                f"({'; '.join(sel.describe() for sel, _ in fit)}){why}, so it cannot tell which one the router "
                f"applies", watch=watch, candidates=tuple(sel for sel, _ in fit))
        if fit:
            return fit[0][0]
        raise UnsupportedModelError(
            f"{who}: no selection rule reproduces the router's own experts exactly on the probe ({'; '.join(tried)}); "
            f"its selection is not a (biased, grouped) top-k the generic family spec knows (a dedicated family spec "
            f"is needed)")

    def _verify(self, who, block, router, experts, output, passed=()) -> InferredRule:
        num_experts = experts.num_experts
        if not (isinstance(output, (tuple, list)) and len(output) == 3
                and all(isinstance(t, torch.Tensor) for t in output)):
            raise UnsupportedModelError(
                f"{who}: the router does not return (router_logits, routing_weights, selected_experts); "
                f"the generic family spec cannot patch it (a dedicated family spec is needed)"
            )
        logits, weights, idx = output
        if logits.dim() == 3:  # a router that keeps [B, S, N]
            logits = logits.reshape(-1, logits.shape[-1])
        if (logits.dim() != 2 or logits.shape[-1] != num_experts or idx.dim() != 2 or weights.shape != idx.shape
                or idx.dtype.is_floating_point or not weights.dtype.is_floating_point
                or idx.shape[0] != logits.shape[0]):
            raise UnsupportedModelError(
                f"{who}: router output shapes {tuple(logits.shape)}, {tuple(weights.shape)}, {tuple(idx.shape)} are "
                f"not [T, N={num_experts}], [T, k], [T, k]; the generic family spec cannot patch it (it needs the "
                f"router to return (router_logits, routing_weights, selected_experts) in that order, as transformers "
                f"5.24 routers do; another order or layout needs a dedicated family spec)"
            )
        top_k = idx.shape[-1]
        idx = idx.long()
        if top_k < 1 or bool((idx < 0).any()) or bool((idx >= num_experts).any()):
            raise UnsupportedModelError(
                f"{who}: the router's expert ids are not in 0..{num_experts - 1} (k={top_k}); the generic family spec "
                f"cannot patch it"
            )
        if not bool(torch.isfinite(logits.float()).all()):
            raise UnsupportedModelError(
                f"{who}: the router's logits on a probe input are not finite (uninitialized weights?); the generic "
                f"family spec cannot verify its rule"
            )
        if top_k > 1 and not bool((idx.sort(dim=-1).values.diff(dim=-1) != 0).all()):
            raise UnsupportedModelError(
                f"{who}: the router chose the same expert twice for a token; the generic family spec cannot "
                f"reproduce its selection")
        selection = self._selection(who, block, router, experts, logits, idx, passed)
        renorm = _stated(block, router, experts, ("norm_topk_prob",))
        scale = _stated(block, router, experts, _SCALE_FIELDS)
        score_fn = _stated(block, router, experts, _SCORE_FN_FIELDS)
        if selection is not None and selection.owner != "none" and selection.score != "logits":
            kinds = ["sigmoid" if selection.score == "sigmoid" else "softmax_all"]
        elif isinstance(score_fn, str) and score_fn.lower() in ("sigmoid", "softmax"):
            kinds = ["sigmoid" if score_fn.lower() == "sigmoid" else "softmax_all"]
        else:
            kinds = ["softmax_all", "sigmoid"]
        renorms = [bool(renorm)] if renorm is not None else [False, True]
        scales = [float(scale)] if isinstance(scale, (int, float)) and not isinstance(scale, bool) else []
        scales.append(1.0)  # no scale, or one the block applies after the experts (Beam, MiniMax-M3-VL)
        tol = 4 * torch.finfo(weights.dtype).eps
        fits, errors = [], []
        for kind, renormalize in itertools.product(kinds, renorms):
            unscaled = routing_weights(logits, idx, kind, renormalize, 1.0).float()
            ratio = (weights.float() / unscaled.clamp_min(1e-30)).median().item()
            for factor in dict.fromkeys([*scales, ratio]):  # the stated scale, 1, the ratio the probe shows
                # a renormalising router may add an epsilon to the denominator (w / (sum + eps)): none, the
                # conventional ones, and the one this probe shows (rounded to 2 significant digits)
                for eps in (_renorm_epsilons(logits, idx, kind, factor, weights) if renormalize else (0.0,)):
                    ours = routing_weights(logits, idx, kind, renormalize, factor, eps).to(weights.dtype).float()
                    err = ((ours - weights.float()).abs() / weights.float().abs().clamp_min(1e-30)).max().item()
                    if torch.allclose(ours, weights.float(), rtol=tol, atol=tol * 1e-3):
                        fits.append((err, len(fits), InferredRule(kind, renormalize, factor, top_k, selection, eps)))
                    errors.append(f"{kind}(renormalize={renormalize}, scale={factor:.6g}"
                                  + (f", denominator eps={eps:.3g}" if eps else "") + f"): max rel err {err:.3g}")
        if fits:  # the closest fit; on an exact tie the attribute-stated / first candidate
            return min(fits, key=lambda fit: fit[:2])[2]
        chose = "plain top-k" if selection is None else selection.describe()
        hints = [f"a per-expert output scale ({name}, {num_experts} values)" for name, t in router.named_parameters()
                 if "scale" in name and t.numel() == num_experts]  # Gemma-4's router.per_expert_scale
        lg = logits.float()
        if bool((lg >= 0).all()) and bool(((lg.sum(dim=-1) - 1).abs() < 1e-3).all()):
            hints.append("the router returns probabilities (rows sum to 1) where the contract has logits")
        seen = f" [{'; '.join(hints)}: a dedicated family spec would need to reproduce that]" if hints else ""
        raise UnsupportedModelError(
            f"{who}: the selection ({chose}) fits, but no inferred weight rule reproduces the router's own weights{seen} "
            f"on the probe to 4 ulps of {str(weights.dtype).replace('torch.', '')} ({'; '.join(errors)}); the weights are "
            f"not a softmax / sigmoid of the chosen logits, renormalised (w / (sum + eps)) and scaled (a dedicated "
            f"family spec is needed)"
        )
