"""Padding rows (issue 36 item 1): vLLM's ``FusedTopKRouter`` / ``FusedTopKBiasRouter`` give a padding row expert id
-1 under ``VLLM_MOE_SKIP_PADDING=1`` (vLLM's default): every row of a CUDA-graph capture warm-up, DP dummy runs, the
padded tail of a decode batch. The plugin excludes them from every index op of the remap, the union, the critical
set's votes and the telemetry (``lynx_hf.vllm.rows.PaddingRows``, a stage of every layer's plan:
``padding_rows`` / ``without_padding``), on the numba (host), torch
(sync-free, the accelerator path) and Triton (interpreted) paths, and hands them back with vLLM's -1 ids and weights.

Driven through the plugin's op (``lynx_hf.vllm.op``) on CPU, compared with a torch reference computed through the
same op **without** those rows, for every policy. Before the fix ``union_mask`` raised ``IndexError`` (``index_add_``
with -1) on CPU, and padding rows marked decode voted and were remapped. Unit level (no engine)."""

import pytest
import torch

pytest.importorskip("vllm")

from lynx_hf.core import WeightRule  # noqa: E402
from lynx_hf.kernels.routing_torch import union_mask  # noqa: E402
from lynx_hf.vllm import op, rows, steps, telemetry  # noqa: E402
from lynx_hf.vllm.state import DECODE, PREFILL, STATE  # noqa: E402
from plugin_steps import set_kinds  # noqa: E402

N, K = 8, 2
POLICIES = {
    "none": {"policy": "none"},
    "lynx": {"policy": "lynx", "mass_price": 0.5},
    "lynx-paper": {"policy": "lynx", "mass_price": None},
    "oea": {"policy": "oea", "oea_k0": 1},
    "xshare": {"policy": "xshare", "xshare_budget": 3},
}
#: (routing_backend, host): the numba twins (CPU eager), the torch ops (the sync-free accelerator path), Triton
PATHS = {"numba": ("torch", True), "torch": ("torch", False), "triton": ("triton", False)}


def _routing(logits):
    vals, ids = torch.topk(logits.float(), K, dim=-1)
    return torch.softmax(vals, dim=-1), ids.to(torch.int32)


def _case(seed, rows=12):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, N, generator=gen) * 2
    weights, ids = _routing(logits)
    return logits, weights, ids


def _run(one_layer, options, backend, host, kinds, logits, weights, ids):
    """One call of the op's step function on a fresh process state: (weights, ids, the layer's telemetry summary and
    loaded-experts counts)."""
    layer = one_layer({**options, "routing_backend": backend, "gate": "always"}, num_experts=N, top_k=K,
                      rule=WeightRule("softmax_all", renormalize=True))
    step = rows.masked_step(torch.tensor(kinds, dtype=torch.int8))
    new_w, new_ids = op.remap_step(layer, step, logits, weights, ids, host)
    return new_w, new_ids, layer.telemetry.summary(), layer.telemetry.loaded()


@pytest.mark.vllm_code
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_padding_rows_are_excluded_and_come_back_untouched(one_layer, policy, path):
    """Rows 3, 7 and 11 are padding (id -1, weights 0), their step-mask kind *decode* (so only the -1 excludes
    them) and their logits the largest of the step (they would dominate every vote): the live rows' routing and the
    telemetry equal the torch reference computed on the live rows alone; the padding rows keep -1 and their weights."""
    if path == "triton" and policy == "xshare":
        pytest.skip("XShare runs the torch ops under the Triton backend (kernels.backend.routing_ops)")
    backend, host = PATHS[path]
    logits, weights, ids = _case(seed=5)
    pad = torch.zeros(12, dtype=torch.bool)
    pad[[3, 7, 11]] = True
    logits[pad] = logits[pad] * 0 + torch.linspace(9, 1, N)  # padding logits agree on experts 0, 1: a strong vote
    kinds = [PREFILL, DECODE, DECODE, DECODE, DECODE, PREFILL, DECODE, DECODE, DECODE, DECODE, DECODE, DECODE]
    padded_ids = ids.masked_fill(pad[:, None], -1)
    padded_w = weights.masked_fill(pad[:, None], 0.0)
    keep = ~pad
    ref_w, ref_ids, ref_tel, ref_loaded = _run(one_layer, POLICIES[policy], "torch", False,
                                               [k for k, p in zip(kinds, pad.tolist()) if not p],
                                               logits[keep], weights[keep], ids[keep])
    new_w, new_ids, tel, loaded = _run(one_layer, POLICIES[policy], backend, host, kinds, logits, padded_w,
                                       padded_ids)
    assert new_ids.dtype == torch.int32 and new_w.dtype == torch.float32
    assert torch.equal(new_ids[pad], padded_ids[pad]) and bool((new_ids[pad] == -1).all())
    assert torch.equal(new_w[pad], padded_w[pad])
    assert torch.equal(new_ids[keep], ref_ids)
    torch.testing.assert_close(new_w[keep], ref_w, rtol=1e-6, atol=1e-6)
    # equal counts; the routing mass kept is an fp32 sum over rows (its order changes with the row count)
    assert tel == pytest.approx(ref_tel, rel=1e-6) and loaded == ref_loaded
    assert tel["decode_tokens"] == 7  # the live decode rows only


@pytest.mark.vllm_code
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("policy", ["none", "lynx", "oea"])
def test_all_padding_step_warm_up(one_layer, policy, path):
    """A CUDA-graph capture warm-up / DP dummy run: every row padding (id -1), whatever the buffer says. The routing
    comes back as it went in and nothing is counted."""
    backend, host = PATHS[path]
    logits, weights, ids = _case(seed=6, rows=8)
    ids = torch.full_like(ids, -1)
    weights = torch.zeros_like(weights)
    new_w, new_ids, tel, loaded = _run(one_layer, POLICIES[policy], backend, host, [DECODE] * 8, logits, weights, ids)
    assert torch.equal(new_ids, ids) and torch.equal(new_w, weights)
    assert tel["decode_tokens"] == 0 and tel["decode_steps"] == 0 and loaded is None


@pytest.mark.vllm_code
def test_the_registered_op_on_a_host_decode_step_with_padding(one_layer):
    """Through ``torch.ops.lynx_vllm.remap_routing`` on the host: a step whose every row the buffer calls decode
    (the fused one-call path's case) with two padding rows from the router takes the masked path, excludes them, and
    the telemetry counts 6 decode tokens."""
    layer = one_layer({"policy": "lynx", "mass_price": 0.5, "gate": "always"})
    logits, weights, ids = _case(seed=7, rows=8)
    pad = torch.tensor([False] * 6 + [True] * 2)
    padded = ids.masked_fill(pad[:, None], -1)
    set_kinds([DECODE] * 8)
    new_w, new_ids = torch.ops.lynx_vllm.remap_routing(logits, weights, padded, 0)
    steps.end_step()
    assert bool((new_ids[6:] == -1).all()) and torch.equal(new_w[6:], weights[6:])
    assert bool((new_ids[:6] >= 0).all())
    snap = telemetry.snapshot()["layers"][0]
    assert snap["decode_tokens"] == 6 and snap["decode_steps"] == 1 and STATE.layers[0] is layer


def test_union_mask_with_negative_ids_is_why():
    """The failure the plugin's exclusion avoids: the core's union over rows with id -1 raises on CPU even when those
    rows are not selected (``index_add_``); the plugin never hands it such ids."""
    with pytest.raises(IndexError):
        union_mask(torch.tensor([[1, 2], [-1, -1]]), 4, torch.tensor([True, False]))
