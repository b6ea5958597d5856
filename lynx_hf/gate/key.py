"""What a gate decision is keyed by: everything the timed step depends on, derived from the objects that run it.

:func:`describe` turns a plan (``lynx_hf.core.RoutePlan``), a ``LayerShape``, a weight / selection rule or an
engine's description of its experts into plain JSON by walking their dataclass fields, named tuples, functions and
namespaces, so a new field of any of them is part of the key without a hand-kept list. :func:`make_key` adds the
device (:func:`device_kind`: a CPU's model name and ISA, a GPU's name and compute capability), torch's intra-op thread
count and the digest of the gate's constants (``decision.TUNING``); :meth:`GateKey.digest` is what the decision tables
(``lynx_hf.gate.table``) are indexed by.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import platform
import types
from dataclasses import dataclass

import torch

from .decision import TUNING, Tuning
from .measure import VERSION as MEASURE_VERSION

#: the layout of a stored key and decision (and of a decision file, ``lynx_hf.gate.table``): bumped when it changes;
#: every stored entry then misses and each format has its own per-user cache file, so two builds never share one
FORMAT = 1


def describe(obj, _depth: int = 0):
    """Plain JSON describing ``obj`` for a decision key (deterministic, no memory addresses).

    Dataclasses: their ``compare=True`` fields by name (plus the class name), except a field with metadata
    ``{"key": "omit_default"}`` while it holds its default (a field added later leaves the older keys as they were); named tuples: their fields; functions,
    methods and classes: ``module.qualname``; ``functools.partial``: its function and keywords; a namespace: its
    attributes; ``torch.dtype`` / ``torch.device``: their string; an enum: its name; any
    other object: its class's qualified name. Raises ``ValueError`` past a nesting depth of 12 (a cycle)."""
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
        return f"{type(obj).__qualname__}.{obj.name}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {"@": type(obj).__qualname__}
        out.update({f.name: describe(getattr(obj, f.name), d) for f in dataclasses.fields(obj) if f.compare and not (
            f.metadata.get("key") == "omit_default" and getattr(obj, f.name) == f.default)})
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {"@": type(obj).__qualname__, **{name: describe(getattr(obj, name), d) for name in obj._fields}}
    if isinstance(obj, (list, tuple)):
        return [describe(x, d) for x in obj]
    if isinstance(obj, dict):
        return {str(k): describe(v, d) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, functools.partial):
        return {"@": "partial", "func": describe(obj.func, d), "args": describe(list(obj.args), d),
                "keywords": describe(dict(obj.keywords), d)}
    if isinstance(obj, types.SimpleNamespace):
        return {"@": "namespace", **{k: describe(v, d) for k, v in sorted(vars(obj).items())}}
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    func = getattr(obj, "__func__", obj)  # a bound method: its function
    name = getattr(func, "__qualname__", None)
    if callable(func) and isinstance(name, str):  # functions, classes, compiled dispatchers (numba)
        return f"{getattr(func, '__module__', '?')}.{name}"
    return type(obj).__module__ + "." + type(obj).__qualname__


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
    """The key of one layer's decisions (one per bucket): ``device`` (:func:`device_kind`), ``threads`` (torch's
    intra-op threads on a CPU, else 0), ``parts`` (the JSON of :func:`describe` of the plan, the layer shape, the
    engine's step and the telemetry mode), ``tuning`` (:meth:`Tuning.digest`), ``format`` (:data:`FORMAT`) and
    ``measure`` (the measuring code's version, ``lynx_hf.gate.measure.VERSION``)."""

    device: str
    threads: int
    parts: str
    tuning: str
    format: int = FORMAT
    measure: int = MEASURE_VERSION

    def digest(self) -> str:
        """A stable hash of the whole key (hex, 20 characters): the decision tables' index. ``measure`` is left out
        while it is 1, the version every key had before the field existed (the shipped tables and the caches written
        then keep their digests)."""
        fields = dataclasses.asdict(self)
        if fields["measure"] == 1:
            del fields["measure"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def to_dict(self) -> dict:
        """Plain JSON, stored beside each table entry so a reader can see what it was measured for."""
        out = dataclasses.asdict(self)
        out["parts"] = json.loads(self.parts)
        return out


def make_key(plan, shape, step: object, telemetry, tuning: Tuning = TUNING) -> GateKey:
    """The key of ``plan``'s decisions (a ``lynx_hf.core.RoutePlan``; its device, which is described by kind) for a
    layer of ``shape`` (``lynx_hf.gate.LayerShape``) whose engine runs the step described by ``step`` (HF:
    ``lynx_hf.block.BlockRouting.step_key``: selection and weight rule, experts implementation and storage, offload;
    vLLM: the router class and the experts method), with telemetry mode ``telemetry``."""
    device = torch.device(plan.device)
    plan_part = describe(dataclasses.replace(plan, device=torch.device(device.type)))
    parts = json.dumps({"plan": plan_part, "shape": describe(shape), "step": describe(step),
                        "telemetry": describe(telemetry)}, sort_keys=True)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return GateKey(device_kind(device), int(threads), parts, tuning.digest(), FORMAT, MEASURE_VERSION)
