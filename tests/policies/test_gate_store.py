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
    foreign = json.dumps({"format": 2, "entries": {"0123456789abcdef0123": {"decisions": {"1": {"on": "maybe"}}}}})
    path.write_text(foreign)
    gate.STORE.reset()
    model = fam.build("qwen2_moe")
    with pytest.warns(UserWarning, match="format 2.*left as it is"):
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


def test_C56_a_new_measuring_version_misses_and_keeps_the_older_entries(fixed_gate, fresh_gate_store, monkeypatch):
    """The measuring code's version is part of the key: a build whose version is 2 measures again and adds its entry
    beside version 1's, which stays as it was (another installed build still reads it); version 1 keys keep the
    digests they had before the field existed (the shipped tables stay valid): hand-computed here."""
    import dataclasses
    import hashlib

    model = fam.build("qwen2_moe")
    lynx_hf.patch(model, policy="lynx", gate="auto")
    key = _gate(model).key
    assert key.measure == 1
    old_fields = {k: v for k, v in dataclasses.asdict(key).items() if k != "measure"}
    assert key.digest() == hashlib.sha256(json.dumps(old_fields, sort_keys=True).encode()).hexdigest()[:20]
    path = _cache_file(fresh_gate_store)
    (digest1, entry1), = json.loads(path.read_text())["entries"].items()

    monkeypatch.setattr(gate.key, "MEASURE_VERSION", 2)
    gate.STORE.reset()
    newer = fam.build("qwen2_moe")
    lynx_hf.patch(newer, policy="lynx", gate="auto")
    assert _gate(newer).key.measure == 2 and _gate(newer).key.digest() != digest1 and len(fixed_gate) == 2
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 and entries[digest1] == entry1


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
    key_file = gate.STORE.cache_file(gate.GateKey(gate.device_kind("cpu"), 1, "{}", "x"))
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
