"""CASES C19, C20, C23: never silently wrong, whatever the experts are.

The matrix: families x expert storage x backend (torch; triton under the interpreter) x policy (none, lynx,
oea). Each cell, on a tiny model, prefill and two teacher-forced decode steps through the KV cache:

- prefill logits bit-identical to the unpatched model of the same storage (every policy, every backend);
- policy ``none``: decode logits bit-identical too;
- LYNX / OEA: every MoE block call of the decode steps, replayed on the same input through the *unpatched*
  block with a test-side router hook that applies the same remap (``lynx_hf.core.remap``, torch ops),
  so the experts run the model's own forward, gives the patched block's output (within fp tolerance);
- where the sparse Triton kernel may read the weights (plain dense fp32/bf16 of transformers' own classes) it
  does run on the triton backend; everywhere else it never runs, and the patch-time reason names why.

Storage (each a way real checkpoints store experts):

- ``fp32`` / ``bf16``: dense;
- ``fp8``: transformers' own ``FP8Experts`` (fp8 e4m3 weights, fp32 block scales [16, 16], built the way
  ``replace_with_fp8_linear`` builds it), its fp8 matmul emulated on CPU by dequantizing with transformers'
  own ``_dequantize_fp8_weight`` (transformers 5.24 has no CPU fp8 matmul: ``fp8_linear`` loads a Triton /
  DeepGEMM kernel from the hub); Llama-4 (whose block calls ``experts(x)``, which ``FP8Experts`` cannot
  serve) gets an fp8 subclass of ``Llama4TextExperts`` with block scales instead;
- ``int8``: a GPTQ/AWQ-style replacement: a subclass of the family's experts class holding int8 weights and
  per-row scales, dequantizing in its own forward (what a bitsandbytes / GPTQ experts module does);
- ``subclass``: an unknown subclass of the family's experts class, plain fp32 weights, whose forward differs
  (it halves the output) and which still dispatches through transformers' experts interface;
- ``lora``: PEFT LoRA on the expert parameters (``target_parameters`` = the experts' ``gate_up_proj`` and
  ``down_proj``, random B so the adapter changes the output; CASES C20 for Llama-4);
- ``cpu_offload``: ``accelerate.cpu_offload`` (weights in a CPU map, ``meta`` in the module);
- ``disk_offload``: ``from_pretrained(device_map=...)`` with the last decoder layer on ``"disk"`` (CASES C19).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import lynx_hf
from helpers import families as fam
from helpers.recording import BlockRecorder
from lynx_hf.config import LynxConfig
from lynx_hf.core import MoELayer, Step, make_plan, remap
from lynx_hf.patches import find_spec

# policy_on_every_step (tests/conftest.py): each cell compares the policy's remap on a storage against the replayed remap;
# on these tiny models the cost gate (the default) keeps the policy off at many step sizes
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py)"),
              pytest.mark.usefixtures("policy_on_every_step")]

BATCH, PROMPT, STEPS = 4, 5, 2
POLICIES = (("none", {}), ("lynx", {}), ("oea", {"oea_k0": 1}))
BACKENDS = ("torch", "triton")
FAMILIES = {
    "qwen2_moe": lambda: fam.build("qwen2_moe"),
    "mixtral": lambda: fam.build("mixtral"),
    "deepseek_v2": lambda: fam.build("deepseek_v2"),
    "llama4": lambda: fam.build("llama4", num_experts_per_tok=2),  # k = 2 so that LYNX / OEA have something to cut
    "qwen3_moe": lambda: fam.build("qwen3_moe"),
}
STORAGES = ("fp32", "bf16", "fp8", "int8", "subclass", "lora", "cpu_offload", "disk_offload")
KERNEL_STORAGES = ("fp32", "bf16")  # the only ones the sparse kernel may read
# what the patch-time reason must name (lower case) for storages the kernel may not read
REASONS = {
    "fp8": ("scale", "float8"),
    "int8": ("not one of transformers' own", "int8", "besides the dense weights"),
    "subclass": ("not one of transformers' own",),
    "lora": ("peft", "lora", "wrapped"),
    "cpu_offload": ("offload",),
    "disk_offload": ("offload",),
}
EXPERT_PATHS = {"llama4": "feed_forward.experts"}


# -- storage builders -------------------------------------------------------------------------------------
def moe_blocks(model):
    """``[(block, spec)]`` for each MoE block lynx_hf patches, in module order."""
    return [(m, spec) for m in model.modules() if (spec := find_spec(m)) is not None]


def quantize_fp8(weight: torch.Tensor, block=(16, 16)):
    """Block-wise fp8 e4m3 quantization of ``weight [N, out, in]``: ``(fp8 [N, out, in], scale_inv fp32
    [N, ceil(out/16), ceil(in/16)])`` with ``weight ~= fp8 * scale_inv`` per block (DeepSeek-V3 style)."""
    n, rows, cols = weight.shape
    br, bc = block
    pad = torch.zeros(n, -(-rows // br) * br, -(-cols // bc) * bc, dtype=torch.float32)
    pad[:, :rows, :cols] = weight.float()
    tiles = pad.unflatten(1, (-1, br)).unflatten(3, (-1, bc))  # [N, R, br, C, bc]
    scale = tiles.abs().amax(dim=(2, 4)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).flatten(3, 4).flatten(1, 2)
    return q[:, :rows, :cols].contiguous(), scale


def _dequantize_fp8_weight(weight, weight_scale_inv, block_size, dtype):
    """transformers' own ``finegrained_fp8._dequantize_fp8_weight`` (5.24); on a release without it (5.19) the
    same block-scale arithmetic, written out here (``[..., N, K]`` fp8 weights, one scale per block)."""
    from transformers.integrations import finegrained_fp8 as fp8

    if hasattr(fp8, "_dequantize_fp8_weight"):
        return fp8._dequantize_fp8_weight(weight, weight_scale_inv, block_size, dtype)
    scale, weight = weight_scale_inv.to(dtype), weight.to(dtype)
    if block_size is None:
        return weight.mul_(scale)
    rows, cols = weight.shape[-2:]
    full, rem = divmod(cols, block_size[1])
    scale = scale.repeat_interleave(block_size[0], dim=-2)[..., :rows, :]
    weight[..., : full * block_size[1]].unflatten(-1, (full, block_size[1])).mul_(scale[..., :full, None])
    if rem:
        weight[..., full * block_size[1]:].mul_(scale[..., full:])
    return weight


def _emulated_fp8_linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
                         allow_deepgemm=True):
    """CPU stand-in for transformers' ``fp8_linear`` (a hub Triton / DeepGEMM kernel): dequantize with
    transformers' own ``_dequantize_fp8_weight``, then a plain matmul in the activation dtype."""
    w = _dequantize_fp8_weight(weight, weight_scale_inv, list(block_size) if block_size else None, input.dtype)
    return F.linear(input, w, bias)


def to_fp8(model, monkeypatch):
    """Replace every MoE block's experts by transformers' ``FP8Experts`` holding the fp8-quantized weights."""
    from transformers.integrations import finegrained_fp8 as fp8
    from transformers.integrations.moe import use_experts_implementation

    monkeypatch.setattr(fp8, "fp8_linear", _emulated_fp8_linear)
    model.to(torch.bfloat16)
    for block, spec in moe_blocks(model):
        old = spec.experts_of(block)
        if type(old).__name__ == "Llama4TextExperts":
            new = _llama4_fp8(old)
        else:
            cls = use_experts_implementation(  # as replace_with_fp8_linear does
                experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False,
                has_gate=True)
            new = cls(config=old.config, block_size=(16, 16))
            with torch.no_grad():
                for name in ("gate_up_proj", "down_proj"):
                    q, s = quantize_fp8(getattr(old, name))
                    getattr(new, name).data = q
                    getattr(new, name + "_scale_inv").data = s
        setattr(block, spec.experts, new)
    model.set_experts_implementation("eager")  # the FP8 interface's grouped_mm needs the hub kernel (no CPU path)
    return model


def _llama4_fp8(old):
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    class FP8Llama4TextExperts(Llama4TextExperts):
        """Llama-4 experts with fp8 block-quantized storage (``[N, H, 2I]`` stored as ``[N, 2I, H]`` blocks)."""

        def __init__(self, config, src):
            torch.nn.Module.__init__(self)
            self.num_experts, self.hidden_size = src.num_experts, src.hidden_size
            self.expert_dim, self.act_fn = src.expert_dim, src.act_fn
            for name in ("gate_up_proj", "down_proj"):
                q, s = quantize_fp8(getattr(src, name).transpose(1, 2))
                self.register_buffer(name + "_fp8", q)
                self.register_buffer(name + "_scale_inv", s)

        def _weight(self, name, dtype):
            return _dequantize_fp8_weight(getattr(self, name + "_fp8"), getattr(self, name + "_scale_inv"),
                                          [16, 16], dtype).transpose(1, 2)

        def forward(self, hidden_states):
            hidden_states = hidden_states.view(self.num_experts, -1, self.hidden_size)
            gate, up = torch.bmm(hidden_states, self._weight("gate_up_proj", hidden_states.dtype)).chunk(2, dim=-1)
            out = torch.bmm(up * self.act_fn(gate), self._weight("down_proj", hidden_states.dtype))
            return out.view(-1, self.hidden_size)

    return FP8Llama4TextExperts(None, old)


def to_int8(model):
    """GPTQ/AWQ-style: each experts module becomes a subclass of its class with int8 weights + per-row scales
    (buffers) and its own dequantizing forward; the dense parameters are gone."""
    for block, spec in moe_blocks(model):
        old = spec.experts_of(block)
        base = type(old)

        class Int8Experts(base):
            def forward(self, hidden_states, *args, **kwargs):
                for name in ("gate_up_proj", "down_proj"):
                    setattr(self, name, getattr(self, name + "_q").float() * getattr(self, name + "_scale"))
                try:
                    return base.forward(self, hidden_states, *args, **kwargs)
                finally:
                    for name in ("gate_up_proj", "down_proj"):
                        delattr(self, name)

        new = object.__new__(Int8Experts)
        new.__dict__.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in old.__dict__.items()})
        for name in ("gate_up_proj", "down_proj"):
            w = new._parameters.pop(name).detach()
            scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
            new.register_buffer(name + "_q", torch.round(w / scale).to(torch.int8))
            new.register_buffer(name + "_scale", scale)
        setattr(block, spec.experts, new)
    return model


def to_subclass(model):
    """An unknown subclass of each experts class: same plain fp32 weights, a forward that halves the output,
    re-decorated with transformers' ``use_experts_implementation`` (it dispatches through the interface)."""
    from transformers.integrations.moe import use_experts_implementation

    for block, spec in moe_blocks(model):
        old = spec.experts_of(block)
        base = type(old)
        if hasattr(old, "has_gate"):
            eager = base.forward.__wrapped__  # the family's own eager loop, under transformers' decorator

            class HalvedExperts(base):
                def forward(self, hidden_states, top_k_index, top_k_weights, _eager=eager):
                    return 0.5 * _eager(self, hidden_states, top_k_index, top_k_weights)

            HalvedExperts = use_experts_implementation(HalvedExperts)
        else:  # Llama-4: no interface
            class HalvedExperts(base):
                def forward(self, hidden_states):
                    return 0.5 * base.forward(self, hidden_states)

        new = object.__new__(HalvedExperts)
        new.__dict__.update(old.__dict__)
        setattr(block, spec.experts, new)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # so that the unpatched model runs the subclass's forward
    return model


def to_lora(model, family):
    from peft import LoraConfig, get_peft_model

    path = EXPERT_PATHS.get(family, "mlp.experts")
    torch.manual_seed(1)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                        target_parameters=[f"{path}.gate_up_proj", f"{path}.down_proj"])
    return get_peft_model(model, config).eval()


def to_cpu_offload(model):
    """Every decoder layer holding an MoE block offloaded with ``accelerate.cpu_offload`` (weights in a CPU map,
    ``meta`` in the modules, loaded by the hooks around each forward). Per layer, because Llama-4's model forward
    moves the input ids to the embedding's device, which a whole-model offload makes ``meta`` (unpatched too)."""
    from accelerate import cpu_offload

    blocks = [b for b, _ in moe_blocks(model)]
    for layer in model.model.layers:
        if any(b is m for m in layer.modules() for b in blocks):
            cpu_offload(layer, execution_device=torch.device("cpu"))
    return model


def to_disk_offload(model, tmp_path):
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "m")
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(layers - 1)}, f"model.layers.{layers - 1}": "disk"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                  offload_folder=str(tmp_path / "off")).eval()
    last = [b for b, _ in moe_blocks(loaded)][-1]
    experts = last.feed_forward.experts if hasattr(last, "feed_forward") else last.experts
    assert experts.gate_up_proj.device.type == "meta"  # really offloaded
    return loaded


def build(family: str, storage: str, tmp_path, monkeypatch):
    model = FAMILIES[family]()
    if storage == "bf16":
        return model.to(torch.bfloat16)
    if storage == "fp8":
        return to_fp8(model, monkeypatch)
    if storage == "int8":
        return to_int8(model)
    if storage == "subclass":
        return to_subclass(model)
    if storage == "lora":
        return to_lora(model, family)
    if storage == "cpu_offload":
        return to_cpu_offload(model)
    if storage == "disk_offload":
        return to_disk_offload(model, tmp_path)
    return model


# -- running and recording ----------------------------------------------------------------------------------
def record_blocks(blocks) -> BlockRecorder:
    """Forward hooks on the MoE blocks: ``(block, args, kwargs, output)`` of every call while ``decode``."""
    return BlockRecorder([b for b, _ in blocks])


run = fam.teacher_forced  # prefill, then one teacher-forced decode step per token through the KV cache


class ReferenceRemap:
    """Router forward hooks on an *unpatched* model applying the same remap as a patched one would (torch
    ops, every call a decode step): the block's own forward then runs the model's own experts.
    ``rules``: ``{id(block): (weight rule, N, k)}`` as the patched model resolved them (:func:`rules_of`)."""

    def __init__(self, blocks, policy: str, params: dict, rules: dict):
        self.handles = []
        for block, spec in blocks:
            rule, num_experts, top_k = rules[id(block)]
            plan = make_plan(LynxConfig(policy=policy, routing_backend="torch", **params),
                             MoELayer(num_experts, top_k, "cpu"))
            router = spec.router_of(block)
            hook = self._dense_hook if spec.decode_forward is not None else self._hook
            self.handles.append(router.register_forward_hook(
                lambda mod, args, out, h=hook, s=spec, r=router, p=plan, w=rule, k=top_k: h(s, r, p, w, k, out)))

    @staticmethod
    def _hook(spec, router, plan, rule, top_k, output):
        logits, weights, idx = spec.unpack(output)
        new_w, new_idx, _ = remap(plan, rule, Step("decode"), spec.selection_scores(router, logits), logits, weights,
                                  idx)
        return spec.repack(output, logits, new_w, new_idx)

    @staticmethod
    def _dense_hook(spec, router, plan, rule, top_k, output):  # Llama-4: dense [T, N] scores, weight on the input
        scores, logits = output
        idx = torch.topk(logits, top_k, dim=1).indices
        weights = scores.gather(1, idx)
        new_w, new_idx, _ = remap(plan, rule, Step("decode"), spec.selection_scores(router, logits), logits, weights,
                                  idx)
        return torch.zeros_like(scores).scatter_(1, new_idx, new_w.to(scores.dtype)), logits

    def close(self):
        for h in self.handles:
            h.remove()


def rules_of(model) -> dict:
    """``{id(block): (weight rule, N, k)}`` of a patched model (what :class:`ReferenceRemap` reproduces)."""
    return {id(b.block): (b.rule, b.num_experts, b.top_k) for b in _state(model).blocks}


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class KernelSpy:
    """Counts calls of the sparse Triton expert kernel (the only code that reads expert weights itself)."""

    def __init__(self, monkeypatch):
        from lynx_hf.kernels.backend import routing_ops

        ops = routing_ops("triton")
        real = ops.sparse_moe
        self.calls = 0

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(ops, "sparse_moe", spy)


def _state(model):
    from lynx_hf.patcher import _find_state

    return _find_state(model)


# -- the matrix ---------------------------------------------------------------------------------------------
def _offloaded(block) -> bool:
    return any(p.device.type == "meta" for p in block.parameters())


def check_cells(model, monkeypatch, kernel_ok, reason_words=(), backends=BACKENDS, policies=POLICIES):
    """Run every backend x policy cell on ``model`` (see the module docstring). ``kernel_ok``: whether the sparse
    kernel may read a block's experts (a bool, or a predicate on the block); where it may not, the block's
    patch-time reason must contain one of ``reason_words``."""
    blocks = moe_blocks(model)
    assert blocks
    allowed = {id(b): kernel_ok(b) if callable(kernel_ok) else kernel_ok for b, _ in blocks}
    ids, mask = fam.prompts(BATCH, PROMPT, seed=3)
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, fam.VOCAB, (BATCH, 1), generator=g) for _ in range(STEPS)]
    ref = run(model, ids, mask, tokens)
    spy = KernelSpy(monkeypatch)
    remapped = 0.0
    for backend in backends:
        for policy, params in policies:
            before = spy.calls
            lynx_hf.patch(model, policy=policy, routing_backend=backend,
                          expert_path="triton" if backend == "triton" else "auto", **params)
            if policy != "none":
                for block in _state(model).blocks:
                    why = block.experts_path.kernel_reason  # lynx_hf.experts.install's ExpertsPath
                    if allowed[id(block.block)]:
                        assert why is None, (block.name, why)
                    else:  # refused for the kernel at patch time, with the reason named
                        assert any(word in (why or "").lower() for word in reason_words), (block.name, why)
            recorder = record_blocks(blocks)
            try:
                out = run(model, ids, mask, tokens, recorder)
            finally:
                recorder.close()
            summary = lynx_hf.stats(model).summary()
            rules = rules_of(model)  # after the run: a router offloaded at patch time is verified on its first call
            lynx_hf.unpatch(model)
            assert summary["decode_steps"] == STEPS
            assert torch.equal(out[0], ref[0]), f"{backend}/{policy}: prefill changed"
            kernel_calls = spy.calls - before
            if policy == "none":
                for step, (a, b) in enumerate(zip(out[1:], ref[1:])):
                    assert torch.equal(a, b), f"{backend}/none: decode step {step} changed"
                assert kernel_calls == 0
                continue
            remapped += summary["remapped_fraction"]
            assert (kernel_calls > 0) == (backend == "triton" and any(allowed.values())), (backend, policy, kernel_calls)
            assert len(recorder.calls) == STEPS * len(blocks)
            reference = ReferenceRemap(blocks, policy, params, rules)
            try:
                for block, args, kwargs, output in recorder.calls:
                    with torch.no_grad():
                        want = _first(block(*args, **kwargs))
                    got = _first(output)
                    tol = dict(rtol=2e-2, atol=2e-2) if got.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{backend}/{policy}: {m}")
            finally:
                reference.close()
    assert remapped > 0  # LYNX / OEA changed some assignments: the comparison covers remapped routing
    assert all(torch.equal(a, b) for a, b in zip(run(model, ids, mask, tokens), ref))  # unpatch is exact
    return ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_storage_matrix(family, storage, backend, tmp_path, monkeypatch, one_thread):
    model = build(family, storage, tmp_path, monkeypatch)
    if storage == "lora":  # the adapter really changes the experts' output (else LoRA could be silently ignored)
        ids, mask = fam.prompts(BATCH, PROMPT, seed=3)
        with_lora = run(model, ids, mask, [])[0]
        with model.disable_adapter():
            assert not torch.equal(run(model, ids, mask, [])[0], with_lora)
    if storage == "subclass":  # the subclass's forward really runs in the unpatched model
        ids, mask = fam.prompts(BATCH, PROMPT, seed=3)
        assert not torch.equal(run(model, ids, mask, [])[0], run(FAMILIES[family](), ids, mask, [])[0])
    kernel_ok = (lambda block: not _offloaded(block)) if storage == "disk_offload" else storage in KERNEL_STORAGES
    check_cells(model, monkeypatch, kernel_ok, REASONS.get(storage, ()), backends=(backend,))


# -- the generic adapter: works exactly, or UnsupportedModelError (CASES C22) -------------------------------------
def gpt_oss():
    """GPT-OSS tiny: hidden 32, intermediate 32 (2I != H), 8 experts, top 2; experts stored transposed
    ``[N, H, 2I]``, interleaved gate/up, biases, clamped SwiGLU; router with a bias."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(**{**fam.COMMON, "num_key_value_heads": 2}, intermediate_size=32, num_hidden_layers=2,
                       num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(20.0)
            if name.endswith(("router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0, 0.5)  # the biases must matter
    return model


@pytest.mark.parametrize("storage", ["fp32", "lora", "cpu_offload"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_C22_gpt_oss_transposed_experts_patch_and_remap_through_their_own_forward(backend, storage, monkeypatch,
                                                                                  one_thread):
    """Generic adapter on GPT-OSS: patched (rule verified on a probe of the right hidden size; offloaded: on the
    first decode call), its experts always run their own forward (transposed, biased, custom gate)."""
    model = gpt_oss()
    block = model.model.layers[0].mlp
    assert block.experts.is_transposed and block.experts.gate_up_proj.shape[-1] != block.experts.gate_up_proj.shape[-2]
    if storage == "cpu_offload":
        model = to_cpu_offload(model)
        assert block.router.weight.device.type == "meta"
    if storage == "lora":
        model = to_lora(model, "gpt_oss")
    words = {"cpu_offload": ("offload",), "lora": ("peft",)}.get(storage, ("layout", "bias", "interleaved", "gate"))
    check_cells(model, monkeypatch, kernel_ok=False, reason_words=words, backends=(backend,))
    lynx_hf.patch(model, policy="lynx")
    assert [b.spec.family for b in _state(model).blocks] == ["generic", "generic"]
    assert [type(b.experts).__name__ for b in _state(model).blocks] == [type(block.experts).__name__] * 2
    ids, mask = fam.prompts(BATCH, PROMPT)
    run(model, ids, mask, [ids[:, -1:]])  # offloaded: the rule is verified on the first decode call
    rule = _state(model).blocks[0].rule  # GPT-OSS: softmax over the chosen k logits = softmax_all renormalized
    assert (rule.kind, rule.renormalize, rule.scale) == ("softmax_all", True, 1.0)
    lynx_hf.unpatch(model)


class CustomMoeBlock(torch.nn.Module):
    """A block with the generic contract (children ``gate`` + ``experts``) around a Mixtral layer's experts."""

    def __init__(self, gate, experts):
        super().__init__()
        self.gate = gate
        self.experts = experts

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        out = self.gate(x, torch.ones(x.shape[0])) if isinstance(self.gate, NeedsMaskRouter) else self.gate(x)
        _, weights, idx = out[:3] if isinstance(out, tuple) else (None, None, None)
        return self.experts(x, idx, weights).reshape(shape)


class _Router(torch.nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.weight = gate.weight
        self.top_k, self.num_experts = gate.top_k, gate.num_experts

    def logits(self, x):
        return torch.nn.functional.linear(x, self.weight)


class NeedsMaskRouter(_Router):
    def forward(self, hidden_states, token_mask):  # needs an input besides the hidden states
        logits = self.logits(hidden_states) * token_mask[:, None]
        w, idx = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), idx


class CorrectionBiasRouter(_Router):
    """Selects by logits + a per-expert correction bias (DeepSeek-V3 style), weights from the logits."""

    def forward(self, hidden_states):
        logits = self.logits(hidden_states)
        bias = torch.linspace(0, 50, self.num_experts)
        idx = (logits + bias).topk(self.top_k, dim=-1).indices
        w = logits.softmax(-1).gather(1, idx)
        return logits, w / w.sum(-1, keepdim=True), idx


class TwoTupleRouter(_Router):
    def forward(self, hidden_states):  # Llama-4 style (dense scores, logits)
        logits = self.logits(hidden_states)
        return torch.zeros_like(logits).scatter(1, logits.topk(self.top_k).indices, 1.0), logits


class FourTupleRouter(_Router):
    def forward(self, hidden_states):  # an extra output the block might use besides (logits, weights, ids)
        logits = self.logits(hidden_states)
        w, idx = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, w, idx, logits.softmax(-1)


class TemperatureRouter(_Router):
    def forward(self, hidden_states):  # weights no family rule gives: softmax(logits / 3)
        logits = self.logits(hidden_states)
        w, idx = (logits / 3).softmax(-1).topk(self.top_k, dim=-1)
        return logits, w, idx


class FailingRouter(_Router):
    def forward(self, hidden_states):
        if hidden_states.shape[0] != 20:  # e.g. a router built for a fixed number of tokens
            raise RuntimeError("shape '[20, -1]' is invalid for input of size 512")
        raise AssertionError


@pytest.mark.parametrize("router_cls,words", [
    (CorrectionBiasRouter, ("not the top-",)),
    (TwoTupleRouter, ("does not return",)),
    (FourTupleRouter, ("does not return",)),
    (TemperatureRouter, ("no inferred weight rule",)),
    (FailingRouter, ("failed", "RuntimeError")),
])
def test_generic_adapter_refuses_unusual_routers_with_a_typed_error(router_cls, words):
    model = fam.build("mixtral")
    for layer in model.model.layers:
        layer.mlp = CustomMoeBlock(router_cls(layer.mlp.gate), layer.mlp.experts)
    with pytest.raises(lynx_hf.UnsupportedModelError) as info:
        lynx_hf.patch(model, policy="lynx")
    message = str(info.value)
    assert "CustomMoeBlock" in message and router_cls.__name__ in message
    assert all(word in message for word in words), message
    assert not lynx_hf.is_patched(model)
    assert all(not m._forward_hooks and "forward" not in vars(m) for m in model.modules())


def test_generic_adapter_probes_a_router_through_its_block():
    """A router that needs an input besides the hidden states is probed as its block calls it (the block supplies the
    mask), verified and patched; policy none stays bit-identical. Called alone it would fail (the reason is named)."""
    model = fam.build("mixtral")
    for layer in model.model.layers:
        layer.mlp = CustomMoeBlock(NeedsMaskRouter(layer.mlp.gate), layer.mlp.experts)
    ids, mask = fam.prompts(4, 5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with lynx_hf.patched(model, policy="none"):
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False), ref)
    from lynx_hf.patches.generic import _needs

    assert "token_mask" in _needs(model.model.layers[0].mlp.gate)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generic_adapter_custom_block_with_a_plain_router_works_exactly(backend, monkeypatch, one_thread):
    """The same custom block with a router of the standard contract is patched by the generic adapter, and
    its remap equals the same remap through the experts' own forward."""

    class PlainRouter(_Router):
        def forward(self, hidden_states):
            logits = self.logits(hidden_states)
            w, idx = logits.softmax(-1, dtype=torch.float32).topk(self.top_k, dim=-1)
            return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), idx

    model = fam.build("mixtral")
    for layer in model.model.layers:
        layer.mlp = CustomMoeBlock(PlainRouter(layer.mlp.gate), layer.mlp.experts)
    check_cells(model, monkeypatch, kernel_ok=True, backends=(backend,))


# -- DeepSeek group routing that cannot supply k experts (CASES C26) --------------------------------------------
def _deepseek(version, **kw):
    if version == "v3":
        return fam.build("deepseek_v3", **kw)
    return fam.build("deepseek_v2", **kw)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_C26_k_equal_to_n_with_group_limits_patches_for_every_policy_and_is_identity(version):
    """transformers' own DeepSeek-V3 test config: 8 experts, 2 groups, 1 allowed group, k = 8. The model fills
    its k slots with every expert; k == N leaves nothing to remap: every policy patches, bit-identical."""
    model = _deepseek(version, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=8)
    ids, mask = fam.prompts(8, 5)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_scores=True,
               return_dict_in_generate=True)
    ref = model.generate(**gen)
    for policy, params in POLICIES:
        with lynx_hf.patched(model, policy=policy, **params):
            out = model.generate(**gen)
            summary = lynx_hf.stats(model).summary()
        assert summary["decode_steps"] == 2 and summary["remapped_fraction"] == 0.0
        assert torch.equal(out.sequences, ref.sequences)
        assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_C26_allowed_groups_below_k_below_n_refuse_remapping_policies_only(version):
    """8 experts, 2 groups, 1 allowed group (4 experts) and k = 6: the model itself fills 2 slots with
    forbidden experts, which a remap inside the allowed groups cannot reproduce: LYNX / OEA are refused at patch
    time with a ModelConfigError naming the fields; policy none patches and is bit-identical."""
    model = _deepseek(version, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=6)
    ids, mask = fam.prompts(8, 5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    for policy, params in POLICIES[1:]:
        with pytest.raises(lynx_hf.ModelConfigError) as info:
            lynx_hf.patch(model, policy=policy, **params)
        for field in ("n_group", "topk_group", "n_routed_experts", "num_experts_per_tok", policy):
            assert field in str(info.value)
        assert not lynx_hf.is_patched(model)
    with lynx_hf.patched(model, policy="none"):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        with pytest.raises(lynx_hf.ModelConfigError, match="num_experts_per_tok"):  # reconfiguring: same refusal
            lynx_hf.patch(model, policy="lynx")
        assert lynx_hf.config_of(model).policy == "none"
    assert torch.equal(out, ref)
