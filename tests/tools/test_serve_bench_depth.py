"""``lab.serve_bench --full-layers`` (issue 52 item 4): the configuration each vLLM worker gets (the spec file's
``lynx``, read by the plugin's own parser) carries the full model's routing-mass price, so the plugin's plan for a
layer of the 2-layer cut runs it; fixture A runs whole. Runs in the main environment: the driver is stepped with vLLM
stubbed and the engines replaced (lab.serve_bench's other pure parts: tests/vllm_plugin/test_serve_bench.py)."""

import json
import sys
import types

import pytest

from lab import serve_bench as sb
from lynx_hf.core import MoELayer, make_plan
from lynx_hf.vllm import config as plugin_config


def _plan_price(lynx_options, moe_layers, n=64, k=8):
    """The price the plugin's plan runs on a layer of an engine of ``moe_layers`` MoE layers (``plans.plan_for``:
    ``moe_layers = len(target_layers())``), from the options as a worker reads them (JSON, ``additional_config``)."""
    parsed = plugin_config.resolve({"lynx": json.loads(json.dumps(lynx_options))})
    return make_plan(parsed.lynx, MoELayer(n, k, "cpu", moe_layers=moe_layers)).params.mass_price


def test_engine_lynx_by_hand():
    # the real-shape model, a 2-layer cut of Qwen2-57B-A14B: 7/64 x 4 / 28 = 1/64 (as given on 2 layers: 7/64)
    lynx, price = sb.engine_lynx("lynx", "qwen2-57b-2l", "real", 2)
    assert lynx == {"policy": "lynx", "mass_price": 1 / 64, "price_ref_layers": None}
    assert price == {"mass_price": 1 / 64, "full_layers": 28, "cut_layers": 2}
    assert _plan_price(lynx, 2) == 1 / 64 and _plan_price(sb.VARIANTS["lynx"], 2) == 0.109375
    assert sb.engine_lynx("lynx", "qwen2-57b-2l", 48, 1)[0]["mass_price"] == pytest.approx(7 / 64 * 4 / 48)
    assert sb.engine_lynx("lynx", "qwen2-57b-2l", "cut", 2) == (sb.VARIANTS["lynx"],
                                                                 {"mass_price": 0.109375, "full_layers": "cut",
                                                                  "cut_layers": 2})
    assert sb.engine_lynx("oea", "qwen2-57b-2l", "real", 2)[0] == sb.VARIANTS["oea"]
    assert sb.engine_lynx("unpatched", "qwen2-57b-2l", "real", 2)[0] is None
    # fixture A runs whole: its own 4 MoE layers, the price as given
    assert sb.engine_lynx("lynx", "fixture-a", "real", 2) == (sb.VARIANTS["lynx"],
                                                              {"mass_price": 0.109375, "full_layers": 4,
                                                               "cut_layers": 4})
    assert sb.parse_args([]).full_layers == "real" and sb.parse_args(["--full-layers", "26"]).full_layers == 26


def test_the_worker_specs_carry_the_full_models_price(monkeypatch, tmp_path):
    """The driver end to end (engines replaced, vLLM stubbed): every spec a LYNX worker of the real-shape model is
    started with makes the plugin plan 1/64 on each layer of the 2-layer cut; fixture A's 7/64 at its 4 layers; the
    table says which price each row ran."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="stub"))
    monkeypatch.setattr(sb, "real_shape_model", lambda args: tmp_path / "model")
    specs = []

    def run_engine(spec, work, env, timeout):
        specs.append(json.loads(json.dumps(spec)))  # what the worker reads back from its spec file
        on = spec["lynx"] is not None  # the unpatched engine has no plugin telemetry
        cell = {"tpot_ms": 10.0, "decode_tok_s": 100.0, "total_tok_s": 50.0, "unique_before": 20.0 if on else None,
                "unique_after": 10.0 if on else None, "decode_steps_seen": 5 if on else None}
        return {"variant": spec["variant"], "cells": {"4": cell}}

    monkeypatch.setattr(sb, "run_engine", run_engine)
    out = tmp_path / "sb"
    assert sb.main(["--models", "fixture-a", "qwen2-57b-2l", "--variants", "lynx", "oea", "--concurrency", "4",
                    "--rounds", "1", "--out", str(out)]) == 0
    lynx = {s["model"]: s["lynx"] for s in specs if s["variant"] == "lynx"}
    assert _plan_price(lynx["qwen2-57b-2l"], 2) == 1 / 64
    assert _plan_price(lynx["fixture-a"], 4, n=32, k=4) == 0.109375
    rows = {(r["model"], r["variant"]): r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert (rows[("qwen2-57b-2l", "lynx")]["mass_price"], rows[("qwen2-57b-2l", "lynx")]["full_layers"]) == (1 / 64, 28)
    md = out.with_suffix(".md").read_text()
    assert "| price 0.015625 (at 28 MoE layers) |" in md and "| price 0.109375 (at 4 MoE layers) |" in md


def test_xshare_budget_follows_the_price_or_the_flag():
    """XShare's budget is matched to LYNX's unique experts at 16 requests at the price the run gives (41 at the full
    model's 1/64, 15 at the cut's 7/64: the measured 40.55 / 14.93 rounded up), or the one ``--xshare-budget`` names;
    the SLO script's transformers engine takes the same table (``lynx_hf.eval.slo.variants``)."""
    from lynx_hf.eval import slo

    assert sb.engine_lynx("xshare", "qwen2-57b-2l", "real", 2)[0]["xshare_budget"] == 41
    assert sb.engine_lynx("xshare", "qwen2-57b-2l", "cut", 2)[0]["xshare_budget"] == 15
    assert sb.engine_lynx("xshare", "qwen2-57b-2l", "real", 2, 30)[0]["xshare_budget"] == 30
    assert sb.parse_args(["--xshare-budget", "30"]).xshare_budget == 30 and sb.parse_args([]).xshare_budget is None
    assert slo.variants()["xshare"]["xshare_budget"] == 41 and slo.variants(None, "cut")["xshare"]["xshare_budget"] == 15
    assert slo.variants(7)["xshare"] == {"policy": "xshare", "xshare_budget": 7, "xshare_warmup": 1}
    assert slo.variants(7)["lynx"] == slo.VARIANTS["lynx"] and slo.VARIANTS["xshare"]["xshare_budget"] == 41
    with pytest.raises(ValueError, match="xshare_budget"):
        slo.variants(0)
    assert slo.parse_args(["transformers", "--xshare-budget", "12"]).xshare_budget == 12


def test_interleaved_schedule_alternates_the_variants_cell_by_cell():
    """``--interleave``: per concurrency every round, each round every variant once, the order rotated by the round."""
    assert sb.interleaved_schedule([4, 16], 2, ["unpatched", "lynx"]) == [
        (4, 0, "unpatched"), (4, 0, "lynx"), (4, 1, "lynx"), (4, 1, "unpatched"),
        (16, 0, "unpatched"), (16, 0, "lynx"), (16, 1, "lynx"), (16, 1, "unpatched")]
    assert len(sb.interleaved_schedule([1, 2, 4], 3, ["unpatched", "lynx", "oea"])) == 27
    assert sb.parse_args(["--interleave"]).interleave and not sb.parse_args([]).interleave


def _specs():
    return {v: {"model": "qwen2-57b-2l", "variant": v, "lynx": None if v == "unpatched" else {"policy": v}}
            for v in ("unpatched", "lynx")}


def test_persistent_engines_answer_cell_by_cell_and_pair_like_the_round_protocol(tmp_path):
    """The driver's side of ``--serve`` workers, against a stand-in worker of the same line protocol
    (tests/helpers/fake_serve_engine.py): both engines stay alive (the second engine's later cells count every
    request it served before), vLLM's log lines go to each engine's log file, and the results pair per round in
    :func:`lab.serve_bench.aggregate` exactly as the one-engine-per-round protocol's do (hand-worked: TPOT 60 + C vs
    100 + C)."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(sb.ROOT), os.environ.get("PYTHONPATH")])))
    engine = lambda spec, work, env: sb.Engine(spec, work, env, worker=("tests.helpers.fake_serve_engine",))  # noqa: E731
    results = sb.run_interleaved(_specs(), [4, 16], 2, tmp_path, env, engine=engine)
    assert sorted((r["variant"], r["round"]) for r in results) == [("lynx", 0), ("lynx", 1), ("unpatched", 0),
                                                                    ("unpatched", 1)]
    by = {(r["variant"], r["round"]): r for r in results}
    # one process per variant served every cell in schedule order: round 1 of C 16 is its 4th cell (4 + 4 + 16 + 16)
    assert [by[("lynx", r)]["cells"][c]["served_so_far"] for c in ("4", "16") for r in (0, 1)] == [4, 8, 24, 40]
    assert by[("lynx", 0)]["engine_start_s"] == 1.5
    log = (tmp_path / "qwen2-57b-2l_lynx.log").read_text()
    assert "vllm-like log line" in log and "stepping 16 requests" in log and "on stderr" in log
    for r in results:
        r["model"] = "m"
    rows = {(x["concurrency"], x["variant"]): x for x in sb.aggregate(results, ["unpatched", "lynx"])}
    assert rows[(4, "lynx")]["tpot_ratio"] == 64 / 104 and rows[(16, "lynx")]["tpot_ratio"] == 76 / 116
    assert rows[(16, "lynx")]["rounds"] == 2 and rows[(16, "lynx")]["unique_after"] == 10.0


def test_a_dying_persistent_engine_raises_with_its_log_and_the_others_are_closed(tmp_path):
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(sb.ROOT), os.environ.get("PYTHONPATH")])))
    made = []

    def engine(spec, work, env):
        made.append(sb.Engine(spec, work, env, worker=("tests.helpers.fake_serve_engine",)))
        return made[-1]

    with pytest.raises(RuntimeError, match=r"(?s)stopped without answering \(exit 3\).*the engine died"):
        sb.run_interleaved(_specs(), [-1], 1, tmp_path, env, engine=engine)
    assert len(made) == 2 and all(e.proc.poll() is not None for e in made)   # every worker is gone


def test_same_engine_switches_one_engine_per_cell_and_pairs_like_two(tmp_path):
    """``--same-engine``: one worker for both variants (memory of one engine), switched before every cell to the
    variant's configuration (the unpatched side: LYNX at price 0, which the gate bypasses); the results pair per
    round like two engines'."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(sb.ROOT), os.environ.get("PYTHONPATH")])))
    made = []

    def engine(spec, work, env):
        made.append(sb.Engine(spec, work, env, worker=("tests.helpers.fake_serve_engine",)))
        return made[-1]

    results = sb.run_interleaved(_specs(), [4, 16], 2, tmp_path, env, engine=engine, same_engine=True)
    assert len(made) == 1 and made[0].name == "qwen2-57b-2l_lynx" and made[0].proc.poll() is not None
    by = {(r["variant"], r["round"]): r for r in results}
    configured = {(v, by[(v, r)]["cells"][c]["price"]) for v in ("unpatched", "lynx") for r in (0, 1) for c in ("4", "16")}
    assert configured == {("unpatched", 0.0), ("lynx", None)}   # the baseline: sb.SAME_ENGINE_BASELINE's price 0
    # one process served every cell in schedule order: C 4 (4, 4, 4, 4), then C 16 round 0 unpatched, lynx ...
    assert [by[(v, 0)]["cells"]["16"]["served_so_far"] for v in ("unpatched", "lynx")] == [32, 48]
    for r in results:
        r["model"] = "m"
    rows = {(x["concurrency"], x["variant"]): x for x in sb.aggregate(results, ["unpatched", "lynx"])}
    assert rows[(16, "lynx")]["tpot_ratio"] == 76 / 116 and rows[(4, "unpatched")]["unique_before"] is None
    args = sb.parse_args(["--same-engine"])
    assert args.same_engine and args.interleave   # implies --interleave
    with pytest.raises(ValueError, match="patched variant"):
        sb.run_interleaved({"unpatched": _specs()["unpatched"]}, [4], 1, tmp_path, env, engine=engine, same_engine=True)
