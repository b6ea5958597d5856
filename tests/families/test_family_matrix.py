"""The family matrix (``lynx_hf.eval.family_matrix``, CASES C28-style new-user census): every MoE implementation the
installed transformers ships, enumerated from ``transformers.models`` (not a hand list), built tiny with its
selection biases non-zero, either patches (policy ``none`` bit-identical in ``generate`` and in a manual decode loop,
``unpatch`` clean, LYNX reducing unique experts in both) or refuses with a typed error that names what is missing
and leaves the model untouched. A new transformers release that adds a family shows up here as a new test id.

One process, ~1 s per implementation; ``docs/families-matrix.md`` is this matrix written out
(``python -m lynx_hf.eval.family_matrix``)."""

import pytest

from lynx_hf.eval import family_matrix as fm

CASES = fm.discover()
#: implementations whose failure is known and tracked (model type -> why); they xfail, and fail once fixed
KNOWN: dict = {}
#: at least this many implementations patch (transformers 5.24: see docs/families-matrix.md)
MIN_PATCHED = 55
STATUS: dict = {}  # model type -> status, filled by the per-family test (which runs first)


def _id(case):
    return case.model_type


@pytest.mark.parametrize("case", [c for c in CASES if c.model_cls is not None], ids=_id)
def test_family_patches_or_refuses_cleanly(case):
    row = fm.check(case)
    STATUS[case.model_type] = row.status
    if case.model_type in KNOWN:
        assert row.status == "FAILED", f"{case.model_type} passes now ({row.status}): drop it from KNOWN"
        pytest.xfail(KNOWN[case.model_type])
    assert row.status != "FAILED", f"{case.model_type}: {row.reason}; {row.failures}"
    if row.status == "refused":
        # refusals that teach: the error names a class of the model and what would be needed
        assert "need" in row.reason, row.reason
    if row.status == "not built":
        pytest.skip(f"the tiny config of {case.model_type} does not build or run unpatched: {row.reason}")


def test_matrix_covers_the_families_and_meets_the_bar():
    """Enumeration finds the families lynx_hf has dedicated specs for and the selection-bias families; enough of
    the implementations patch (checked on the rows the per-family test builds, counted once here)."""
    types = {c.model_type for c in CASES} | {a for c in CASES for a in c.aliases}
    for model_type in ("qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "ernie4_5_moe",
                       "lfm2_moe", "afmoe", "kimi_linear", "dots1" if "dots1" in types else "glm4_moe"):
        assert model_type in types
    assert len([c for c in CASES if c.model_cls is not None]) >= 60


def test_matrix_headline_count():
    """At least :data:`MIN_PATCHED` implementations patch (needs every per-family row of this run)."""
    built = [c for c in CASES if c.model_cls is not None]
    if len(STATUS) < len(built):
        pytest.skip("not every family ran in this session (-k / -x)")
    patched = [t for t, status in STATUS.items() if status in ("dedicated", "generic")]
    assert len(patched) >= MIN_PATCHED, sorted(set(STATUS) - set(patched))
