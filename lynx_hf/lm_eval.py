"""lm-eval integration: the model type ``lynx`` (an lm-eval ``HFLM`` whose model is patched).

lm-eval has no plugin entry point, so registration happens on import of this module. Use either

- Python: ``import lynx_hf.lm_eval`` then ``lm_eval.simple_evaluate(model="lynx",
  model_args="pretrained=PATH,policy=lynx,tau=1.0", tasks=[...], batch_size=16)``, or pass
  ``HFLM(pretrained=<patched model object>, tokenizer=tok, batch_size=16)`` directly (``docs/cases.md`` C17);
- the CLI: ``python -m lynx_hf.lm_eval run --model lynx --model_args pretrained=PATH,policy=lynx
  --tasks TASK --include_path eval/tasks --batch_size 16`` (forwards to lm-eval's own CLI).

A configuration file (:meth:`LynxConfig.from_file`, e.g. the ``lynx_config.json`` of ``lynx-hf sweep --model``):
``model_args="pretrained=PATH,lynx_config=FILE"``; single options beside it override its fields.
LYNX options in ``model_args``: every :class:`~lynx_hf.LynxConfig` field (``policy``, ``tau``, ``mass_price``,
``oea_k0``, ``routing_backend``, ``expert_path``, ...; ``mass_price=None`` selects the paper's rule), parsed by
:meth:`LynxConfig.from_options` like the CLI's. Names of LYNX options renamed before any release (``k0``,
``mass_floor``, ``lynx_backend``) are refused with :class:`~lynx_hf.LynxConfigError` like any unknown field (CASES
C40), and so is ``backend`` with a value that is no HFLM model backend (``backend=torch``: LYNX's is
``routing_backend``); every other name goes to ``HFLM`` / ``from_pretrained``, as with lm-eval's ``hf`` model.
The cost gate is off here: ``gate`` defaults to ``"always"`` (accuracy must not depend on a machine's timing;
``gate=auto`` in ``model_args`` asks for it). Every other argument goes to ``HFLM`` (``device`` defaults to ``cpu`` when CUDA is unavailable). Use a fixed ``batch_size`` (never ``auto``): LYNX's effect
depends on the decode batch.
"""

from __future__ import annotations

import sys
from dataclasses import fields

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .config import LynxConfig
from .errors import LynxConfigError
from .patcher import patch

_LYNX_ARGS = tuple(f.name for f in fields(LynxConfig))
#: LYNX option names renamed before any release (CASES C40): refused by LynxConfig.from_options (unknown field)
#: instead of reaching from_pretrained as a model keyword (a TypeError from the model's __init__)
_FORMER_NAMES = ("k0", "mass_floor", "lynx_backend")
#: HFLM's own ``backend`` values (lm_eval.models.huggingface.HFLM)
_HFLM_BACKENDS = ("default", "causal", "seq2seq")


@register_model("lynx")
class LynxLM(HFLM):
    """``HFLM`` over a model patched with ``LynxConfig(**lynx options)``.

    ``lynx_config``: a :class:`LynxConfig` or the path of a config file (its fields, overridden by the single
    options). Raises :class:`lynx_hf.LynxConfigError` for a bad LYNX option or config file
    (``FileNotFoundError`` when missing; both before the model is loaded) and whatever :func:`lynx_hf.patch`
    raises for an unsupported model.
    """

    def __init__(self, pretrained, *, lynx_config=None, **kwargs) -> None:
        options = {name: kwargs.pop(name) for name in _LYNX_ARGS + _FORMER_NAMES if name in kwargs}
        if kwargs.get("backend", "default") not in _HFLM_BACKENDS:
            raise LynxConfigError(f"lynx: backend={kwargs['backend']!r} is HFLM's model backend (one of "
                                  f"{_HFLM_BACKENDS}); LYNX's routing ops are chosen by routing_backend=auto|torch|"
                                  f"triton and its expert kernel by expert_path")
        if "policy" in options and options["policy"] is None:  # lm-eval's model_args parser reads "none" as None
            options["policy"] = "none"
        # accuracy must not depend on this machine's timing: the policy runs on every decode step unless the
        # model_args ask for the cost gate (gate=auto); this overrides a config file's gate too
        options.setdefault("gate", "always")
        if isinstance(lynx_config, LynxConfig):
            base = lynx_config
        else:  # a config file; the single options above override its fields
            base = LynxConfig.from_file(lynx_config) if lynx_config is not None else None
        self.lynx_config = LynxConfig.from_options(options, base=base)
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")  # HFLM assumes CUDA
        if kwargs.get("batch_size") == "auto":
            raise LynxConfigError("lynx: use a fixed batch_size (LYNX's effect depends on the decode batch)")
        super().__init__(pretrained=pretrained, **kwargs)
        patch(self.model, self.lynx_config)


def main() -> None:
    """``python -m lynx_hf.lm_eval ...``: lm-eval's CLI with the ``lynx`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm-eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
