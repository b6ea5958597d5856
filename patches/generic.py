"""Generic adapter: any transformers 5.x MoE block with the standard router/experts contract.

A block qualifies (structurally, no class names) when it has

- a child ``gate`` or ``router`` that, called on flattened hidden states ``[T, H]``, returns
  ``(router_logits [T, N], routing_weights [T, k], selected_experts [T, k])``, and
- a child ``experts`` built by ``transformers.integrations.moe.use_experts_implementation``
  (stacked ``gate_up_proj``/``down_proj`` 3-D weights, ``num_experts``, called as
  ``experts(hidden, top_k_index, top_k_weights)``),

and no dedicated adapter claims it (the generic adapter is last in ``ADAPTERS``).

Weight rule: inferred, then verified. The router/block/config attributes state what they can
(``norm_topk_prob`` -> renormalize, ``routed_scaling_factor`` -> scale, ``scoring_func``-like
fields or an ``e_score_correction_bias`` -> sigmoid); what they do not state (e.g. GraniteMoE's and
MiniMax's always-on renormalization, which no attribute names) is enumerated (softmax/sigmoid,
renormalize or not). At patch time (:meth:`GenericAdapter.check_block`) the router runs, without
grad, on a fixed random probe of ``[16, H]`` hidden states in the experts' dtype, and a rule is
accepted only if (1) the model's own experts are the top-k of its router logits (no correction bias,
no group limits, no sampling), and (2) the rule, applied by ``naive_routing_weights`` to the model's
own logits and indices and cast to the router's weight dtype, reproduces the router's own weights
(to 4 ulps of that dtype; the closest fitting candidate wins). Otherwise ``patch`` refuses with
:class:`lynx_hf.UnsupportedModelError` naming the block class (e.g. PhiMoE's sparsemixer). A router whose weights are not materialized at
patch time (meta / offloaded) is verified on its first decode call instead, on the real outputs;
if that fails the block keeps the model's own routing (a warning says so).

Selection scores: the fp32 router logits (pre-softmax / pre-sigmoid, DESIGN.md).

Decode forward: the block's *own* forward runs, with two temporary interceptions that are removed
before it returns (nothing stays on the modules): a forward hook on the router hands its output to
``lynx.route`` and returns the remapped ``(logits, weights, indices)`` to the block, so shared
experts, gates and output contracts are the block's own; and, only when the sparse Triton decode
kernel applies (``lynx.run_experts``: Triton backend, SiLU-gated, concatenated, non-transposed,
bias-free experts, no accelerate hook on the experts module), an instance ``forward`` on the experts
that routes the call through ``lynx.run_experts``.

Verified by the test suite (tests/test_adapters_extra.py, transformers 5.23): GraniteMoE
(``GraniteMoeMoE``: softmax over the chosen k, weights in the hidden dtype), FlexOlmo
(``FlexOlmoSparseMoeBlock``: softmax over N, no renormalization), HunYuan-V1-MoE
(``HunYuanMoEV1Moe``: softmax renormalized, shared MLP); refused: PhiMoE (sparsemixer).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError
from ..kernels.routing_naive import naive_routing_weights
from .base import MoEAdapter, WeightRule

_PROBE_TOKENS = 16
_ROUTER_NAMES = ("gate", "router")
_SCORE_FN_FIELDS = ("scoring_func", "score_func", "score_function", "gating_func", "router_score_function")


@dataclass(frozen=True)
class InferredRule:
    """A verified weight rule of one block (``rule`` is a ``WEIGHT_RULES`` name)."""

    rule: str
    renormalize: bool
    scale: float
    top_k: int


_REFUSED = InferredRule("", False, 1.0, 0)  # deferred verification failed: keep the model's routing


def block_parts(module: torch.nn.Module):
    """``(router, experts)`` of a block with the standard contract, else ``(None, None)``."""
    children = dict(module.named_children())
    experts = children.get("experts")
    if experts is None or not _is_standard_experts(experts):
        return None, None
    for name in _ROUTER_NAMES:
        router = children.get(name)
        if isinstance(router, torch.nn.Module) and router is not experts:
            return router, experts
    return None, None


def _is_standard_experts(experts) -> bool:
    """Built by ``use_experts_implementation``: it sets ``has_gate``/``is_transposed`` and ``config``."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and isinstance(getattr(experts, "num_experts", None), int)
            and hasattr(experts, "has_gate") and hasattr(experts, "is_transposed"))


def _kernel_layout(experts) -> bool:
    """The sparse decode kernel's layout: [N, 2I, H] gate-first, [N, H, I], no bias, no post norm."""
    return (bool(experts.has_gate) and not experts.is_transposed and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "has_bias", False) and not getattr(experts, "has_post_expert_norm", False))


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


class GenericAdapter(MoEAdapter):
    family = "generic"
    block_class_paths = ()

    def __init__(self, exclude: tuple[MoEAdapter, ...] = ()) -> None:
        self.exclude = tuple(exclude)
        # block -> InferredRule (None: verification deferred to the first decode call); weak keys, so
        # nothing is attached to the user's modules and nothing outlives them.
        self._rules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- matching / patch-time checks -------------------------------------------------------------
    def matches(self, module):
        if any(adapter.matches(module) for adapter in self.exclude):
            return False
        router, _ = block_parts(module)
        return router is not None

    def experts_and_top_k(self, block):
        router, experts = block_parts(block)
        rule = self._rules.get(block)
        if rule is not None and rule is not _REFUSED:
            return experts.num_experts, rule.top_k
        top_k = _stated(block, router, experts, ("top_k", "num_experts_per_tok", "moe_topk"))
        if not isinstance(top_k, int):
            raise UnsupportedModelError(f"{type(block).__name__}: cannot find the router's top_k")
        return experts.num_experts, top_k

    def check_block(self, block, name):
        """Infer the weight rule and verify it on a probe (raises :class:`UnsupportedModelError`)."""
        router, experts = block_parts(block)
        weight = next(router.parameters(), None)
        if weight is None or weight.device.type == "meta" or experts.gate_up_proj.device.type == "meta":
            self._rules[block] = None  # not materialized here: verify on the first decode call
        else:
            hidden_dim = experts.gate_up_proj.shape[-1]
            probe = torch.randn(_PROBE_TOKENS, hidden_dim, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                output = router(probe.to(device=weight.device, dtype=experts.gate_up_proj.dtype))
            self._rules[block] = self.verify(block, name, output)
        super().check_block(block, name)

    def verify(self, block, name, output) -> InferredRule:
        """The rule that reproduces ``output`` (the router's own), or raise ``UnsupportedModelError``."""
        router, experts = block_parts(block)
        who = f"{name} ({type(block).__name__}, router {type(router).__name__})"
        num_experts = experts.num_experts
        if not (isinstance(output, (tuple, list)) and len(output) == 3
                and all(isinstance(t, torch.Tensor) for t in output)):
            raise UnsupportedModelError(
                f"{who}: the router does not return (router_logits, routing_weights, selected_experts); "
                f"the generic adapter cannot patch it (a dedicated adapter is needed)"
            )
        logits, weights, idx = output
        if (logits.dim() != 2 or logits.shape[-1] != num_experts or idx.dim() != 2 or weights.shape != idx.shape
                or idx.dtype.is_floating_point or not weights.dtype.is_floating_point
                or idx.shape[0] != logits.shape[0]):
            raise UnsupportedModelError(
                f"{who}: router output shapes {tuple(logits.shape)}, {tuple(weights.shape)}, {tuple(idx.shape)} are "
                f"not [T, N={num_experts}], [T, k], [T, k]; the generic adapter cannot patch it"
            )
        top_k = idx.shape[-1]
        scores = logits.float()
        idx = idx.long()
        distinct = bool((idx.sort(dim=-1).values.diff(dim=-1) != 0).all()) if top_k > 1 else True
        chosen = scores.gather(1, idx).sort(dim=-1, descending=True).values
        best = scores.topk(top_k, dim=-1).values
        if not distinct or not torch.allclose(chosen, best, rtol=1e-6, atol=1e-6):
            raise UnsupportedModelError(
                f"{who}: the router's experts are not the top-{top_k} of its logits (a selection bias, group "
                f"limits or sampling?); the generic adapter cannot reproduce its selection"
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
            ours = naive_routing_weights(logits, idx, kind, renormalize, factor).to(weights.dtype).float()
            err = ((ours - weights.float()).abs() / weights.float().abs().clamp_min(1e-30)).max().item()
            if torch.allclose(ours, weights.float(), rtol=tol, atol=tol * 1e-3):
                fits.append((err, len(fits), InferredRule(kind, renormalize, factor, top_k)))
            errors.append(f"{kind}(renormalize={renormalize}, scale={factor}): max rel err {err:.3g}")
        if fits:  # the closest fit; on an exact tie the attribute-stated / first candidate
            return min(fits, key=lambda fit: fit[:2])[2]
        raise UnsupportedModelError(
            f"{who}: no inferred weight rule reproduces the router's own weights on a probe input "
            f"({'; '.join(errors)}); the generic adapter cannot patch it (a dedicated adapter is needed)"
        )

    # -- decode ---------------------------------------------------------------------------------
    def forward(self, block, *args, lynx, **kwargs):
        router, experts = block_parts(block)
        state = {"changed": False}

        def router_hook(module, inputs, output):
            rule = self._rules.get(block)
            if rule is None:  # deferred verification, on the real router output
                try:
                    rule = self.verify(block, lynx.name, output)
                except UnsupportedModelError as exc:
                    warnings.warn(f"lynx_hf: {exc}; this block keeps the model's own routing", stacklevel=2)
                    rule = _REFUSED
                self._rules[block] = rule
            if rule is _REFUSED:
                return None
            logits, weights, idx = output
            new_idx, new_weights, changed = lynx.route(
                logits, lambda: logits.float(), idx, weights,
                WeightRule(rule.rule, rule.renormalize, rule.scale, dtype=weights.dtype),
            )
            state["changed"] = changed
            if not changed:
                return None  # the router's own output object, untouched
            remapped = (logits, new_weights, new_idx.to(idx.dtype))
            return list(remapped) if isinstance(output, list) else remapped

        handles = [router.register_forward_hook(router_hook)]
        kernel = self._kernel_applies(lynx, experts)
        if kernel:
            def experts_forward(hidden, top_k_index, top_k_weights, *rest, **kw):
                def default():
                    return type(experts).forward(experts, hidden, top_k_index, top_k_weights, *rest, **kw)
                if rest or kw:
                    return default()
                return lynx.run_experts(experts, hidden, top_k_index, top_k_weights, state["changed"], default)

            object.__setattr__(experts, "forward", experts_forward)
        try:
            return lynx.original_forward(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            if kernel:
                experts.__dict__.pop("forward", None)

    @staticmethod
    def _kernel_applies(lynx, experts) -> bool:
        from .. import policy

        return (lynx.owner.config.policy != "none" and "forward" not in experts.__dict__
                and _kernel_layout(experts) and policy.use_triton(lynx.owner.config.backend,
                                                                  experts.gate_up_proj.device))
