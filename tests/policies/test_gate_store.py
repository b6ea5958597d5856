"""The cost gate's decision store (``lynx_hf.gate.table``) under data and deployments as they come (docs/cases.md
C56-C58): an entry that is JSON but not a decision, a file of another build, paths with ``~`` / ``$VAR`` / relative
values / no home, a lock file this user may only read, a fork during a measurement. No timed assertion: the
measurement is replaced by fixed decisions (``fixed_gate``), so what is asserted is where decisions come from and what
the files hold afterwards."""

import json
import os
import signal
import threading
import time

import pytest
import torch

import lynx_hf
import lynx_hf.gate.stage as gs
import lynx_hf.gate.table as gt
from helpers import families as fam
from lynx_hf import gate


def _decision(on: bool) -> gate.GateDecision:
    d = gate.decide(1.0, 10.0 if on else 0.0, 0.5)
    return gate.GateDecision(d.on, d.cost_ms, d.saving_ms, d.experts_saved, d.expert_ms, experts_before=20.0,
                             experts_after=10.0 if on else 20.0, reason=d.reason)


@pytest.fixture
def fixed_gate(monkeypatch, fresh_gate_store):
    """The measurement replaced by fixed decisions, on at every step size of 4 tokens and more (3 x 4 experts saved at
    0.5 ms against 1 ms: on; nothing saved: off). Returns the list of gates measured."""
    calls = []

    def measure_layer(planned, expert_times, tuning=gate.TUNING):
        calls.append(planned)
        return {b: _decision(b >= 4) for b in tuning.buckets}

    monkeypatch.setattr(gs, "measure_layer", measure_layer)
    return calls


def _gate(model) -> gate.PlanGate:
    return gate.of(lynx_hf.patcher._state(model).blocks[0].plan)


def _untouched(model) -> bool:
    """No lynx_hf state, hook or instance attribute left on any module."""
    return not lynx_hf.is_patched(model) and not any(
        m._forward_hooks or m._forward_pre_hooks or "generate" in m.__dict__ for m in model.modules())


def _cache_file(folder) -> "os.PathLike":
    (path,) = (folder / "gate").glob("*.json")
    return path


# -- C56: entries that are JSON but not decisions; files of other builds -----------------------------------------
BAD_ENTRIES = {
    "on is 1": lambda d: d["4"].update(on=1),
    "cost_ms missing": lambda d: d["4"].pop("cost_ms"),
    "cost_ms a string": lambda d: d["8"].update(cost_ms="0.3"),
    "a step size lost": lambda d: d.pop("16"),
}


@pytest.mark.parametrize("edit", list(BAD_ENTRIES), ids=list(BAD_ENTRIES))
def test_C56_a_user_table_with_a_bad_entry_is_refused_before_the_model_changes(edit, fixed_gate, tmp_path):
    """CASES C56: the entry of the model's own key edited by hand (``"on": 1``, a missing ``cost_ms``, ...): ``patch``
    raises ``LynxConfigError`` naming the table and the entry, and the model is untouched (before: a ``ValueError``
    after the hooks and ``generate`` were installed). A re-patch with that table keeps the config the model runs."""
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    planned = _gate(model)
    table = gate.DecisionTable()
    table.put(planned.key, planned.decisions, "test")
    BAD_ENTRIES[edit](table.entries[planned.key.digest()]["decisions"])
    path = tmp_path / "table.json"
    table.save(path)

    with pytest.raises(lynx_hf.LynxConfigError, match=f"gate_table.*{planned.key.digest()}.*not a valid decision"):
        lynx_hf.patch(model, policy="lynx", gate_table=str(path))  # a re-patch: the running config stays
    assert lynx_hf.config_of(model).gate_table is None and _gate(model).decisions == planned.decisions
    fresh = fam.build("qwen2_moe")
    with pytest.raises(lynx_hf.LynxConfigError, match="not a valid decision"):
        lynx_hf.patch(fresh, policy="lynx", gate_table=str(path))
    assert _untouched(fresh)


@pytest.mark.parametrize("edit", list(BAD_ENTRIES), ids=list(BAD_ENTRIES))
def test_C56_a_bad_cache_entry_is_measured_again_and_replaced(edit, fixed_gate, fresh_gate_store):
    """CASES C56: the per-user cache's entry of the model's key edited into a non-decision: the next process (the
    store emptied) warns once, measures again, patches, and the file holds a valid entry again (before: ``patch``
    raised ``ValueError`` in every later process, the entry never replaced). The process after reads it."""
    lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx", gate="auto")
    path = _cache_file(fresh_gate_store)
    data = json.loads(path.read_text())
    (digest, entry), = data["entries"].items()
    measured = {int(b): gate.GateDecision.from_dict(d) for b, d in entry["decisions"].items()}
    BAD_ENTRIES[edit](entry["decisions"])
    path.write_text(json.dumps(data))
    assert len(fixed_gate) == 1

    gate.STORE.reset()
    model = fam.build("qwen2_moe")
    with pytest.warns(UserWarning, match=f"{digest}.*measured again and replaced"):
        lynx_hf.patch(model, policy="lynx", gate="auto")
    assert lynx_hf.is_patched(model) and len(fixed_gate) == 2
    assert _gate(model).decisions == measured
    assert gt.decode_entry(json.loads(path.read_text())["entries"][digest]) == measured  # the file repaired

    gate.STORE.reset()
    again = fam.build("qwen2_moe")
    lynx_hf.patch(again, policy="lynx", gate="auto")
    assert len(fixed_gate) == 2 and _gate(again).source == f"cache {path}"


def test_C56_a_cache_file_of_another_build_is_left_as_it_is(fixed_gate, fresh_gate_store):
    """CASES C56: the cache file this build would write holds another format (another lynx_hf build's): the patch
    decides (measured, kept in memory, one warning) and the file is byte for byte what the other build wrote (before:
    replaced by this build's, the other build's decisions erased)."""
    lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx", gate="auto")
    path = _cache_file(fresh_gate_store)
    other = gate.FORMAT + 1
    foreign = json.dumps({"format": other, "entries": {"0123456789abcdef0123": {"decisions": {"1": {"on": "maybe"}}}}})
    path.write_text(foreign)
    gate.STORE.reset()
    model = fam.build("qwen2_moe")
    with pytest.warns(UserWarning, match=f"format {other}.*left as it is"):
        lynx_hf.patch(model, policy="lynx", gate="auto")
    assert lynx_hf.is_patched(model) and len(fixed_gate) == 2 and _gate(model).source.startswith("measured")
    assert path.read_text() == foreign


def test_C56_a_cache_file_that_is_no_table_is_kept_aside(fixed_gate, fresh_gate_store):
    """A cache file that is not a decision table at all is moved to ``<name>.unreadable`` (kept), and a new cache
    started (before: overwritten)."""
    lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx", gate="auto")
    path = _cache_file(fresh_gate_store)
    path.write_text("not json {")
    gate.STORE.reset()
    with pytest.warns(UserWarning, match="not JSON.*moved to"):
        lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx", gate="auto")
    assert path.with_name(path.name + ".unreadable").read_text() == "not json {"
    assert len(json.loads(path.read_text())["entries"]) == 1


def _code_digest(source: str) -> str:
    """A hash of a module's code: its syntax tree without docstrings, comments, layout or the ``MEASURE_VERSION``
    assignment itself (so a reworded comment does not count as a change of what is measured), written back as source
    by ``ast.unparse`` (stable across Python releases, unlike ``ast.dump``'s field listing)."""
    import ast
    import hashlib

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "MEASURE_VERSION" for t in n.targets))]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]


#: the code of each measuring version (``lynx_hf/gate/measure.py``, :func:`_code_digest`). A change to that code fails
#: :func:`test_measure_version_pins_the_measuring_code`: bump ``MEASURE_VERSION`` (every stored decision of the older
#: code then misses: measured again) and pin the new digest here, with a line saying what changed.
MEASURED_CODE = {
    # L2 flushed between CUDA expert timings, the experts path each step size runs, a captured engine's cost as a
    # graph replay, an expert-parallel rank's own share of the saving
    2: "b405edf0358858e4",
}


def test_measure_version_pins_the_measuring_code():
    """The measuring code hashes to the digest pinned for ``MEASURE_VERSION``: a change to what is timed or how a
    bucket is decided cannot ship under an older version (the L2-flush change once did: CUDA expert costs x 2.5, and
    caches written before it were still served). The hash sees code, not prose: a mutated constant changes it, a
    reworded docstring or comment does not."""
    from pathlib import Path

    import lynx_hf.gate.measure as gm

    source = Path(gm.__file__).read_text(encoding="utf-8")
    digest = _code_digest(source)
    assert MEASURED_CODE.get(gate.MEASURE_VERSION) == digest, (
        f"lynx_hf/gate/measure.py's code hashes to {digest}, not to the digest pinned for MEASURE_VERSION "
        f"{gate.MEASURE_VERSION}: bump MEASURE_VERSION and pin the new digest in MEASURED_CODE")
    assert "L2_FLUSH_BYTES = 256 << 20" in source
    assert _code_digest(source.replace("L2_FLUSH_BYTES = 256 << 20", "L2_FLUSH_BYTES = 0")) != digest
    assert _code_digest(source.replace("MEASURE_VERSION = ", "# reworded\nMEASURE_VERSION = ", 1)) == digest
    assert _code_digest(source.replace('"""Measuring', '"""Timing', 1)) == digest


def test_stale_cache_of_an_older_measuring_code_is_measured_again(fixed_gate, fresh_gate_store):
    """A per-user cache written by the measuring code before this one (``MEASURE_VERSION - 1``, its key otherwise the
    same) is never served: the patch measures again, adds its entry, and the older one stays byte for byte (the build
    that wrote it still reads it). The stale decisions (on at every step size) differ from the measured ones (off
    below 4 tokens), so serving them would show. An entry of the older code filed under this key's digest (a hand
    edit) is no decision of this key either: warned, measured again, replaced."""
    import dataclasses

    lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx", gate="auto")
    assert len(fixed_gate) == 1
    path = _cache_file(fresh_gate_store)
    (digest, entry), = json.loads(path.read_text())["entries"].items()
    key = gate.GateKey.from_dict(entry["key"])
    assert key.digest() == digest and key.measure == gate.MEASURE_VERSION
    stale_key = dataclasses.replace(key, measure=gate.MEASURE_VERSION - 1)
    stale = {b: _decision(True) for b in gate.BUCKETS}
    table = gate.DecisionTable()
    table.put(stale_key, stale, "the older measuring code")
    table.save(path)
    stale_entry = json.loads(path.read_text())["entries"][stale_key.digest()]

    gate.STORE.reset()
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    assert len(fixed_gate) == 2 and _gate(model).source.startswith("measured")
    assert _gate(model).key == key and _gate(model).decisions == {b: _decision(b >= 4) for b in gate.BUCKETS}
    assert _gate(model).decisions != stale
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {digest, stale_key.digest()} and entries[stale_key.digest()] == stale_entry

    entries[digest] = stale_entry  # the older code's entry under this key's digest
    path.write_text(json.dumps({"format": gate.FORMAT, "entries": entries}))
    gate.STORE.reset()
    again = fam.build("qwen2_moe")
    with pytest.warns(UserWarning, match=f"{digest}.*hashes to {stale_key.digest()}"):
        lynx_hf.patch(again, policy="lynx", gate="auto")
    assert len(fixed_gate) == 3 and _gate(again).decisions == {b: _decision(b >= 4) for b in gate.BUCKETS}
    assert json.loads(path.read_text())["entries"][digest]["key"]["measure"] == gate.MEASURE_VERSION


def test_stale_keys_never_come_from_a_rename_they_are_readable_fields():
    """A key names what was measured (declared fields, as vLLM names its tuned configs), never a function or class of
    this package: renaming the policy's class and the decode-step function leaves the key (format 1 described them by
    qualified name: a rename missed every table), while a measured fact (H, the dtype, the telemetry mode) changes it.
    The fields are hand-written here (the oracle), the engine's description made plain (a function in it ``None``)."""
    from lynx_hf import LynxConfig, core

    plan = core.make_plan(LynxConfig(routing_backend="torch", tau=1.0, mass_price=None), core.MoELayer(16, 4, "cpu"))
    shape = gate.LayerShape(16, 4, 64, 32, torch.bfloat16, torch.bfloat16)
    engine = {"family": "qwen2_moe", "weight": core.WeightRule("softmax_all"), "scores": len}
    key = gate.make_key(plan, shape, engine, True)
    fields = key.to_dict()
    assert {k: fields[k] for k in ("num_experts", "top_k", "hidden", "intermediate", "dtype", "expert_dtype", "policy",
                                   "backend", "expert_path", "telemetry", "captured", "mixed", "ep_size", "format",
                                   "measure")} == {
        "num_experts": 16, "top_k": 4, "hidden": 64, "intermediate": 32, "dtype": "torch.bfloat16",
        "expert_dtype": "torch.bfloat16", "policy": "lynx", "backend": "torch", "expert_path": "model",
        "telemetry": "full", "captured": False, "mixed": False, "ep_size": 1, "format": gate.FORMAT,
        "measure": gate.MEASURE_VERSION}
    assert fields["params"]["tau"] == 1.0 and fields["params"]["mass_price"] is None
    assert fields["engine"] == {"family": "qwen2_moe", "scores": None, "weight": {"kind": "softmax_all", "renormalize": False,
                                                                  "scale": 1.0, "renorm_eps": 0.0}}
    assert fields["step"] in ("fused", "remap") and "lynx_hf" not in json.dumps(fields)
    assert "N=16,k=4,H=64,I=32,dtype=bfloat16" in key.readable()

    renamed = type("RenamedPolicy", (type(plan.policy),), {"__module__": "lynx_hf.policies.renamed"})()
    step, names = plan.kernel, (plan.kernel.__name__, plan.kernel.__qualname__)
    try:
        step.__name__ = step.__qualname__ = "renamed_step"
        assert gate.make_key(dataclasses_replace(plan, policy=renamed), shape, engine, True).digest() == key.digest()
    finally:
        step.__name__, step.__qualname__ = names
    for changed in (dataclasses_replace(shape, hidden=128), dataclasses_replace(shape, dtype=torch.float32)):
        assert gate.make_key(plan, changed, engine, True).digest() != key.digest()
    assert gate.make_key(plan, shape, engine, "counts").telemetry == "counts"


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# -- C57: paths as deployments write them -------------------------------------------------------------------------
def test_C57_cache_paths_resolve_as_huggingface_hub_and_torch_hub_do(monkeypatch, tmp_path):
    """``~`` and ``$VAR`` expanded (before: ``~/lynx-gate`` made a folder named ``~`` in each working folder); a
    relative ``XDG_CACHE_HOME`` ignored (the XDG specification); no ``HOME`` and no password entry: no folder (before:
    ``RuntimeError`` out of ``Path.home()``). Values hand-worked from the environment set here."""
    import pwd

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MY_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv(gate.CACHE_ENV, "~/lynx-gate")
    assert gate.cache_dir() == tmp_path / "home" / "lynx-gate"
    monkeypatch.setenv(gate.CACHE_ENV, "${MY_ROOT}/gate")
    assert gate.cache_dir() == tmp_path / "root" / "gate"
    monkeypatch.delenv(gate.CACHE_ENV)
    assert gate.cache_dir() == tmp_path / "home" / ".cache" / "lynx_hf"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert gate.cache_dir() == tmp_path / "home" / ".cache" / "lynx_hf"
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert gate.cache_dir() == tmp_path / "home" / "xdg" / "lynx_hf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert gate.cache_dir() is None


@pytest.mark.parametrize("written", ["~/tables/table.json", "$LYNX_TEST_TABLES/table.json"])
def test_C57_a_gate_table_path_is_expanded_as_the_cache_path_is(written, fixed_gate, tmp_path, monkeypatch):
    """CASES C57 for a user's table: ``gate_table="~/..."`` or ``"$VAR/..."`` (as a Docker ``ENV`` or a ``.env`` file
    writes it) names the file under the home folder / the variable's folder (before: taken literally, "No such file
    or directory: '~/table.json'")."""
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    planned = _gate(model)
    table = gate.DecisionTable()
    flipped = {b: _decision(not d.on) for b, d in planned.decisions.items()}
    table.put(planned.key, flipped, "test")
    (tmp_path / "tables").mkdir()
    table.save(tmp_path / "tables" / "table.json")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LYNX_TEST_TABLES", str(tmp_path / "tables"))
    lynx_hf.patch(model, policy="lynx", gate_table=written)
    assert _gate(model).source == f"table {written}"
    assert {b: d.on for b, d in _gate(model).decisions.items()} == {b: d.on for b, d in flipped.items()}
    lynx_hf.unpatch(model)


def test_C57_no_home_keeps_decisions_in_memory_with_one_warning(fixed_gate, monkeypatch):
    """No cache folder can be named: the patch measures, keeps the decisions in memory, says so once; a second model
    of the key reads them from memory (before: ``RuntimeError: Could not determine home directory``)."""
    import pwd

    monkeypatch.delenv(gate.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    gate.STORE._warned.discard("no cache folder")
    with pytest.warns(UserWarning, match="no folder for the gate's decision cache") as seen:
        lynx_hf.patch(fam.build("qwen2_moe"), policy="lynx", gate="auto")
        second = fam.build("qwen2_moe")
        lynx_hf.patch(second, policy="lynx", gate="auto")
    assert sum("no folder" in str(w.message) for w in seen) == 1
    assert len(fixed_gate) == 1 and _gate(second).source.startswith("measured")


def test_C57_a_lock_file_this_user_may_only_read_still_guards_the_write(fixed_gate, fresh_gate_store, monkeypatch):
    """The cache folder's lock file was made by another user (this one may open it read-only: ``flock`` needs no
    write access): the measurement is written to the cache under the lock (before: the lock could not be opened, the
    decisions stayed in memory and every process measured again). Denied write access is simulated (tests run as
    root): ``open(..., "a+")`` of the lock file raises ``PermissionError``."""
    real_open = open
    opened = []

    def as_other_user(file, mode="r", *args, **kwargs):
        if str(file).endswith(".lock"):
            opened.append(mode)
            if mode != "r":
                raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    (fresh_gate_store / "gate").mkdir(parents=True)
    from lynx_hf import LynxConfig, core

    plan = core.make_plan(LynxConfig(), core.MoELayer(8, 2, "cpu"))
    key_file = gate.STORE.cache_file(gate.make_key(plan, gate.LayerShape(8, 2, 16, 8), None, True))
    key_file.with_name(key_file.name + ".lock").write_text("")  # the other user's lock file
    monkeypatch.setattr(gt, "open", as_other_user, raising=False)
    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    assert opened == ["a+", "r"]
    assert _gate(model).source.endswith(f"cached in {key_file}")
    assert len(json.loads(key_file.read_text())["entries"]) == 1


# -- C58: fork while another thread measures ----------------------------------------------------------------------
def test_C58_a_child_forked_during_a_measurement_patches_and_generates(fresh_gate_store, monkeypatch):
    """CASES C58: thread A is inside ``patch``, measuring (holding the store's lock); the main thread forks. The child
    patches a model of the same key and generates (the store's lock re-created after fork; the cache file's lock is
    A's and is released when A finishes, so the child then reads A's decisions). Before: the child waited forever on
    the lock A held in the parent. The child is given 300 s before it counts as hung (a guard, not a timing)."""
    if not hasattr(os, "fork"):
        pytest.fail("os.fork is missing on this platform: C58 cannot be checked here")
    parent = os.getpid()
    inside, release = threading.Event(), threading.Event()

    def measure_layer(planned, expert_times, tuning=gate.TUNING):
        if os.getpid() == parent:
            inside.set()
            release.wait(120)
        return {b: _decision(b >= 4) for b in tuning.buckets}

    monkeypatch.setattr(gs, "measure_layer", measure_layer)
    measuring = threading.Thread(target=lynx_hf.patch, args=(fam.build("qwen2_moe"),),
                                 kwargs=dict(policy="lynx", gate="auto"))
    measuring.start()
    assert inside.wait(120)
    ids, mask = fam.prompts(2, 4)
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if it patched and generated
        code = 1
        try:
            torch.set_num_threads(1)
            model = fam.build("qwen2_moe")
            lynx_hf.patch(model, policy="lynx", gate="auto")
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
            code = 0 if out.shape == (2, 6) and _gate(model).decisions[4].on else 3
        finally:
            os._exit(code)
    release.set()
    measuring.join()
    deadline = time.monotonic() + 300
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in patch (the store's lock held by a thread it does not have)")
        time.sleep(0.2)
    assert os.waitstatus_to_exitcode(status) == 0


def test_C56_a_measurement_that_fails_leaves_the_model_untouched(fresh_gate_store, monkeypatch):
    """Whatever raises while the plans are resolved (here the measurement itself) is raised by ``patch`` with the model
    as it was: no hook, no ``generate``, not patched (before: the state stayed attached, ``generate`` raised too)."""
    def broken(planned, expert_times, tuning=gate.TUNING):
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(gs, "measure_layer", broken)
    model = fam.build("qwen2_moe")
    with pytest.raises(RuntimeError, match="measurement failed"):
        lynx_hf.patch(model, policy="lynx", gate="auto")
    assert _untouched(model)


# -- C59: copies keep their decisions ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_C59_a_copy_at_another_thread_count_keeps_the_originals_decisions(how, fresh_gate_store, monkeypatch):
    """CASES C59: the measurement here decides by the thread count (1 thread: on from 4 tokens; else off everywhere).
    The model is patched at 1 thread, then copied and used at 2: the copy runs the original's decisions (on at a
    4-token step), measures nothing in its first ``generate``, and gives the original's tokens at that thread count.
    Before: the copy's plan was resolved again under a 2-thread key, measured inside ``generate``, and ran off."""
    import copy
    import io
    import pickle

    calls = []

    def by_threads(planned, expert_times, tuning=gate.TUNING):
        calls.append(torch.get_num_threads())
        return {b: _decision(b >= 4 and torch.get_num_threads() == 1) for b in tuning.buckets}

    monkeypatch.setattr(gs, "measure_layer", by_threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = fam.build("qwen2_moe")
        lynx_hf.patch(model, policy="lynx", gate="auto")
        assert calls == [1] and _gate(model).decisions[4].on
        torch.set_num_threads(2)
        if how == "deepcopy":
            clone = copy.deepcopy(model)
        elif how == "pickle":
            clone = pickle.loads(pickle.dumps(model))
        else:
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            clone = torch.load(buf, weights_only=False)
        ids, mask = fam.prompts(4, 5)
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        want = model.generate(**gen)
        got = clone.generate(**gen)
    finally:
        torch.set_num_threads(threads)
    assert calls == [1]  # nothing measured by the copy
    planned = _gate(clone)
    assert planned.decisions == _gate(model).decisions and planned.decisions[4].on
    assert planned.source.endswith("(carried by a copy)")
    assert torch.equal(got, want)
    assert lynx_hf.stats(clone).summary()["per_layer"][0]["gate"]["by_tokens"][4]["steps_skipped"] == 0


# -- C60: tune keys its table by the dtype the model runs in -----------------------------------------------------
def test_C60_tune_makes_the_table_a_from_pretrained_model_reads(fixed_gate, tmp_path, capsys):
    """CASES C60: a bf16 checkpoint; ``lynx-hf tune --model CKPT`` (no --dtype) and then ``from_pretrained(CKPT)`` (its
    default: the checkpoint's dtype): the patch reads the table (before: tune loaded float32, the table was keyed by
    float32 and never read). tune prints the dtype and the thread count of its key. The same table given to the model
    in float32 matches none of its layers and the patch says so (dtypes and threads of both sides)."""
    from transformers import AutoModelForCausalLM

    from lynx_hf import cli

    fam.build("qwen2_moe").to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    fam.tokenizer().save_pretrained(tmp_path / "ckpt")
    table = tmp_path / "table.json"
    assert cli.main(["tune", "--model", str(tmp_path / "ckpt"), "--out", str(table)]) == 0
    out = capsys.readouterr().out
    assert f"dtype: bfloat16 (the checkpoint's, as from_pretrained loads it)  threads: {torch.get_num_threads()}" in out

    gate.STORE.reset()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert next(model.parameters()).dtype == torch.bfloat16
    lynx_hf.patch(model, policy="lynx", gate_table=str(table))
    assert _gate(model).source == f"table {table}"

    as_float = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    threads = torch.get_num_threads()
    with pytest.warns(UserWarning, match=f"matches none of this model's 2 gated MoE layers.*entries are for bfloat16 "
                                         f"at {threads} threads, this model's layers are float32 at {threads} threads"):
        lynx_hf.patch(as_float, policy="lynx", gate_table=str(table))
