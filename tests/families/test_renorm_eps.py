"""A denominator epsilon in the weight rule (LFM2-MoE renormalises with ``w / (sum + 1e-6)``): the generic probe
finds it and verifies it to fp32 round-off, a router with another epsilon is fitted from what the probe shows, and
a remap reproduces the router's weights with it (policy ``none``: bit-identical; LYNX: the rule on the new set)."""

import pytest
import torch

import lynx_hf
from lab import family_matrix as fm
from lynx_hf import patcher
from lynx_hf.kernels.routing_torch import routing_weights
from lynx_hf.patches import generic

pytestmark = pytest.mark.skipif(fm.case_of("lfm2_moe") is None, reason="this transformers has no LFM2-MoE")


def _lfm2():
    return fm.build(fm.case_of("lfm2_moe"))


def _rules(model):
    return [b.rule for b in patcher._state(model).blocks]


def test_lfm2_rule_has_the_epsilon_and_patches_bit_identical():
    model = _lfm2()
    ids = fm._prompts(8, 4)
    ref = fm._manual_loop(model, ids)
    with fm._quiet():
        lynx_hf.patch(model, policy="none")
    assert {(r.kind, r.renormalize, r.renorm_eps) for r in _rules(model)} == {("sigmoid", True, 1e-6)}
    assert fm._same(fm._manual_loop(model, ids), ref)
    lynx_hf.unpatch(model)


def test_the_epsilon_is_needed_and_checked():
    """Without the epsilon the rule misses the router's weights by more than 4 ulps (so the probe can tell); with
    it they agree to fp32 round-off on the router's own output."""
    model = _lfm2()
    block = next(m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock"))
    h = generic.probe_hidden(model.config.hidden_size)
    with torch.no_grad():
        logits, weights, idx = block.gate(h, block.expert_bias)
    with_eps = routing_weights(logits, idx, "sigmoid", True, 1.0, 1e-6)
    without = routing_weights(logits, idx, "sigmoid", True, 1.0)
    tol = 4 * torch.finfo(torch.float32).eps
    assert torch.allclose(with_eps, weights, rtol=tol, atol=tol * 1e-3)
    assert not torch.allclose(without, weights, rtol=tol, atol=tol * 1e-3)


def test_an_unlisted_epsilon_is_fitted_from_the_probe(monkeypatch):
    """A router with an epsilon the spec does not list (3e-5): the probe shows it, the rule carries it."""
    model = _lfm2()
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            original = type(m).forward

            def forward(self, hidden_states, expert_bias=None, _orig=original):
                logits, w, idx = _orig(self, hidden_states, expert_bias)
                raw = torch.sigmoid(logits.float()).gather(1, idx)
                return logits, raw / (raw.sum(dim=-1, keepdim=True) + 3e-5) * self.routed_scaling_factor, idx

            m.forward = forward.__get__(m)
    with fm._quiet():
        lynx_hf.patch(model, policy="none")
    assert {r.renorm_eps for r in _rules(model)} == {3e-5}
    lynx_hf.unpatch(model)
