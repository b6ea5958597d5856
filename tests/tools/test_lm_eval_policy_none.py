"""lm-eval's model_args parser turns the string "none" into Python None; ``policy=none`` must still select
policy "none" (and a batch_size of "auto" is a typed LynxConfigError)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
from lm_eval.utils import simple_parse_args_string  # noqa: E402

import lynx_hf  # noqa: E402
import lynx_hf.lm_eval as lynx_lm_eval  # noqa: E402
from lynx_hf.eval import FIXTURES_DIR  # noqa: E402

FIXTURE = FIXTURES_DIR / "mixtral-tiny"


def test_model_args_policy_none_selects_policy_none():
    assert simple_parse_args_string("policy=none")["policy"] is None  # what lm-eval hands over
    lm = lynx_lm_eval.LynxLM.create_from_arg_string(f"pretrained={FIXTURE},policy=none", {"batch_size": 8})
    assert lm.lynx_config.policy == "none"
    assert lynx_hf.is_patched(lm.model) and lynx_hf.patcher._state(lm.model).config.policy == "none"


def test_batch_size_auto_is_a_typed_error():
    with pytest.raises(lynx_hf.LynxConfigError, match="fixed batch_size"):
        lynx_lm_eval.LynxLM(pretrained=str(FIXTURE), batch_size="auto")
