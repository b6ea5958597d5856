"""A patched decode step issues no host sync and no data-dependent shape in lynx_hf's code, on
every family, every policy and both backends (torch; Triton under the interpreter), checked by a
dispatch-mode detector (tests/helpers/sync_detector.py) with the CPU-only early exits turned off
(``strict_sync_free``: the accelerator code path). The detector itself is tested: an inserted
``.item()`` is caught."""

import os

import pytest
import torch
from transformers import StaticCache

import lynx_hf
from helpers import families as fam
from helpers.sync_detector import SyncDetector
from lynx_hf import core
from lynx_hf.kernels.routing_torch import strict_sync_free

# policy_on_every_step (tests/conftest.py): the subject is the policy's device path (no host sync while it remaps); on
# a tiny model the cost gate (the default) keeps it off at many step sizes. The default gate's own path is checked
# sync-free in tests/policies/test_gate.py::test_gate_adds_no_host_sync
pytestmark = pytest.mark.usefixtures("policy_on_every_step")

POLICIES = {"lynx-default": dict(policy="lynx"), "lynx-paper": dict(policy="lynx", mass_price=None),
            "oea": dict(policy="oea", oea_k0=1)}
BACKENDS = ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]


def _decode_under_detector(model, steps=2, static=False, batch=8):
    ids, mask = fam.prompts(batch, 5)
    cache = StaticCache(config=model.config, max_cache_len=16) if static else None
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **fam.cache_kw(model, cache), use_cache=True)
        cache = fam.cache_of(out)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        detector = SyncDetector()
        with strict_sync_free(), detector:
            for _ in range(steps):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(input_ids=nxt, attention_mask=mask, **fam.cache_kw(model, cache), use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return detector


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", fam.PATCHABLE)
def test_decode_step_is_sync_free(family, policy, backend):
    model = fam.build(family)
    lynx_hf.patch(model, routing_backend=backend, expert_path="triton" if backend == "triton" else "auto",
                  **POLICIES[policy])
    detector = _decode_under_detector(model)
    summary = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    detector.check()
    assert summary["decode_steps"] == 2  # the steps ran through the patched path (not skipped as prefill)
    assert detector.ops_seen > 100


@pytest.mark.parametrize("policy", ["lynx-default", "oea"])
def test_static_cache_decode_is_sync_free(policy):
    """StaticCache keeps its length on the device: decode is decided per token with tensors."""
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, **POLICIES[policy])
    detector = _decode_under_detector(model, static=True)
    summary = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    detector.check()
    assert summary["decode_steps"] == 2


def _insert_into_routing(monkeypatch, line: str):
    """Replace core.remap by a wrapper whose code lives in core.py's file (so it is "ours") and
    runs ``line`` before the real remap."""
    source = (f"def remap(plan, rule, step, scores, *args, **kwargs):\n    {line}\n"
              "    return real(plan, rule, step, scores, *args, **kwargs)\n")
    namespace = {"real": core.remap}
    exec(compile(source, core.__file__, "exec"), namespace)
    monkeypatch.setattr(core, "remap", namespace["remap"])


def test_detector_catches_an_inserted_item(monkeypatch):
    _insert_into_routing(monkeypatch, "float(scores.max().item())")  # the host read the decode path must not have
    model = fam.build("mixtral")
    lynx_hf.patch(model, policy="lynx")
    detector = _decode_under_detector(model, steps=1)
    lynx_hf.unpatch(model)
    assert detector.violations and all("_local_scalar_dense" in op for op, _ in detector.violations)
    assert all("core.py" in where for _, where in detector.violations)
    assert len(detector.violations) == 2  # one per MoE layer (the tiny Mixtral has 2)
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        detector.check()


def test_detector_catches_boolean_mask_indexing(monkeypatch):
    _insert_into_routing(monkeypatch, "scores[scores > 0]")  # data-dependent shape (nonzero in disguise)
    model = fam.build("mixtral")
    lynx_hf.patch(model, policy="lynx")
    detector = _decode_under_detector(model, steps=1)
    lynx_hf.unpatch(model)
    assert len(detector.violations) == 2 and all("index" in op for op, _ in detector.violations)
