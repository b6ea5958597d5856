"""The product default (``LynxConfig()``: ``gate="auto"``) in the decode tier: every decode layer-step follows its
layer's decision for that step, whatever this machine measured.

A spy on the router hook's routing (``BlockRouting.route``) records each layer-step; for each, the layer's gate says
what should have happened (``PlanGate.decision(T, Step.decode_rows)``): on, the routing equals the step below the gate
run on the same inputs (the policy's remap); off, the model's own routing objects come back. Run on the paths whose
steps differ in size: ``generate`` with rows finishing early (dynamic and static cache) and continuous batching
(``generate_batch``: prefill chunks beside decode rows, mixed steps decided on their decode rows). Each path runs
twice: with the decisions this machine measured (the plain default), and with a decision table (``gate_table``) that
switches the policy on from 8 tokens, so both branches are taken whatever was measured.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import lynx_hf
from helpers import families as fam
from lynx_hf import gate
from lynx_hf.block import BlockRouting
from lynx_hf.core import StepInputs, host_reads_allowed
from lynx_hf.eval import FIXTURES_DIR


class Spy:
    """Every ``BlockRouting.route`` call: ``(block, step, logits, weights, idx, new_weights, new_idx)`` (clones)."""

    def __init__(self, monkeypatch):
        self.records = []
        real = BlockRouting.route

        def route(block, step, logits, weights, idx):
            new_w, new_idx = real(block, step, logits, weights, idx)
            self.records.append((block, step, logits.clone(), weights.clone(), idx.clone(), new_w, new_idx))
            return new_w, new_idx

        monkeypatch.setattr(BlockRouting, "route", route)

    def check(self, expect_on=None) -> dict:
        """Assert every recorded layer-step followed its decision; returns ``{"on": n, "off": n, "kept": n}``.
        ``expect_on(num_tokens, decode_rows) -> bool``: the decision worked out independently (from a decision
        table's own numbers: :func:`table_on`), which the gate's must equal; ``None``: the gate's own decision
        (measured figures cannot be worked out by hand)."""
        seen = {"on": 0, "off": 0, "kept": 0}
        for block, step, logits, weights, idx, new_w, new_idx in self.records:
            planned = gate.of(block.plan)
            assert planned is not None, "the default configuration has a cost gate"
            num_tokens = idx.shape[0]
            if block.plan.keeps(num_tokens):  # one token keeps its own top-k under every policy
                assert torch.equal(new_idx, idx)
                seen["kept"] += 1
                continue
            on = planned.decision(num_tokens, step.decode_rows).on
            if expect_on is not None:
                assert on == expect_on(num_tokens, step.decode_rows), (num_tokens, step.decode_rows)
            if on:
                inputs = StepInputs(step, logits, weights, idx, block.rule, host_reads_allowed(logits),
                                    block._scores_fn(), None)
                want = planned.inner(planned.plan, inputs)  # the step below the gate: the policy's remap
                assert torch.equal(new_idx, want.idx) and torch.equal(new_w, want.weights)
                seen["on"] += 1
            else:
                assert torch.equal(new_idx, idx) and torch.equal(new_w, weights)  # the model's own routing
                seen["off"] += 1
        return seen


def _forced_table(model, path, on_from: int = 8):
    """A decision table for ``model``'s gate keys (read from a default patch): on at buckets >= ``on_from`` (cost 1 ms;
    1 expert saved x 2 ms there, 0.25 below: a mixed step is on iff its decode rows' bucket is)."""
    lynx_hf.patch(model)
    entries = {}
    for block in lynx_hf.patcher._state(model).blocks:
        planned = gate.of(block.plan)
        decisions = {b: gate.GateDecision(b >= on_from, 1.0, 2.0 if b >= on_from else 0.5,
                                          1.0 if b >= on_from else 0.25, 2.0, reason="test table")
                     for b in gate.BUCKETS}
        table = gate.DecisionTable(entries)
        table.put(planned.key, decisions, "test table")
        entries = table.entries
    lynx_hf.unpatch(model)
    gate.DecisionTable(entries).save(path)
    return str(path)


def table_on(num_tokens: int, decode_rows: int | None) -> bool:
    """The decision :func:`_forced_table` makes, worked out from its numbers (not by the gate): every bucket costs
    1 ms; from bucket 8 (5 tokens or more) 1 expert x 2 ms is saved (2 > 1.25 x 1: on), below it 0.25 x 2 = 0.5 ms
    (off). A mixed step saves at its decode rows' bucket, so it is on iff those rows (else all its tokens) are >= 5."""
    return (num_tokens if decode_rows is None else decode_rows) >= 5


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("decisions", ["measured", "table"])
def test_generate_with_rows_finishing_early_follows_the_default_gate(cache, decisions, monkeypatch, tmp_path):
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(12, 5)
    table = _forced_table(model, tmp_path / "table.json") if decisions == "table" else None
    spy = Spy(monkeypatch)
    eos = 23  # a frequent token of these prompts' continuations: rows finish at different steps
    with lynx_hf.patched(model, lynx_hf.LynxConfig(gate_table=table)):
        assert lynx_hf.config_of(model).gate == "auto"
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, cache_implementation=None if cache == "dynamic" else "static")
        summary = lynx_hf.stats(model).summary()
    seen = spy.check(table_on if decisions == "table" else None)
    assert seen["on"] + seen["off"] > 0
    if decisions == "table":  # 12 rows: bucket 16, on in the table
        assert seen["on"] > 0 and seen["off"] == 0 and summary["decode_steps"] > 0
        assert summary["per_layer"][0]["gate"]["source"] == f"table {table}"
    assert (out[:, ids.shape[1]:] == eos).any(), "no row finished early: pick another eos"


@pytest.mark.parametrize("decisions", ["measured", "table"])
def test_continuous_batching_steps_follow_the_default_gate_on_their_decode_rows(decisions, monkeypatch, tmp_path):
    """Fixture A, 12 requests of mixed lengths through ``generate_batch`` with a small token budget: prefill chunks
    beside decode rows. Each mixed step is decided with the cost at its size and the saving at its decode rows
    (``Step.decode_rows``, from the scheduler's requests)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / "qwen2moe-tiny", dtype=torch.float32).eval()
    table = _forced_table(model, tmp_path / "table.json") if decisions == "table" else None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (3 + 2 * i,), generator=g).tolist() for i in range(12)]
    spy = Spy(monkeypatch)
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=24)
    with lynx_hf.patched(model, lynx_hf.LynxConfig(gate_table=table)):
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert len(out) == len(prompts)
    seen = spy.check(table_on if decisions == "table" else None)
    mixed = [r for r in spy.records if r[1].kind == "mixed"]
    assert mixed and all(r[1].decode_rows is not None for r in mixed)  # the host's count reaches the gate
    if decisions == "table":
        assert seen["on"] > 0 and seen["off"] > 0
        json.loads((tmp_path / "table.json").read_text())  # a plain JSON decision table
