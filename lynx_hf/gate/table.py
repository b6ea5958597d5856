"""Decisions as data: tables of gate decisions keyed by what the timed step runs (``lynx_hf.gate.key``).

Where a layer's decisions come from, first match wins (:meth:`DecisionStore.decisions`):

1. the user's table, ``LynxConfig.gate_table`` (written by ``lynx-hf tune``);
2. the tables the project ships for the machines it has measured (``lynx_hf/gate/tables/<device kind>.<what it
   holds>.json``);
3. this process's memory of what it already read or measured;
4. the per-user cache, one file per device kind and format under :func:`cache_dir` (``$LYNX_HF_CACHE``, else
   ``$XDG_CACHE_HOME/lynx_hf``, else ``~/.cache/lynx_hf``; ``~`` and ``$VAR`` expanded), read under a file lock;
5. a measurement (``lynx_hf.gate.measure``), written to that cache atomically while the lock is held, so every later
   process, rank and run on this machine reads the same decision, and a second process that asked meanwhile waits
   and reads it instead of measuring again.

The format (one JSON object): ``{"format": 2, "entries": {digest: {"key": {...}, "decisions": {bucket: {...}},
"source": str, "seconds": float}}}``, ``decisions`` as ``GateDecision.to_dict``. Vllm's tuned fused-MoE configs and
Triton's autotune cache are the models: looked up by what the kernel depends on, measured once, never timed again in
the serving process.

What the store promises (``docs/guarantees.md``, "The decision store"): every entry is decoded and checked when its
file is read, before any model is touched. A user's table with a bad entry is refused whole (``ValueError``, which
``patch`` raises as ``LynxConfigError`` before it changes anything); a bad entry of the per-user cache is skipped
(one warning per file), measured again and replaced in the file; entries it cannot read and does not need stay as
they are, and a cache file of another format (another lynx_hf build) is never rewritten. A folder that cannot be
written, or no home folder at all, keeps the decisions in this process's memory (one warning); no lookup raises out
of ``patch`` or a decode step. The locks are re-created in a forked child (``os.register_at_fork``).
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
import weakref
from pathlib import Path

from .decision import TUNING, GateDecision
from .key import FORMAT, GateKey

#: the tables shipped with the package (one per measured machine kind)
SHIPPED_DIR = Path(__file__).with_name("tables")
#: the environment variable naming the per-user cache folder
CACHE_ENV = "LYNX_HF_CACHE"


def _expand(value: str) -> str:
    """``~`` and ``$VAR`` / ``${VAR}`` expanded, as huggingface_hub (``HF_HOME``) and torch.hub (``TORCH_HOME``) do."""
    return os.path.expandvars(os.path.expanduser(value))


def cache_dir() -> Path | None:
    """The per-user cache folder: ``$LYNX_HF_CACHE``, else ``$XDG_CACHE_HOME/lynx_hf``, else ``~/.cache/lynx_hf``,
    with ``~`` and environment variables expanded (as huggingface_hub and torch.hub resolve theirs). A relative
    ``XDG_CACHE_HOME`` is ignored (the XDG Base Directory specification); a relative ``LYNX_HF_CACHE`` is taken from
    the working folder, as ``HF_HOME`` is. ``None`` where no folder can be named (no ``LYNX_HF_CACHE``, no absolute
    ``XDG_CACHE_HOME``, and neither ``HOME`` nor a password entry gives a home folder): the decision store then keeps
    its decisions in memory. Never raises."""
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(_expand(explicit))
    base = _expand(os.environ.get("XDG_CACHE_HOME", "").strip())
    if base and os.path.isabs(base):
        return Path(base) / "lynx_hf"
    try:
        home = os.path.expanduser("~")
    except (KeyError, ImportError, OSError, RuntimeError):  # no passwd entry on some platforms' lookups
        home = "~"
    if not home or home.startswith("~") or not os.path.isabs(home):
        return None
    return Path(home) / ".cache" / "lynx_hf"


def cache_name(device: str, format: int = FORMAT) -> str:
    """The per-user cache file of a device kind in a table format: ``<slug>.json`` for format 1 (the name it had
    before formats were named), ``<slug>.format<N>.json`` for any other, so builds of different formats keep files of
    their own."""
    return f"{slug(device)}.json" if format == 1 else f"{slug(device)}.format{format}.json"


def slug(device: str) -> str:
    """A file name for a device kind (``lynx_hf.gate.key.device_kind``)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()[:120] or "device"


class ForeignTableError(ValueError):
    """A decision file of another format (another lynx_hf build): read by none of its entries, never rewritten."""


def decode_entry(entry, tuning=TUNING, digest: str | None = None) -> dict:
    """``{bucket: GateDecision}`` of one stored entry (the module docstring's format), every field checked. An entry
    whose key names ``tuning`` (its digest) must hold exactly that tuning's buckets; one stored under ``digest``
    whose key is a :class:`~lynx_hf.gate.key.GateKey` must hash to it (so no entry is served under another key's
    index). Raises ``ValueError`` saying what is wrong (a ``KeyError`` / ``TypeError`` of a field is turned into
    one)."""
    if not isinstance(entry, dict):
        raise ValueError(f"an entry must be an object, got {type(entry).__name__}")
    decisions = entry.get("decisions")
    if not isinstance(decisions, dict) or not decisions:
        raise ValueError("no 'decisions' object of step sizes")
    out = {}
    for bucket, values in decisions.items():
        try:
            b = int(bucket)
        except ValueError:
            raise ValueError(f"step size {bucket!r} is not an integer") from None
        if b < 1:
            raise ValueError(f"step size {bucket!r} is below 1")
        try:
            out[b] = GateDecision.from_dict(values)
        except KeyError as exc:
            raise ValueError(f"step size {bucket}: field {exc.args[0]!r} missing") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"step size {bucket}: {exc}") from None
    key = entry.get("key")
    if digest is not None and isinstance(key, dict):
        try:
            stated = GateKey.from_dict(key).digest()
        except (KeyError, TypeError, ValueError):  # not a key of this format: nothing to check it against
            stated = None
        if stated is not None and stated != digest:
            raise ValueError(f"its key hashes to {stated}, not to the digest it is stored under (a hand-edited key: "
                             f"its decisions may be another key's, e.g. an older measuring code's)")
    if isinstance(key, dict) and key.get("tuning") == tuning.digest() and set(out) != set(tuning.buckets):
        missing = sorted(set(tuning.buckets) - set(out))
        raise ValueError(f"step sizes {sorted(out)} are not the tuning's {list(tuning.buckets)}"
                         + (f" (missing {missing})" if missing else ""))
    return out


class DecisionTable:
    """One table of decisions: digest -> entry (the module docstring's format). ``path``: where it was read from
    (``None``: in memory). ``entries`` hold every entry as stored (an entry this build cannot read stays, so saving
    the table keeps it); ``bad``: digest -> why, for the entries that failed their check when read leniently."""

    def __init__(self, entries: dict | None = None, path: Path | None = None) -> None:
        self.entries = dict(entries or {})
        self.path = path
        self.bad: dict = {}
        self._decoded: dict = {}

    @classmethod
    def load(cls, path, missing_ok: bool = False, strict: bool = True) -> "DecisionTable":
        """Read ``path`` and check every entry (:func:`decode_entry`).

        ``strict`` (a user's table): one bad entry refuses the whole file (``ValueError`` naming the entry and what is
        wrong); else (the per-user cache, the shipped tables) a bad entry is recorded in :attr:`bad` and kept as
        stored, and :meth:`get` misses it. Raises ``FileNotFoundError`` (unless ``missing_ok``: an empty table),
        :class:`ForeignTableError` (a ``ValueError``) for a decision table of another format, ``ValueError`` for a
        file that is not a decision table (not JSON, no ``entries`` object)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            if missing_ok:
                return cls(path=path)
            raise
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a lynx_hf gate decision table (not text: {exc})") from None
        try:
            data = json.loads(text) if text.strip() else {"format": FORMAT, "entries": {}}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a lynx_hf gate decision table (not JSON: {exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError(f"{path}: not a lynx_hf gate decision table (no 'entries' object)")
        if data.get("format") != FORMAT:
            raise ForeignTableError(f"{path}: gate decision table format {data.get('format')!r}, this lynx_hf "
                                    f"reads {FORMAT}")
        table = cls(data["entries"], path)
        for digest, entry in table.entries.items():
            try:
                table._decoded[digest] = decode_entry(entry, digest=digest)
            except ValueError as exc:
                if strict:
                    raise ValueError(f"{path}: gate decision entry {digest} is not a valid decision: {exc}") from None
                table.bad[digest] = str(exc)
        return table

    def get(self, digest: str) -> dict | None:
        """``{bucket: GateDecision}`` of the entry ``digest``, or ``None`` (none, or a bad entry: :attr:`bad`)."""
        hit = self._decoded.get(digest)
        return None if hit is None else dict(hit)

    def source(self, digest: str) -> str:
        return str(self.entries.get(digest, {}).get("source", ""))

    def put(self, key: GateKey, decisions: dict, source: str, seconds: float = 0.0) -> None:
        """Add (or replace) the entry of ``key``."""
        digest = key.digest()
        self.entries[digest] = {"key": key.to_dict(), "source": source, "seconds": round(float(seconds), 3),
                                "decisions": {str(b): d.to_dict() for b, d in sorted(decisions.items())}}
        self._decoded[digest] = dict(decisions)
        self.bad.pop(digest, None)

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
    """An exclusive advisory lock on ``path`` for the body: the file is created where the folder can be written, else
    an existing one opened read-only (``flock`` needs no write access: a folder another user filled); a no-op where
    ``fcntl`` is missing. Raises ``OSError`` where the lock file can be neither created nor opened."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError:  # no write access (another user's lock file, a read-only folder or file system): read-only
        f = open(path)
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


#: every store of this process, for :func:`_after_fork`
_STORES: "weakref.WeakSet[DecisionStore]" = weakref.WeakSet()


class DecisionStore:
    """Where a process gets each layer's decisions (the module docstring's order). One per process
    (:data:`STORE`); safe under concurrent ``patch`` calls: one lock serializes lookups and measurements, re-created
    in a child forked while another thread held it (``os.fork`` during a measurement: the child would wait forever).

    ``memory``: digest -> (decisions, source) read or measured by this process; ``expert_times``: the batched-MLP
    expert timings (``lynx_hf.gate.measure.measure_bucket``); both emptied by :meth:`reset`.
    """

    def __init__(self, shipped_dir: Path | None = SHIPPED_DIR) -> None:
        self.shipped_dir = shipped_dir
        self.lock = threading.RLock()
        self.memory: dict = {}
        self.expert_times: dict = {}
        self._tables: dict = {}  # path -> (mtime, DecisionTable)
        self._warned: set = set()
        #: inside :meth:`refreshing`: the digests measured since it began (every other key is measured again)
        self._refreshed: set | None = None
        _STORES.add(self)

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by a thread the child does not have)."""
        self.lock = threading.RLock()

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

    def _table(self, path: Path, missing_ok: bool = False, strict: bool = True) -> DecisionTable:
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            if missing_ok:
                return DecisionTable(path=path)
            raise
        cached = self._tables.get((path, strict))
        if cached is None or cached[0] != mtime:
            cached = (mtime, DecisionTable.load(path, missing_ok=missing_ok, strict=strict))
            self._tables[(path, strict)] = cached
        return cached[1]

    def shipped(self) -> list[DecisionTable]:
        """The shipped tables (sorted by file name; read leniently: a bad entry is skipped, never raised)."""
        if self.shipped_dir is None or not self.shipped_dir.is_dir():
            return []
        out = []
        for p in sorted(self.shipped_dir.glob("*.json")):
            try:
                out.append(self._table(p, strict=False))
            except (OSError, ValueError) as exc:
                self._warn_once(p, f"lynx_hf: the shipped gate decision table {p} is not readable ({exc}); skipped")
        return out

    def user_table(self, path) -> DecisionTable:
        """The user's table ``path`` (``LynxConfig.gate_table``; ``~`` and ``$VAR`` expanded as for the cache folder),
        every entry checked. Raises ``FileNotFoundError`` / ``ValueError`` (naming the file and the entry) for a
        missing or bad table."""
        return self._table(Path(_expand(str(path))))

    def cache_file(self, key: GateKey) -> Path | None:
        """The per-user cache file of ``key``'s device kind in this build's format (:func:`cache_name`), or ``None``
        where no cache folder can be named (:func:`cache_dir`)."""
        folder = cache_dir()
        return None if folder is None else folder / "gate" / cache_name(key.device)

    def _no_cache(self) -> None:
        self._warn_once("no cache folder", "lynx_hf: no folder for the gate's decision cache (no LYNX_HF_CACHE, no "
                        "absolute XDG_CACHE_HOME, no home folder); decisions are kept in memory and measured in each "
                        "process (set LYNX_HF_CACHE to keep them)")

    def _cached(self, path: Path, digest: str) -> dict | None:
        """The per-user cache's decisions of ``digest`` (``None``: none, a file that cannot be read, or a bad entry,
        warned once per file: measured again and replaced)."""
        try:
            table = self._table(path, missing_ok=True, strict=False)
        except (OSError, ValueError):
            return None
        if digest in table.bad:
            self._warn_once((path, "bad"), f"lynx_hf: the gate's decision cache {path} holds an entry that is not a "
                            f"valid decision ({digest}: {table.bad[digest]}); it is measured again and replaced")
        return table.get(digest)

    def lookup(self, key: GateKey, user_table=None) -> tuple[dict, str] | None:
        """``(decisions, source)`` for ``key`` from a table or this process's memory, without measuring; ``None``
        where none has it (the per-user cache is read too). Raises ``FileNotFoundError`` / ``ValueError`` for a
        missing or bad ``user_table`` (``patch`` checks it before anything changes: ``LynxConfigError``)."""
        digest = key.digest()
        with self.lock:
            if self._refreshed is not None:  # lynx-hf tune: only what it measured itself
                return self.memory.get(digest) if digest in self._refreshed else None
            if user_table is not None:
                hit = self.user_table(user_table).get(digest)
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
            hit = None if path is None else self._cached(path, digest)
            if hit is not None:
                self.memory[digest] = found = (hit, f"cache {path}")
                return found
        return None

    def _open_cache(self, path: Path, stack: contextlib.ExitStack) -> DecisionTable | None:
        """The per-user cache file ``path`` read under its lock (entered on ``stack``), ready to take a new entry;
        ``None`` where it must not or cannot be written (warned once per file or folder): a file of another format
        (another build's: left as it is), a folder that cannot be written. A file that is not a decision table at all
        is moved aside to ``<name>.unreadable`` (kept, not erased) and a new one started."""
        try:
            stack.enter_context(file_lock(path.with_name(path.name + ".lock")))
        except OSError as exc:
            self._warn_once(path.parent, f"lynx_hf: the gate's decision cache {path.parent} is not usable ({exc}); "
                                         f"decisions are measured in each process")
            return None
        try:
            return DecisionTable.load(path, missing_ok=True, strict=False)
        except ForeignTableError as exc:
            self._warn_once(path, f"lynx_hf: {exc}; that file is left as it is (another lynx_hf build's) and these "
                                  f"decisions are kept in memory")
            return None
        except OSError as exc:  # a file this user may not read: not this process's to move
            self._warn_once(path, f"lynx_hf: the gate's decision cache {path} cannot be read ({exc}); decisions are "
                                  f"kept in memory")
            return None
        except ValueError as exc:
            aside = path.with_name(path.name + ".unreadable")
            try:
                os.replace(path, aside)
            except OSError:
                self._warn_once(path, f"lynx_hf: {exc}; decisions are kept in memory")
                return None
            self._warn_once(path, f"lynx_hf: {exc}; moved to {aside}, a new cache file is started")
            return DecisionTable(path=path)

    def decisions(self, key: GateKey, measure, user_table=None) -> tuple[dict, str]:
        """``(decisions, source)`` for ``key``: from :meth:`lookup`, else ``measure()`` (``-> {bucket:
        GateDecision}``) under the cache file's lock (re-read first: another process may have measured meanwhile),
        written to the per-user cache atomically (a bad entry of that key replaced, every other entry kept as it
        was). A cache that cannot be written, or none at all, keeps the decisions in memory (one warning per folder
        or file). Raises what :meth:`lookup` raises."""
        found = self.lookup(key, user_table)
        if found is not None:
            return found
        digest = key.digest()
        path = self.cache_file(key)
        with self.lock, contextlib.ExitStack() as stack:
            if digest in self.memory and (self._refreshed is None or digest in self._refreshed):
                return self.memory[digest]  # another thread measured it while this one waited
            if path is None:
                self._no_cache()
                table = None
            else:
                table = self._open_cache(path, stack)
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


def _after_fork() -> None:
    for store in list(_STORES):
        store._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

#: this process's store
STORE = DecisionStore()
