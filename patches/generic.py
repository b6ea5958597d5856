"""Generic family spec: any transformers 5.x MoE block with the standard router/experts contract.

A block qualifies (structurally, no class names) when it has

- a child ``gate`` or ``router`` that, called on flattened hidden states ``[T, H]``, returns
  ``(router_logits [T, N], routing_weights [T, k], selected_experts [T, k])``, and
- a child ``experts`` built by ``transformers.integrations.moe.use_experts_implementation``
  (stacked ``gate_up_proj``/``down_proj`` 3-D weights, ``num_experts``, called as
  ``experts(hidden, top_k_index, top_k_weights)``),

and no dedicated family spec claims it (the generic spec is last in ``SPECS``).

Weight rule: inferred, then verified. The router/block/config attributes state what they can
(``norm_topk_prob`` -> renormalize, ``routed_scaling_factor`` -> scale, ``scoring_func``-like
fields or an ``e_score_correction_bias`` -> sigmoid); what they do not state (e.g. GraniteMoE's and
MiniMax's always-on renormalization, which no attribute names) is enumerated (softmax/sigmoid,
renormalize or not). At patch time (:meth:`GenericSpec.validate`) the router runs, without
grad, on a fixed random probe of ``[16, H]`` hidden states in the router's dtype, and a rule is
accepted only if (1) the model's own experts are the top-k of its router logits (no correction bias,
no group limits, no sampling), and (2) the rule, applied by ``routing_weights`` to the model's
own logits and indices and cast to the router's weight dtype, reproduces the router's own weights
(to 4 ulps of that dtype; the closest fitting candidate wins). Otherwise ``patch`` refuses with
:class:`lynx_hf.UnsupportedModelError` naming the block class (e.g. PhiMoE's sparsemixer). A router
whose weights are not materialized at patch time (meta / offloaded) is verified on its first decode call
instead, on the real outputs; if that fails the block keeps the model's own routing (a warning says so).

Never a raw error: the probe's hidden size comes from the config's ``hidden_size`` (else the
router weight, else the expert layout, transposed or not: GPT-OSS stores ``gate_up_proj [N, H, 2I]``), in
the router's dtype (not the experts': fp8 experts); a router that fails on hidden states alone (it needs
other inputs), returns another tuple, ids out of range or non-finite logits is refused with
:class:`lynx_hf.UnsupportedModelError` naming the block, the router class and the reason.

Experts: whatever their storage, the block's own forward calls them with the remapped routing; a sparse
path reads their weights only when ``lynx_hf.experts`` finds them plain (GPT-OSS's transposed, biased,
clamped-SwiGLU experts run transformers' own implementation).

Selection scores: the fp32 router logits (pre-softmax / pre-sigmoid, ``docs/design.md``).

Decode: like every family, the block's own forward runs; the core's router hook post-processes the
router's output and the experts run through transformers' experts interface (``lynx_hf.experts``).

Verified by the test suite (tests/test_adapters_extra.py, transformers 5.23): GraniteMoE
(``GraniteMoeMoE``: softmax over the chosen k, weights in the hidden dtype), FlexOlmo
(``FlexOlmoSparseMoeBlock``: softmax over N, no renormalization), HunYuan-V1-MoE
(``HunYuanMoEV1Moe``: softmax renormalized, shared MLP); refused: PhiMoE (sparsemixer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..core import WeightRule
from ..errors import UnsupportedModelError
from ..kernels.routing_torch import routing_weights
from .base import FamilySpec

_PROBE_TOKENS = 16
_ROUTER_NAMES = ("gate", "router")
_SCORE_FN_FIELDS = ("scoring_func", "score_func", "score_function", "gating_func", "router_score_function")


@dataclass(frozen=True)
class InferredRule:
    """A verified weight rule of one block (``kind`` is a ``WEIGHT_RULES`` name) and the router's k."""

    kind: str
    renormalize: bool
    scale: float
    top_k: int


def block_parts(module: torch.nn.Module):
    """``(router, experts)`` of a block with the standard contract, else ``(None, None)``. ``experts`` is the
    experts module itself, inside PEFT adapter wrappers (PEFT LoRA on the expert parameters wraps it in
    ``ParamWrapper`` layers; ``lynx_hf.experts.unwrap``); the block's child is :meth:`GenericSpec.experts_of`."""
    from ..experts import unwrap

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
    """Built by ``use_experts_implementation``: it sets ``has_gate``/``is_transposed`` and ``config``."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and isinstance(getattr(experts, "num_experts", None), int)
            and hasattr(experts, "has_gate") and hasattr(experts, "is_transposed"))


def _hidden_dim(block, router, experts) -> int | None:
    """The hidden size the router reads: the config's ``hidden_size``, else a 2-d router weight's input size,
    else the expert layout (``gate_up_proj [N, 2I, H]``, or ``[N, H, 2I]`` when ``is_transposed``: GPT-OSS)."""
    for owner in (getattr(experts, "config", None), getattr(block, "config", None)):
        value = getattr(owner, "hidden_size", None)
        if isinstance(value, int) and value > 0:
            return value
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[-1])
    gate_up = experts.gate_up_proj
    return int(gate_up.shape[-2] if getattr(experts, "is_transposed", False) else gate_up.shape[-1])


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


class GenericSpec(FamilySpec):
    """Any block with the standard router/experts contract that no dedicated spec claims."""

    #: tokens a router output needs before a deferred verification trusts it (the patch-time probe's size)
    probe_tokens = _PROBE_TOKENS

    def __init__(self, exclude=()) -> None:
        super().__init__(family="generic", block_classes=(), weight_rule_of=None)
        object.__setattr__(self, "exclude", tuple(exclude))
        object.__setattr__(self, "_rules", {})  # id(block) -> InferredRule | None, between validate and weight_rule

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
        router, experts = block_parts(block)
        rule = self._rules.get(id(block))
        if rule is not None:
            return experts.num_experts, rule.top_k
        top_k = _stated(block, router, experts, ("top_k", "num_experts_per_tok", "moe_topk"))
        if not isinstance(top_k, int):
            raise UnsupportedModelError(f"{type(block).__name__}: cannot find the router's top_k")
        return experts.num_experts, top_k

    def validate(self, block, name, config):
        """Infer the weight rule and verify it on a probe (raises :class:`UnsupportedModelError`, never a raw
        error: a router that cannot run on hidden states alone, a probe that fails, an output of another
        form are each refused with the block's class and the reason)."""
        router, experts = block_parts(block)
        who = f"{name} ({type(block).__name__}, router {type(router).__name__})"
        weight = next(router.parameters(), None)
        if weight is None or weight.device.type == "meta" or experts.gate_up_proj.device.type == "meta":
            self._rules[id(block)] = None  # not materialized here: verify on the first decode call
        else:
            hidden_dim = _hidden_dim(block, router, experts)
            if hidden_dim is None:
                raise UnsupportedModelError(
                    f"{who}: cannot tell the hidden size (no hidden_size in the config, no 2-d router weight, expert "
                    f"layout unknown); the generic family spec cannot probe its router"
                )
            dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 else torch.float32
            probe = torch.randn(_PROBE_TOKENS, hidden_dim, generator=torch.Generator().manual_seed(0))
            try:
                with torch.no_grad():
                    output = router(probe.to(device=weight.device, dtype=dtype))
            except Exception as exc:  # noqa: BLE001 - any failure of a foreign router is a refusal, not a crash
                raise UnsupportedModelError(
                    f"{who}: calling the router on hidden states [{_PROBE_TOKENS}, {hidden_dim}] alone failed "
                    f"({type(exc).__name__}: {exc}); a router that needs other inputs or another layout cannot be "
                    f"patched by the generic family spec (a dedicated family spec is needed)"
                ) from exc
            self._rules[id(block)] = self.verify(block, name, output)
        super().validate(block, name, config)
    def weight_rule(self, block):
        """The verified rule (``None``: verification deferred to the first decode call)."""
        rule = self._rules.pop(id(block), None)
        return None if rule is None else WeightRule(rule.kind, rule.renormalize, rule.scale)

    def deferred_rule(self, block, name, output) -> WeightRule:
        rule = self.verify(block, name, output)
        return WeightRule(rule.kind, rule.renormalize, rule.scale)

    def verify(self, block, name, output) -> InferredRule:
        """The rule that reproduces ``output`` (the router's own), or raise ``UnsupportedModelError``."""
        router, experts = block_parts(block)
        who = f"{name} ({type(block).__name__}, router {type(router).__name__})"
        try:
            return self._verify(who, block, router, experts, output)
        except UnsupportedModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - a foreign router's output that breaks the check is a refusal
            raise UnsupportedModelError(
                f"{who}: checking the router's output failed ({type(exc).__name__}: {exc}); the generic family spec "
                f"cannot patch it (a dedicated family spec is needed)"
            ) from exc

    def _verify(self, who, block, router, experts, output) -> InferredRule:
        num_experts = experts.num_experts
        if not (isinstance(output, (tuple, list)) and len(output) == 3
                and all(isinstance(t, torch.Tensor) for t in output)):
            raise UnsupportedModelError(
                f"{who}: the router does not return (router_logits, routing_weights, selected_experts); "
                f"the generic family spec cannot patch it (a dedicated family spec is needed)"
            )
        logits, weights, idx = output
        if (logits.dim() != 2 or logits.shape[-1] != num_experts or idx.dim() != 2 or weights.shape != idx.shape
                or idx.dtype.is_floating_point or not weights.dtype.is_floating_point
                or idx.shape[0] != logits.shape[0]):
            raise UnsupportedModelError(
                f"{who}: router output shapes {tuple(logits.shape)}, {tuple(weights.shape)}, {tuple(idx.shape)} are "
                f"not [T, N={num_experts}], [T, k], [T, k]; the generic family spec cannot patch it"
            )
        top_k = idx.shape[-1]
        scores = logits.float()
        idx = idx.long()
        if top_k < 1 or bool((idx < 0).any()) or bool((idx >= num_experts).any()):
            raise UnsupportedModelError(
                f"{who}: the router's expert ids are not in 0..{num_experts - 1} (k={top_k}); the generic family spec "
                f"cannot patch it"
            )
        if not bool(torch.isfinite(scores).all()):
            raise UnsupportedModelError(
                f"{who}: the router's logits on a probe input are not finite (uninitialized weights?); the generic "
                f"family spec cannot verify its rule"
            )
        distinct = bool((idx.sort(dim=-1).values.diff(dim=-1) != 0).all()) if top_k > 1 else True
        chosen = scores.gather(1, idx).sort(dim=-1, descending=True).values
        best = scores.topk(top_k, dim=-1).values
        if not distinct or not torch.allclose(chosen, best, rtol=1e-6, atol=1e-6):
            raise UnsupportedModelError(
                f"{who}: the router's experts are not the top-{top_k} of its logits (a selection bias, group "
                f"limits or sampling?); the generic family spec cannot reproduce its selection"
            )
        renorm = _stated(block, router, experts, ("norm_topk_prob",))
        scale = _stated(block, router, experts, ("routed_scaling_factor",))
        score_fn = _stated(block, router, experts, _SCORE_FN_FIELDS)
        if isinstance(score_fn, str) and score_fn.lower() in ("sigmoid", "softmax"):
            kinds = ["sigmoid" if score_fn.lower() == "sigmoid" else "softmax_all"]
        elif getattr(router, "e_score_correction_bias", None) is not None:
            kinds = ["sigmoid"]
        else:
            kinds = ["softmax_all", "sigmoid"]
        renorms = [bool(renorm)] if renorm is not None else [False, True]
        scales = [float(scale)] if scale is not None else [1.0]
        tol = 4 * torch.finfo(weights.dtype).eps
        fits, errors = [], []
        for kind, renormalize, factor in itertools.product(kinds, renorms, scales):
            ours = routing_weights(logits, idx, kind, renormalize, factor).to(weights.dtype).float()
            err = ((ours - weights.float()).abs() / weights.float().abs().clamp_min(1e-30)).max().item()
            if torch.allclose(ours, weights.float(), rtol=tol, atol=tol * 1e-3):
                fits.append((err, len(fits), InferredRule(kind, renormalize, factor, top_k)))
            errors.append(f"{kind}(renormalize={renormalize}, scale={factor}): max rel err {err:.3g}")
        if fits:  # the closest fit; on an exact tie the attribute-stated / first candidate
            return min(fits, key=lambda fit: fit[:2])[2]
        raise UnsupportedModelError(
            f"{who}: no inferred weight rule reproduces the router's own weights on a probe input "
            f"({'; '.join(errors)}); the generic family spec cannot patch it (a dedicated family spec is needed)"
        )



