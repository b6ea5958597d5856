"""lynx_hf: LYNX dynamic expert reduction for batched MoE decode in HuggingFace Transformers.

>>> import lynx_hf
>>> lynx_hf.patch(model, lynx_hf.LynxConfig(policy="lynx"))   # doctest: +SKIP
>>> model.generate(**batch, max_new_tokens=32)                  # doctest: +SKIP
>>> lynx_hf.stats(model).summary()["unique_experts_after"]     # doctest: +SKIP
"""

from .config import LynxConfig
from .errors import (
    LynxAccuracyWarning,
    LynxConfigError,
    LynxError,
    LynxHookError,
    LynxNoDecodeWarning,
    ModelConfigError,
    NotPatchedError,
    UnsupportedModelError,
)
from .patcher import config_of, is_patched, patch, patched, reset_stats, stats, unpatch
from .patches import supported_families
from .policies.lynx import at_depth
from .telemetry import LynxStats

__version__ = "0.1.0"

__all__ = [
    "LynxAccuracyWarning",
    "LynxConfig",
    "LynxConfigError",
    "LynxError",
    "LynxHookError",
    "LynxNoDecodeWarning",
    "LynxStats",
    "ModelConfigError",
    "NotPatchedError",
    "UnsupportedModelError",
    "at_depth",
    "config_of",
    "is_patched",
    "patch",
    "patched",
    "reset_stats",
    "stats",
    "supported_families",
    "unpatch",
]
