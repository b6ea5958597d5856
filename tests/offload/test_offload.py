"""Expert-granular decode for experts accelerate offloads (``lynx_hf.offload``).

Families Qwen2-MoE, Mixtral, DeepSeek-V2 (fused ``[N, 2I, H]`` / ``[N, H, I]`` experts behind transformers' experts
interface) and Llama-4 (``[N, H, 2I]`` / ``[N, I, H]``, dense ``[N * T, H]`` input) x offload store:

- ``cpu_offload``: ``accelerate.cpu_offload`` per decoder layer (a dict of CPU tensors);
- ``disk_offload``: ``from_pretrained(device_map=...)`` with the last decoder layer on ``"disk"`` (safetensors
  files: transformers' offload folder, or the checkpoint itself);
- ``disk_dat``: ``accelerate.disk_offload`` per decoder layer (accelerate's raw ``.dat`` memory-map files).

Per cell, prefill and two teacher-forced decode steps through the KV cache (B = 4):

- prefill logits bit-identical to the unpatched offloaded model (prefill runs accelerate's own forward);
- policy ``none``: decode logits bit-identical too (stated tolerance: 0 on CPU -- the experts implementation runs
  on the step's experts in the order of their ids, the same arithmetic; with a resident cache the experts sit in
  cache slots, whose order may differ from the ids', so the per-token sum over its k experts may be added in
  another order: ``rtol 1e-5, atol 1e-6`` in fp32);
- LYNX: every MoE block call of the decode steps, replayed on the same input through the *unpatched* block with a
  router hook applying the same remap (``lynx_hf.core.remap``, with the resident experts the patched call seeded
  when a cache is on), gives the patched block's output (``rtol 1e-4, atol 1e-5``, fp32);
- telemetry: experts fetched + cache hits per call = the unique experts of the routing the experts received
  (read from a forward pre-hook), bytes read = fetched x one expert's stored bytes;
- ``unpatch`` puts accelerate's objects back: the same hook object, the same ``forward`` object
  (``functools.partial``), the same ``_old_forward``; the unpatched model's logits are unchanged.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import lynx_hf
from helpers import families as fam
from helpers.recording import BlockRecorder
from lynx_hf import offload
from lynx_hf.config import LynxConfig
from lynx_hf.core import MoELayer, Step, make_plan, remap
from lynx_hf.errors import LynxConfigError
from lynx_hf.patcher import _find_state
from lynx_hf.patches import find_spec

BATCH, PROMPT, STEPS = 4, 5, 2
FAMILIES = ("qwen2_moe", "mixtral", "deepseek_v2", "llama4")
STORAGES = ("cpu_offload", "disk_offload", "disk_dat")
# the cost gate (lynx_hf.gate, if present) may skip the policy on a tiny CPU model: forced on, so LYNX runs
ALWAYS = {"gate": "always"} if "gate" in LynxConfig.__dataclass_fields__ else {}
FP32 = dict(rtol=1e-4, atol=1e-5)


# -- models ----------------------------------------------------------------------------------------------------
def tiny(family, dtype=torch.float32):
    return fam.build(family, dtype=dtype, **({"num_experts_per_tok": 2} if family == "llama4" else {}))


def moe_blocks(model):
    return [(m, spec) for m in model.modules() if (spec := find_spec(m)) is not None]


def experts_of(block):
    return block.feed_forward.experts if hasattr(block, "feed_forward") else block.experts


def _moe_layers(model):
    blocks = [b for b, _ in moe_blocks(model)]
    return [layer for layer in model.model.layers if any(b is m for m in layer.modules() for b in blocks)]


def offloaded(family, storage, tmp_path, dtype=torch.float32):
    model = tiny(family, dtype)
    if storage == "cpu_offload":
        from accelerate import cpu_offload

        for layer in _moe_layers(model):
            cpu_offload(layer, execution_device=torch.device("cpu"))
        return model
    if storage == "disk_dat":
        from accelerate import disk_offload

        for i, layer in enumerate(_moe_layers(model)):
            disk_offload(layer, tmp_path / f"dat{i}", execution_device=torch.device("cpu"))
        return model
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "m")
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(layers - 1)}, f"model.layers.{layers - 1}": "disk"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map, dtype=dtype,
                                                  offload_folder=str(tmp_path / "off")).eval()
    assert experts_of(moe_blocks(loaded)[-1][0]).gate_up_proj.device.type == "meta"  # really offloaded
    return loaded


def is_offloaded(block) -> bool:
    return experts_of(block).gate_up_proj.device.type == "meta"


# -- running and recording ----------------------------------------------------------------------------------------
def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def record_blocks(model) -> BlockRecorder:
    """While ``decode``: every MoE block call ``(block, args, kwargs, output)`` (``calls``) and every offloaded experts
    call's inputs ``(experts module, args)`` (``pre_calls``)."""
    blocks = [block for block, _ in moe_blocks(model)]
    return BlockRecorder(blocks, [experts_of(b) for b in blocks if is_offloaded(b)])


run = fam.teacher_forced  # prefill, then one teacher-forced decode step per token; the logits of each forward


def inputs():
    ids, mask = fam.prompts(BATCH, PROMPT, seed=3)
    g = torch.Generator().manual_seed(5)
    return ids, mask, [torch.randint(3, fam.VOCAB, (BATCH, 1), generator=g) for _ in range(STEPS)]


class SeedSpy:
    """Records, per router call of an offloaded block, the resident-expert seed the patched remap used."""

    def __init__(self, monkeypatch):
        self.seeds: list = []
        real = offload.OffloadedExperts.resident_seed

        def spy(this, device):
            seed = real(this, device)
            self.seeds.append((this.block.block, None if seed is None else seed.clone()))
            return seed

        monkeypatch.setattr(offload.OffloadedExperts, "resident_seed", spy)

    def for_block(self, block):
        return [seed for b, seed in self.seeds if b is block]


class ReferenceRemap:
    """Router forward hooks on the *unpatched* model applying the remap the patched one applied (torch ops, every
    call a decode step; ``seeds[block]``: the resident seed of each successive call, ``None`` = none); the block's
    own forward then runs accelerate's whole-module path and the model's own experts."""

    def __init__(self, model, rules, seeds=None):
        self.handles = []
        for block, spec in moe_blocks(model):
            rule, num_experts, top_k = rules[id(block)]
            plan = make_plan(LynxConfig(policy="lynx", routing_backend="torch", **ALWAYS),
                             MoELayer(num_experts, top_k, "cpu"))
            router = spec.router_of(block)
            queue = list((seeds or {}).get(block, []))
            hook = self._dense if spec.decode_forward is not None else self._fused
            self.handles.append(router.register_forward_hook(
                lambda mod, args, out, h=hook, s=spec, r=router, p=plan, w=rule, k=top_k, q=queue:
                h(s, r, p, w, k, q.pop(0) if q else None, out)))

    @staticmethod
    def _fused(spec, router, plan, rule, top_k, seed, output):
        logits, weights, idx = spec.unpack(output)
        new_w, new_idx, _ = remap(plan, rule, Step("decode"), spec.selection_scores(router, logits), logits, weights,
                                  idx, seed=seed)
        return spec.repack(output, logits, new_w, new_idx)

    @staticmethod
    def _dense(spec, router, plan, rule, top_k, seed, output):  # Llama-4: dense [T, N] scores, weight on the input
        scores, logits = output
        idx = torch.topk(logits, top_k, dim=1).indices
        weights = scores.gather(1, idx)
        new_w, new_idx, _ = remap(plan, rule, Step("decode"), spec.selection_scores(router, logits), logits, weights,
                                  idx, seed=seed)
        return torch.zeros_like(scores).scatter_(1, new_idx, new_w.to(scores.dtype)), logits

    def close(self):
        for h in self.handles:
            h.remove()


def accelerate_objects(model):
    """``{experts module: (hook, forward, _old_forward)}`` of every offloaded experts module."""
    out = {}
    for block, _ in moe_blocks(model):
        e = experts_of(block)
        if "_hf_hook" in e.__dict__:
            out[e] = (e.__dict__["_hf_hook"], e.__dict__.get("forward"), e.__dict__.get("_old_forward"))
    return out


def expected_fetches(recorder, num_experts):
    """Per offloaded experts call: the unique experts its routing uses, from the inputs it received."""
    counts = []
    for module, args in recorder.pre_calls:
        if len(args) == 3:  # (hidden, top_k_index, top_k_weights)
            counts.append((module, torch.unique(args[1]).numel()))
        else:  # Llama-4: routed_in [N * T, H], zero rows off the chosen experts
            x = args[0].view(num_experts, -1, args[0].shape[-1])
            counts.append((module, int((x != 0).flatten(1).any(1).sum())))
    return counts


def _assert_replayed(recorder, reference):
    """Every recorded decode call of a patched block equals the same block run again under ``reference`` (the remap
    replayed through the unpatched block); ``reference`` is closed afterwards."""
    try:
        for block, args, kwargs, output in recorder.calls:
            with torch.no_grad():
                want_out = _first(block(*args, **kwargs))
            torch.testing.assert_close(_first(output), want_out, **FP32)
    finally:
        reference.close()


def _state(model):
    return _find_state(model)


# -- the matrix ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_decode_reads_only_the_steps_experts(family, storage, tmp_path, one_thread):
    model = offloaded(family, storage, tmp_path)
    ids, mask, tokens = inputs()
    before = accelerate_objects(model)
    assert before
    ref = run(model, ids, mask, tokens)
    for policy in ("none", "lynx"):
        lynx_hf.patch(model, policy=policy, **ALWAYS)
        state = _state(model)
        active = [b for b in state.blocks if b.offload is not None]
        assert [b.block for b in active] == [b for b, _ in moe_blocks(model) if is_offloaded(b)]
        assert all(b.offload_reason is None for b in active)
        recorder = record_blocks(model)
        try:
            out = run(model, ids, mask, tokens, recorder)
        finally:
            recorder.close()
        rules = {id(b.block): (b.rule, b.num_experts, b.top_k) for b in state.blocks}
        per_layer = {b.name: offload.layer_summary(b) for b in active}
        counts = {b.offload.module: dict(b.offload.counts) for b in active}
        expert_bytes = {b.offload.module: b.offload.store.expert_bytes() for b in active}
        num_experts = active[0].num_experts
        summary = lynx_hf.stats(model).summary()
        lynx_hf.unpatch(model)
        assert accelerate_objects(model) == before  # the same hook, forward and _old_forward objects
        assert torch.equal(out[0], ref[0]), f"{policy}: prefill changed"
        # telemetry: fetched = unique experts of the routing the experts received (no cache: every one is read)
        want = expected_fetches(recorder, num_experts)
        assert len(want) == STEPS * len(active)
        for module, c in counts.items():
            used = sum(n for m, n in want if m is module)
            assert c["calls"] == STEPS and c["fetched"] == used and c["hits"] == 0
            assert c["bytes_read"] == used * expert_bytes[module]
            assert c["bytes_module"] == STEPS * num_experts * expert_bytes[module]
        assert summary["offload_layers"] == len(active)
        assert summary["offload_bytes_read"] == pytest.approx(sum(v["offload_bytes_read"] for v in per_layer.values()))
        assert summary["offload_bytes_read"] < summary["offload_bytes_module"]
        if policy == "none":
            for step, (a, b) in enumerate(zip(out[1:], ref[1:])):
                assert torch.equal(a, b), f"none: decode step {step} changed"
            continue
        assert summary["remapped_fraction"] > 0
        reference = ReferenceRemap(model, rules)
        _assert_replayed(recorder, reference)
    assert all(torch.equal(a, b) for a, b in zip(run(model, ids, mask, tokens), ref))  # unpatch is exact


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_cache_seeds_the_remap_and_counts_hits(family, tmp_path, monkeypatch, one_thread):
    """A cache of half the layer's experts: hits counted, fetched + hits = unique experts; LYNX equals the remap
    seeded with the resident experts replayed through the unpatched block; policy none stays equal (stated
    tolerance: slot order)."""
    model = offloaded(family, "cpu_offload", tmp_path)
    ids, mask, tokens = inputs()
    tokens = tokens + tokens  # four decode steps: the cache warms up
    ref = run(model, ids, mask, tokens)
    block0 = next(b for b, _ in moe_blocks(model))
    probe = lynx_hf.patch(model, policy="none")
    state = _state(probe)
    half = state.blocks[0].offload.store.expert_bytes() * (state.blocks[0].num_experts // 2)
    lynx_hf.unpatch(model)
    for policy in ("none", "lynx"):
        spy = SeedSpy(monkeypatch)
        lynx_hf.patch(model, policy=policy, expert_cache_bytes=half, **ALWAYS)
        active = [b for b in _state(model).blocks if b.offload is not None]
        assert all(b.offload.cache.slots == b.num_experts // 2 for b in active)
        recorder = record_blocks(model)
        try:
            out = run(model, ids, mask, tokens, recorder)
        finally:
            recorder.close()
        rules = {id(b.block): (b.rule, b.num_experts, b.top_k) for b in _state(model).blocks}
        counts = {b.offload.module: dict(b.offload.counts) for b in active}
        transfer = offload.transfer_ms(model)
        num_experts = active[0].num_experts
        lynx_hf.unpatch(model)
        monkeypatch.undo()
        assert torch.equal(out[0], ref[0])
        want = expected_fetches(recorder, num_experts)
        for module, c in counts.items():
            used = sum(n for m, n in want if m is module)
            assert c["fetched"] + c["hits"] == used and c["hits"] > 0, c
        assert all(v is not None and v > 0 for v in transfer.values())
        if policy == "none":
            for a, b in zip(out[1:], ref[1:]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert not spy.seeds  # policy none never remaps: no seed asked
            continue
        seeds = {b: spy.for_block(b) for b, _ in moe_blocks(model)}
        assert any(s is not None for s in seeds[block0])  # resident experts did seed some remap
        reference = ReferenceRemap(model, rules, seeds)
        _assert_replayed(recorder, reference)


def test_bf16_disk_offload_casts_and_matches(tmp_path, one_thread):
    """A bf16 model loaded from an fp32 checkpoint with a disk offload: the stored dtype is cast as accelerate casts
    it; policy none decode bit-identical."""
    model = offloaded("qwen2_moe", "disk_offload", tmp_path, dtype=torch.bfloat16)
    ids, mask, tokens = inputs()
    ref = run(model, ids, mask, tokens)
    lynx_hf.patch(model, policy="none")
    out = run(model, ids, mask, tokens)
    assert lynx_hf.stats(model).summary()["offload_layers"] == 1
    lynx_hf.unpatch(model)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_lru_replacement_and_reads():
    """ExpertCache on a dict store: least recently used experts leave first; only misses are read."""
    n, rows = 6, 3
    data = {"w": torch.arange(n * rows * 2, dtype=torch.float32).view(n, rows, 2)}
    store = offload.ExpertStore(data, ["w"], {"w": (n, rows, 2)}, {"w": torch.float32})
    cache = offload.ExpertCache(store, {"w": (n, rows, 2)}, n, torch.device("cpu"), budget_bytes=3 * rows * 2 * 4)
    assert cache.slots == 3

    def step(experts):
        tensors, slots, fetched, hits, nbytes, _ = cache.gather(experts)
        for e, s in zip(experts, slots):
            assert torch.equal(tensors["w"][s], data["w"][e])
        return fetched, hits, nbytes

    assert step([0, 1]) == (2, 0, 2 * rows * 2 * 4)
    assert step([1, 2]) == (1, 1, rows * 2 * 4)  # 0 is now least recently used
    assert step([3, 4]) == (2, 0, 2 * rows * 2 * 4)  # evicts 0, then 1 (2 was used last)
    assert sorted(cache.lru) == [2, 3, 4]
    assert cache.resident.tolist() == [False, False, True, True, True, False]
    assert step([0, 2, 3, 4, 5]) == (2, 3, 2 * rows * 2 * 4)  # more than the slots: a buffer for this step
    assert sorted(cache.lru) == [2, 3, 4]  # no room (every resident expert is used): resident set unchanged
    assert step([0, 1, 2, 5]) == (3, 1, 3 * rows * 2 * 4)  # 3 and 4 leave (unused), misses 0 and 1 take their slots
    assert sorted(cache.lru) == [0, 1, 2]
    assert cache.resident.tolist() == [True, True, True, False, False, False]


def test_file_store_reads_only_the_experts_byte_ranges(tmp_path):
    """Safetensors and accelerate .dat stores: rows come back exact, cast to the module dtype, bytes = rows read."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, offload_state_dict
    from safetensors.torch import save_file

    w = torch.randn(7, 4, 5)
    save_file({"x.w": w}, str(tmp_path / "a.safetensors"))
    offload_state_dict(str(tmp_path / "dat"), {"x.w": w.to(torch.bfloat16)})
    st_map = PrefixedDataset(OffloadedWeightsLoader(index={"x.w": {"safetensors_file": str(tmp_path / "a.safetensors"),
                                                                   "weight_name": "x.w", "dtype": "bfloat16"}}), "x.")
    dat_map = PrefixedDataset(OffloadedWeightsLoader(save_folder=str(tmp_path / "dat")), "x.")
    for weights_map, stored in ((st_map, 4), (dat_map, 2)):
        store = offload.ExpertStore(weights_map, ["w"], {"w": (7, 4, 5)}, {"w": torch.bfloat16})
        assert store.row_bytes("w") == 20 * stored
        out = torch.empty(3, 4, 5, dtype=torch.bfloat16)
        assert store.read("w", [1, 2, 5], out) == 3 * 20 * stored
        assert torch.equal(out, w[[1, 2, 5]].to(torch.bfloat16))
        store.close()


def test_config_fields_and_module_path(tmp_path, one_thread):
    with pytest.raises(LynxConfigError, match="expert_cache_bytes"):
        LynxConfig(expert_cache_bytes=-1)
    with pytest.raises(LynxConfigError, match="offload_path"):
        LynxConfig(offload_path="disk")
    model = offloaded("mixtral", "cpu_offload", tmp_path)
    before = accelerate_objects(model)
    lynx_hf.patch(model, policy="lynx")
    assert set(offload.transfer_ms(model).values()) == {None}  # nothing read yet
    estimates = offload.transfer_ms(model, estimate=True)  # one probe read per layer
    assert len(estimates) == 2 and all(v > 0 for v in estimates.values())
    lynx_hf.patch(model, policy="lynx", offload_path="module")
    state = _state(model)
    assert all(b.offload is None and "module" in b.offload_reason for b in state.blocks)
    assert accelerate_objects(model) == before
    lynx_hf.patch(model, policy="lynx", offload_path="experts")  # reconfigured in place
    assert all(b.offload is not None for b in _state(model).blocks)
    assert accelerate_objects(model) != before
    lynx_hf.unpatch(model)
    assert accelerate_objects(model) == before


def test_cost_gate_weighs_the_transfer_of_an_offloaded_expert(tmp_path, one_thread, monkeypatch, fresh_gate_store):
    """gate="auto" on an offloaded model: each block's gate adds the probe's per-expert transfer time to the saving
    of every avoided expert (lynx_hf.gate.decide's extra_expert_ms), timed when the gate measures (an empty decision
    cache here); unpatch drops it. The block's ``LayerFacts`` (``lynx_hf.facts``) carry the transfer."""
    import lynx_hf.gate.stage
    from lynx_hf import facts, gate

    monkeypatch.setattr(lynx_hf.gate.stage, "TUNING", gate.Tuning(buckets=(1, 4)))  # two buckets keep it short
    model = offloaded("mixtral", "cpu_offload", tmp_path)
    lynx_hf.patch(model, policy="lynx", gate="auto")
    state = _state(model)
    ids, mask, _ = inputs()
    with torch.no_grad():  # the routers are offloaded too (meta at patch time): the plan resolves on the first call
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    gates = [gate.of(block.plan) for block in state.blocks]
    for block, g in zip(state.blocks, gates):
        assert block.offload is not None and facts.layer_facts(block).extra_expert_ms == block.offload.probe_ms
        assert block.plan.device.type == "cpu" and g is not None
    # the layers share one key: the first measured (with its own transfer probe), the others read its decisions
    assert gates[0].source.startswith("measured") and all(g.decisions == gates[0].decisions for g in gates)
    d = gates[0].decision(4)
    assert d.extra_expert_ms == state.blocks[0].offload.probe_ms() > 0
    assert d.saving_ms == pytest.approx(d.experts_saved * (d.expert_ms + d.extra_expert_ms))
    lynx_hf.unpatch(model)
    assert all(b.offload is None and facts.layer_facts(b).extra_expert_ms == 0.0 for b in state.blocks)


def test_not_offloaded_blocks_are_left_alone(one_thread):
    model = tiny("qwen2_moe")
    lynx_hf.patch(model, policy="lynx")
    assert all(b.offload is None and "not offloaded" in b.offload_reason for b in _state(model).blocks)
    assert "offload_layers" not in lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)


@pytest.mark.parametrize("family", ["qwen2_moe", "llama4"])
def test_no_host_sync_beyond_the_expert_ids_read(family, tmp_path, one_thread):
    """On the accelerator code path (``strict_sync_free``) the only host reads / data-dependent ops lynx_hf adds for
    offloaded experts are the reads of the step's expert ids in ``lynx_hf/offload.py`` (the lines marked
    ``the host sync``): the host must know which byte ranges to read before any copy (docs/expert-storage.md)."""
    from helpers.sync_detector import SyncDetector
    from lynx_hf.kernels.routing_torch import strict_sync_free

    model = offloaded(family, "cpu_offload", tmp_path)
    lynx_hf.patch(model, policy="lynx", expert_cache_bytes=1 << 20, **ALWAYS)
    ids, mask, tokens = inputs()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        detector = SyncDetector()
        with strict_sync_free(), detector:
            for tok in tokens:
                mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
                cache = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True).past_key_values
    summary = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    assert summary["offload_layers"] > 0 and summary["decode_steps"] == STEPS
    source = Path(offload.__file__).read_text().splitlines()
    marked = {i + 1 for i, line in enumerate(source) if "the host sync" in line}
    # index tensors made from the host's decisions (torch.tensor: lift_fresh), anywhere in offload.py: they follow
    # the ids read, which has already synced the step (the store and its LRU live on the host)
    assert marked
    reads = []
    for op, where in detector.violations:
        path, line = where.rsplit(":", 1)
        assert os.path.samefile(path, offload.__file__), (op, where)
        if "lift_fresh" not in op:
            assert int(line) in marked, (op, where)
            reads.append(op)
    assert reads  # the read is there (and seen by the detector)
    assert all(re.search(r"unique|nonzero", op) for op in reads)


def test_generate_patched_under_inference_mode(tmp_path, one_thread):
    """``generate`` (its decode detection) with a cache made under ``torch.inference_mode`` and used again outside it
    (the cache's tensors are normal tensors): the same tokens as the unpatched offloaded model; hits counted."""
    model = offloaded("qwen2_moe", "disk_offload", tmp_path)
    ids, mask = fam.prompts(BATCH, PROMPT)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    ref = model.generate(**kw)
    with torch.inference_mode():
        lynx_hf.patch(model, policy="none", expert_cache_bytes=1 << 16)
        out = model.generate(**kw)
    with torch.no_grad():
        again = model.generate(**kw)
    summary = lynx_hf.stats(model).summary()
    lynx_hf.unpatch(model)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert summary["offload_layers"] == 1 and summary["offload_cache_hits"] > 0


# -- a router that reads a buffer, buffers offloaded too (docs/cases.md C39) -----------------------------------
DEEPSEEK_V3_DISK = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                    "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def _biased_deepseek_v3():
    model = fam.build("deepseek_v3")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)  # moves the selection: a wrong read shows
    return model


@pytest.mark.parametrize("storage", ["cpu_offload", "disk_offload", "from_pretrained"])
def test_C39_offload_buffers_with_a_router_reading_a_buffer(storage, tmp_path, one_thread):
    """CASES C39: accelerate with ``offload_buffers=True`` keeps DeepSeek-V3's ``e_score_correction_bias`` on
    ``meta`` outside the router's forward; the router hook runs after accelerate's post-forward, so it reads the
    bias from the hook's weights map (``lynx_hf.selection.live_tensor``). Policy none: the unpatched model's tokens;
    LYNX: decodes (before: "Cannot copy out of meta tensor") and gives the in-memory patched model's tokens."""
    from accelerate import cpu_offload, disk_offload

    memory = _biased_deepseek_v3()
    ids, mask = fam.prompts(BATCH, PROMPT)

    def run(model):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)

    want = run(memory)
    with lynx_hf.patched(memory, policy="lynx", gate="always", mass_price=None, tau=1000.0):
        want_lynx = run(memory)
    if storage == "from_pretrained":
        memory.save_pretrained(tmp_path / "ckpt")
        model = type(memory).from_pretrained(tmp_path / "ckpt", device_map=DEEPSEEK_V3_DISK, offload_buffers=True,
                                             offload_folder=str(tmp_path / "off"), dtype=torch.float32).eval()
    else:
        model = _biased_deepseek_v3()
        if storage == "cpu_offload":
            cpu_offload(model, execution_device=torch.device("cpu"), offload_buffers=True)
        else:
            disk_offload(model, str(tmp_path / "dat"), execution_device=torch.device("cpu"), offload_buffers=True)
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.device.type == "meta" for b in biases)  # the condition of the case
    assert torch.equal(run(model), want)
    lynx_hf.patch(model, policy="none", gate="always")
    assert torch.equal(run(model), want)
    lynx_hf.patch(model, policy="lynx", mass_price=None, tau=1000.0)  # on top: gate stays "always"
    got = run(model)
    summary = lynx_hf.stats(model).summary()
    assert summary["decode_steps"] == 3 and summary["unique_experts_after"] < summary["unique_experts_before"]
    assert torch.equal(got, want_lynx)
    lynx_hf.unpatch(model)
    assert torch.equal(run(model), want)


def test_C39_generic_spec_router_with_an_offloaded_bias_is_verified_and_remaps(one_thread):
    """CASES C39, the generic spec (GLM-4.5, the bias a router buffer, grouped): under ``cpu_offload(...,
    offload_buffers=True)`` the router is verified on its first large call with the bias read from accelerate's hook
    (before: refused, "not materialized"), and decodes the in-memory patched model's tokens."""
    import warnings

    from accelerate import cpu_offload

    from lab import family_matrix as fm

    ids = torch.randint(3, 100, (8, 4), generator=torch.Generator().manual_seed(0))
    memory, model = fm.build(fm.case_of("glm4_moe")), fm.build(fm.case_of("glm4_moe"))
    with lynx_hf.patched(memory, policy="lynx", gate="always"):
        want = memory.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    cpu_offload(model, execution_device=torch.device("cpu"), offload_buffers=True)
    lynx_hf.patch(model, policy="lynx", gate="always")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    # no lynx_hf warning (the refusal: "... this block keeps the model's own routing"); transformers' own (5.19: the
    # offloaded model's device is meta, the inputs on cpu) are not this test's subject
    ours = [str(w.message) for w in caught if str(w.message).startswith("lynx_hf")]
    assert not ours, ours
    assert all(b.rule_status == "verified" for b in _state(model).blocks)
    assert lynx_hf.stats(model).summary()["decode_steps"] == 3 and torch.equal(got, want)
    lynx_hf.unpatch(model)


# -- issue 38: least-recently-used (not first-in first-out) replacement; the per-expert transfer time -----------------
def test_cache_replaces_the_least_recently_used_expert_not_the_first_loaded():
    """3 slots: experts 0, 1, 2 loaded in that order, then 0 used again, then 3 needs a slot. LRU evicts 1 (least
    recently used); FIFO would evict 0 (first loaded). Then 0 is a hit (nothing read) and 1 a miss."""
    n, rows = 6, 2
    data = {"w": torch.arange(n * rows, dtype=torch.float32).view(n, rows)}
    store = offload.ExpertStore(data, ["w"], {"w": (n, rows)}, {"w": torch.float32})
    cache = offload.ExpertCache(store, {"w": (n, rows)}, n, torch.device("cpu"), budget_bytes=3 * rows * 4)
    assert cache.slots == 3
    fetched = [cache.gather(experts)[2] for experts in ([0, 1, 2], [0], [3])]
    assert fetched == [3, 0, 1]
    assert sorted(cache.lru) == [0, 2, 3] and cache.resident.tolist() == [True, False, True, True, False, False]
    tensors, slots, fetched, hits, _, _ = cache.gather([0])
    assert (fetched, hits) == (0, 1) and torch.equal(tensors["w"][slots[0]], data["w"][0])
    assert cache.gather([1])[2:4] == (1, 0)


def test_transfer_time_is_per_expert_fetched(tmp_path, one_thread):
    """``transfer_ms``: the store's read time over the experts read, not over the decode calls: 12 ms for 6 experts
    in 3 calls is 2 ms per expert (4 would be per call); ``None`` before any read."""
    model = offloaded("qwen2_moe", "cpu_offload", tmp_path)
    lynx_hf.patch(model, policy="lynx", **ALWAYS)
    offloaded_experts = [b.offload for b in _state(model).blocks if b.offload is not None]
    assert offloaded_experts
    one = offloaded_experts[0]
    assert one.transfer_ms() is None
    one.counts.update(seconds=0.012, fetched=6, calls=3)
    assert one.transfer_ms() == pytest.approx(2.0)
    lynx_hf.unpatch(model)
