"""The family matrix (``lab.family_matrix``, CASES C28-style new-user census): every MoE implementation the
installed transformers ships, enumerated from ``transformers.models`` (not a hand list), built tiny with its
selection biases non-zero, either patches (policy ``none`` bit-identical in ``generate`` and in a manual decode loop,
``unpatch`` clean, LYNX reducing unique experts in both) or refuses with a typed error that names what is missing
and leaves the model untouched. A new transformers release that adds a family shows up here as a new test id.

One process, ~1 s per implementation; ``docs/families-matrix.md`` is this matrix written out
(``python -m lab.family_matrix``)."""

import dataclasses

import pytest
import transformers
from packaging.version import Version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from lab import family_matrix as fm

CASES = fm.discover()
#: implementations whose failure is known and tracked (model type -> why); they xfail, and fail once fixed
KNOWN: dict = {}
#: implementations whose tiny model cannot be built or run unpatched on CPU (model type -> exactly why); they
#: xfail with that reason (docs/families-matrix.md lists them as "not built"), and fail once they build.
#: Any other "not built" row fails: a tiny config that does not build is missing work in ``fm.tiny_config``.
NOT_BUILDABLE: dict = {}
#: the census bar (docs/families-matrix.md): on the transformers release the census was taken on (5.24) and later,
#: at least this many implementations patch and this many are enumerated; an older release (5.19, what vLLM
#: pins) ships fewer families (a family it lacks simply is not enumerated) and is held to what it measured
CENSUS = Version(transformers.__version__).release[:2] >= (5, 24)
MIN_PATCHED = 60 if CENSUS else 43
MIN_IMPLEMENTATIONS = 68 if CENSUS else 55
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
    if case.model_type in NOT_BUILDABLE:
        assert row.status == "not built", f"{case.model_type} builds now ({row.status}): drop it from NOT_BUILDABLE"
        pytest.xfail(NOT_BUILDABLE[case.model_type])
    assert row.status != "not built", (
        f"the tiny config of {case.model_type} does not build or run unpatched ({row.reason}): fix it in "
        f"lab.family_matrix (TINY / OVERRIDES), or list it in NOT_BUILDABLE with exactly why")


#: model types that build another family's model class from a text config class of their own (transformers 5.25's
#: param2moe: ``Glm4MoeForCausalLM`` from ``Param2MoeConfig``): the matrix counts them as aliases of that class, so
#: each is also built here from its own config (its routing fields, e.g. groups and scaling, may differ). Composite
#: (multimodal) config classes are left out: their text decoder is the implementation the matrix already builds.
OWN_CONFIG_ALIASES = [dataclasses.replace(c, model_type=a, config_cls=CONFIG_MAPPING[a], aliases=[])
                      for c in CASES if c.model_cls is not None for a in c.aliases
                      if CONFIG_MAPPING[a] is not c.config_cls and not getattr(CONFIG_MAPPING[a], "sub_configs", None)]


def test_aliases_with_their_own_config_patch_or_refuse_cleanly():
    names = [case.model_type for case in OWN_CONFIG_ALIASES]
    assert "param2moe" in names or "param2moe" not in CONFIG_MAPPING_NAMES, names
    for case in OWN_CONFIG_ALIASES:
        row = fm.check(case)
        assert row.status in ("dedicated", "generic", "refused"), f"{case.model_type}: {row.status}: {row.reason}"
        if row.status == "refused":
            assert "need" in row.reason, row.reason


def test_matrix_covers_the_families_and_meets_the_bar():
    """Enumeration finds the families lynx_hf has dedicated specs for and the selection-bias families; enough of
    the implementations patch (checked on the rows the per-family test builds, counted once here)."""
    types = {c.model_type for c in CASES} | {a for c in CASES for a in c.aliases}
    for model_type in ("qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "ernie4_5_moe",
                       "lfm2_moe", "afmoe", "kimi_linear", "dots1", "hunyuan_v1_moe", "gemma4", "mimo_v2_flash",
                       # transformers 5.25's four selection-bias families
                       "minicpm5_moe", "kolibri1_1", "ergo", "param2moe"):
        # every one the installed transformers ships (an older release lacks some: then it is not enumerated)
        assert model_type in types or model_type not in CONFIG_MAPPING_NAMES, model_type
    if CENSUS:
        for model_type in ("dots1", "lfm2_moe", "mimo_v2_flash", "inkling2", "gemma4"):
            assert model_type in types, model_type
    # encoders are not text generation: counted as "not a decoder", never as an implementation
    privacy = [c for c in CASES if c.model_type == "openai_privacy_filter"]
    assert all(c.model_cls is None and c.why_not.startswith("encoder-only") for c in privacy)
    assert len([c for c in CASES if c.model_cls is not None]) >= MIN_IMPLEMENTATIONS


def test_matrix_headline_count():
    """At least :data:`MIN_PATCHED` implementations patch (needs every per-family row of this run)."""
    built = [c for c in CASES if c.model_cls is not None]
    if len(STATUS) < len(built):
        pytest.skip("not every family ran in this session (-k / -x)")
    patched = [t for t, status in STATUS.items() if status in ("dedicated", "generic")]
    assert len(patched) >= MIN_PATCHED, sorted(set(STATUS) - set(patched))
