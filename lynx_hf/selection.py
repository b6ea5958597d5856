"""Selection-bias routing: the rule of DeepSeek-V3 and its many copies (``docs/design.md`` "Family rules").

The model's own routing (e.g. ``DeepseekV3TopkRouter.forward``, ``Glm4MoeTopkRouter.forward``,
``MiniMaxM2TopKRouter.forward``, ``Ernie4_5_MoeTopKRouter.forward``, ``Lfm2MoeTopKRouter.forward``):

- ``p = score(logits)`` in fp32, ``score`` = sigmoid or softmax over N (or the logits themselves: Kolibri-1);
- ``c = p + bias`` (the *corrected* scores; ``bias [N]`` fp32 is a load-balancing correction that selects only);
- with ``n_group > 1``: group score = sum of the top-2 ``c`` of each group (DeepSeek-V3) or their max;
  only the experts of the token's ``topk_group`` best groups may be chosen (the others are ``-inf``);
- top-k of the masked ``c`` selects the experts;
- weights = the *unbiased* ``p`` of the chosen experts, renormalised and scaled as the family does (a
  :class:`lynx_hf.core.WeightRule` applied to the router logits). The bias never enters the weights.

:class:`BiasedSelection` states this rule for one router: where the bias lives (``owner`` + dotted
``path``: the router, a submodule of it, or the parent block, which may pass it to the router as an argument),
the score function and the groups. It is a plain picklable value (no tensors): the bias is read from the live
modules at each call, so a moved or reloaded model is read correctly.

Selection scores handed to the policies: ``log(c - min(bias))`` (fp32, clamped at the smallest normal fp32
so every allowed expert is finite), ``-inf`` outside the token's allowed groups. Strictly increasing in
``c`` (a remap restricted to the critical set picks what the model itself would pick there), defined for any
bias sign, and equal to ``log p`` for a zero (or uniform) bias, so the LYNX affinity gaps are log weight
ratios as for softmax routers (the reasoning in full: ``patches/deepseek_v3.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.step_spec import FusedSelection

__all__ = ["BiasedSelection", "SCORE_FNS", "GROUP_SCORES"]

#: score functions a selection-bias router applies to its logits before adding the bias
SCORE_FNS = ("sigmoid", "softmax", "logits")
#: how a group's score is made from its experts' corrected scores
GROUP_SCORES = ("top2_sum", "max")

_TINY = torch.finfo(torch.float32).tiny


def _resolve(module: torch.nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _offload_hook(module):
    """accelerate's ``AlignDevicesHook`` on ``module`` that holds its tensors' values (a ``weights_map``: CPU / disk
    offload, ``offload_buffers=True``), looked up duck-typed (no accelerate import); ``None`` without one."""
    hook = module.__dict__.get("_hf_hook") if isinstance(module, torch.nn.Module) else None
    for one in [hook, *getattr(hook, "hooks", ())]:
        if one is not None and getattr(one, "weights_map", None) is not None:
            return one
    return None


def live_tensor(module: torch.nn.Module, path: str) -> torch.Tensor:
    """The tensor at the dotted attribute ``path`` of ``module`` with its values, read where they live: a parameter or
    buffer that accelerate offloads (``cpu_offload`` / ``disk_offload`` / ``dispatch_model`` / ``from_pretrained``
    with an offloading device map, ``offload_buffers=True`` for buffers) is on ``meta`` outside its module's forward
    (the router hook runs after accelerate's post-forward put it back), so its value is read from the module's hook
    the way accelerate's pre-forward reads it (``weights_map[name]``, on the hook's execution device). Any other
    tensor is returned as it is (``docs/cases.md`` C39)."""
    *parents, leaf = path.split(".")
    owner = _resolve(module, ".".join(parents)) if parents else module
    tensor = getattr(owner, leaf)
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
        hook = _offload_hook(owner)
        if hook is not None:
            try:
                value = hook.weights_map[leaf]
            except KeyError:
                return tensor
            device = hook.execution_device
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
            return value.to(device=device if device.type != "meta" else "cpu", dtype=tensor.dtype)
    return tensor


@dataclass(frozen=True)
class BiasedSelection:
    """One router's selection rule: ``top-k(mask_groups(score(logits) + bias))``.

    ``score``: ``"sigmoid"``, ``"softmax"`` (over all N, fp32) or ``"logits"`` (the bias added to the raw
    logits; selection scores are then ``logits + bias`` themselves); ``owner``: ``"router"`` or ``"block"``
    (whose attribute the bias is), or ``"none"`` (a grouped router without a bias: zeros); ``path``: the dotted attribute path from the owner to the bias tensor
    (any shape with N elements, e.g. ERNIE-4.5's ``[1, N]`` ``moe_statics.e_score_correction_bias``);
    ``n_group`` / ``topk_group``: the grouping (``n_group == 1``: none); ``group_score``: ``"top2_sum"``
    (DeepSeek-V3) or ``"max"``; ``passes_bias``: the block passes the bias to the router as an argument
    (MiniMax-M2, LFM2-MoE, AFMoE), said in messages only.
    """

    score: str
    owner: str
    path: str
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    passes_bias: bool = False

    def describe(self) -> str:
        groups = "" if self.n_group == 1 else (f", top-{self.topk_group} of {self.n_group} groups by "
                                               f"{self.group_score}")
        where = "no bias" if self.owner == "none" else f"{self.owner}.{self.path}" + (
            " (passed to the router)" if self.passes_bias else "")
        score = "logits" if self.score == "logits" else f"{self.score}(logits)"
        return f"top-k of {score} + {where}{groups}"

    def bias(self, router: torch.nn.Module, block: torch.nn.Module | None, num_experts: int = 0) -> torch.Tensor:
        """The live bias ``[N]`` in fp32 (a view when it already is; an offloaded one read from accelerate's hook,
        :func:`live_tensor`); zeros of ``num_experts`` for ``owner == "none"`` (a grouped router without a bias)."""
        if self.owner == "none":
            device = next((p.device for p in router.parameters()), None)
            return torch.zeros(num_experts, device=device)
        owner = router if self.owner == "router" else block
        return live_tensor(owner, self.path).detach().reshape(-1).float()

    def fused(self) -> FusedSelection:
        """This rule as data for the fused device step (``lynx_hf.kernels.fused_step``; its bias passed beside it)."""
        return FusedSelection("biased", self.score, self.n_group, self.topk_group, self.group_score)

    def bias_tensor(self, router: torch.nn.Module, block: torch.nn.Module | None) -> torch.Tensor | None:
        """The live bias tensor itself (:func:`live_tensor`, no copy where it is resident), ``None`` for ``owner ==
        "none"`` (zeros)."""
        if self.owner == "none":
            return None
        return live_tensor(router if self.owner == "router" else block, self.path)

    def corrected(self, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``c [T, N]`` fp32 = ``score(logits) + bias``, the model's own ops."""
        logits = logits.float()
        if self.score == "logits":  # the bias added to the raw logits (Kolibri-1)
            return logits + bias.to(logits.device)
        p = logits.sigmoid() if self.score == "sigmoid" else torch.softmax(logits, dim=-1, dtype=torch.float32)
        return p + bias.to(p.device)

    def allowed(self, corrected: torch.Tensor) -> torch.Tensor | None:
        """``[T, N]`` bool: the experts of each token's ``topk_group`` best groups; ``None`` without groups."""
        if self.n_group <= 1:
            return None
        num_tokens, num_experts = corrected.shape
        per_group = num_experts // self.n_group
        grouped = corrected.view(num_tokens, self.n_group, per_group)
        if self.group_score == "top2_sum":
            group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return group_mask.repeat_interleave(per_group, dim=-1)

    def choice_scores(self, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``[T, N]`` fp32: the corrected scores the model ranks by, ``-inf`` outside the allowed groups."""
        corrected = self.corrected(logits, bias)
        allowed = self.allowed(corrected)
        return corrected if allowed is None else corrected.masked_fill(~allowed, float("-inf"))

    def selection_scores(self, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The policies' scores ``[T, N]`` fp32: ``log(c - min(bias))``, ``-inf`` outside the allowed groups."""
        corrected = self.corrected(logits, bias)
        allowed = self.allowed(corrected)
        if self.score == "logits":  # already in logit units, as the plain routers' scores
            scores = corrected
        else:
            scores = torch.log((corrected - bias.min().to(corrected.device)).clamp_min(_TINY))
        return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))

    def mismatches(self, logits: torch.Tensor, bias: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``[T]`` bool: tokens whose chosen experts ``idx [T, k]`` are not this rule's top-k (exactly: the
        corrected scores of the chosen set must equal the k best, value for value, so exact ties in the model's
        scores are no mismatch while any bias or group effect is)."""
        choice = self.choice_scores(logits, bias)
        chosen = choice.gather(1, idx.long()).sort(dim=-1, descending=True).values
        best = choice.topk(idx.shape[-1], dim=-1).values
        return ~(chosen == best).all(dim=-1)
