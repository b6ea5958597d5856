"""LynxConfig's renamed, removed and per-policy fields: old names warn and map exactly to the new ones (every
entry point: the constructor, from_dict, from_options (CLI / lm-eval / vLLM), patch overrides, the CLI options),
removed fields raise naming their replacement, and each policy validates its own fields."""

import argparse
import json
import types
import warnings

import pytest

import lynx_hf
from helpers import families as fam
from lynx_hf import LynxConfig, LynxConfigError, cli, policies
from lynx_hf.config import REMOVED, RENAMED

# old spelling -> the exact config it means today
OLD_TO_NEW = [
    (dict(k0=3), dict(oea_k0=3)),
    (dict(backend="auto"), dict(routing_backend="auto", expert_path="auto")),
    (dict(backend="torch"), dict(routing_backend="torch", expert_path="auto")),
    (dict(backend="triton"), dict(routing_backend="triton", expert_path="triton")),
    (dict(policy="oea", k0=2, backend="torch"), dict(policy="oea", oea_k0=2, routing_backend="torch")),
]


@pytest.mark.parametrize("old,new", OLD_TO_NEW)
def test_old_names_warn_and_map_exactly(old, new):
    want = LynxConfig(**new)
    for make in (lambda: LynxConfig(**old), lambda: LynxConfig.from_dict(old),
                 lambda: LynxConfig.from_options({k: str(v) for k, v in old.items()})):
        with pytest.warns(FutureWarning) as record:
            got = make()
        assert got == want
        names = " ".join(str(w.message) for w in record)
        assert all(RENAMED[k].split()[0] in names for k in old if k in RENAMED)  # the new name is named


def test_old_names_through_patch_overrides_and_reading():
    model = fam.build("mixtral")
    with pytest.warns(FutureWarning, match="oea_k0"):
        lynx_hf.patch(model, policy="oea", k0=2)
    assert lynx_hf.config_of(model) == LynxConfig(policy="oea", oea_k0=2)
    with pytest.warns(FutureWarning, match="routing_backend"):
        lynx_hf.patch(model, LynxConfig(oea_k0=3), backend="torch")  # an override wins over the config's value
    assert lynx_hf.config_of(model) == LynxConfig(oea_k0=3, routing_backend="torch")
    lynx_hf.unpatch(model)
    cfg = LynxConfig(oea_k0=4, routing_backend="torch")
    with pytest.warns(FutureWarning, match="oea_k0"):
        assert cfg.k0 == 4
    with pytest.warns(FutureWarning, match="routing_backend"):
        assert cfg.backend == "torch"
    assert "k0" not in cfg.to_dict() and "backend" not in cfg.to_dict()


# an old name and a field it now sets, given in one set of options: refused whatever the values (equal ones too)
PAIRS = [dict(k0=2, oea_k0=3), dict(k0=2, oea_k0=2), dict(backend="torch", routing_backend="torch"),
         dict(backend="torch", expert_path="model"), dict(backend="triton", routing_backend="torch")]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(f"{k}={v}" for k, v in p.items()))
def test_C40_old_and_new_name_together_are_refused_on_every_entry_point(pair, tmp_path, capsys):
    """CASES C40: one rule on every entry point (lynx_hf.config.check_pairs): LynxConfigError naming both names;
    before, from_dict / from_file / patch(**kw) / patch("file.json") / the CLI let the deprecated value win."""
    old = next(k for k in pair if k in RENAMED)
    new = next(k for k in pair if k not in RENAMED)
    path = tmp_path / "lynx_config.json"
    path.write_text(json.dumps(pair))
    model = fam.build("mixtral")
    makes = {"LynxConfig(...)": lambda: LynxConfig(**pair), "from_dict": lambda: LynxConfig.from_dict(pair),
             "from_options": lambda: LynxConfig.from_options({k: str(v) for k, v in pair.items()}),
             "from_file": lambda: LynxConfig.from_file(path), "patch(**kw)": lambda: lynx_hf.patch(model, **pair),
             "patch(dict)": lambda: lynx_hf.patch(model, dict(pair)), "patch(file)": lambda: lynx_hf.patch(model, path),
             "patched(**kw)": lambda: lynx_hf.patched(model, **pair).__enter__()}
    for where, make in makes.items():
        with pytest.raises(LynxConfigError, match=rf"{old} \(deprecated\) and {new} given together") as err, \
                warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # refused before any old name is mapped
            make()
        assert new in str(err.value), where
        assert not lynx_hf.is_patched(model), where
    # the CLI: exit status 2, one line naming both (before: status 0 with the deprecated value)
    argv = ["generate", "--batch-size", "1", "--max-new-tokens", "1"]
    argv += [a for k, v in pair.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{old} (deprecated) and {new} given together" in err
    assert cli.main(["generate", "--config", str(path), "--batch-size", "1"]) == 2
    assert "given together" in capsys.readouterr().err


def test_old_name_in_one_set_of_options_and_the_new_in_another_is_an_override():
    """Different levels are not a pair: an override wins over the config it overrides (under either name)."""
    model = fam.build("mixtral")
    with pytest.warns(FutureWarning, match="oea_k0"):
        lynx_hf.patch(model, dict(oea_k0=3), k0=2)
    assert lynx_hf.config_of(model).oea_k0 == 2
    with pytest.warns(FutureWarning, match="oea_k0"):
        lynx_hf.patch(model, LynxConfig(policy="oea", oea_k0=3), k0=1)
    assert lynx_hf.config_of(model).oea_k0 == 1
    lynx_hf.unpatch(model)
    with pytest.warns(FutureWarning, match="oea_k0"):
        assert LynxConfig.from_options({"k0": "4"}, base=LynxConfig(oea_k0=2)).oea_k0 == 4


def test_cli_deprecated_aliases():
    parser = argparse.ArgumentParser()
    cli._policy_args(parser)
    args = parser.parse_args(["--k0", "3", "--backend", "triton", "--tau", "2"])
    with pytest.warns(FutureWarning):
        cfg = cli._config(args)
    assert cfg == LynxConfig(oea_k0=3, routing_backend="triton", expert_path="triton", tau=2.0)
    args = parser.parse_args(["--oea-k0", "3", "--routing-backend", "torch", "--expert-path", "model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the new options never warn
        assert cli._config(args) == LynxConfig(oea_k0=3, routing_backend="torch", expert_path="model")


@pytest.mark.parametrize("value", [0.0, 0.25, None])
def test_mass_floor_is_removed_naming_mass_price(value):
    for make in (lambda: LynxConfig(mass_floor=value), lambda: LynxConfig.from_dict({"mass_floor": value}),
                 lambda: LynxConfig.from_options({"mass_floor": str(value)}),
                 lambda: lynx_hf.patch(fam.build("mixtral"), mass_floor=value)):
        with pytest.raises(LynxConfigError, match="mass_floor was removed: use mass_price"):
            make()
    assert set(REMOVED) == {"mass_floor"}
    assert not hasattr(LynxConfig(), "mass_floor")


def test_phase_never_is_removed_naming_policy_none_and_unpatch():
    for make in (lambda: LynxConfig(phase="never"), lambda: LynxConfig.from_options({"phase": "never"})):
        with pytest.raises(LynxConfigError, match=r'policy="none".*lynx_hf.unpatch'):
            make()
    assert LynxConfig(phase="decode").phase == "decode"


# -- each policy validates its own fields -----------------------------------------------------------------
BAD = {"lynx": [("alpha", 0.0), ("beta", 65), ("tau", -1.0), ("mass_price", float("nan")), ("price_unit", "x")],
       "oea": [("oea_k0", 0)],
       "xshare": [("xshare_budget", 0), ("xshare_fraction", 1.5), ("xshare_warmup", -1)]}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_policy_validates_its_own_fields(name):
    policy = policies.get(name)
    good = LynxConfig().to_dict()
    policy.validate(types.SimpleNamespace(**good))
    assert {field for field, _ in BAD[name]} == set(policy.fields)  # every field it declares is checked
    for field, value in BAD[name]:
        with pytest.raises(LynxConfigError, match=field):
            policy.validate(types.SimpleNamespace(**{**good, field: value}))
        for other in set(BAD) - {name}:  # another policy does not look at it
            policies.get(other).validate(types.SimpleNamespace(**{**good, field: value}))
        with pytest.raises(LynxConfigError, match=field):  # a config is valid as a whole, whatever its policy
            LynxConfig(policy="none", **{field: value})
    assert policies.get("none").fields == ()
