"""What the fused device decode step (:mod:`.fused_step`) runs, as plain data: the policy (:class:`FusedPolicy`) and
how a layer's selection scores come from its router logits (:class:`FusedSelection`). Cheap to import (no Triton):
the policies (``lynx_hf.policies``) and the family specs (``lynx_hf.patches``) describe themselves with these at patch
time; the kernel module is imported only when a plan runs the Triton backend."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .routing_torch import PRICE_UNITS

#: :attr:`FusedPolicy.kind` values, in kernel code order
POLICIES = ("lynx_mass", "lynx", "oea", "xshare", "keep")
#: :attr:`FusedSelection.kind` values, in kernel code order
SELECTIONS = ("logits", "group_softmax_max", "biased", "scores")
#: biased selection: the score the bias is added to (``lynx_hf.selection.BiasedSelection.score``)
BIAS_SCORES = ("sigmoid", "softmax", "logits")
#: grouped selection: the group score (``BiasedSelection.group_score``; DeepSeek-V2's groups use ``"max"``)
GROUP_SCORES = ("top2_sum", "max")


@dataclass(frozen=True)
class FusedPolicy:
    """The policy a :class:`FusedStep` runs, as data (resolved once per layer by ``lynx_hf.policies``).

    ``kind``: one of :data:`POLICIES`; LYNX (arXiv 2411.08982 Sec. 4): ``alpha`` (bin scale, finite > 0), ``beta``
    (bins), ``tau`` (consensus threshold, paper rule ``"lynx"``); routing-mass growth (``"lynx_mass"``, the default):
    ``price`` (tokens' worth of top-k mass, >= 0) and ``unit`` (:data:`.routing_torch.PRICE_UNITS`); OEA
    (arXiv 2511.02237 Sec. 3): ``k0``; XShare (arXiv 2602.07265): ``budget`` and ``warmup``. Raises ``ValueError``
    for an unknown kind or unit."""

    kind: str
    alpha: float = 1.0
    beta: int = 0
    tau: float = math.inf
    price: float = 0.0
    unit: str = "token"
    k0: int = 1
    budget: int = 1
    warmup: int = 0

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"FusedPolicy.kind must be one of {POLICIES}, got {self.kind!r}")
        if self.unit not in PRICE_UNITS:
            raise ValueError(f"FusedPolicy.unit must be one of {PRICE_UNITS}, got {self.unit!r}")
        if self.kind in ("lynx", "lynx_mass") and not (0 < self.alpha < math.inf and self.beta >= 0):
            raise ValueError(f"FusedPolicy: alpha must be finite > 0 and beta >= 0, got {self.alpha}, {self.beta}")


@dataclass(frozen=True)
class FusedSelection:
    """How a layer's selection scores come from its router logits, as data (``docs/design.md`` "Family rules").

    ``kind``: ``"logits"`` (the fp32 logits); ``"group_softmax_max"`` (DeepSeek-V2 ``group_limited_greedy``: the
    logits, ``-inf`` outside each token's ``topk_group`` best of ``n_group`` groups ranked by the max of
    ``softmax(logits)``); ``"biased"`` (``lynx_hf.selection.BiasedSelection``: ``c = score(logits) + bias``, groups
    ranked by ``group_score`` of ``c``, scores ``log(max(c - min(bias), tiny))``, or ``c`` itself for ``score ==
    "logits"``; no bias tensor: zeros); ``"scores"`` (computed by the caller, passed as ``scores=``). Raises
    ``ValueError`` for unknown names or a grouping that does not divide into groups of at least one expert."""

    kind: str = "logits"
    score: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"

    def __post_init__(self):
        if self.kind not in SELECTIONS or self.score not in BIAS_SCORES or self.group_score not in GROUP_SCORES:
            raise ValueError(f"FusedSelection: unknown kind / score / group_score in {self}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"FusedSelection: need 1 <= topk_group <= n_group, got {self.topk_group}, {self.n_group}")


LOGITS = FusedSelection()
SCORES = FusedSelection("scores")


__all__ = ["POLICIES", "SELECTIONS", "BIAS_SCORES", "GROUP_SCORES", "FusedPolicy", "FusedSelection",
           "LOGITS", "SCORES"]
