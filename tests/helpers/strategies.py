"""Hypothesis strategies shared by the kernel tests (the numba twins, the fused CPU decode step), and the property
tests' example budget (:func:`fuzz`)."""

import math

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays


def fuzz(share: float, **overrides) -> settings:
    """The settings of a property test: ``share`` x the loaded profile's ``max_examples`` examples (tests/conftest.py:
    "dev" 100, "ci" 30), the profile's other settings, ``overrides`` on top. Decorate with it (``@fuzz(1.5)``) or bind
    it once per module. Read when the test module is imported, after the profile is loaded."""
    return settings(max_examples=max(1, round(share * settings.default.max_examples)), **overrides)


# logits from a small grid (many exact ties) or continuous values; -inf marks forbidden experts
_VALUES = st.one_of(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]),
                    st.floats(-6, 6, allow_nan=False, width=32), st.just(-math.inf))


@st.composite
def routing_scores(draw, tokens=(1, 12), experts=(2, 24), max_k=5, k_below_n=False):
    """``(scores [T, N] fp32, own top-k idx [T, k] int64, k)``: values from ``_VALUES`` (ties, -inf), every row
    with at least k allowed experts; ``k_below_n`` keeps k < N (the fused decode step's tests)."""
    t = draw(st.integers(*tokens))
    n = draw(st.integers(*experts))
    k = draw(st.integers(1, min(n - 1 if k_below_n else n, max_k)))
    s = draw(arrays(np.float32, (t, n), elements=_VALUES))
    s[:, :k] = np.where(np.isfinite(s[:, :k]), s[:, :k], 0.0)  # every row keeps >= k allowed experts
    scores = torch.from_numpy(s)
    idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return scores, idx, k


def tied_topk(scores: torch.Tensor, k: int, order: torch.Tensor) -> torch.Tensor:
    """A model's own top-k ``[T, k]`` int64 of ``scores [T, N]`` whose exact ties are taken in the order of ``order``
    (a permutation of ``0..N-1``) instead of by lower id: the k largest scores of each row, as any ``torch.topk`` may
    return them (its order among tied experts is its own: on CPU ``torch.topk(torch.zeros(1, 8), 2)`` gives [6, 5])."""
    by_score = torch.sort(scores[:, order], dim=-1, descending=True, stable=True).indices[:, :k]
    return order[by_score]


def planted_ties(num_tokens: int, num_experts: int, k: int, seed: int) -> torch.Tensor:
    """``[T, N]`` fp32 scores with exact ties across each row's k-th largest value (a few other experts set to it, on
    both sides of the top-k boundary) and some ``-inf`` experts outside the top-k, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(num_tokens, num_experts, generator=g)
    kth = s.sort(dim=-1, descending=True).values[:, k - 1:k]
    tie = torch.rand(num_tokens, num_experts, generator=g) < 0.4
    s = torch.where(tie, kth.expand_as(s), s)
    forbidden = (torch.rand(num_tokens, num_experts, generator=g) < 0.2) & (s < kth)
    return s.masked_fill(forbidden, float("-inf"))
