"""The SLO table (python -m lynx_hf.eval.slo): the reachable throughput under an SLO, worked by hand on small curves,
and a smoke run of the transformers continuous-batching engine on a 1/16-scaled model (no timing asserted)."""

import json
import os
import subprocess
import sys

import pytest

from lynx_hf.eval import slo


def _p(variant, c, tpot, tok, engine="e", model="m"):
    return {"engine": engine, "model": model, "variant": variant, "concurrency": c, "tpot_ms": tpot, "tok_s": tok,
            "unique_before": None, "unique_after": None}


CURVES = [_p("unpatched", 1, 10.0, 100.0), _p("unpatched", 2, 15.0, 133.0), _p("unpatched", 4, 25.0, 160.0),
          _p("lynx", 1, 9.0, 111.0), _p("lynx", 2, 12.0, 166.0), _p("lynx", 4, 16.0, 250.0)]


def test_best_under_takes_the_most_tokens_per_second_among_points_meeting_the_slo():
    assert slo.best_under(CURVES[:3], 15.0)["concurrency"] == 2  # 15 <= 15 counts
    assert slo.best_under(CURVES[:3], 14.9)["concurrency"] == 1
    assert slo.best_under(CURVES[:3], 9.0) is None


#: curves whose tokens/s dip as concurrency grows (measured vLLM curves do: a step past the memory-bound regime slows
#: more than the batch grows), tok/s = 1000 C / TPOT: unpatched 100 / 160 / 200 / 160 at C 1 / 4 / 8 / 16 (the dip at
#: 16), LYNX 111 / 250 / 200 / 200 (the dip at 8)
DIPS = [_p("unpatched", 1, 10.0, 100.0), _p("unpatched", 4, 25.0, 160.0), _p("unpatched", 8, 40.0, 200.0),
        _p("unpatched", 16, 100.0, 160.0), _p("lynx", 1, 9.0, 111.0), _p("lynx", 4, 16.0, 250.0),
        _p("lynx", 8, 40.0, 200.0), _p("lynx", 16, 80.0, 200.0)]


def test_best_under_a_dipping_curve_is_the_most_tokens_per_second_not_the_largest_concurrency():
    """Issue 47: the point of a curve under an SLO is the one with the most tokens/s, which after a dip is not the
    largest concurrency meeting the SLO. Worked by hand on :data:`DIPS`."""
    lynx = [p for p in DIPS if p["variant"] == "lynx"]
    unpatched = [p for p in DIPS if p["variant"] == "unpatched"]
    # 40 ms: LYNX meets it at C 1, 4, 8; 250 tok/s at C=4 beats 200 at C=8
    assert (slo.best_under(lynx, 40.0)["concurrency"], slo.best_under(lynx, 40.0)["tok_s"]) == (4, 250.0)
    # 100 ms: the unpatched curve meets it everywhere; C=8 (200) beats C=16 (160)
    assert (slo.best_under(unpatched, 100.0)["concurrency"], slo.best_under(unpatched, 100.0)["tok_s"]) == (8, 200.0)


def test_slo_rows_on_dipping_curves_hand_worked():
    """The rows of :data:`DIPS`: at TPOT(unpatched, C=8) = 40 ms LYNX's best is C=4 (250 tok/s) against the unpatched
    C=8 (200): 1.25x; at 10 x TPOT(C=1) = 100 ms, LYNX C=4 (250, not its C=16 at 200) against unpatched C=8 (200, not
    its C=16 at 160): 1.25x again."""
    rows = {(r["slo"], r["variant"]): r for r in slo.slo_rows(DIPS, multiples=(10.0,), at=(8,))}
    at8 = rows[("TPOT(unpatched, C=8)", "lynx")]
    assert (at8["slo_ms"], at8["concurrency"], at8["tok_s"]) == (40.0, 4, 250.0)
    assert at8["ratio"] == pytest.approx(250.0 / 200.0)
    ten = rows[("10 x TPOT(unpatched, C=1)", "lynx")]
    assert (ten["slo_ms"], ten["concurrency"], ten["ratio"]) == (100.0, 4, pytest.approx(250.0 / 200.0))
    base = rows[("10 x TPOT(unpatched, C=1)", "unpatched")]
    assert (base["concurrency"], base["tok_s"], base["ratio"]) == (8, 200.0, 1.0)


def test_slo_rows_hand_worked():
    rows = {(r["slo"], r["variant"]): r for r in slo.slo_rows(CURVES, multiples=(1.5, 2.5), at=(2, 4))}
    # 1.5 x 10 ms = 15 ms: unpatched reaches C=2 (133 tok/s), LYNX C=2 (166; its C=4 at 16 ms misses by 1 ms)
    r = rows[("1.5 x TPOT(unpatched, C=1)", "lynx")]
    assert (r["slo_ms"], r["concurrency"], r["tok_s"]) == (15.0, 2, 166.0)
    assert r["ratio"] == pytest.approx(166.0 / 133.0)
    # 2.5 x 10 = 25 ms: unpatched C=4 (160), LYNX C=4 (250)
    assert rows[("2.5 x TPOT(unpatched, C=1)", "lynx")]["ratio"] == pytest.approx(250.0 / 160.0)
    # at the unpatched TPOT of C=2 (15 ms) and C=4 (25 ms): the same SLOs by another name
    assert rows[("TPOT(unpatched, C=2)", "lynx")]["ratio"] == pytest.approx(166.0 / 133.0)
    assert rows[("TPOT(unpatched, C=4)", "unpatched")]["ratio"] == pytest.approx(1.0)
    assert ("TPOT(unpatched, C=8)", "lynx") not in rows  # no unpatched point at C=8


def test_a_variant_meeting_no_slo_gets_no_throughput_and_a_curve_without_unpatched_is_refused():
    pts = [_p("unpatched", 1, 10.0, 100.0), _p("lynx", 1, 11.0, 91.0)]
    row = next(r for r in slo.slo_rows(pts, multiples=(1.0,), at=()) if r["variant"] == "lynx")
    assert row["tok_s"] is None and row["ratio"] is None
    with pytest.raises(ValueError, match="no unpatched points"):
        slo.slo_rows([_p("lynx", 1, 9.0, 111.0)])


def test_a_point_whose_steps_the_gate_all_skipped_reads_gate_off_not_zero_experts():
    none_ran = {"decode_steps": 0, "unique_experts_before": 0.0, "unique_experts_after": 0.0, "gate_steps_skipped": 96}
    ran = {"decode_steps": 23, "unique_experts_before": 14.74, "unique_experts_after": 11.13, "gate_steps_skipped": 0}
    assert slo.unique_from_summary(none_ran) == {"unique_before": None, "unique_after": None, "gate_off": True}
    assert slo.unique_from_summary(ran) == {"unique_before": 14.74, "unique_after": 11.13}
    rows = [dict(_p("xshare", 2, 9.0, 200.0), **slo.unique_from_summary(none_ran)),
            dict(_p("lynx", 2, 9.0, 200.0), **slo.unique_from_summary(ran))]
    table = slo.curve_markdown(rows)
    assert "0.00 → 0.00" not in table and "gate off" in table and "14.74 → 11.13" in table
    assert slo.step_model(rows) is None   # too few points; the gate-off point never enters the fit


def test_serve_bench_rows_are_read_as_vllm_points():
    run = {"command": "x", "rows": [{"model": "q", "concurrency": 8, "variant": "lynx", "tpot_ms": 5.0,
                                     "decode_tok_s": 1600.0, "unique_before": 50.0, "unique_after": 12.0}]}
    (p,) = slo.points_of(run)
    assert (p["engine"], p["tok_s"], p["unique_after"]) == ("vllm", 1600.0, 12.0)


def test_two_runs_of_one_engine_and_model_are_labeled_apart_not_merged(tmp_path):
    """Issue 46: two run files of the same engine and model (here :data:`CURVES` and a second run, twice as fast) are
    two curves, labeled with their file names, each with its own SLO rows; before, their points were merged into one
    curve (each SLO's best taken from either run) and the markdown kept one of two same-named rows. Files whose points
    do not collide (variants measured in separate runs) still make one curve."""
    fast = [{**p, "tpot_ms": p["tpot_ms"] / 2, "tok_s": p["tok_s"] * 2} for p in CURVES]
    first, second = tmp_path / "day1.json", tmp_path / "day2.json"
    first.write_text(json.dumps({"command": "one", "points": CURVES}))
    second.write_text(json.dumps({"command": "two", "points": fast}))
    out = tmp_path / "out"
    assert slo.main(["table", str(first), str(second), "--multiples", "2", "--at", "2", "--out", str(out)]) == 0
    table = json.loads((out / "slo.json").read_text())
    assert {p["model"] for p in table["points"]} == {"m [day1.json]", "m [day2.json]"}
    rows = {(r["model"], r["slo"], r["variant"]): r for r in table["rows"]}
    # each run's SLOs come from its own unpatched curve: 2 x 10 ms and 2 x 5 ms; each best point is its own run's
    assert rows[("m [day1.json]", "2 x TPOT(unpatched, C=1)", "lynx")]["slo_ms"] == 20.0
    assert rows[("m [day2.json]", "2 x TPOT(unpatched, C=1)", "lynx")]["slo_ms"] == 10.0
    assert rows[("m [day1.json]", "2 x TPOT(unpatched, C=1)", "lynx")]["tok_s"] == 250.0
    assert rows[("m [day2.json]", "2 x TPOT(unpatched, C=1)", "lynx")]["tok_s"] == 500.0
    md = (out / "slo.md").read_text()
    slo_lines = [line for line in md.splitlines() if "x TPOT(unpatched" in line or "| TPOT(unpatched" in line]
    assert len(slo_lines) == 4  # 2 SLOs x 2 runs, none dropped
    # variants measured in separate runs of one engine and model: one curve, as before
    split = slo.merge_runs([{"points": CURVES[:3]}, {"points": CURVES[3:]}])
    assert {p["model"] for p in split} == {"m"} and len(split) == len(CURVES)


def test_duplicate_points_in_one_run_and_same_named_rows_are_refused():
    with pytest.raises(ValueError, match="two points of e / m / lynx at C=2"):
        slo.merge_runs([{"points": CURVES + [CURVES[4]]}])
    rows = slo.slo_rows(CURVES, multiples=(2.0,), at=())
    with pytest.raises(ValueError, match="several rows of one variant"):
        slo.slo_markdown(rows + [rows[-1]])


@pytest.mark.slow
def test_transformers_engine_smoke_run_writes_the_table(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "lynx_hf.eval.slo", "transformers", "--scale", "16", "--vocab", "256",
         "--concurrency", "1", "4", "--new-tokens", "4", "--prompt-tokens", "4", "--variants", "unpatched", "lynx",
         "--multiples", "2", "--at", "4", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "slo.json").read_text())
    pts = {(p["variant"], p["concurrency"]): p for p in out["points"]}
    assert set(pts) == {("unpatched", 1), ("unpatched", 4), ("lynx", 1), ("lynx", 4)}
    # structural facts: the policy never touches more experts than the router chose
    assert pts[("lynx", 4)]["unique_after"] <= pts[("lynx", 4)]["unique_before"]
    assert (tmp_path / "slo.png").is_file() and "| SLO |" in (tmp_path / "slo.md").read_text()


def test_step_model_recovers_the_costs_of_an_exact_curve():
    # TPOT = 10 + 2 T + 3 C; the unpatched points take T from the other variant's "before" at the same C
    pts = []
    for c, before, after in ((4, 20.0, 8.0), (8, 30.0, 10.0), (16, 40.0, 15.0), (32, 50.0, 22.0)):
        pts.append(_p("unpatched", c, 10 + 2 * before + 3 * c, 1.0))
        pts.append(dict(_p("lynx", c, 10 + 2 * after + 3 * c, 1.0), unique_before=before, unique_after=after))
    fit = slo.step_model(pts)
    assert fit["a_ms"] == pytest.approx(10.0) and fit["b_ms_per_expert"] == pytest.approx(2.0)
    assert fit["c_ms_per_request"] == pytest.approx(3.0) and fit["r2"] == pytest.approx(1.0)
    assert slo.step_model(pts[:3]) is None  # too few points that know T


def test_full_layers_reaches_the_configs_the_transformers_engine_patches(monkeypatch):
    """``--full-layers`` (issue 52 item 4): the 1-layer cut of the Qwen2-57B-A14B shape patched by the transformers
    engine runs 1/64 on its layer (7/64 x 4 / 28, by hand; as given it would be 7/64) with the default ``real``, 7/64
    with ``cut``, 7/64 x 4 / 8 with 8; each LYNX point records it and the curve table says it."""
    from types import SimpleNamespace

    import lynx_hf

    assert slo.parse_args(["transformers"]).full_layers == "real"
    assert slo.parse_args(["transformers", "--full-layers", "8"]).full_layers == 8
    with pytest.raises(SystemExit):
        slo.parse_args(["transformers", "--full-layers", "0"])
    monkeypatch.setenv("LYNX_HF_GATE", "always")  # the gate's patch-time timing is not this test's subject
    real, prices = lynx_hf.patch, []

    def patch(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        if lynx_hf.config_of(model).policy == "lynx":
            prices.append([b.plan.params.mass_price for b in lynx_hf.patcher._state(model).blocks])
        return out

    monkeypatch.setattr(lynx_hf, "patch", patch)
    for option, want, depth in (("real", 1 / 64, 28), ("cut", 0.109375, "cut"), (8, 7 / 64 / 2, 8)):
        prices.clear()
        opts = SimpleNamespace(layers=1, vocab=256, scale=16, threads=None, dtype="float32", prompt_tokens=4,
                               new_tokens=2, rounds=1, variants=["unpatched", "lynx"], concurrency=[2], cmd="test",
                               full_layers=option)
        run = slo.run_transformers(opts)
        assert prices and all(p == [want] for p in prices), (option, prices)
        lynx = next(p for p in run["points"] if p["variant"] == "lynx")
        assert (lynx["mass_price"], lynx["full_layers"], lynx["cut_layers"]) == (want, depth, 1)
    assert "price 0.0546875 (at 8 MoE layers)" in slo.curve_markdown(run["points"])
    assert "as given" in slo.point_price({"variant": "lynx"})  # a run file from before the option
