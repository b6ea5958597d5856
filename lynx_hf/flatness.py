"""Router flatness and the routing mass the default moves, on the first decode steps; a warning where the default
policy's accuracy is not known to hold.

The default policy (LYNX with the routing-mass greedy, ``LynxConfig()``) keeps ΔCE <= 1 % on fixtures A, B, C (4-layer
MoEs) and, with its price scaled by depth (``LynxConfig.price_ref_layers``), on the 30-layer real-weights fixture D2
(``docs/results.md``). What tells a model where the default costs more apart is not how flat its routers are (the
top-1 excess share below: C 0.30, D2 0.23) but how much routing mass the policy moves per token summed over the
layers it passes: each layer's remap perturbs the residual stream and the perturbations add up with depth. Measured
(B = 16, sweeps' telemetry and ``python -m lab.router_flatness``): A 0.6, B 0.1, C 1.1, D2 0.7 tokens' worth under
the default, where ΔCE <= 1 %; D2 7.1 with the price as given, where ΔCE was +7.1 %. A model over
:data:`MOVED_THRESHOLD` gets :class:`~lynx_hf.errors.LynxAccuracyWarning` with both figures and the sweep command
that measures the default on that model; nothing is changed (the policy still runs as configured).

The figures (hand-checked in ``tests/policies/test_flatness.py``), per live decode token of a layer, with ``w`` the
token's relative routing weights (``routing_torch.relative_weights``: its own top-k sum to 1, the unit of the
routing-mass rule):

- **routing mass moved** ``1 - sum of w over the experts the token keeps from its own top-k`` after the policy (what
  ``lynx_hf.stats``' ``routing_mass_kept`` complements); the model's figure is the **sum over its MoE layers** of each
  layer's mean over the live decode tokens of its first :data:`STEPS` decode steps (0 where the cost gate kept the
  model's routing);
- **top-1 excess share** ``(w1 - 1/k) / (1 - 1/k)``, ``w1`` the top-1's weight: 0 when the top-k weights are equal
  (flat), 1 when the top-1 holds them all; the model's figure is the mean over its MoE layers. Reported, not a
  trigger (it did not separate the fixtures).

Only the default configuration is watched (a configuration the user chose, e.g. from ``lynx-hf sweep``, is theirs);
only eager steps of more than one token are measured (a step traced by ``torch.compile`` or captured in a CUDA graph
is passed through; the probe reads its sums to the host once, after its last step). ``lynx_hf.stats(model)``
reports each layer's figures under ``"router_flatness"``. Not in the vLLM plugin.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import policies
from .core import Runner, StageBase, Step, StepInputs
from .errors import LynxAccuracyWarning
from .kernels.routing_torch import relative_weights

NAME = "router_flatness"
#: decode steps measured per layer
STEPS = 8
#: decode steps (of more than one token) a layer sees before the model's figures are taken over the layers that ran,
#: whether or not every registered layer has its :data:`STEPS` (a layer that never runs, e.g. vision experts on text,
#: must not keep the warning off for the whole model)
DECIDE_AFTER = 2 * STEPS
#: above this routing mass moved per token, summed over the MoE layers, the warning fires (tokens' worth of top-k
#: routing weight; between the fixtures where the default keeps ΔCE <= 1 % and D / D2: module docstring)
MOVED_THRESHOLD = 2.0


def top1_excess_share(scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp32: ``(w1 - 1/k) / (1 - 1/k)``, ``w1`` the largest of each token's top-k relative weights
    (``scores [T, N]`` fp32 selection scores, ``topk_idx [T, k]`` the model's own top-k). ``k == 1``: 1."""
    k = topk_idx.shape[-1]
    if k == 1:
        return torch.ones(topk_idx.shape[0], device=scores.device)
    w1 = relative_weights(scores, topk_idx).gather(1, topk_idx.long()).max(dim=-1).values
    return (w1 - 1.0 / k) / (1.0 - 1.0 / k)


def mass_moved(scores: torch.Tensor, topk_idx: torch.Tensor, new_idx: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp32: ``1 - sum of w over the experts of new_idx [T, k] that were in topk_idx [T, k]``, ``w`` the
    relative weights (``scores [T, N]``): 0 when the token keeps its own top-k, 1 when it keeps none of it."""
    w = relative_weights(scores, topk_idx)
    own = torch.zeros_like(w, dtype=torch.bool).scatter_(1, topk_idx.long(), True)
    kept = torch.where(own, w, 0.0).gather(1, new_idx.long()).sum(dim=-1)
    return (1.0 - kept).clamp_min(0.0)


def is_default(config) -> bool:
    """Whether ``config`` (a ``LynxConfig``) runs the default policy with its default parameters."""
    base = type(config)()
    return config.policy == base.policy and all(getattr(config, f) == getattr(base, f)
                                                for f in policies.get(base.policy).fields)


class ModelFlatness:
    """One patched model's probe: its layers' stages, the model's figures once every layer has its steps, and the
    warning, once (thread-safe)."""

    def __init__(self, where: str = "this model") -> None:
        self.where = where
        self.layers: dict[str, FlatnessStage] = {}
        self.figures: dict | None = None
        self._lock = threading.Lock()

    def __getstate__(self):  # deepcopy / pickle of a patched model: a lock cannot be copied
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def layer_done(self, force: bool = False) -> None:
        """Take the model's figures (and warn) once every layer has its :data:`STEPS` steps, or, ``force`` (a layer
        has seen :data:`DECIDE_AFTER` decode steps), over the layers that measured at least one step."""
        with self._lock:
            if self.figures is not None or not self.layers:
                return
            if not force and any(s.steps < STEPS for s in self.layers.values()):
                return
            ran = [s for s in self.layers.values() if s.steps > 0]
            if not ran:
                return
            share, moved = zip(*(s.value() for s in ran))
            self.figures = {"moved": sum(moved), "share": sum(share) / len(share), "layers": len(moved),
                            "registered": len(self.layers)}
        f = self.figures
        over = f"its {f['layers']}" if f["layers"] == f["registered"] else \
            f"the {f['layers']} of its {f['registered']} (the others did not run)"
        if f["moved"] > MOVED_THRESHOLD:
            warnings.warn(LynxAccuracyWarning(
                f"lynx_hf: on the first {STEPS} decode steps of {self.where} the default policy moved "
                f"{f['moved']:.2f} tokens' worth of top-k routing weight per token, summed over {over} MoE "
                f"layers (per layer {min(moved):.2f}-{max(moved):.2f}; router top-1 excess share {f['share']:.2f}). "
                f"The default's ΔCE <= 1 % was measured where this stays below {MOVED_THRESHOLD} (fixtures: 0.1-1.1); "
                f"at 7.1 (a 30-layer real-weights fixture, its price not scaled by depth) it cost +7.1 % "
                f"(docs/results.md). Measure it on this "
                f"model before relying on it: `lynx-hf sweep --model <your checkpoint>` writes the frontier and a "
                f"lynx_config.json within the 1 % budget (patch(model, 'lynx_config.json')), or scale the price down "
                f"further (LynxConfig(price_ref_layers=...): smaller keeps more experts). Nothing is changed: the "
                f"policy runs as configured, wherever the cost gate lets it."),
                stacklevel=2)


class FlatnessStage(StageBase):
    """The probe's stage in one layer's plan (``lynx_hf.core.Stage``; not bound to a plan that keeps the routing): for its first :data:`STEPS` eager decode
    steps of more than one token it adds, on the device, the live decode tokens' top-1 excess shares and the routing
    mass the steps below it (the cost gate, the policy) moved; then it passes every step through."""

    name = NAME

    def __init__(self, model: ModelFlatness, layer: str) -> None:
        self.model, self.layer = model, layer
        self.steps = 0
        self.passed = 0  # steps passed through after the first STEPS, until the model's figures are taken
        self.sums: torch.Tensor | None = None   # [share, moved, tokens]
        self._value: tuple[float, float] | None = None

    def bind(self, plan, inner: Runner):
        self.model.layers[self.layer] = self

        def run(p, inputs: StepInputs):
            if self.steps >= STEPS or inputs.idx.shape[0] < 2 or _traced(inputs.logits):
                if self.steps >= STEPS and self.model.figures is None and not _traced(inputs.logits) \
                        and inputs.idx.shape[0] >= 2:
                    self.passed += 1
                    if self.steps + self.passed >= DECIDE_AFTER:  # some layer never ran: decide without it
                        self.model.layer_done(force=True)
                return inner(p, inputs)
            out = inner(p, inputs)
            self.add(inputs, out.idx)
            return out

        return run

    def add(self, inputs: StepInputs, new_idx: torch.Tensor) -> None:
        step: Step = inputs.step
        scores = inputs.logits.float() if inputs.scores is None else inputs.scores(inputs.logits)
        rows = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
        if step.decode is not None:
            rows = rows & step.decode
        if step.live is not None:
            rows = rows & step.live
        share = top1_excess_share(scores, inputs.idx)
        moved = mass_moved(scores, inputs.idx, new_idx)
        rows = rows & torch.isfinite(share) & torch.isfinite(moved)   # a non-finite router row is the model's own
        sums = torch.stack([torch.where(rows, share, 0.0).sum(), torch.where(rows, moved, 0.0).sum(),
                            rows.sum().float()])
        self.sums = sums if self.sums is None else self.sums + sums
        self.steps += 1
        if self.steps == STEPS:
            self.model.layer_done()

    def value(self) -> tuple[float, float]:
        """``(top-1 excess share, routing mass moved)``: the layer's means over its measured live decode tokens (one
        host read, cached; ``(1.0, 0.0)`` when none was live)."""
        if self._value is not None:
            return self._value
        share, moved, n = (0.0, 0.0, 0.0) if self.sums is None else self.sums.tolist()
        value = (share / n, moved / n) if n else (1.0, 0.0)
        if self.steps >= STEPS:
            self._value = value
        return value

    def summary(self) -> dict:
        if not self.steps:
            return {"steps": 0, "top1_excess_share": None, "routing_mass_moved": None}
        share, moved = self.value()
        return {"steps": self.steps, "top1_excess_share": share, "routing_mass_moved": moved}


def _traced(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def plan_stage(block, config):
    """The probe's stage of ``block``'s plan (``lynx_hf.patcher.PLAN_STAGES``) where ``config`` is the default
    configuration (:func:`is_default`), else ``None``."""
    if not is_default(config):
        return None
    state = block.model_state
    probe = getattr(state, "flatness", None)
    if probe is None:
        # the message names the model (Python shows a warning once per text and place: two models, two warnings)
        path = getattr(getattr(state.model, "config", None), "_name_or_path", "")
        name = f"{type(state.model).__name__} at {id(state.model):#x}" + (f" ({path})" if path else "")
        probe = state.flatness = ModelFlatness(name)
    return FlatnessStage(probe, block.name)
