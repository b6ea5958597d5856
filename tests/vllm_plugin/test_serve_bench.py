"""lab.serve_bench's pure parts (the benchmark itself is a script the lead runs alone): the paired
ratios of ``aggregate`` on hand-worked numbers, the real-shape config, the fixture prompts."""

from lab import serve_bench as sb


def _cell(tpot, decode, before=None, after=None):
    return {"tpot_ms": tpot, "decode_tok_s": decode, "total_tok_s": decode / 2, "unique_before": before,
            "unique_after": after}


def test_aggregate_pairs_ratios_by_round():
    """Round 0: lynx 50 vs unpatched 100 ms (0.5); round 1: 90 vs 120 (0.75). Paired ratios -> median 0.625;
    the ratio of medians would be 70 / 110 = 0.636. Decode speed-ups 2.0 and 1.25 -> 1.625."""
    results = [
        {"model": "m", "round": 0, "variant": "unpatched", "cells": {"16": _cell(100.0, 160.0)}},
        {"model": "m", "round": 0, "variant": "lynx", "cells": {"16": _cell(50.0, 320.0, 20.0, 9.0)}},
        {"model": "m", "round": 1, "variant": "lynx", "cells": {"16": _cell(90.0, 200.0, 22.0, 11.0)}},
        {"model": "m", "round": 1, "variant": "unpatched", "cells": {"16": _cell(120.0, 160.0)}},
    ]
    rows = {r["variant"]: r for r in sb.aggregate(results, ["unpatched", "lynx"])}
    assert rows["lynx"]["tpot_ratio"] == 0.625 and rows["lynx"]["decode_speedup"] == 1.625
    assert rows["lynx"]["tpot_ms"] == 70.0 and rows["unpatched"]["tpot_ratio"] == 1.0
    assert (rows["lynx"]["unique_before"], rows["lynx"]["unique_after"]) == (21.0, 10.0)
    assert rows["unpatched"]["unique_before"] is None
    md = sb.markdown(list(rows.values()), "# t")
    assert "| m | 16 | lynx | 70.0 | 0.625 |" in md


def test_a_cell_without_remapped_steps_reads_gate_off():
    """Telemetry from engines whose cost gate kept vLLM's routing on every step (no decode step counted, 0 -> 0
    experts): the row says so instead of "0.00 -> 0.00"; one engine that remapped makes it a normal row."""
    off = dict(_cell(50.0, 320.0, 0.0, 0.0), decode_steps_seen=0, gate_bypassed_layers=4)
    results = [{"model": "m", "round": 0, "variant": "unpatched", "cells": {"16": _cell(100.0, 160.0)}},
               {"model": "m", "round": 0, "variant": "lynx", "cells": {"16": off}}]
    rows = {r["variant"]: r for r in sb.aggregate(results, ["unpatched", "lynx"])}
    assert rows["lynx"]["gate_off"] and not rows["unpatched"]["gate_off"]
    assert "| gate off: vLLM's routing (4 layers bypassed) |" in sb.markdown(list(rows.values()), "# t")
    results.append({"model": "m", "round": 1, "variant": "lynx",
                    "cells": {"16": dict(_cell(50.0, 320.0, 20.0, 9.0), decode_steps_seen=60)}})
    assert not {r["variant"]: r for r in sb.aggregate(results, ["unpatched", "lynx"])}["lynx"]["gate_off"]


def test_real_shape_config_is_qwen2_57b_cut_to_layers():
    cfg = sb.real_shape_config(layers=2, vocab=4096, scale=1)
    assert (cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["shared_expert_intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == \
        (3584, 64, 8, 2560, 20480, 28, 4)
    assert cfg["num_hidden_layers"] == 2 and cfg["norm_topk_prob"] is False
    tiny = sb.real_shape_config(layers=2, vocab=4096, scale=16)
    assert tiny["hidden_size"] == 224 and tiny["num_experts"] == 64 and tiny["hidden_size"] % tiny["num_attention_heads"] == 0


def test_fixture_prompts_have_exact_length_and_differ():
    prompts = sb.make_prompts("fixture-a", sb.FIXTURE_A, 64, 32, 4096, seed=16)
    assert len(prompts) == 64 and all(len(p) == 32 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 64


def test_item7_gate_off_bench_interleaves_rounds_and_pairs_its_ratios():
    """lab.gate_off_bench (issue 54 item 7; the lead runs it alone): each round runs every (mode, variant) once, the
    modes and the variants rotated by the round; the ratios are paired per round and mode (hand-worked: decode
    ratios 0.95 and 1.05 -> median 1.0)."""
    from lab import gate_off_bench as gb

    order = gb.schedule(2)
    assert order[:4] == [(0, "eager", "unpatched"), (0, "eager", "default"), (0, "compiled", "unpatched"),
                         (0, "compiled", "default")]
    assert order[4:] == [(1, "compiled", "default"), (1, "compiled", "unpatched"), (1, "eager", "default"),
                         (1, "eager", "unpatched")]
    assert len(gb.schedule(5)) == 20

    def out(rnd, mode, variant, decode, tpot):
        return {"round": rnd, "mode": mode, "variant": variant,
                "cells": {"16": dict(_cell(tpot, decode), gate_bypassed_layers=2 if variant == "default" else None)}}

    results = [out(0, "eager", "unpatched", 100.0, 10.0), out(0, "eager", "default", 95.0, 10.5),
               out(1, "eager", "default", 105.0, 9.5), out(1, "eager", "unpatched", 100.0, 10.0),
               out(0, "compiled", "unpatched", 200.0, 5.0)]  # compiled: no default engine ran
    table = gb.ratios(results, 16)
    assert table["eager"]["decode"] == [0.95, 1.05] and table["eager"]["decode_median"] == 1.0
    assert table["eager"]["bypassed"] == 2 and table["compiled"]["rounds"] == 0
    assert "| eager | 2 | 1.000 |" in gb.markdown(table, "# t")


def test_item7_host_cost_times_the_functions_the_hooks_look_up(monkeypatch):
    """lab.gate_off_bench --host-cost: each of HOST_FUNCTIONS is replaced on its module by a timer that calls the
    original (same result) and counts its calls and nanoseconds; the hooks of lynx_hf.vllm.install look them up
    there at call time, so a hook's call is counted. The hook frame microbenchmark gives a finite number."""
    import importlib
    import inspect

    from lab import gate_off_bench as gb
    from lynx_hf.vllm import install

    for module, name in gb.HOST_FUNCTIONS:  # restored after the test
        monkeypatch.setattr(importlib.import_module(module), name, getattr(importlib.import_module(module), name))

    from lynx_hf.vllm import checks

    before = checks.op_calls()
    cells = gb.time_host_functions()
    assert set(cells) == {f"{m.rsplit('.', 1)[1]}.{n}" for m, n in gb.HOST_FUNCTIONS}
    assert checks.op_calls() == before  # the timer returns what the function returns
    assert cells["checks.op_calls"][1] == 1 and cells["checks.op_calls"][0] > 0 and cells["steps.end_step"] == [0, 0]
    # the hooks call them through the module: `checks.op_calls()` / `steps.end_step()` in the hook's code
    source = inspect.getsource(install._runner_execute)
    assert "checks.op_calls()" in source and "steps.end_step()" in source
    assert abs(gb.hook_frame_ns(calls=1000)) < 1e6
