"""Decisions as data: tables of gate decisions keyed by what the timed step runs (``lynx_hf.gate.key``).

Where a layer's decisions come from, first match wins (:meth:`DecisionStore.decisions`):

1. the user's table, ``LynxConfig.gate_table`` (written by ``lynx-hf tune``);
2. the tables the project ships for the machines it has measured (``lynx_hf/gate/tables/*.json``);
3. this process's memory of what it already read or measured;
4. the per-user cache, one file per device kind under :func:`cache_dir` (``$LYNX_HF_CACHE``, else
   ``$XDG_CACHE_HOME/lynx_hf``, else ``~/.cache/lynx_hf``), read under a file lock;
5. a measurement (``lynx_hf.gate.measure``), written to that cache atomically while the lock is held, so every later
   process, rank and run on this machine reads the same decision, and a second process that asked meanwhile waits
   and reads it instead of measuring again.

The format (one JSON object): ``{"format": 1, "entries": {digest: {"key": {...}, "decisions": {bucket: {...}},
"source": str, "seconds": float}}}``, ``decisions`` as ``GateDecision.to_dict``. Vllm's tuned fused-MoE configs and
Triton's autotune cache are the models: looked up by what the kernel depends on, measured once, never timed again in
the serving process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .decision import GateDecision
from .key import FORMAT, GateKey

#: the tables shipped with the package (one per measured machine kind)
SHIPPED_DIR = Path(__file__).with_name("tables")
#: the environment variable naming the per-user cache folder
CACHE_ENV = "LYNX_HF_CACHE"


def cache_dir() -> Path:
    """The per-user cache folder: ``$LYNX_HF_CACHE``, else ``$XDG_CACHE_HOME/lynx_hf``, else ``~/.cache/lynx_hf``."""
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "lynx_hf"


def slug(device: str) -> str:
    """A file name for a device kind (``lynx_hf.gate.key.device_kind``)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()[:120] or "device"


class DecisionTable:
    """One table of decisions: digest -> entry (the module docstring's format). ``path``: where it was read from
    (``None``: in memory)."""

    def __init__(self, entries: dict | None = None, path: Path | None = None) -> None:
        self.entries = dict(entries or {})
        self.path = path

    @classmethod
    def load(cls, path, missing_ok: bool = False) -> "DecisionTable":
        """Read ``path``. Raises ``FileNotFoundError`` (unless ``missing_ok``: an empty table) and ``ValueError`` for a
        file that is not a decision table of this format."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            if missing_ok:
                return cls(path=path)
            raise
        try:
            data = json.loads(text) if text.strip() else {"format": FORMAT, "entries": {}}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a lynx_hf gate decision table (not JSON: {exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError(f"{path}: not a lynx_hf gate decision table (no 'entries' object)")
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: gate decision table format {data.get('format')!r}, this lynx_hf reads {FORMAT}")
        return cls(data["entries"], path)

    def get(self, digest: str) -> dict | None:
        """``{bucket: GateDecision}`` of the entry ``digest``, or ``None``. Raises ``ValueError`` for a malformed
        entry (naming the file)."""
        entry = self.entries.get(digest)
        if entry is None:
            return None
        try:
            return {int(b): GateDecision.from_dict(d) for b, d in entry["decisions"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{self.path}: malformed gate decision entry {digest}: {exc!r}") from None

    def source(self, digest: str) -> str:
        return str(self.entries.get(digest, {}).get("source", ""))

    def put(self, key: GateKey, decisions: dict, source: str, seconds: float = 0.0) -> None:
        """Add (or replace) the entry of ``key``."""
        self.entries[key.digest()] = {"key": key.to_dict(), "source": source, "seconds": round(float(seconds), 3),
                                      "decisions": {str(b): d.to_dict() for b, d in sorted(decisions.items())}}

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "entries": self.entries}, indent=1, sort_keys=True) + "\n"

    def save(self, path=None) -> Path:
        """Write atomically (a temporary file in the same folder, then ``os.replace``). Returns the path."""
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a table from the other users of a machine
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.path = path
        return path


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock on ``path`` (created) for the body; a no-op where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class DecisionStore:
    """Where a process gets each layer's decisions (the module docstring's order). One per process
    (:data:`STORE`); safe under concurrent ``patch`` calls: one lock serializes lookups and measurements.

    ``memory``: digest -> (decisions, source) read or measured by this process; ``expert_times``: the batched-MLP
    expert timings (``lynx_hf.gate.measure.measure_bucket``); both emptied by :meth:`reset`.
    """

    def __init__(self, shipped_dir: Path | None = SHIPPED_DIR) -> None:
        self.shipped_dir = shipped_dir
        self.lock = threading.RLock()
        self.memory: dict = {}
        self.expert_times: dict = {}
        self._tables: dict = {}  # (path, mtime) -> DecisionTable
        self._warned: set = set()
        #: inside :meth:`refreshing`: the digests measured since it began (every other key is measured again)
        self._refreshed: set | None = None

    @contextlib.contextmanager
    def refreshing(self):
        """Within the body every key is measured again (once) and written to the per-user cache, whatever a table or
        the cache holds: ``lynx-hf tune``. Not re-entrant."""
        with self.lock:
            self._refreshed = set()
        try:
            yield self
        finally:
            with self.lock:
                self._refreshed = None

    def reset(self) -> None:
        """Forget what this process read or measured (the files stay)."""
        with self.lock:
            self.memory.clear()
            self.expert_times.clear()
            self._tables.clear()

    def _table(self, path: Path, missing_ok: bool = False) -> DecisionTable:
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            if missing_ok:
                return DecisionTable(path=path)
            raise
        cached = self._tables.get(path)
        if cached is None or cached[0] != mtime:
            cached = (mtime, DecisionTable.load(path, missing_ok=missing_ok))
            self._tables[path] = cached
        return cached[1]

    def shipped(self) -> list[DecisionTable]:
        """The shipped tables (sorted by file name)."""
        if self.shipped_dir is None or not self.shipped_dir.is_dir():
            return []
        return [self._table(p) for p in sorted(self.shipped_dir.glob("*.json"))]

    def cache_file(self, key: GateKey) -> Path:
        """The per-user cache file of ``key``'s device kind."""
        return cache_dir() / "gate" / f"{slug(key.device)}.json"

    def lookup(self, key: GateKey, user_table=None) -> tuple[dict, str] | None:
        """``(decisions, source)`` for ``key`` from a table or this process's memory, without measuring; ``None``
        where none has it (the per-user cache is read too). Raises ``FileNotFoundError`` / ``ValueError`` for a
        missing or malformed ``user_table``."""
        digest = key.digest()
        with self.lock:
            if self._refreshed is not None:  # lynx-hf tune: only what it measured itself
                return self.memory.get(digest) if digest in self._refreshed else None
            if user_table is not None:
                table = self._table(Path(user_table))
                hit = table.get(digest)
                if hit is not None:
                    return hit, f"table {user_table}"
            if digest in self.memory:
                return self.memory[digest]
            for table in self.shipped():
                hit = table.get(digest)
                if hit is not None:
                    self.memory[digest] = found = (hit, f"shipped table {table.path.name}")
                    return found
            path = self.cache_file(key)
            try:
                hit = self._table(path, missing_ok=True).get(digest)
            except (OSError, ValueError):
                hit = None
            if hit is not None:
                self.memory[digest] = found = (hit, f"cache {path}")
                return found
        return None

    def decisions(self, key: GateKey, measure, user_table=None) -> tuple[dict, str]:
        """``(decisions, source)`` for ``key``: from :meth:`lookup`, else ``measure()`` (``-> {bucket:
        GateDecision}``) under the cache file's lock (re-read first: another process may have measured meanwhile),
        written to the per-user cache atomically. A cache that cannot be written keeps the decisions in memory (one
        warning per folder). Raises what :meth:`lookup` raises."""
        found = self.lookup(key, user_table)
        if found is not None:
            return found
        digest = key.digest()
        path = self.cache_file(key)
        with self.lock, contextlib.ExitStack() as stack:
            if digest in self.memory and (self._refreshed is None or digest in self._refreshed):
                return self.memory[digest]  # another thread measured it while this one waited
            table = None
            try:
                stack.enter_context(file_lock(path.with_name(path.name + ".lock")))
                try:
                    table = DecisionTable.load(path, missing_ok=True)
                except ValueError:
                    table = DecisionTable(path=path)  # a corrupt cache is replaced
            except OSError as exc:
                self._warn_once(path.parent, f"lynx_hf: the gate's decision cache {path.parent} is not usable "
                                             f"({exc}); decisions are measured in each process")
            hit = None if table is None or self._refreshed is not None else table.get(digest)
            if hit is not None:  # another process measured it while this one waited for the lock
                self.memory[digest] = found = (hit, f"cache {path}")
                return found
            start = time.perf_counter()
            decisions = measure()
            seconds = time.perf_counter() - start
            source = f"measured in {seconds:.1f} s"
            if table is not None:
                table.put(key, decisions, source, seconds)
                try:
                    table.save(path)
                    source += f", cached in {path}"
                except OSError as exc:
                    self._warn_once(path.parent, f"lynx_hf: could not write the gate's decision cache {path} "
                                                 f"({exc}); decisions are measured in each process")
            self.memory[digest] = found = (decisions, source)
            if self._refreshed is not None:
                self._refreshed.add(digest)
            return found

    def _warn_once(self, where, message: str) -> None:
        if where not in self._warned:
            self._warned.add(where)
            warnings.warn(message, UserWarning, stacklevel=4)


#: this process's store
STORE = DecisionStore()
