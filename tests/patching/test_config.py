"""LynxConfig's field names on every entry point (names renamed before any release, ``k0`` / ``backend`` /
``mass_floor``, are unknown fields like any other, CASES C40), ``phase="never"`` refused naming its replacement, and
each policy validates its own fields."""

import argparse
import json
import types

import pytest

import lynx_hf
from helpers import families as fam
from lynx_hf import LynxConfig, LynxConfigError, cli, policies
from lynx_hf import config as config_module

#: names that existed only before the first release; no compatibility code maps them (issue 46 deleted it)
OLD_NAMES = [dict(k0=2), dict(backend="torch"), dict(mass_floor=0.25), dict(k0=2, oea_k0=2),
             dict(backend="torch", routing_backend="torch")]


@pytest.mark.parametrize("old", OLD_NAMES, ids=lambda p: "+".join(f"{k}={v}" for k, v in p.items()))
def test_C40_names_renamed_before_any_release_are_unknown_fields_on_every_entry_point(old, tmp_path, capsys):
    """CASES C40: one rule on every entry point: a name that is no field is refused with LynxConfigError listing the
    fields (``LynxConfig(...)`` itself: Python's TypeError), never mapped, never silently dropped; the model is left
    unpatched. Before issue 46, ``k0`` / ``backend`` were mapped with a FutureWarning and ``mass_floor`` named its
    replacement."""
    name = next(k for k in old if k in ("k0", "backend", "mass_floor"))
    path = tmp_path / "lynx_config.json"
    path.write_text(json.dumps(old))
    model = fam.build("mixtral")
    makes = {"from_dict": lambda: LynxConfig.from_dict(old),
             "from_options": lambda: LynxConfig.from_options({k: str(v) for k, v in old.items()}),
             "from_file": lambda: LynxConfig.from_file(path), "patch(**kw)": lambda: lynx_hf.patch(model, **old),
             "patch(dict)": lambda: lynx_hf.patch(model, dict(old)), "patch(file)": lambda: lynx_hf.patch(model, path),
             "patched(**kw)": lambda: lynx_hf.patched(model, **old).__enter__()}
    for where, make in makes.items():
        with pytest.raises(LynxConfigError, match=rf"unknown LynxConfig field\(s\) \['{name}'\]") as err:
            make()
        assert "oea_k0" in str(err.value), where  # the known fields are listed
        assert not lynx_hf.is_patched(model), where
    with pytest.raises(TypeError, match=name):
        LynxConfig(**old)
    assert not hasattr(LynxConfig(), name)
    for gone in ("RENAMED", "RENAMED_FIELDS", "REMOVED", "check_pairs"):
        assert not hasattr(config_module, gone), gone
    # the CLI: no such option (argparse: exit status 2 naming it)
    argv = ["generate", "--batch-size", "1", "--max-new-tokens", "1"]
    argv += [a for k, v in old.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and f"--{name.replace('_', '-')}" in capsys.readouterr().err
    assert cli.main(["generate", "--config", str(path), "--batch-size", "1"]) == 2
    assert f"unknown LynxConfig field(s) ['{name}']" in capsys.readouterr().err
    # `lynx-hf eval` (the harness): no such option either
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", f"--{name.replace('_', '-')}", "1"])
    assert exit_.value.code == 2
    capsys.readouterr()
    # lm-eval's `lynx` model: LynxConfigError before the model is loaded (a path that does not exist shows it:
    # loading would raise OSError); HFLM's own `backend` keeps HFLM's values
    lynx_lm = pytest.importorskip("lynx_hf.lm_eval")
    options = {k: str(v) for k, v in old.items()}
    with pytest.raises(LynxConfigError, match=name if name != "backend" else "routing_backend"):
        lynx_lm.LynxLM(pretrained=str(tmp_path / "no-model"), batch_size=1, **options)


def test_cli_options_are_the_fields():
    parser = argparse.ArgumentParser()
    cli._policy_args(parser)
    args = parser.parse_args(["--oea-k0", "3", "--routing-backend", "torch", "--expert-path", "model", "--tau", "2"])
    assert cli._config(args) == LynxConfig(oea_k0=3, routing_backend="torch", expert_path="model", tau=2.0)


def test_phase_never_is_removed_naming_policy_none_and_unpatch():
    for make in (lambda: LynxConfig(phase="never"), lambda: LynxConfig.from_options({"phase": "never"})):
        with pytest.raises(LynxConfigError, match=r'policy="none".*lynx_hf.unpatch'):
            make()
    assert LynxConfig(phase="decode").phase == "decode"


# -- each policy validates its own fields -----------------------------------------------------------------
BAD = {"lynx": [("alpha", 0.0), ("beta", 65), ("tau", -1.0), ("mass_price", float("nan")), ("price_unit", "x"),
                ("price_ref_layers", 0)],
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


def test_oea_k0_at_or_above_k_warns_that_oea_changes_nothing(recwarn):
    """``oea_k0`` is clipped to each layer's k at run time (docs/policies.md): at or above every k OEA is the model's
    own routing, so patch says so (a typo like oea_k0=99 is not a silent no-op); below k no such warning. With
    telemetry off, print(stats) says nothing was recorded rather than "0 decode steps"."""
    model = fam.build("mixtral")
    k = model.config.num_experts_per_tok
    with pytest.warns(UserWarning, match=f"oea_k0={k} is at least every MoE layer's top-k \\({k}\\).*changes nothing"):
        lynx_hf.patch(model, policy="oea", oea_k0=k, gate="always")   # the warning is the config's, not the gate's
    lynx_hf.unpatch(model)
    lynx_hf.patch(model, policy="oea", oea_k0=k - 1, gate="always", telemetry=False)
    assert not [w for w in recwarn if "oea_k0" in str(w.message)]
    report = str(lynx_hf.stats(model))
    assert "telemetry off" in report and "nothing recorded" in report and "0 decode steps" not in report
    lynx_hf.unpatch(model)
