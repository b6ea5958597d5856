"""Patched models remain ordinary Python objects, and telemetry never gets in the way.

``copy.deepcopy``, ``pickle``, ``torch.save(model)`` / ``torch.load(weights_only=False)`` (also in a fresh
process), ``state_dict`` round trips and ``.to(dtype)`` / ``.to(device)`` work patched and unpatched; a
deep copy is patched independently (its own telemetry; unpatching one leaves the other patched). Telemetry
is detached, independent of grad / inference mode (CASES C27) and never changes what the model computes.
Every comparison is against the unpatched model or a patched one built the ordinary way.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf.patcher import _find_state
from test_storage_matrix import KernelSpy, ReferenceRemap, _first, moe_blocks, record_blocks, rules_of, run

# policy_on_every_step (tests/conftest.py): copies, pickles and saved models must keep remapping and counting decode
# steps as the original does, which needs the policy on every decode step of these tiny models
pytestmark = pytest.mark.usefixtures("policy_on_every_step")


GEN = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)


def _generate(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, **GEN)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        assert torch.equal(x, y)


def _decode_steps(model):
    return lynx_hf.stats(model).summary()["decode_steps"]


# -- deepcopy ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_moe", "llama4"])
def test_deepcopy_of_patched_model_is_patched_independently(family):
    model = fam.build(family)
    ids, mask = fam.prompts(8, 5)
    unpatched = _generate(model, ids, mask)
    lynx_hf.patch(model, policy="oea", oea_k0=1)
    want = _generate(model, ids, mask)
    lynx_hf.reset_stats(model)
    clone = copy.deepcopy(model)
    assert lynx_hf.is_patched(clone) and lynx_hf.config_of(clone) == lynx_hf.config_of(model)
    _same(_generate(clone, ids, mask), want)  # the copy computes what the original does
    assert _decode_steps(clone) == 2 and _decode_steps(model) == 0  # its own telemetry
    lynx_hf.unpatch(clone)  # unpatching the copy leaves the original patched
    assert lynx_hf.is_patched(model) and not lynx_hf.is_patched(clone)
    _same(_generate(model, ids, mask), want)
    _same(_generate(clone, ids, mask), unpatched)
    assert _decode_steps(model) == 2
    clone2 = copy.deepcopy(model)
    lynx_hf.unpatch(model)  # and the other way round
    _same(_generate(clone2, ids, mask), want)
    _same(_generate(model, ids, mask), unpatched)
    plain = copy.deepcopy(model)  # an unpatched model copies as before
    assert not lynx_hf.is_patched(plain)
    _same(_generate(plain, ids, mask), unpatched)


# -- pickle / torch.save ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_and_torch_save_round_trip_patched_and_unpatched(how):
    model = fam.build("mixtral")
    ids, mask = fam.prompts(8, 5)
    unpatched = _generate(model, ids, mask)

    def round_trip(m):
        if how == "pickle":
            return pickle.loads(pickle.dumps(m))
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    plain = round_trip(model)
    assert not lynx_hf.is_patched(plain)
    _same(_generate(plain, ids, mask), unpatched)
    lynx_hf.patch(model, policy="lynx")
    want = _generate(model, ids, mask)
    loaded = round_trip(model)
    assert lynx_hf.is_patched(loaded) and lynx_hf.config_of(loaded).policy == "lynx"
    assert _decode_steps(loaded) == _decode_steps(model) == 2  # telemetry travels with it, as a plain tensor
    lynx_hf.reset_stats(loaded)
    _same(_generate(loaded, ids, mask), want)
    assert _decode_steps(loaded) == 2
    lynx_hf.unpatch(loaded)
    _same(_generate(loaded, ids, mask), unpatched)
    assert lynx_hf.is_patched(model)
    lynx_hf.unpatch(model)


@pytest.mark.slow
def test_torch_load_of_a_patched_model_in_a_fresh_process(tmp_path):
    """A fresh interpreter has no ``"lynx"`` experts implementation registered until lynx_hf is imported by
    unpickling: the loaded model still generates (what the saving process generated) and unpatches."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 5)
    unpatched = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    lynx_hf.patch(model, policy="lynx")
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    torch.save({"model": model, "ids": ids, "mask": mask}, tmp_path / "m.pt")
    script = (
        "import sys, torch\n"
        "d = torch.load(sys.argv[1], weights_only=False)\n"
        "m = d['model']\n"
        "out = m.generate(input_ids=d['ids'], attention_mask=d['mask'], max_new_tokens=3, do_sample=False)\n"
        "import lynx_hf\n"
        "assert lynx_hf.is_patched(m)\n"
        "lynx_hf.unpatch(m)\n"
        "ref = m.generate(input_ids=d['ids'], attention_mask=d['mask'], max_new_tokens=3, do_sample=False)\n"
        "torch.save({'out': out, 'ref': ref}, sys.argv[2])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]),
                                                os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.pt"), str(tmp_path / "o.pt")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "o.pt")
    assert torch.equal(got["out"], want) and torch.equal(got["ref"], unpatched)
    lynx_hf.unpatch(model)


# -- state_dict -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2", "llama4"])
def test_state_dict_round_trips_while_patched(family):
    a, b = fam.build(family, seed=0), fam.build(family, seed=1)
    ids, mask = fam.prompts(8, 5)
    ref_b = _generate(b, ids, mask)
    keys = list(a.state_dict())
    lynx_hf.patch(a, policy="none")
    lynx_hf.patch(b, policy="none")
    want_b = _generate(b, ids, mask)
    _same(want_b, ref_b)
    state = a.state_dict()
    assert list(state) == keys  # nothing added
    a.load_state_dict(b.state_dict())  # strict: same keys; a now holds b's weights, still patched
    assert lynx_hf.is_patched(a)
    _same(_generate(a, ids, mask), ref_b)
    lynx_hf.patch(a, policy="lynx")
    lynx_hf.patch(b, policy="lynx")
    _same(_generate(a, ids, mask), _generate(b, ids, mask))
    lynx_hf.unpatch(a), lynx_hf.unpatch(b)
    a.load_state_dict(state)
    lynx_hf.patch(a, policy="none")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), state.values()))


# -- moving the model -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["none", "lynx"])
def test_dtype_moves_after_patch_equal_patching_after_the_move(policy):
    """Patch in fp32, then ``.to(bf16)``: computes exactly what a model cast first and patched then computes
    (policy none: the unpatched bf16 model); back to fp32, what that model computes after the same round trip."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 5)
    cast_first = copy.deepcopy(model).to(torch.bfloat16)
    unpatched_bf16 = _generate(cast_first, ids, mask)
    lynx_hf.patch(cast_first, policy=policy)
    want_bf16 = _generate(cast_first, ids, mask)
    lynx_hf.patch(model, policy=policy)
    model.to(torch.bfloat16)
    got = _generate(model, ids, mask)
    _same(got, want_bf16)
    if policy == "none":
        _same(got, unpatched_bf16)
    model.to(torch.float32)  # back: the bf16-rounded weights in fp32, as a model cast the same way and patched
    _same(_generate(model, ids, mask), _generate(cast_first.to(torch.float32), ids, mask))
    lynx_hf.unpatch(model)


def test_moving_weights_to_a_dtype_the_kernel_lacks_falls_back_to_the_model_experts(monkeypatch, one_thread):
    """Checked again cheaply when weights move: patched with the Triton backend in fp32 (the sparse kernel
    runs), then ``.to(float64)`` (no kernel dtype): the kernel no longer runs, and every MoE block still gives
    the same remap through the model's own experts; back to fp32, the kernel runs again."""
    model = fam.build("mixtral")
    model.set_experts_implementation("eager")  # transformers' grouped_mm has no fp64 on CPU (unpatched fails too)
    blocks = moe_blocks(model)
    ids, mask = fam.prompts(4, 5)
    tokens = [torch.randint(3, fam.VOCAB, (4, 1), generator=torch.Generator().manual_seed(2)) for _ in range(2)]
    spy = KernelSpy(monkeypatch)
    lynx_hf.patch(model, policy="oea", oea_k0=1, routing_backend="triton", expert_path="triton")
    rules = rules_of(model)
    run(model, ids, mask, tokens)
    assert spy.calls > 0
    model.to(torch.float64)
    spy.calls = 0
    recorder = record_blocks(blocks)
    run(model, ids, mask, tokens, recorder)
    recorder.close()
    assert spy.calls == 0
    lynx_hf.unpatch(model)
    reference = ReferenceRemap(blocks, "oea", {"oea_k0": 1}, rules)
    for block, args, kwargs, output in recorder.calls:
        with torch.no_grad():
            torch.testing.assert_close(_first(block(*args, **kwargs)), _first(output), rtol=1e-5, atol=1e-7)
    reference.close()
    lynx_hf.patch(model, policy="oea", oea_k0=1, routing_backend="triton", expert_path="triton")
    model.to(torch.float32)
    run(model, ids, mask, tokens)
    assert spy.calls > 0
    lynx_hf.unpatch(model)


def test_device_change_re_resolves_the_plan():
    """``.to(device)`` after patch: the next decode step resolves the routing plan for the new device (here the
    ``meta`` device, the only other one a CPU machine has: shapes propagate, nothing is computed; the remap is
    sync-free, so it runs there), and moving back resolves it again, without patching anew: the results are
    those the patched model gave before the trip. (bf16: the only dtype of torch's meta grouped_mm.)"""
    model = fam.build("mixtral").to(torch.bfloat16)
    ids, mask = fam.prompts(4, 5, left_pad=False)
    tokens = [ids[:, -1:], ids[:, -2:-1]]
    lynx_hf.patch(model, policy="oea", oea_k0=1)
    want = run(model, ids, mask, tokens)
    state = _find_state(model)
    assert {b.plan.device.type for b in state.blocks} == {"cpu"}
    saved = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    model.to("meta")
    with torch.no_grad():  # no attention mask: transformers' mask code reads values (.item()), meta has none
        out = model(input_ids=ids.to("meta"), use_cache=True)
        step = model(input_ids=tokens[0].to("meta"), past_key_values=out.past_key_values, use_cache=True)
    assert step.logits.device.type == "meta" and step.logits.shape == want[1].shape
    assert {b.plan.device.type for b in state.blocks} == {"meta"}
    model.to_empty(device="cpu")  # meta holds no data: storage back on the cpu, then the values
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t.copy_(saved[name])
    lynx_hf.reset_stats(model)
    got = run(model, ids, mask, tokens)
    assert {b.plan.device.type for b in state.blocks} == {"cpu"}
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert lynx_hf.stats(model).summary()["decode_steps"] == 2
    lynx_hf.unpatch(model)


# -- telemetry (CASES C27) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["none", "lynx"])
def test_C27_inference_mode_then_plain_generate_then_grad_enabled_decode(policy):
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(8, 5)
    lynx_hf.patch(model, policy=policy)
    with torch.inference_mode():
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    second = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(first, second)
    assert _decode_steps(model) == 4
    # decode with gradients enabled (a manual step, no no_grad): the accumulators hold no autograd graph
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    step = model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                 past_key_values=out.past_key_values, use_cache=True)
    assert step.logits.requires_grad  # gradients really were enabled
    assert _decode_steps(model) == 5
    for block in _find_state(model).blocks:
        acc = block.telemetry.acc
        assert acc.grad_fn is None and not acc.requires_grad and not acc.is_inference()
    with torch.inference_mode():  # and back into inference mode after a normal step
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert _decode_steps(model) == 6
    lynx_hf.unpatch(model)


@pytest.mark.parametrize("family", ["qwen2_moe", "llama4"])
def test_telemetry_never_changes_what_the_model_computes(family):
    model = fam.build(family)
    ids, mask = fam.prompts(8, 5)
    outs = []
    for telemetry in (True, False, True):
        lynx_hf.patch(model, policy="lynx", telemetry=telemetry)
        outs.append(_generate(model, ids, mask))
        lynx_hf.unpatch(model)
    _same(outs[0], outs[1])
    _same(outs[0], outs[2])
