"""numba's on-disk cache, safe when several processes compile the same function at once.

numba (``cache=True``) keeps, per function, an index file (``<name>.nbi``: signature -> data file) and one data file
per compiled signature (``<name>.<i>.nbc``). Saving a new signature reads the index, takes the first free number,
writes the index, then the data (``numba.core.caching.IndexDataCacheFile.save``), with no lock between processes.
Two processes that compile *different* signatures of one function at the same time (pytest-xdist workers, vLLM's
tensor-parallel workers, data-parallel lm-eval runs, a fresh checkout) can both take number 1: the index then maps one
signature to the other signature's machine code, and every later process loads it. Seen here as ``RuntimeError: In
'NRT_adapt_ndarray_to_python', 'descr' is NULL`` in 64 tests of one run and a worker killed for 23 GB of memory in
another (numba issues #4807, #10128: open).

:func:`cached_njit` compiles like ``numba.njit(cache=True, nogil=True)`` and replaces the dispatcher's cache with
:class:`LockedFunctionCache`: saving an overload holds an exclusive ``flock`` on ``<index>.lock`` beside the index
(read index, number, write index, write data: one step for every process), loading holds a shared one (the index and
the data it names are read from one writer's state). Where the numba release lacks the classes this relies on, or
the platform has no ``fcntl``, the disk cache is switched off (each process compiles once: about a second per
function), never left racy.
"""

from __future__ import annotations

import contextlib
import os

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms
    fcntl = None

try:
    import numba
    from numba.core import caching as _caching

    _BASE = _caching.FunctionCache
except (ImportError, AttributeError):  # pragma: no cover - without numba, or a numba that moved these
    numba = None
    _caching = None
    _BASE = object


class LockedFunctionCache(_BASE):
    """numba's ``FunctionCache`` whose save (exclusive) and load (shared) hold a file lock beside the index.

    A cache folder this user may only read (one user filled it for everyone, docs/cases.md C57): the lock file is
    opened read-only (``flock`` needs no write access); where it cannot be opened at all, a load reads without the
    lock (as numba alone does) and a save is skipped. A save that fails with ``OSError`` keeps the compiled function
    in memory: the disk cache never raises into a decode step."""

    @contextlib.contextmanager
    def _locked(self, mode):
        index = getattr(self._cache_file, "_index_path", None) or os.path.join(self._cache_path, "numba-index")
        fd = None
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                if flags & os.O_CREAT:
                    os.makedirs(self._cache_path, exist_ok=True)
                fd = os.open(index + ".lock", flags, 0o666)
                break
            except OSError:
                continue
        if fd is None:
            yield False
            return
        try:
            fcntl.flock(fd, mode)
            yield True
        finally:
            os.close(fd)  # releases the lock

    def save_overload(self, sig, data):
        with self._locked(fcntl.LOCK_EX) as locked:
            if not locked:  # no lock: never write racily (the compiled function stays in memory)
                return
            try:
                super().save_overload(sig, data)
            except OSError:  # a folder that cannot be written
                pass

    def load_overload(self, sig, target_context):
        with self._locked(fcntl.LOCK_SH):
            return super().load_overload(sig, target_context)


def _lockable() -> bool:
    if numba is None or fcntl is None:
        return False
    probe = getattr(_caching, "IndexDataCacheFile", None)
    return probe is not None and all(hasattr(_BASE, name) for name in ("save_overload", "load_overload"))


LOCKABLE = _lockable()


def cached_njit(fn):
    """``numba.njit(cache=True, nogil=True)(fn)`` with :class:`LockedFunctionCache` (or no disk cache where it cannot
    lock; see the module docstring). ``fn`` unchanged when numba is not installed."""
    if numba is None:
        return fn
    dispatcher = numba.njit(cache=LOCKABLE, nogil=True)(fn)
    if LOCKABLE:
        dispatcher._cache = LockedFunctionCache(dispatcher.py_func)
    return dispatcher
