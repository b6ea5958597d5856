"""numba's disk cache under processes that compile one function at once (lynx_hf.kernels.numba_cache).

Two processes compile *different* signatures of one cached function, both having read the (empty) index before
either writes it: numba's own cache gives both data file number 1, so the index ends up mapping one signature to the
other's machine code (seen as ``'descr' is NULL`` in 64 tests of one run and a 23 GB worker in another, pytest-xdist
on a fresh checkout). The window is widened by a delay before the index write, and both processes start together.
With :func:`cached_njit` a third process must load *both* signatures from the cache (no recompilation) and compute
the right values. On numba's plain ``njit(cache=True)`` the same run leaves one signature out of the index, or gives
it the other's code (checked by hand when this test was written: 1 of 2 signatures in the index)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

numba = pytest.importorskip("numba")

SOURCE = Path(__file__).resolve().parents[2] / "lynx_hf" / "kernels" / "numba_cache.py"

MODULE = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("numba_cache", {str(SOURCE)!r})
numba_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(numba_cache)


@numba_cache.cached_njit
def twice_plus_one(x):
    return x[0] * 2 + 1
'''

WORKER = '''
import json, sys, time
import numpy as np
from numba.core import caching
save_index = caching.IndexDataCacheFile._save_index
def slow(self, overloads):  # both processes have read the index by now
    time.sleep(1.5)
    return save_index(self, overloads)
caching.IndexDataCacheFile._save_index = slow
start, kind = float(sys.argv[1]), sys.argv[2]
while time.time() < start:
    time.sleep(0.01)
import racy
x = np.array([3], dtype=np.int64) if kind == "int" else np.array([1.5], dtype=np.float64)
print(json.dumps(float(racy.twice_plus_one(x))))
'''

CHECK = '''
import json
import numpy as np
import racy
f = racy.twice_plus_one
out = [float(f(np.array([3], dtype=np.int64))), float(f(np.array([1.5], dtype=np.float64)))]
print(json.dumps({"out": out, "hits": sum(f.stats.cache_hits.values()), "misses": sum(f.stats.cache_misses.values())}))
'''


def test_two_processes_compiling_different_signatures_leave_a_cache_both_can_load(tmp_path):
    from lynx_hf.kernels.numba_cache import LOCKABLE

    assert LOCKABLE, "numba's cache classes moved: cached_njit runs without a disk cache (correct, slower)"
    (tmp_path / "racy.py").write_text(MODULE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    start = time.time() + 4.0  # both import numba first, then compile together
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(start), kind], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kind in ("int", "float")]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    assert [json.loads(out) for out, _ in results] == [7.0, 4.0]
    check = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stderr[-2000:]
    report = json.loads(check.stdout)
    assert report["out"] == [7.0, 4.0]  # worked out by hand: 3 * 2 + 1, 1.5 * 2 + 1
    assert (report["hits"], report["misses"]) == (2, 0), report  # both signatures in the index, each its own code
    data = sorted(p.name for p in (tmp_path / "cache").rglob("*.nbc"))
    assert len(data) == 2, data


FIRST_USER = '''
import json
import numpy as np
import racy
print(json.dumps(float(racy.twice_plus_one(np.array([3], dtype=np.int64)))))
'''

OTHER_USER = '''
import json, os
real_open = os.open
def as_other_user(path, flags, *args, **kwargs):  # the first user's folder: this one may only read its lock file
    if str(path).endswith(".lock") and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        raise PermissionError(13, "Permission denied", str(path))
    return real_open(path, flags, *args, **kwargs)
os.open = as_other_user
import numpy as np
import racy
f = racy.twice_plus_one
out = float(f(np.array([3], dtype=np.int64)))
print(json.dumps({"out": out, "hits": sum(f.stats.cache_hits.values()), "misses": sum(f.stats.cache_misses.values())}))
'''


@pytest.mark.parametrize("lock_file", ["kept", "removed"])
def test_C57_a_numba_cache_another_user_filled_is_read_without_write_access(tmp_path, lock_file):
    """CASES C57: a numba cache folder one user filled (``NUMBA_CACHE_DIR`` shared, or a package's ``__pycache__``);
    another user may not write its lock file (simulated: tests run as root, so ``os.open`` of the lock file for writing
    raises ``PermissionError``). That user's call loads the cached code (one hit, no compile) and computes 3 * 2 + 1
    = 7: with the lock file opened read-only, or, where there is none and none can be made, without the lock as numba
    alone reads it. Before: ``PermissionError`` out of the call (a decode step)."""
    (tmp_path / "racy.py").write_text(MODULE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "-c", FIRST_USER], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0 and json.loads(first.stdout) == 7.0, first.stderr[-2000:]
    locks = list((tmp_path / "cache").rglob("*.lock"))
    assert len(locks) == 1
    if lock_file == "removed":
        locks[0].unlink()
    other = subprocess.run([sys.executable, "-c", OTHER_USER], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    assert json.loads(other.stdout) == {"out": 7.0, "hits": 1, "misses": 0}
