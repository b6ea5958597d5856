"""The product default (``LynxConfig()``: policy ``lynx``, ``gate="auto"``) on every family of the registry: a batch
decodes exactly as its layers' decisions say, whatever this machine measured. Where the gate decided on at the step
size, the tokens and scores equal ``gate="always"``'s; where off, policy ``none``'s (the model's own routing) and no
decode step is recorded."""

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf import gate


def _generate(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family", fam.PATCHABLE)
def test_the_default_gate_decodes_as_its_decisions_say(family):
    model = fam.build(family)
    batch = 8
    ids, mask = fam.prompts(batch, 5)
    with lynx_hf.patched(model, policy="none"):
        own = _generate(model, ids, mask)
    with lynx_hf.patched(model, gate="always"):
        always = _generate(model, ids, mask)
    with lynx_hf.patched(model):  # the product default
        assert lynx_hf.config_of(model) == lynx_hf.LynxConfig(gate="auto")
        gates = [gate.of(b.plan) for b in lynx_hf.patcher._state(model).blocks]
        out = _generate(model, ids, mask)
        summary = lynx_hf.stats(model).summary()
    assert all(g is not None and g.source for g in gates)
    on = {g.decision(batch).on for g in gates}
    assert len(on) == 1, "layers of one shape and rule share one decision"
    want = always if on.pop() else own
    assert torch.equal(out.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, want.scores))
    if want is own:
        assert summary["decode_steps"] == 0 and summary["gate_steps_skipped"] == 3 * len(gates)
    else:
        assert summary["decode_steps"] == 3 and summary["gate_steps_skipped"] == 0
