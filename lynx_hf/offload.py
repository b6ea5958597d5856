"""Expert-granular decode for experts that accelerate offloads (CPU / disk offload), with a resident-expert cache.

accelerate's ``AlignDevicesHook`` (``offload=True`` with a ``weights_map``: ``cpu_offload``, ``disk_offload``,
``from_pretrained(device_map=...)`` with ``"cpu"`` / ``"disk"`` entries) keeps ``meta`` placeholders in the experts
module and loads **every** tensor of it before each forward. transformers v5 stores a layer's experts fused
(``gate_up_proj [N, 2I, H]`` / ``down_proj [N, H, I]``; Llama-4 ``[N, H, 2I]`` / ``[N, I, H]``), so each decode
step reads all N experts of every offloaded layer, whatever the routing (and LYNX) chose.

:func:`install` (called by ``lynx_hf.patch``; undone exactly by :func:`remove`) replaces, for each patched block
whose experts module is offloaded that way, the module's instance ``forward`` (accelerate's hooked
``functools.partial``) by an :class:`OffloadedExperts` object:

- **prefill** (and anything it cannot serve: extra arguments, a traced call) -> accelerate's own forward, the
  very object it replaced (bit-identical: whole-module load, the model's own experts implementation);
- **decode** -> the unique experts the (remapped) routing uses are found (``torch.unique`` of the routing ids;
  Llama-4, whose experts take a dense ``[N * T, H]`` input: the experts with a nonzero input row -- an expert
  with an all-zero input contributes exactly zero), only their rows are read from accelerate's offload store
  (:class:`ExpertStore`: the CPU tensors of a ``cpu_offload`` map, or ``pread`` of the byte ranges of a disk
  offload's safetensors / ``.dat`` files, never the whole tensor) into a per-layer slot buffer on the execution
  device (:class:`ExpertCache`), and the model's own experts implementation runs on those slots (a stand-in
  module whose ``gate_up_proj`` / ``down_proj`` / ``num_experts`` are the slots, routing ids mapped to slot ids).

**Cache.** ``LynxConfig.expert_cache_bytes`` (per offloaded MoE layer, bytes on the execution device; 0 = none:
a step's experts are read into a buffer freed after the step) keeps experts resident between steps. Replacement:
least recently used. Why LRU: consecutive decode steps of the same requests route to overlapping experts (the
reuse is recent, not lifelong: a prompt's topic drifts, so LFU counts from early tokens pin stale experts and
need a decay to tune), and cache-aware remapping (below) makes the experts a step uses the resident ones, which
LRU then keeps; it is O(1) per access and has no parameter. On CUDA the rows read from the store are staged in
pinned host memory and copied with ``non_blocking=True``.

**Cache-aware remapping.** Resident experts cost no transfer, like the experts a step's prefill tokens load
anyway: with a remapping policy and a non-empty cache, the plan's :class:`ResidentSeed` stage (``lynx_hf.core.Stage``,
composed by :func:`plan_stage`) passes the layer's resident mask ``[N]`` bool as an extra seed of the critical set
(``StepInputs.seed``, ``lynx_hf.core.remap(..., seed=)``), so tokens prefer experts already on the device (one-token
steps keep their own top-k, as without a cache).

**Telemetry** (host counters; the reads are host work anyway): per layer, decode calls, experts used, fetched
(read from the store), cache hits, bytes read from the store, bytes the whole-module path would have read, and
the host time spent reading / copying. ``lynx_hf.stats(model).summary()`` carries them per decode step
(``offload_*`` keys); :func:`transfer_ms` gives the measured per-expert transfer time per layer, the extra cost a
cost gate (``lynx_hf.gate``) may weigh per expert saved.

**Host syncs.** On an accelerator the decode path reads the step's unique expert ids on the host
(``torch.unique(...).tolist()`` in :meth:`OffloadedExperts._decode`; Llama-4: the nonzero-row mask): the host
must know which byte ranges to read from the offload store before any copy can be issued, so this read cannot be
avoided (the whole-module path avoids it only by reading every expert). Besides it, the copies themselves: the
pinned staging buffer is reused, so before refilling it the host waits for the event recorded after the previous
step's copies (:meth:`ExpertCache._stage`). Nothing else reads device memory. On CPU there is no sync at all.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections import OrderedDict

import torch

from .core import PREFILL, Routed, RoutePlan, Runner, StageBase, StepInputs
from .experts import dispatch, original_implementation, unwrap
from .state import state_of

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


# -- the offload store --------------------------------------------------------------------------------------
class _FileTensor:
    """One tensor stored contiguously in a file: ``path``, byte ``offset`` of its first element, ``dtype`` as
    stored, ``shape``."""

    def __init__(self, path: str, offset: int, dtype: torch.dtype, shape) -> None:
        self.path, self.offset, self.dtype, self.shape = str(path), int(offset), dtype, tuple(int(s) for s in shape)


def _safetensors_entry(path: str, name: str) -> _FileTensor:
    """Where tensor ``name`` lies in the safetensors file ``path`` (its header: 8-byte little-endian length, JSON
    of ``{name: {dtype, shape, data_offsets}}``, then the data). Raises ``KeyError`` / ``ValueError``."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    info = header[name]
    return _FileTensor(path, 8 + size + int(info["data_offsets"][0]), _ST_DTYPES[info["dtype"]], info["shape"])


def _dat_entry(folder: str, key: str, info: dict) -> _FileTensor:
    """accelerate's ``offload_weight`` ``.dat`` file (a raw ``numpy.memmap``; bf16 stored as int16, fp8 as int8)."""
    dtype = getattr(torch, info["dtype"])
    return _FileTensor(os.path.join(folder, f"{key}.dat"), 0, dtype, info["shape"] or (1,))


class ExpertStore:
    """Per-expert reads from accelerate's offload store of one experts module.

    ``weights_map``: the hook's map (``accelerate.utils.PrefixedDataset`` over a ``dict`` of CPU tensors --
    ``cpu_offload`` -- or an ``OffloadedWeightsLoader``: CPU tensors, safetensors files, ``.dat`` files);
    ``names``: the module's offloaded tensors, each ``[N, ...]``; ``dtypes``: ``{name: dtype}`` the module computes
    in (what accelerate casts to). Files are read with ``os.pread`` of the experts' byte ranges (one read per run
    of consecutive expert ids), never memory-mapped whole, so dropping them from the page cache
    (``os.posix_fadvise(..., POSIX_FADV_DONTNEED)``) makes the next read a real one.

    Raises ``ValueError`` (the reason) when a source is of an unknown kind or its shape is not the module's.
    """

    def __init__(self, weights_map, names, shapes: dict, dtypes: dict) -> None:
        self.names = tuple(names)
        self.dtypes = dict(dtypes)
        self.sources: dict[str, object] = {}
        dataset, prefix = getattr(weights_map, "dataset", None), getattr(weights_map, "prefix", None)
        if dataset is None or prefix is None:
            dataset, prefix = weights_map, ""
        for name in self.names:
            key = prefix + name
            source = self._resolve(dataset, key)
            shape = tuple(source.shape)
            if shape != tuple(shapes[name]):
                raise ValueError(f"offloaded {key} has shape {shape}, the module {tuple(shapes[name])}")
            self.sources[name] = source
        self._fds: dict[str, int] = {}

    @staticmethod
    def _resolve(dataset, key):
        if isinstance(dataset, dict):
            value = dataset[key]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"offloaded {key} is a {type(value).__name__}")
            return value
        state_dict, index = getattr(dataset, "state_dict", None), getattr(dataset, "index", None)
        if index is None or state_dict is None:
            raise ValueError(f"unknown offload map {type(dataset).__name__}")
        if key in state_dict:
            return state_dict[key]
        info = index[key]
        if info.get("safetensors_file") is not None:
            return _safetensors_entry(info["safetensors_file"], info.get("weight_name", key))
        return _dat_entry(dataset.save_folder, key, info)

    def row_bytes(self, name: str) -> int:
        """Bytes one expert of ``name`` occupies in the store."""
        source = self.sources[name]
        numel = 1
        for s in source.shape[1:]:
            numel *= s
        return numel * (source.element_size() if isinstance(source, torch.Tensor) else source.dtype.itemsize)

    def expert_bytes(self) -> int:
        """Bytes one expert occupies in the store, over every offloaded tensor of the module."""
        return sum(self.row_bytes(name) for name in self.names)

    def files(self) -> list[str]:
        """The files this store reads (empty for CPU tensors)."""
        return sorted({s.path for s in self.sources.values() if isinstance(s, _FileTensor)})

    def read(self, name: str, experts: list[int], out: torch.Tensor) -> int:
        """Read rows ``experts`` (sorted ascending, distinct) of ``name`` into ``out [len(experts), ...]`` (CPU,
        contiguous, any dtype: cast from the stored one). Returns the bytes read from the store."""
        return self.read_many([(name, experts, out)])

    def read_many(self, requests) -> int:
        """:meth:`read` for each ``(name, experts, out)`` of ``requests``; the file reads of all of them (one per run
        of consecutive experts) are issued together on a small thread pool (``os.preadv`` releases the GIL), so
        storage sees them in parallel instead of one latency after another. Returns the bytes read."""
        nbytes, jobs, casts = 0, [], []
        for name, experts, out in requests:
            source = self.sources[name]
            if isinstance(source, torch.Tensor):
                ids = torch.tensor(experts, dtype=torch.long)
                if source.device.type == "cpu" and source.dtype == out.dtype:
                    torch.index_select(source, 0, ids, out=out)  # straight into the slots / pinned staging
                else:
                    out.copy_(source.index_select(0, ids.to(source.device)))
                nbytes += len(experts) * self.row_bytes(name)
                continue
            raw = out if out.dtype == source.dtype else torch.empty(out.shape, dtype=source.dtype)
            if raw is not out:
                casts.append((raw, out))
            buffer = raw.view(torch.uint8).reshape(-1).numpy()
            row = self.row_bytes(name)
            fd = self._fd(source.path)
            start = 0
            for first, count in _runs(experts):
                jobs.append((fd, source.path, memoryview(buffer[start * row:(start + count) * row]),
                             source.offset + first * row))
                start += count
            nbytes += len(experts) * row
        if len(jobs) > 1:
            list(_pool().map(_pread_all, jobs))
        elif jobs:
            _pread_all(jobs[0])
        for raw, out in casts:
            out.copy_(raw)
        return nbytes

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state


READ_THREADS = 8  # parallel file reads per step (lynx_hf.offload.ExpertStore.read_many)
_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="lynx-offload-read")
    return _POOL


def _pread_all(job) -> None:
    """Fill ``view`` from byte ``offset`` of ``fd`` (looping over short reads)."""
    fd, path, view, offset = job
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read from {path}")
        done += n


def _runs(sorted_ids):
    """``[(first, count)]`` of runs of consecutive ids."""
    runs = []
    for e in sorted_ids:
        if runs and runs[-1][0] + runs[-1][1] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    return runs


# -- the resident-expert cache --------------------------------------------------------------------------------
class ExpertCache:
    """The slots of one offloaded experts module on the execution device, least-recently-used replacement.

    ``slots``: how many experts stay resident (``budget_bytes // bytes per expert on the device``, at most N;
    0 = none). :meth:`gather` returns, for one step's unique experts, tensors ``{name: [S, ...]}`` on ``device`` in
    the module's dtypes and the slot of each expert: the resident slot buffer when the step's experts fit in it
    (misses evict the least recently used experts the step does not use), else a buffer for this step only.
    ``resident`` ``[N]`` bool on ``device``: which experts are resident (updated when the cache changes).
    """

    def __init__(self, store: ExpertStore, shapes: dict, num_experts: int, device: torch.device,
                 budget_bytes: int) -> None:
        self.store, self.device, self.num_experts = store, torch.device(device), int(num_experts)
        self.shapes = {name: tuple(shapes[name][1:]) for name in store.names}
        per_expert = sum(_numel(self.shapes[n]) * store.dtypes[n].itemsize for n in store.names)
        self.device_bytes_per_expert = per_expert
        self.slots = min(self.num_experts, int(budget_bytes) // per_expert) if per_expert else 0
        # normal tensors even when patched under torch.inference_mode: they are updated in place in any mode
        with torch.inference_mode(False):
            self.buffers = {n: torch.empty((self.slots, *self.shapes[n]), dtype=store.dtypes[n], device=self.device)
                            for n in store.names} if self.slots else {}
            self.resident = torch.zeros(self.num_experts, dtype=torch.bool, device=self.device)
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.free = list(range(self.slots))[::-1]  # pop() gives the lowest free slot
        self._pinned = self.device.type == "cuda"
        self._staging: dict[str, torch.Tensor] = {}
        self._event = None

    def gather(self, experts: list[int]):
        """``(tensors {name: [S, ...]}, slot per expert [len(experts)], fetched, hits, bytes, seconds)`` for the
        sorted distinct ``experts`` (seconds: host time spent reading and issuing the copies)."""
        hits = [e for e in experts if e in self.lru]
        misses = [e for e in experts if e not in self.lru]
        started = time.perf_counter()
        if len(experts) <= self.slots:
            for e in hits:
                self.lru.move_to_end(e)
            needed = set(experts)
            slots, evicted = [], []
            for _ in misses:  # enough: free + (resident - hits) = slots - hits >= misses
                if self.free:
                    slots.append(self.free.pop())
                else:
                    victim = next(e for e in self.lru if e not in needed)  # least recently used first
                    slots.append(self.lru.pop(victim))
                    evicted.append(victim)
            nbytes = self._fill(self.buffers, misses, slots)
            for e, s in zip(misses, slots):
                self.lru[e] = s
            if misses:
                self._set_resident(evicted, False)
                self._set_resident(misses, True)
            return (self.buffers, [self.lru[e] for e in experts], len(misses), len(hits), nbytes,
                    time.perf_counter() - started)
        # more experts than slots: a buffer for this step (resident ones copied on the device, misses read)
        step = {n: torch.empty((len(experts), *self.shapes[n]), dtype=self.store.dtypes[n], device=self.device)
                for n in self.store.names}
        position = {e: j for j, e in enumerate(experts)}
        if hits:
            src = torch.tensor([self.lru[e] for e in hits], dtype=torch.long, device=self.device)
            dst = torch.tensor([position[e] for e in hits], dtype=torch.long, device=self.device)
            for n in self.store.names:
                step[n].index_copy_(0, dst, self.buffers[n].index_select(0, src))
            for e in hits:
                self.lru.move_to_end(e)
        nbytes = self._fill(step, misses, [position[e] for e in misses])
        if self.slots and misses:  # the step's experts are now the most recent: as many misses as fit stay resident
            evictable = [e for e in self.lru if e not in position]  # least recently used first
            insert, slots, evicted = misses[:len(self.free) + len(evictable)], [], []
            for _ in insert:
                if self.free:
                    slots.append(self.free.pop())
                else:
                    evicted.append(evictable.pop(0))
                    slots.append(self.lru.pop(evicted[-1]))
            if insert:
                src = torch.tensor([position[e] for e in insert], dtype=torch.long, device=self.device)
                dst = torch.tensor(slots, dtype=torch.long, device=self.device)
                for n in self.store.names:
                    self.buffers[n].index_copy_(0, dst, step[n].index_select(0, src))
            for e, s in zip(insert, slots):
                self.lru[e] = s
            self._set_resident(evicted, False)
            self._set_resident(insert, True)
        return (step, list(range(len(experts))), len(misses), len(hits), nbytes,
                time.perf_counter() - started)

    def _set_resident(self, experts: list[int], value: bool) -> None:
        if experts:
            self.resident[torch.tensor(experts, dtype=torch.long, device=self.device)] = value

    def _fill(self, buffers: dict, experts: list[int], slots: list[int]) -> int:
        """Read ``experts`` (ascending) from the store into rows ``slots`` of ``buffers``; the bytes read. On CPU
        straight into the rows (one read per run of consecutive experts and slots); on an accelerator through the
        pinned staging buffer, then one ``non_blocking`` copy and an ``index_copy_`` on the device."""
        if not experts:
            return 0
        if self.device.type == "cpu":
            requests = [(name, experts[first:first + count], buffers[name][slots[first]:slots[first] + count])
                        for name in self.store.names for first, count in _runs_pairs(experts, slots)]
            return self.store.read_many(requests)
        staged = {name: self._stage(name, len(experts)) for name in self.store.names}
        nbytes = self.store.read_many([(name, experts, staged[name]) for name in self.store.names])
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        for name in self.store.names:
            buffers[name].index_copy_(0, index, staged[name].to(self.device, non_blocking=self._pinned))
        if self._pinned:
            self._event = torch.cuda.Event()
            self._event.record()
        return nbytes

    def _stage(self, name: str, rows: int) -> torch.Tensor:
        """A host buffer for ``rows`` experts of ``name`` (pinned on CUDA, reused: before refilling it the host waits
        for the previous step's copies out of it -- the one wait besides the copies)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        buf = self._staging.get(name)
        if buf is None or buf.shape[0] < rows:
            with torch.inference_mode(False):  # reused in any mode
                buf = torch.empty((max(rows, 1), *self.shapes[name]), dtype=self.store.dtypes[name],
                                  pin_memory=self._pinned)
            self._staging[name] = buf
        return buf[:rows]

    def __getstate__(self):  # pickle / deepcopy: no CUDA event, no pinned staging (made again on use)
        state = dict(self.__dict__)
        state["_event"] = None
        state["_staging"] = {}
        return state

    def clear(self) -> None:
        self.lru.clear()
        self.free = list(range(self.slots))[::-1]
        self.resident.zero_()


def _runs_pairs(experts, slots):
    """``[(start, count)]``: runs over positions where both the expert ids and the slots go up by one."""
    runs = []
    for j in range(len(experts)):
        if runs and experts[j] == experts[j - 1] + 1 and slots[j] == slots[j - 1] + 1:
            runs[-1][1] += 1
        else:
            runs.append([j, 1])
    return runs


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# -- the experts module's forward -----------------------------------------------------------------------------
class _Slots:
    """The experts module with its weights replaced by slot buffers (``num_experts`` = slots): what transformers'
    experts implementations read (``self.gate_up_proj``, ``self.num_experts``, ...). Everything else is the
    module's."""

    def __init__(self, module, tensors: dict, count: int) -> None:
        self.__dict__.update(tensors)
        self.__dict__["num_experts"] = count
        self.__dict__["_module"] = module

    def __getattr__(self, name):
        return getattr(self.__dict__["_module"], name)


#: counter keys of one layer (OffloadedExperts.counts), summed over its decode calls
COUNTERS = ("calls", "experts_used", "fetched", "hits", "bytes_read", "bytes_module", "seconds")


class OffloadedExperts:
    """The instance ``forward`` of one offloaded experts module while patched (see the module docstring).

    ``block``: its ``BlockRouting``; ``module``: the experts module; ``hook``: accelerate's ``AlignDevicesHook``;
    ``original``: the module's instance ``forward`` it replaced (accelerate's), restored by :meth:`restore`;
    ``layout``: ``"interface"`` (transformers' experts interface: ``forward(hidden [T, H], ids [T, k],
    weights [T, k])``) or ``"dense"`` (Llama-4: ``forward(routed_in [N * T, H])``); ``cache_bytes``: the
    resident budget in bytes on the execution device.
    """

    def __init__(self, block, module, hook, store: ExpertStore, shapes: dict, layout: str, cache_bytes: int,
                 num_experts: int) -> None:
        self.block, self.module, self.hook, self.store, self.layout = block, module, hook, store, layout
        self.num_experts = int(num_experts)
        self.device = torch.device(hook.execution_device) if not isinstance(hook.execution_device, int) \
            else torch.device("cuda", hook.execution_device)
        self.original = module.__dict__["forward"]
        self.cache = ExpertCache(store, shapes, num_experts, self.device, cache_bytes)
        self.module_bytes = store.expert_bytes() * self.num_experts
        self.seed_resident = True  # cache-aware remapping (resident experts seed the critical set)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._probe_ms: float | None = None

    # -- patch / unpatch
    def attach(self) -> None:
        object.__setattr__(self.module, "forward", self)

    def restore(self) -> None:
        if self.module.__dict__.get("forward") is self:
            object.__setattr__(self.module, "forward", self.original)
        self.store.close()

    # -- calls
    def __call__(self, *args, **kwargs):
        if self.module.__dict__.get("_hf_hook") is not self.hook or torch.compiler.is_compiling() or kwargs \
                or self.block.step.kind == PREFILL:
            return self.original(*args, **kwargs)
        if self.layout == "dense":
            if len(args) != 1:
                return self.original(*args, **kwargs)
            return self._decode_dense(args[0])
        if len(args) != 3:
            return self.original(*args, **kwargs)
        return self._decode(*args)

    def _fetch(self, experts: list[int]):
        tensors, slots, fetched, hits, nbytes, seconds = self.cache.gather(experts)
        c = self.counts
        c["calls"] += 1
        c["experts_used"] += len(experts)
        c["fetched"] += fetched
        c["hits"] += hits
        c["bytes_read"] += nbytes
        c["bytes_module"] += self.module_bytes
        c["seconds"] += seconds
        return tensors, slots

    def _decode(self, hidden, top_k_index, top_k_weights):
        """Interface layout: ``hidden [T, H]``, ``top_k_index [T, k]`` int, ``top_k_weights [T, k]`` -> ``[T, H]``
        on ``hidden``'s device, the model's own experts implementation on the step's experts."""
        home = hidden.device
        dev = self.device
        hidden, top_k_index, top_k_weights = hidden.to(dev), top_k_index.to(dev), top_k_weights.to(dev)
        experts = torch.unique(top_k_index).tolist()  # the host sync: which byte ranges to read (module docstring)
        tensors, slots = self._fetch(experts)
        lut = torch.zeros(self.num_experts, dtype=top_k_index.dtype)
        lut[experts] = torch.tensor(slots, dtype=top_k_index.dtype)
        local = lut.to(dev, non_blocking=True)[top_k_index]
        interface, original = dispatch(self.module)
        name = original_implementation(self.module)
        if dev.type == "cuda" and "grouped_mm" in interface:
            name = "grouped_mm"
        count = next(iter(tensors.values())).shape[0]
        out = interface.get_interface(name, original)(_Slots(self.module, tensors, count), hidden, local,
                                                      top_k_weights)
        return out.to(home) if self.hook.io_same_device else out

    def _decode_dense(self, routed_in):
        """Llama-4 layout: ``routed_in [N * T, H]`` (row ``e * T + t``: token t's input scaled by its score for
        expert e, zero off its chosen experts) -> ``[N * T, H]``, HF's ``bmm`` on the experts with a nonzero row."""
        home = routed_in.device
        x = routed_in.to(self.device).view(self.num_experts, -1, routed_in.shape[-1])
        used = (x != 0).flatten(1).any(1)
        experts = used.nonzero().flatten().tolist()  # the host sync: which byte ranges to read
        tensors, slots = self._fetch(experts)
        out = torch.zeros_like(x)
        if experts:
            index = torch.tensor(slots, dtype=torch.long, device=self.device)
            rows = torch.tensor(experts, dtype=torch.long, device=self.device)
            gate_up = tensors["gate_up_proj"].index_select(0, index)
            down = tensors["down_proj"].index_select(0, index)
            gate, up = torch.bmm(x.index_select(0, rows), gate_up).chunk(2, dim=-1)
            out.index_copy_(0, rows, torch.bmm(up * self.module.act_fn(gate), down))
        out = out.view(-1, routed_in.shape[-1])
        return out.to(home) if self.hook.io_same_device else out

    # -- cache-aware remapping and telemetry
    def resident_seed(self, device) -> torch.Tensor | None:
        """``[N]`` bool on ``device``: the resident experts, or ``None`` when none is (no cache, or empty)."""
        if not self.seed_resident or not self.cache.lru:
            return None
        return self.cache.resident if self.cache.resident.device == device else self.cache.resident.to(device)

    def transfer_ms(self) -> float | None:
        """Measured host time to read and copy one expert from the offload store (ms; mean over the decode reads so
        far), ``None`` before any read."""
        c = self.counts
        return 1e3 * c["seconds"] / c["fetched"] if c["fetched"] else None

    def probe_ms(self) -> float:
        """An estimate before any decode read (ms): the time to read expert 0 from the store and copy it to the
        execution device, measured once (the store's files may be in the page cache: a warm figure). Synchronizes
        the device once, here."""
        if self._probe_ms is None:
            rows = {n: torch.empty((1, *self.cache.shapes[n]), dtype=self.store.dtypes[n]) for n in self.store.names}
            started = time.perf_counter()
            self.store.read_many([(n, [0], rows[n]) for n in self.store.names])
            if self.device.type != "cpu":
                for t in rows.values():
                    t.to(self.device)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self._probe_ms = 1e3 * (time.perf_counter() - started)
        return self._probe_ms

    def summary(self) -> dict:
        """Per decode call of this layer: ``offload_experts_used`` (unique experts computed),
        ``offload_experts_fetched`` (read from the store), ``offload_cache_hits`` (resident), ``offload_bytes_read``
        (bytes read from the store), ``offload_bytes_module`` (bytes accelerate's whole-module load reads),
        ``offload_transfer_ms_per_expert``; plus ``offload_decode_calls`` and ``offload_cache_slots``."""
        c = self.counts
        n = max(c["calls"], 1)
        return {
            "offload_decode_calls": c["calls"],
            "offload_experts_used": c["experts_used"] / n,
            "offload_experts_fetched": c["fetched"] / n,
            "offload_cache_hits": c["hits"] / n,
            "offload_bytes_read": c["bytes_read"] / n,
            "offload_bytes_module": c["bytes_module"] / n,
            "offload_transfer_ms_per_expert": self.transfer_ms(),
            "offload_cache_slots": self.cache.slots,
        }

    def reset(self) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)


# -- detection, install, remove -----------------------------------------------------------------------------------
def _align_hook(module):
    """accelerate's ``AlignDevicesHook`` of ``module`` when it offloads (``offload=True`` and a ``weights_map``),
    else ``None``. A ``SequentialHook`` is accepted only when it holds exactly one hook."""
    hook = module.__dict__.get("_hf_hook")
    while hook is not None and type(hook).__name__ == "SequentialHook" and len(getattr(hook, "hooks", ())) == 1:
        hook = hook.hooks[0]
    if hook is None or type(hook).__name__ != "AlignDevicesHook":
        return None
    if not getattr(hook, "offload", False) or getattr(hook, "weights_map", None) is None:
        return None
    return hook


def offload_reason(block) -> str | None:
    """``None`` if decode of ``block`` (a ``BlockRouting``) may read its offloaded experts per expert, else why not
    (also when the experts are not offloaded). Patch time; a few attribute reads and the store's file headers."""
    return _plan(block)[0]


def _plan(block):
    module, wrappers = unwrap(block.experts)
    if wrappers:
        return "the experts are wrapped (PEFT)", None
    if _align_hook(module) is None:
        return "the experts are not offloaded by an accelerate AlignDevicesHook with a weights map", None
    hook = _align_hook(module)
    if hook.execution_device is None or str(hook.execution_device) == "meta":
        return "no execution device", None
    if "forward" not in module.__dict__:
        return "accelerate's hooked forward is not on the module", None
    if block.spec.decode_forward is not None:
        if type(module).__name__ != "Llama4TextExperts" or not type(module).__module__.startswith("transformers."):
            return f"experts class {type(module).__name__} is not Llama4TextExperts", None
        layout = "dense"
    else:
        if dispatch(module) is None or not hasattr(module, "config") \
                or not type(module).__module__.startswith("transformers.models."):
            return "the experts do not dispatch through transformers' experts interface", None
        layout = "interface"
    if any(next(child.parameters(), None) is not None for child in module.children()):
        return "the experts module has submodules with weights", None
    names = [n for n, _ in module.named_parameters(recurse=False)]
    if getattr(hook, "offload_buffers", False):
        names += [n for n, _ in module.named_buffers(recurse=False)]
    if layout == "dense" and sorted(names) != ["down_proj", "gate_up_proj"]:
        return f"Llama-4 experts with tensors {sorted(names)}", None
    tensors = {n: getattr(module, n) for n in names}
    num_experts = block.num_experts
    bad = [n for n, t in tensors.items() if t.dim() < 2 or t.shape[0] != num_experts]
    if bad or not names:
        return f"offloaded tensors {bad or names} are not stacked per expert [N, ...]", None
    if any(not t.dtype.is_floating_point for t in tensors.values()):
        return "quantized expert storage", None
    try:
        store = ExpertStore(hook.weights_map, names, {n: t.shape for n, t in tensors.items()},
                            {n: t.dtype for n, t in tensors.items()})
    except (KeyError, ValueError, OSError) as exc:
        return f"offload store not readable per expert ({exc})", None
    return None, (module, hook, store, {n: t.shape for n, t in tensors.items()}, layout, num_experts)


def install(state) -> None:
    """Install :class:`OffloadedExperts` on every patched block of ``state`` (a ``lynx_hf.patcher.ModelState``) whose
    experts accelerate offloads, when ``state.config.offload_path == "experts"``; sets ``block.offload`` (``None``
    elsewhere) and ``block.offload_reason`` (the cost gate reads the transfer of one expert,
    :meth:`OffloadedExperts.probe_ms`, through ``lynx_hf.facts.layer_facts``: timed only if it measures). Called before the blocks' plans
    are made (``lynx_hf.patcher``), so each plan composes its :class:`ResidentSeed` stage once. Idempotent: installed
    ones are removed first (cache and counters restart)."""
    remove(state)
    config = state.config
    for block in state.blocks:
        reason, found = _plan(block) if config.offload_path == "experts" else ("offload_path='module'", None)
        block.offload_reason = reason
        if found is None:
            continue
        module, hook, store, shapes, layout, num_experts = found
        offloaded = OffloadedExperts(block, module, hook, store, shapes, layout, config.expert_cache_bytes, num_experts)
        offloaded.attach()
        block.offload = offloaded


def remove(state) -> None:
    """Undo :func:`install`: each experts module's instance ``forward`` is accelerate's object again (the hook
    itself was never touched); the caches are dropped; the blocks' offload fields are back at their defaults."""
    for block in state.blocks:
        offloaded, block.offload = block.offload, None
        block.offload_reason = None
        if offloaded is not None:
            offloaded.restore()


def reset(state) -> None:
    """Zero the offload counters of ``state``'s blocks (``lynx_hf.reset_stats``); the caches stay."""
    for block in state.blocks:
        if block.offload is not None:
            block.offload.reset()


class ResidentSeed(StageBase):
    """The stage of an offloaded block's plan (``lynx_hf.core.Stage``): the resident experts of ``offloaded`` (its
    :class:`OffloadedExperts`) seed the critical set of each step the policy runs on (cache-aware remapping,
    ``StepInputs.seed``); nothing resident, or a step the plan keeps (one token): the step as it is."""

    name = "offload"

    def __init__(self, offloaded: OffloadedExperts) -> None:
        self.offloaded = offloaded

    def bind(self, plan: RoutePlan, inner: Runner) -> Runner | None:
        """The runner that adds the seed (``lynx_hf.core.make_plan`` binds it to plans that remap only)."""
        offloaded = self.offloaded

        def run(plan: RoutePlan, inputs: StepInputs) -> Routed:
            if plan.keeps(inputs.idx.shape[0]):
                return inner(plan, inputs)
            seed = offloaded.resident_seed(inputs.logits.device)
            return inner(plan, inputs if seed is None else inputs._replace(seed=seed))

        return run


def plan_stage(block, config) -> ResidentSeed | None:
    """The offload stage of ``block``'s plan (``lynx_hf.patcher.PLAN_STAGES``): a :class:`ResidentSeed` where its
    experts are read per expert (``block.offload``), else ``None``."""
    return None if block.offload is None else ResidentSeed(block.offload)


def layer_summary(block) -> dict:
    """The ``offload_*`` keys of one block's ``stats`` entry (empty when its experts are not read per expert)."""
    return {} if block.offload is None else block.offload.summary()


def transfer_ms(model, estimate: bool = False) -> dict[str, float | None]:
    """``{block name: measured ms to read and copy one expert from the offload store}`` of a patched model's
    offloaded blocks: the per-expert transfer cost a cost gate (``lynx_hf.gate``, ``extra_expert_ms``) adds to the
    saving of each avoided expert. Before any decode read a block gives ``None``, or with ``estimate=True`` its
    :meth:`OffloadedExperts.probe_ms`. Raises ``lynx_hf.errors.NotPatchedError``."""
    out = {}
    for block in state_of(model).blocks:
        offloaded = block.offload
        if offloaded is not None:
            measured = offloaded.transfer_ms()
            out[block.name] = offloaded.probe_ms() if measured is None and estimate else measured
    return out


__all__ = ["ExpertStore", "ExpertCache", "OffloadedExperts", "ResidentSeed", "offload_reason", "install", "remove",
           "reset", "plan_stage", "layer_summary", "transfer_ms"]
