"""Public API: config validation, typed errors, patch/unpatch exactness, save/load round-trip (C6)."""

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import lynx_hf
from helpers import families as fam


@pytest.mark.parametrize(
    "field,value",
    [("policy", "fast"), ("phase", "always"), ("routing_backend", "cuda"), ("expert_path", "cuda"), ("alpha", 0.0),
     ("alpha", -1.0), ("alpha", float("nan")), ("beta", -1), ("beta", 1.5), ("tau", -0.1), ("tau", float("inf")),
     ("oea_k0", 0), ("oea_k0", True), ("q_max", 0), ("telemetry", "yes"), ("mass_price", -1.0),
     ("mass_price", float("inf")), ("alpha", float("inf")), ("beta", 65), ("price_unit", "tokens"),
     ("xshare_budget", 0), ("xshare_fraction", 0.0), ("xshare_warmup", -1)],
)
def test_config_rejects_bad_field_naming_it(field, value):
    with pytest.raises(lynx_hf.LynxConfigError, match=field) as info:
        lynx_hf.LynxConfig(**{field: value})
    assert isinstance(info.value, ValueError) and isinstance(info.value, lynx_hf.LynxError)


def test_config_from_dict_rejects_unknown_field():
    with pytest.raises(lynx_hf.LynxConfigError, match="gamma"):
        lynx_hf.LynxConfig.from_dict({"policy": "lynx", "gamma": 1})
    model = fam.build("mixtral")
    with pytest.raises(lynx_hf.LynxConfigError, match="kk0"):  # keyword overrides are checked the same way
        lynx_hf.patch(model, kk0=2)
    assert not lynx_hf.is_patched(model)


def test_stats_restart_when_the_config_changes():
    """stats describe one config: swapping it (patch again, or leaving a nested patched()) restarts them."""
    model = fam.build("mixtral")
    ids, mask = fam.prompts(8, 5)
    lynx_hf.patch(model, policy="none")
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert lynx_hf.stats(model).summary()["decode_steps"] == 3
    lynx_hf.patch(model, policy="none")  # same config: nothing restarts
    assert lynx_hf.stats(model).summary()["decode_steps"] == 3
    lynx_hf.patch(model, policy="lynx", gate="always")  # every decode step counted (no cost gate on a tiny model)
    restarted = lynx_hf.stats(model).summary()
    assert restarted["policy"] == "lynx" and restarted["decode_steps"] == 0 and restarted["decode_tokens"] == 0
    assert restarted["unique_experts_before"] == restarted["unique_experts_after"] == 0.0
    assert all(layer["decode_steps"] == 0 and layer["decode_tokens"] == 0 for layer in restarted["per_layer"])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert lynx_hf.stats(model).summary()["decode_steps"] == 2
    lynx_hf.unpatch(model)


def test_patch_dense_model_raises_unsupported_listing_families():
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    with pytest.raises(lynx_hf.UnsupportedModelError) as info:
        lynx_hf.patch(model)
    for family in ("qwen2_moe", "mixtral", "deepseek_v2", "llama4"):
        assert family in str(info.value)
    assert not lynx_hf.is_patched(model)


def test_patch_unknown_moe_lookalike_names_its_class():
    class FancyMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 3)
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    model = nn.Sequential(FancyMoeBlock())
    with pytest.raises(lynx_hf.UnsupportedModelError, match="FancyMoeBlock"):
        lynx_hf.patch(model)


def test_patch_non_module_raises():
    with pytest.raises(lynx_hf.UnsupportedModelError):
        lynx_hf.patch("Qwen/Qwen1.5-MoE-A2.7B")


def test_stats_on_unpatched_model_raises():
    model = fam.build("mixtral")
    with pytest.raises(lynx_hf.NotPatchedError):
        lynx_hf.stats(model)
    with pytest.raises(lynx_hf.NotPatchedError):
        lynx_hf.reset_stats(model)


def _forward_ids(model):
    return {k: id(v) for k, v in vars(model).items()}


def test_patch_twice_only_swaps_config():
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, lynx_hf.LynxConfig(policy="lynx"))
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    hooks = len(model._forward_pre_hooks)
    lynx_hf.patch(model, lynx_hf.LynxConfig(policy="oea", oea_k0=2))
    assert lynx_hf.config_of(model).policy == "oea"
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards
    assert len(model._forward_pre_hooks) == hooks
    lynx_hf.unpatch(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_patched_context_manager_restores_on_error():
    model = fam.build("mixtral")
    with pytest.raises(RuntimeError, match="boom"):
        with lynx_hf.patched(model, policy="oea"):
            assert lynx_hf.is_patched(model)
            raise RuntimeError("boom")
    assert not lynx_hf.is_patched(model)
    lynx_hf.patch(model, policy="lynx")
    with lynx_hf.patched(model, policy="none"):
        assert lynx_hf.config_of(model).policy == "none"
    assert lynx_hf.config_of(model).policy == "lynx"  # previous config restored, still patched
    lynx_hf.unpatch(model)


def test_C43_repatch_applies_overrides_on_top_of_the_current_config(monkeypatch):
    """CASES C43: on a patched model, patch(m, **overrides) / patch(m, dict) / patched(m, ...) change only the
    fields given (before: they started from LynxConfig() defaults, so gate, telemetry and expert_cache_bytes
    silently reverted); a LynxConfig or a config file replaces the config whole."""
    monkeypatch.setenv("LYNX_HF_GATE", "auto")  # the default gate differs from the one the model runs with
    model = fam.build("mixtral")
    cfg = lynx_hf.LynxConfig(policy="oea", oea_k0=2, gate="always", telemetry="counts", expert_cache_bytes=4096,
                             tau=0.5)
    lynx_hf.patch(model, cfg)
    lynx_hf.patch(model, policy="lynx")
    assert lynx_hf.config_of(model) == dataclasses.replace(cfg, policy="lynx")
    lynx_hf.patch(model, {"policy": "none"}, telemetry=True)
    assert lynx_hf.config_of(model) == dataclasses.replace(cfg, policy="none", telemetry=True)
    lynx_hf.patch(model, cfg)
    with lynx_hf.patched(model, policy="xshare") as same:
        assert lynx_hf.config_of(same) == dataclasses.replace(cfg, policy="xshare")
        ids, mask = fam.prompts(4, 5)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert lynx_hf.stats(model).summary()["telemetry"] == "counts"
    assert lynx_hf.config_of(model) == cfg  # restored
    lynx_hf.patch(model)  # nothing given: nothing changes
    assert lynx_hf.config_of(model) == cfg
    lynx_hf.patch(model, lynx_hf.LynxConfig(policy="none"))  # a complete config replaces
    assert lynx_hf.config_of(model) == lynx_hf.LynxConfig(policy="none") and lynx_hf.config_of(model).gate == "auto"
    lynx_hf.unpatch(model)
    lynx_hf.patch(model, policy="none")  # unpatched first: overrides on the defaults
    assert lynx_hf.config_of(model) == lynx_hf.LynxConfig(policy="none")
    lynx_hf.unpatch(model)


def test_C43_a_partial_config_file_replaces_the_config_and_overrides_apply_on_top(monkeypatch, tmp_path):
    """CASES C43 with a file that names only some fields (issue 47): a config file is a complete configuration,
    its left-out fields the ``LynxConfig`` defaults, never the values the model ran with; keyword overrides then
    apply on top of the file. Re-patching with files written by ``LynxConfig.to_file`` (every field) cannot tell
    replacing from merging; this file can. The expected config is written out field by field."""
    monkeypatch.setenv("LYNX_HF_GATE", "auto")  # the default gate differs from the one the model runs with
    model = fam.build("mixtral")
    running = lynx_hf.LynxConfig(policy="oea", oea_k0=2, gate="always", telemetry="counts", expert_cache_bytes=4096,
                                 tau=0.5, q_max=2)
    lynx_hf.patch(model, running)
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"policy": "xshare", "xshare_budget": 5, "tau": 0.75}))
    lynx_hf.patch(model, path, telemetry=False)
    got = lynx_hf.config_of(model)
    # from the file
    assert (got.policy, got.xshare_budget, got.tau) == ("xshare", 5, 0.75)
    # the override
    assert got.telemetry is False
    # left out of both: the defaults (oea_k0 1, gate "auto" here, no expert cache, q_max 1), not the running config's
    assert (got.oea_k0, got.gate, got.expert_cache_bytes, got.q_max) == (1, "auto", 0, 1)
    assert got == lynx_hf.LynxConfig(policy="xshare", xshare_budget=5, tau=0.75, telemetry=False)
    with lynx_hf.patched(model, str(path)) as same:  # the context manager: the same replacement, then restored
        assert lynx_hf.config_of(same) == lynx_hf.LynxConfig(policy="xshare", xshare_budget=5, tau=0.75)
    assert lynx_hf.config_of(model) == got
    lynx_hf.unpatch(model)


def _intercepted(model):
    """Modules lynx_hf changed: a swapped forward (Llama-4) or a forward hook on the router (the others),
    reported by the block's name."""
    names = []
    for n, m in model.named_modules():
        routers = [c for c in (getattr(m, "gate", None), getattr(m, "router", None)) if isinstance(c, nn.Module)]
        if "forward" in vars(m) or any(c._forward_hooks for c in routers):
            names.append(n)
    return names


def test_only_moe_blocks_are_patched_dense_layers_untouched():
    model = fam.build("qwen2_moe")  # layer 1 is dense (mlp_only_layers)
    lynx_hf.patch(model)
    patched = _intercepted(model)
    assert patched == ["model.layers.0.mlp", "model.layers.2.mlp"]
    lynx_hf.unpatch(model)
    assert _intercepted(model) == []
    model = fam.build("deepseek_v2")  # first_k_dense_replace=1
    lynx_hf.patch(model)
    assert _intercepted(model) == ["model.layers.1.mlp", "model.layers.2.mlp"]
    lynx_hf.unpatch(model)


@pytest.mark.parametrize("family", fam.REPRESENTATIVE)
def test_C6_save_pretrained_round_trip_while_patched(family, tmp_path):
    """C6: patch -> save_pretrained -> from_pretrained round-trips keys and tensors exactly."""
    model = fam.build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lynx_hf.patch(model)
    model.save_pretrained(tmp_path)
    # the checkpoint names no experts implementation (lynx_hf's is a run-time switch): it loads the same whether
    # transformers reads the field from a checkpoint's config (<= 5.24) or ignores it (5.25)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not [key for key in saved if "experts_implementation" in key], saved
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    after = loaded.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert not lynx_hf.is_patched(loaded)
    lynx_hf.unpatch(model)


def test_two_models_do_not_share_state():
    a, b = fam.build("mixtral", seed=0), fam.build("mixtral", seed=1)
    lynx_hf.patch(a, policy="lynx", gate="always")  # every decode step counted (no cost gate on a tiny model)
    lynx_hf.patch(b, policy="none")
    ids, mask = fam.prompts(8, 5)
    a.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert lynx_hf.stats(a).summary()["decode_steps"] == 2
    assert lynx_hf.stats(b).summary()["decode_steps"] == 0
    assert lynx_hf.config_of(b).policy == "none"
    lynx_hf.unpatch(a), lynx_hf.unpatch(b)


def test_deepcopy_of_patched_model_is_independent():
    model = lynx_hf.patch(fam.build("mixtral"), gate="always")  # every decode step counted
    clone = copy.deepcopy(model)
    lynx_hf.unpatch(model)
    assert lynx_hf.is_patched(clone) and not lynx_hf.is_patched(model)
    ids, mask = fam.prompts(8, 5)
    clone.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert lynx_hf.stats(clone).summary()["decode_steps"] == 2


class _Boom(Exception):
    pass


def test_exception_mid_generate_then_unpatch_leaves_model_exactly_as_before():
    """Nothing lost: an exception raised inside a decode step (here from a logits processor at the
    third step) leaves no phase state behind, and unpatch restores outputs, modules, hooks, state_dict."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class RaiseAt(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                raise _Boom()
            return scores

    model = fam.build("deepseek_v2")
    keys = list(model.state_dict().keys())
    hooks = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    ids, mask = fam.prompts(4, 5)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    lynx_hf.patch(model, policy="lynx", gate="always")  # every decode step counted (no cost gate on a tiny model)
    with pytest.raises(_Boom):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                       logits_processor=LogitsProcessorList([RaiseAt()]))
    state = model.__dict__["_lynx_state"]
    assert state.tracker._var.get() is None and state.tracker.step.kind == "prefill"  # reset by the always-called hook
    assert lynx_hf.stats(model).summary()["decode_steps"] == 2
    lynx_hf.unpatch(model)
    assert list(model.state_dict().keys()) == keys
    assert {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()} == hooks
    assert all("forward" not in vars(m) and "_lynx_block" not in vars(m) and "_lynx_experts" not in vars(m) for m in model.modules())
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False), ref)


def test_same_inputs_same_outputs_run_after_run():
    model = lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx")
    ids, mask = fam.prompts(16, 6)
    runs = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           output_scores=True, return_dict_in_generate=True) for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].scores, runs[1].scores))
    lynx_hf.unpatch(model)


def test_installed_layout_does_not_shadow_kernels(tmp_path):
    """patches/ is installed inside lynx_hf and the kernels live in lynx_hf/kernels; no top-level ``kernels`` module is
    ours, from any working directory, the checkout's root included (HF's ``kernels`` distribution, which transformers
    5.25 requires, must never be shadowed: with a top-level kernels/ folder, ``python -m lab.<script>`` and pytest
    from the checkout imported ours as ``kernels`` and transformers failed on ``from kernels import ...``)."""
    import subprocess
    import sys
    from pathlib import Path

    import lynx_hf.kernels
    import lynx_hf.patches

    repo = Path(__file__).resolve().parents[2]
    assert Path(lynx_hf.kernels.__file__).parent == repo / "lynx_hf" / "kernels"
    assert Path(lynx_hf.patches.__file__).parent == repo / "patches"
    assert not (repo / "kernels").exists()
    probe = ("import importlib.util, sys; sys.path.insert(0, ''); s = importlib.util.find_spec('kernels'); "
             "print('none' if s is None else s.origin)")
    for cwd in (tmp_path, repo):
        out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True)
        origin = out.stdout.strip()  # HF's distribution (site-packages, maybe a venv inside the checkout) or none
        assert origin == "none" or "site-packages" in Path(origin).parts, (cwd, origin)
        assert not Path(origin).is_relative_to(repo / "lynx_hf"), (cwd, origin)
