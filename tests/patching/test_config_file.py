"""One config file everywhere: LynxConfig.to_file / from_file, lynx_hf.patch(model, PATH), the vLLM plugin's
config_file (parsed at unit level: vLLM does not run in this venv). ``lynx-hf generate --config`` and lm-eval's
``lynx_config=`` are exercised on a sweep's output in tests/tools/test_sweep_cli.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import lynx_hf
from lynx_hf import LynxConfig, LynxConfigError
from lynx_hf.vllm import config as vllm_config

NON_DEFAULT = dict(policy="oea", oea_k0=2, mass_price=None, price_unit="token", tau=0.5, alpha=1.5, beta=3,
                   xshare_budget=5, xshare_fraction=0.25, xshare_warmup=0, q_max=2, verify=False,
                   routing_backend="torch", expert_path="model", telemetry=False)


def _write(path, values):
    path.write_text(json.dumps(values))
    return path


def test_round_trip_writes_every_field_and_ignores_the_note(tmp_path):
    cfg = LynxConfig(**NON_DEFAULT)
    path = cfg.to_file(tmp_path / "c.json", about={"made_by": "a test", "within_budget": False})
    data = json.loads(path.read_text())
    assert set(data) == set(cfg.to_dict()) | {"_about"}  # every field, so a changed default changes nothing
    assert LynxConfig.from_file(path) == cfg
    assert LynxConfig.from_file(str(path)) == cfg


def test_left_out_fields_take_the_base_and_strings_are_parsed(tmp_path):
    path = _write(tmp_path / "c.json", {"policy": "oea", "oea_k0": "3", "mass_price": "None"})
    cfg = LynxConfig.from_file(path)
    assert (cfg.policy, cfg.oea_k0, cfg.mass_price, cfg.tau) == ("oea", 3, None, LynxConfig().tau)
    base = LynxConfig(tau=2.0)
    assert LynxConfig.from_file(path, base=base).tau == 2.0


@pytest.mark.parametrize("values,message", [
    ({"policy": "lynx", "speed": 2}, "unknown LynxConfig field(s) ['speed']"),
    ({"tau": -1}, "LynxConfig.tau"),
    ({"oea_k0": "two"}, "LynxConfig.oea_k0: cannot parse 'two'"),
    ({"policy": "fast"}, "policy"),
    ({"mass_floor": 0.5}, "unknown LynxConfig field(s) ['mass_floor']"),
    ({"phase": "never"}, 'phase="never" was removed'),
    ([1, 2], "expected a JSON object of LynxConfig fields"),
])
def test_bad_fields_raise_config_error_naming_field_and_file(tmp_path, values, message):
    path = _write(tmp_path / "bad.json", values)
    with pytest.raises(LynxConfigError) as info:
        LynxConfig.from_file(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_not_json_and_missing_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{policy: lynx")
    with pytest.raises(LynxConfigError, match="not a JSON file"):
        LynxConfig.from_file(path)
    with pytest.raises(FileNotFoundError, match="no LynxConfig file"):
        LynxConfig.from_file(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def tiny_mixtral():
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(cfg).eval()


def test_patch_accepts_a_config_file_path_with_overrides(tiny_mixtral, tmp_path):
    path = LynxConfig(policy="oea", oea_k0=1, telemetry=False).to_file(tmp_path / "lynx_config.json")
    try:
        lynx_hf.patch(tiny_mixtral, str(path))
        assert lynx_hf.config_of(tiny_mixtral) == LynxConfig(policy="oea", oea_k0=1, telemetry=False)
        lynx_hf.patch(tiny_mixtral, path, telemetry=True)  # a PathLike; keyword overrides win over the file
        assert lynx_hf.config_of(tiny_mixtral) == LynxConfig(policy="oea", oea_k0=1, telemetry=True)
        with lynx_hf.patched(tiny_mixtral, str(path)):
            assert lynx_hf.config_of(tiny_mixtral).telemetry is False
    finally:
        lynx_hf.unpatch(tiny_mixtral)


def test_patch_with_a_bad_or_missing_file_changes_nothing(tiny_mixtral, tmp_path):
    with pytest.raises(FileNotFoundError):
        lynx_hf.patch(tiny_mixtral, tmp_path / "missing.json")
    with pytest.raises(LynxConfigError, match="unknown LynxConfig field"):
        lynx_hf.patch(tiny_mixtral, str(_write(tmp_path / "bad.json", {"policy": "lynx", "nope": 1})))
    assert not lynx_hf.is_patched(tiny_mixtral)


def test_vllm_plugin_reads_a_config_file(tmp_path):
    path = LynxConfig(policy="oea", oea_k0=2).to_file(tmp_path / "lynx_config.json", about="from a sweep")
    cfg = vllm_config.parse({"config_file": str(path), "oea_k0": 3, "stats_path": "/tmp/s.json"})  # keys override the file
    assert cfg.lynx == LynxConfig(policy="oea", oea_k0=3) and cfg.stats_path == "/tmp/s.json"
    assert vllm_config.resolve({"lynx": {"config_file": str(path)}}).lynx == LynxConfig(policy="oea", oea_k0=2)
    # the environment variable: a JSON object with config_file, or the file's path itself
    for value in (json.dumps({"config_file": str(path)}), str(path), f"  {path} "):
        assert vllm_config.resolve(None, {"LYNX_VLLM_CONFIG": value}).lynx == LynxConfig(policy="oea", oea_k0=2)
    assert "config_file" not in vllm_config.resolve(None, {"LYNX_VLLM_CONFIG": str(path)}).to_dict()


def test_vllm_plugin_config_file_errors_name_the_source(tmp_path):
    bad = _write(tmp_path / "bad.json", {"policy": "oea", "oea_k0": 2, "speed": 1})
    cases = [({"config_file": str(tmp_path / "missing.json")}, "config_file: no LynxConfig file"),
             ({"config_file": 3}, "config_file must be a string path"),
             ({"config_file": str(bad)}, "unknown LynxConfig field(s) ['speed']"),
             ("{not json", "not valid JSON"), ("[1]", "must be a JSON object")]
    for value, message in cases:
        with pytest.raises(LynxConfigError) as info:
            vllm_config.parse(value, source='additional_config["lynx"]')
        assert message in str(info.value) and 'additional_config["lynx"]' in str(info.value), str(info.value)
