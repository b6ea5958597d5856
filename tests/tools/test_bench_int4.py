"""Smoke test of ``python -m lab.bench_int4 --quick`` on fixture A (issue 39). Asserts structure, no timing."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_bench_int4_quick_fixture(tmp_path, one_thread):
    from lab import bench_int4

    assert bench_int4.main(["--quick", "--models", "fixture", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "bench_int4_quick.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 4 |")]
    assert [r[1] for r in rows] == list(bench_int4.VARIANTS)
    for r in rows:
        assert r[-1].rstrip(" |") in ("True", "False")  # greedy tokens vs the same storage unpatched: reported
        if r[1].endswith("+lynx"):  # "before -> after": LYNX touches fewer experts on both storages
            before, after = (float(x) for x in r[5].split(" -> "))
            assert after < before
