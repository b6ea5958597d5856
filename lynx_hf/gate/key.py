"""What a gate decision is keyed by: declared, readable fields naming what the timed step measured.

A key (:class:`GateKey`) holds what the decisions depend on as plain values, the way vLLM names its tuned fused-MoE
configs (``E=..,N=..,device_name=..,dtype=..``) and Triton's autotuner keys its cache by the kernel's source and
version: the device kind and thread count, the layer's sizes and dtypes, the policy and its resolved parameters, the
routing backend, the decode-step kind, the expert path, the engine's description of its experts (implementation,
storage, offload) and routing rules, the telemetry mode, captured or eager, mixed steps, expert-parallel ranks, the
digest of the gate's constants (``decision.TUNING``), the table format (:data:`FORMAT`) and the version of the
measuring code (:data:`MEASURE_VERSION`, pinned by ``tests/policies/test_gate_store.py`` to a hash of that code).
No function or class of this package is named in a key: renaming one leaves every table valid, and a new field of a
plan or shape enters a key only when it is declared here. :meth:`GateKey.digest` is what the decision tables
(``lynx_hf.gate.table``) are indexed by; :meth:`GateKey.readable` is the key in one line.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import platform
from dataclasses import dataclass

import torch

from ..core import STEP_KINDS
from ..telemetry import mode_of
from .decision import TUNING, Tuning
from .measure import MEASURE_VERSION

#: the layout of a stored key and decision (and of a decision file, ``lynx_hf.gate.table``): bumped when it changes;
#: every stored entry then misses and each format has its own per-user cache file, so two builds never share one.
#: Format 2: the declared fields of :class:`GateKey` (format 1 described the plan's objects by their qualified names)
FORMAT = 2

def readable(obj, _depth: int = 0):
    """Plain JSON of an engine's step description (``step=`` of :func:`make_key`) or a policy's parameters.

    ``None``, bools, ints, strings as they are; a float as it is (``repr`` where not finite); ``torch.dtype`` /
    ``torch.device``: their string; an enum: its name; a dataclass: ``{field: value, ...}`` over its compared fields
    (its class is named by the key field it is in: ``policy`` for its parameters); a class: its name (a vLLM or transformers class: what runs); a list / tuple: a list; a
    dict: a dict with string keys. A function (or any other callable) is ``None``, as no function is: what it
    computes is described by the rule beside it (a selection-scores function by the selection rule and the family),
    and its name is not a measured fact. Any other object: its class's name. Raises ``ValueError`` past a nesting depth of 12 (a cycle)."""
    if _depth > 12:
        raise ValueError("gate key: object nested too deeply to describe (a cycle?)")
    d = _depth + 1
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else repr(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, type):
        return obj.__name__
    if dataclasses.is_dataclass(obj):
        return {f.name: readable(getattr(obj, f.name), d) for f in dataclasses.fields(obj) if f.compare}
    if isinstance(obj, (list, tuple)):
        return [readable(x, d) for x in obj]
    if isinstance(obj, dict):
        return {str(k): readable(v, d) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if callable(obj):
        return None
    return type(obj).__name__


def _json(value) -> str:
    return json.dumps(readable(value), sort_keys=True)


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_kind(device) -> str:
    """The kind of ``device`` a decision holds on: ``"cpu: <model name> (<machine>, <ISA>)"`` (the ISA torch's CPU
    kernels use: ``torch.backends.cpu.get_cpu_capability()``, e.g. AVX2 or AVX512), ``"cuda: <name> (sm<major><minor>)"``
    for a CUDA / ROCm GPU, else the device type."""
    device = torch.device(device)
    if device.type == "cpu":
        isa = torch.backends.cpu.get_cpu_capability()
        return f"cpu: {_cpu_name()} ({platform.machine()}, {isa})"
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda: {torch.cuda.get_device_name(device)} (sm{major}{minor})"
    return device.type


@dataclass(frozen=True)
class GateKey:
    """The key of one layer's decisions (one per bucket), every field a plain value:

    - ``device``: :func:`device_kind`; ``threads``: torch's intra-op threads on a CPU, else 0;
    - ``num_experts`` (N), ``top_k`` (k), ``hidden`` (H) and ``intermediate`` (I, one expert's; ``None``: unknown);
      ``dtype``: the router logits' (e.g. ``"torch.bfloat16"``); ``expert_dtype``: the expert weights' (or ``None``);
    - ``policy``: ``LynxConfig.policy``; ``params``: its resolved per-layer parameters (JSON of
      :func:`readable`, e.g. ``{"alpha": 1.92, "beta": 4, ...}``; ``"null"``: none);
    - ``backend``: the routing backend (``"torch"`` / ``"triton"``); ``host_ops``: the ops of a CPU step in eager mode
      (``"numba"``: the numba twins; else the backend's); ``step``: the decode-step kind (``"keep"``: the model's
      routing; ``"fused"``: the policy's one-call CPU step; ``"device"``: the one-launch Triton step; ``"remap"``: the
      general path);
    - ``expert_path``: ``"model"`` (the model's own experts implementation) or ``"triton>=<T>"`` (the sparse Triton
      kernel from ``T`` decode tokens on);
    - ``engine``: JSON of the engine's description of what else its step runs (HF: family, selection and weight rule,
      experts class, implementation, storage, offload; vLLM: router and experts classes, rules);
    - ``telemetry``: ``"off"``, ``"full"`` or ``"counts"``; ``captured``: the step is replayed from a CUDA graph;
      ``mixed``: the engine's steps carry per-token masks; ``ep_size``: expert-parallel ranks;
    - ``tuning``: :meth:`~lynx_hf.gate.decision.Tuning.digest`; ``format``: :data:`FORMAT`; ``measure``: the
      measuring code's version, :data:`~lynx_hf.gate.measure.MEASURE_VERSION` (a new version misses every older
      entry: stale decisions are never served).
    """

    device: str
    threads: int
    num_experts: int
    top_k: int
    hidden: int | None
    intermediate: int | None
    dtype: str
    expert_dtype: str | None
    policy: str
    params: str
    backend: str
    host_ops: str
    step: str
    expert_path: str
    engine: str
    telemetry: str
    captured: bool
    mixed: bool
    ep_size: int
    tuning: str
    format: int = FORMAT
    measure: int = MEASURE_VERSION

    def digest(self) -> str:
        """A stable hash of every field (hex, 20 characters): the decision tables' index."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:20]

    def to_dict(self) -> dict:
        """Plain JSON, stored beside each table entry so a reader can see what it was measured for (``params`` and
        ``engine`` as objects)."""
        out = dataclasses.asdict(self)
        out["params"], out["engine"] = json.loads(self.params), json.loads(self.engine)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> "GateKey":
        """The inverse of :meth:`to_dict`. Raises ``KeyError`` for a missing field, ``TypeError`` for an unknown
        one (a key of another format)."""
        values = dict(values)
        values["params"] = json.dumps(values["params"], sort_keys=True)
        values["engine"] = json.dumps(values["engine"], sort_keys=True)
        return cls(**values)

    def readable(self) -> str:
        """The key in one line, as vLLM names its tuned configs: ``"device=..,threads=2,N=32,k=4,H=256,I=64,
        dtype=bfloat16,...,measure=2"`` (``engine`` and ``tuning`` by their digests)."""
        short = lambda text: hashlib.sha256(text.encode()).hexdigest()[:8]  # noqa: E731
        dtype = lambda d: None if d is None else d.removeprefix("torch.")  # noqa: E731
        parts = [("device", self.device), ("threads", self.threads), ("N", self.num_experts), ("k", self.top_k),
                 ("H", self.hidden), ("I", self.intermediate), ("dtype", dtype(self.dtype)),
                 ("expert_dtype", dtype(self.expert_dtype)), ("policy", self.policy), ("params", self.params),
                 ("backend", self.backend), ("host_ops", self.host_ops), ("step", self.step),
                 ("expert_path", self.expert_path), ("engine", short(self.engine)), ("telemetry", self.telemetry),
                 ("captured", self.captured), ("mixed", self.mixed), ("ep", self.ep_size), ("tuning", self.tuning),
                 ("format", self.format), ("measure", self.measure)]
        return ",".join(f"{k}={v}" for k, v in parts)


def step_kind(plan) -> str:
    """The decode-step kind of ``plan`` (a ``lynx_hf.core.RoutePlan``) by its declared name
    (``lynx_hf.core.STEP_KINDS``): ``"keep"``, ``"fused"``, ``"device"`` or ``"remap"``; raises ``ValueError`` for a
    step function the core does not declare."""
    for name, fn in STEP_KINDS.items():
        if plan.kernel is fn:
            return name
    raise ValueError(f"gate key: the plan's decode step {plan.kernel!r} is not one of lynx_hf.core.STEP_KINDS")


def make_key(plan, shape, step: object, telemetry, tuning: Tuning = TUNING) -> GateKey:
    """The key of ``plan``'s decisions (a ``lynx_hf.core.RoutePlan``; its device is described by kind) for a layer of
    ``shape`` (``lynx_hf.gate.LayerShape``) whose engine runs the step described by ``step`` (plain data, made
    readable by :func:`readable`; HF: ``lynx_hf.gate.LayerFacts.step``: family, selection and weight rule, experts
    implementation, storage and offload; vLLM: the router's rule and the experts' classes), with telemetry mode
    ``telemetry`` (``LynxConfig.telemetry``)."""
    device = torch.device(plan.device)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    numba = plan.host_ops is not None and getattr(plan.host_ops, "lynx_mass_decode", None) is not None
    return GateKey(
        device=device_kind(device), threads=int(threads), num_experts=int(shape.num_experts),
        top_k=int(shape.top_k), hidden=shape.hidden, intermediate=shape.intermediate, dtype=str(shape.dtype),
        expert_dtype=None if shape.expert_dtype is None else str(shape.expert_dtype),
        policy=plan.policy.name, params=_json(plan.params), backend=plan.routing_backend,
        host_ops="numba" if numba else plan.routing_backend, step=step_kind(plan),
        expert_path="model" if plan.expert_ops is None else f"triton>={plan.kernel_min_tokens}",
        engine=_json(step), telemetry=mode_of(telemetry) or "off", captured=bool(shape.captured),
        mixed=bool(shape.mixed_steps), ep_size=int(shape.ep_size), tuning=tuning.digest(), format=FORMAT,
        measure=MEASURE_VERSION)
