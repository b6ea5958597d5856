"""The decode post-process core (lynx_hf/core.py ``remap`` / ``BlockRouting.route``) on hand-worked
steps with per-token masks: finished rows do not vote, prefill rows seed the critical set, telemetry
counts only live decode tokens (each test here kills a named mutant of eval/mutants.py)."""

import types

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf import LynxConfig
from lynx_hf.core import DECODE, MIXED, Step, make_plan, remap

SOFTMAX_ALL = types.SimpleNamespace(kind="softmax_all", renormalize=False, scale=1.0, renorm_eps=0.0)


def _own_topk(s, k):
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]


def _remap(cfg, step, s, k):
    idx = _own_topk(s, k)
    weights = torch.softmax(s, -1).gather(1, idx)
    plan = make_plan(cfg, s.shape[1], k, torch.device("cpu"))
    return remap(plan, SOFTMAX_ALL, step, s, s, weights, idx)


def test_finished_rows_are_remapped_into_the_set_but_do_not_vote():
    """OEA k0=1, k=1, N=4. Live rows' top-1: e0, e1, so S = {e0, e1}. The finished row (top-1 e3) does
    not vote: it is remapped to its best expert inside S, e1 (score 1 > 0). Were it voting, S would hold
    e3 and it would keep e3."""
    s = torch.tensor([[3.0, 1.0, 0.0, 2.0],
                      [1.0, 3.0, 0.0, 2.0],
                      [0.0, 1.0, 2.0, 3.0]])
    step = Step(DECODE, live=torch.tensor([True, True, False]))
    w, idx, finite = _remap(LynxConfig(policy="oea", oea_k0=1), step, s, 1)
    assert idx.tolist() == [[0], [1], [1]]
    assert bool(finite.all())
    # the weight of the finished row is the rule on its new expert: softmax(all N) at e1
    assert w[2, 0].item() == pytest.approx(torch.softmax(s[2], -1)[1].item(), rel=1e-6)


def test_prefill_rows_keep_their_routing_and_seed_the_critical_set():
    """A mixed step (continuous batching): row 0 decodes, row 1 is a prefill token using {e2, e3}. OEA
    k0=1, k=2, N=4: S = seed {e2, e3} + row 0's top-1 {e0}. Row 0 takes its top-2 inside S: e0 (3) then
    e2 (1), not its own e1 (2) outside S; row 1 keeps exactly its own routing. Without the seed S = {e0}
    and row 0 would keep [e0, e1]."""
    s = torch.tensor([[3.0, 2.0, 1.0, 0.0],
                      [0.0, 1.0, 3.0, 2.0]])
    step = Step(MIXED, decode=torch.tensor([True, False]))
    idx0 = _own_topk(s, 2)
    w, idx, _ = _remap(LynxConfig(policy="oea", oea_k0=1), step, s, 2)
    assert idx.tolist() == [[0, 2], [2, 3]]
    assert torch.equal(idx[1], idx0[1])
    assert torch.equal(w[1], torch.softmax(s[1], -1)[[2, 3]])  # the model's own weights, untouched


def test_telemetry_counts_only_live_decode_tokens():
    """Telemetry of one MoE block: a prefill forward records nothing; a mixed step with 2 decode tokens,
    1 prefill token and 1 finished decode token counts exactly those (hand-counted)."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(4, 6)
    with lynx_hf.patched(model, policy="lynx"):
        model(input_ids=ids, attention_mask=mask)  # plain forward: prefill
        model(input_ids=ids, attention_mask=mask, use_cache=True)  # prefill with a cache
        summary = lynx_hf.stats(model).summary()
        assert summary["decode_steps"] == 0 and summary["decode_tokens"] == 0
        assert all(layer["decode_tokens"] == 0 for layer in summary["per_layer"])
        block = model.__dict__["_lynx_state"].blocks[0]
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(4, block.num_experts, generator=g) * 3
        idx = _own_topk(logits, block.top_k)
        weights = torch.softmax(logits, -1).gather(1, idx)
        step = Step(MIXED, decode=torch.tensor([True, False, True, True]),
                    live=torch.tensor([True, True, True, False]))
        block.route(step, logits, weights, idx)
        layer = lynx_hf.stats(model).summary()["per_layer"][0]
    assert layer["decode_steps"] == 1
    assert layer["decode_tokens"] == 2  # rows 0 and 2
    assert layer["prefill_tokens_in_mixed_steps"] == 1  # row 1
    assert layer["finished_row_tokens"] == 1  # row 3
    # unique experts before: the union of rows 0 and 2's own top-k (hand count from the indices)
    assert layer["unique_experts_before"] == len(set(idx[0].tolist()) | set(idx[2].tolist()))
