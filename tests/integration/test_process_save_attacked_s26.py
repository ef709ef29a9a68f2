"""``async_save="process"`` attacked (session 26), with real persisting processes:

1. the persisting process is SIGKILLed after it committed a generation (stopped right after
   its rename or as its read-back begins, `SITECUSTOMIZE`, then killed; or killed from
   outside while its paced read-back runs), also with the generation rotting before this
   process looks at it, before its commit, and between moving the generation a save of the
   same step supersedes aside and its own rename: the save is a `SaveFailed` that says what
   was found, and the next save is neither refused as a first save (the generation is this
   Checkpointer's own) nor built on a generation that is not committed and verified (its
   manifest's parent);
2. the persisting process cannot be started (no interpreter at ``sys.executable``, no file
   descriptors left): a typed `SaveFailed` naming the command and the reason, at
   construction (the lock released) and at a save;
3. a save after ``close()`` reopens the run and saves, as the other modes do.

Every restored state is compared bit for bit with the state at save time. Every wait is
bounded (SIGALRM per test, `hang_watchdog`; polling loops have deadlines)."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import sys
import time
import warnings

import pytest
import torch
from _persisting import assert_bitwise, gens, restored, snapshot, worker_pid, workers_of_me

import unbroken
from unbroken.errors import SaveFailed, UnbrokenError, UnbrokenWarning

pytestmark = pytest.mark.usefixtures("hang_watchdog")  # (60 s a test: nothing may hang)


# -- helpers ---------------------------------------------------------------------------------

STOP_ENV = "UNBROKEN_TEST_S26_STOP"

# Imported at start-up by the persisting processes the tests start (PYTHONPATH, `stopper`):
# with $UNBROKEN_TEST_S26_STOP = "after-rename@N" / "before-rename@N" (the store's fault
# points), "verify@N" (a verification of generation N begins: its read-back) or "superseded"
# (it moved aside the generation a save of the same step supersedes), the first to get there
# stops itself (SIGSTOP), so the test can look at the folder and SIGKILL it at exactly that
# point (the kill points of `killpoints` stand for a crash of the machine: they kill the
# writer too).
SITECUSTOMIZE = """
import os, signal
_spec = os.environ.get("UNBROKEN_TEST_S26_STOP", "")
if _spec and os.environ.get("UNBROKEN_PERSISTER_OF"):
    from unbroken.store import generations as _g
    _point, _, _at = _spec.partition("@")

    def _due(generation):
        return not _at or generation == int(_at)

    def _stop():  # (once: the first persisting process to get here, never its successors)
        try:
            os.close(os.open(os.environ["UNBROKEN_TEST_S26_STOPPED"],
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGSTOP)

    if _point == "superseded":
        _move = _g.GenerationStore.move_aside

        def move_aside(self, info, why):
            moved = _move(self, info, why)
            if why == "superseded":
                _stop()
            return moved

        _g.GenerationStore.move_aside = move_aside
    elif _point == "verify":
        _verify = _g.GenerationStore.verify

        def verify(self, info, *args, **kwargs):
            if _due(info.generation):
                _stop()
            return _verify(self, info, *args, **kwargs)

        _g.GenerationStore.verify = verify
    else:
        _fault = _g.fault_point

        def fault_point(name, step=None):
            if name == _point and step is not None and _due(step):
                _stop()
            return _fault(name, step)

        _g.fault_point = fault_point
"""


@pytest.fixture
def stopper(tmp_path, monkeypatch):
    """Set the point where the persisting processes started from now on stop themselves
    (see `SITECUSTOMIZE`); None: nowhere."""
    folder = tmp_path / "sitecustomize"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, (str(folder), os.environ.get("PYTHONPATH")))))

    marks = iter(range(1_000_000))

    def stop_at(point: str | None) -> None:
        if point is None:
            monkeypatch.delenv(STOP_ENV, raising=False)
        else:
            monkeypatch.setenv(STOP_ENV, point)
            monkeypatch.setenv("UNBROKEN_TEST_S26_STOPPED", str(tmp_path / f"stopped{next(marks)}"))

    yield stop_at
    for pid in workers_of_me():  # (a test that failed early: no stopped process outlives it)
        if state_of(pid) == "T":
            kill_and_reap(pid)


def state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # (a process that is vanishing)
        return "gone"


def kill_when_stopped(pid: int) -> None:
    """Wait (bounded) until the persisting process ``pid`` stopped itself at its stop point,
    then SIGKILL it and wait until it is gone."""
    deadline = time.monotonic() + 30
    while state_of(pid) != "T":
        assert state_of(pid) not in ("Z", "gone"), f"{pid} ended before its stop point"
        assert time.monotonic() < deadline, f"{pid} never reached its stop point"
        time.sleep(0.005)
    kill_and_reap(pid)


def build(n: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(n, n)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def update(ck: unbroken.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer,
           step: int) -> None:
    """One update of ``model`` (seeded by ``step``), declared done."""
    torch.manual_seed(step)
    model(torch.randn(4, model.in_features)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ck.step_done(step)


def parent(root, generation: int) -> dict | None:
    with open(os.path.join(root, f"gen-{generation:09d}", "MANIFEST.json")) as f:
        return json.load(f)["parent"]


def kill_and_reap(pid: int) -> None:
    """SIGKILL ``pid`` and wait (bounded) until it is a zombie or gone."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while state_of(pid) not in ("Z", "gone"):
        assert time.monotonic() < deadline, f"{pid} survived SIGKILL"
        time.sleep(0.02)


def aside(root) -> list[str]:
    folder = os.path.join(root, "aside")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def assert_no_workers_left() -> None:
    deadline = time.monotonic() + 20
    while workers_of_me() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers_of_me() == []


def close_quietly(ck: unbroken.Checkpointer) -> None:
    """(A test's ``finally``.) ``close()``, after killing a persisting process still stopped
    (a test that failed early), which it would wait for."""
    for pid in workers_of_me():
        if state_of(pid) == "T":
            kill_and_reap(pid)
    try:
        ck.close()
    except UnbrokenError:
        pass


# -- 1. the persisting process dies after it committed ---------------------------------------


@pytest.mark.parametrize("restore_first", [False, True])
@pytest.mark.parametrize("point", ["after-rename@1", "verify@1"])
def test_killed_after_commit_next_save_builds_on_it(fast_tmp, stopper, restore_first, point):
    """SIGKILLed once generation 1 is in place (right after its rename, or as its read-back
    begins): generation 1 is this Checkpointer's own. The next save is no false
    `RunNotRestored` ("did not call restore()"), and names generation 1 (committed, and
    verified by the writer since) as its parent (with ``restore()`` first: not None)."""
    root = fast_tmp / "run"
    model, opt = build()
    stopper(point)
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process")
    try:
        if restore_first:
            assert ck.restore() == 0  # (an empty folder: nothing to restore)
        update(ck, model, opt, 1)
        ck.save()
        want1 = snapshot(model, opt)
        kill_when_stopped(worker_pid(ck))
        assert gens(root) == [1]
        with pytest.raises(SaveFailed) as raised:
            ck.wait()
        update(ck, model, opt, 2)
        ck.save()  # (before the fix: RunNotRestored, "this Checkpointer did not call restore()")
        want2 = snapshot(model, opt)
        assert ck.wait() is not None
        update(ck, model, opt, 3)
        ck.save()
        assert ck.wait() is not None
    finally:
        close_quietly(ck)
    assert gens(root) == [1, 2, 3]
    # (before the fix, with restore() first: None)
    assert parent(root, 2) == {"run_id": ck.run_id, "generation": 1, "incarnation": 0}
    assert str(root) in str(raised.value)
    assert "gen-000000001 is committed and verifies" in str(raised.value)
    assert parent(root, 3)["generation"] == 2
    for generation, want in ((2, want2), (1, want1)):
        step, got = restored(root, build, generation)
        assert step == generation
        assert_bitwise(got, want)
    assert_no_workers_left()


def test_killed_after_commit_a_retry_of_the_step_writes_it_again(fast_tmp, stopper):
    """Saving the failed step again is a save (not the no-op of an unchanged state saved
    twice): ``wait()`` returns the generation, which restores bit for bit."""
    root = fast_tmp / "run"
    model, opt = build()
    stopper("after-rename@1")
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        update(ck, model, opt, 1)
        ck.save()
        want = snapshot(model, opt)
        kill_when_stopped(worker_pid(ck))
        with pytest.raises(SaveFailed):
            ck.wait()
        stopper(None)
        ck.save(1)
        info = ck.wait()
        assert info is not None and info.generation == 1
    assert gens(root) == [1]
    step, got = restored(root, build)
    assert step == 1
    assert_bitwise(got, want)


def test_sigkilled_from_outside_during_its_read_back(fast_tmp):
    """No stop point: a SIGKILL from outside as soon as generation 1 is in place, while the
    (paced) persisting process reads it back; the same Checkpointer goes on saving."""
    root = fast_tmp / "run"
    model, opt = build(1500)  # (27 MB: a read-back paced at 2% of a core takes a while)
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.02, keep=unbroken.Keep(last=10))
    try:
        update(ck, model, opt, 1)
        ck.save()
        want1 = snapshot(model, opt)
        pid = worker_pid(ck)
        deadline = time.monotonic() + 30
        while not (root / "gen-000000001").exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert (root / "gen-000000001").exists(), "generation 1 never committed"
        kill_and_reap(pid)
        failed = ""
        try:
            ck.wait()  # (it may have replied just before the kill)
        except SaveFailed as e:
            failed = str(e)
        update(ck, model, opt, 2)
        ck.save()
        want2 = snapshot(model, opt)
        assert ck.wait() is not None
    finally:
        close_quietly(ck)
    assert gens(root) == [1, 2]
    assert parent(root, 2)["generation"] == 1
    assert not failed or "gen-000000001 is committed and verifies" in failed, failed
    for generation, want in ((2, want2), (1, want1)):
        step, got = restored(root, lambda: build(1500), generation)
        assert step == generation
        assert_bitwise(got, want)
    assert_no_workers_left()


def test_killed_before_commit_parent_is_the_last_verified(fast_tmp, stopper):
    """Killed before its rename (generation 2 not committed): the next save's parent is
    generation 1, the newest verified one; a first save killed so: the next is a first save
    again, and allowed."""
    root = fast_tmp / "run"
    model, opt = build()
    stopper("before-rename@2")
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        update(ck, model, opt, 1)
        ck.save()
        want1 = snapshot(model, opt)
        assert ck.wait() is not None
        update(ck, model, opt, 2)
        ck.save()
        kill_when_stopped(worker_pid(ck))
        with pytest.raises(SaveFailed) as raised:
            ck.wait()
        assert "gen-000000002 was not committed" in str(raised.value)
        update(ck, model, opt, 3)
        ck.save()
        want3 = snapshot(model, opt)
        assert ck.wait() is not None
    assert gens(root) == [1, 3]
    assert parent(root, 3)["generation"] == 1
    for generation, want in ((3, want3), (1, want1)):
        assert_bitwise(restored(root, build, generation)[1], want)

    other = fast_tmp / "other"
    model, opt = build()
    stopper("before-rename@5")
    with unbroken.Checkpointer(other, model=model, optimizer=opt, async_save="process") as ck:
        for s in range(1, 6):
            update(ck, model, opt, s)
        ck.save()
        kill_when_stopped(worker_pid(ck))
        with pytest.raises(SaveFailed):
            ck.wait()
        assert gens(other) == []
        update(ck, model, opt, 6)
        ck.save()
        want6 = snapshot(model, opt)
        assert ck.wait() is not None
    assert gens(other) == [6]
    assert parent(other, 6) is None
    assert_bitwise(restored(other, build)[1], want6)


def test_killed_after_commit_and_the_generation_rotted(fast_tmp, stopper):
    """Generation 2 committed (incremental saves), a byte of it flipped while its persisting
    process was stopped before its read-back, then SIGKILL: it is moved aside as corrupt,
    and the next save names generation 1 (verified) as its parent and links nothing from
    the rotten one; every generation left restores bit for bit."""
    root = fast_tmp / "run"
    model, opt = build()
    stopper("after-rename@2")
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               incremental=True) as ck:
        update(ck, model, opt, 1)
        ck.save()
        want1 = snapshot(model, opt)
        assert ck.wait() is not None
        update(ck, model, opt, 2)
        ck.save()
        pid = worker_pid(ck)
        deadline = time.monotonic() + 30
        while state_of(pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.005)
        path = root / "gen-000000002" / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # (the same size: only a read-back tells)
        path.write_bytes(bytes(data))
        kill_when_stopped(pid)
        with pytest.raises(SaveFailed) as raised:
            ck.wait()
        assert "does not read back as written" in str(raised.value)
        assert "moved aside" in str(raised.value)
        assert gens(root) == [1]
        assert any(n.startswith("gen-000000002-corrupt-") for n in aside(root)), aside(root)
        update(ck, model, opt, 3)
        ck.save()
        want3 = snapshot(model, opt)
        assert ck.wait() is not None
    assert gens(root) == [1, 3]
    assert parent(root, 3)["generation"] == 1
    for generation, want in ((3, want3), (1, want1)):
        assert_bitwise(restored(root, build, generation)[1], want)


def test_killed_between_superseding_and_its_rename(fast_tmp, stopper):
    """The same step saved again (the state changed): its persisting process moved the
    generation it supersedes aside and was killed before its own rename. That generation is
    put back (the step's last verified state); saving the step again writes the new state."""
    root = fast_tmp / "run"
    model, opt = build()
    stopper("superseded")
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        update(ck, model, opt, 1)
        ck.save()
        want_old = snapshot(model, opt)
        assert ck.wait() is not None
        with torch.no_grad():
            model.weight.add_(1)  # (an end-of-epoch change: the same step, a new state)
        want_new = snapshot(model, opt)
        ck.save(1)
        kill_when_stopped(worker_pid(ck))
        with pytest.raises(SaveFailed) as raised:
            ck.wait()
        assert "is back in place" in str(raised.value), str(raised.value)
        assert gens(root) == [1]
        # (the run is locked by ck: its generation 1 is restored from a copy)
        shutil.copytree(root, fast_tmp / "copy", ignore=shutil.ignore_patterns("LOCK"))
        assert_bitwise(restored(fast_tmp / "copy", build)[1], want_old)
        stopper(None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnbrokenWarning)
            ck.save(1)
        assert ck.wait() is not None
    assert gens(root) == [1]
    step, got = restored(root, build)
    assert step == 1
    assert_bitwise(got, want_new)


# -- 2. the persisting process cannot be started ---------------------------------------------


def assert_not_started(e: BaseException, root, command: str, reason: str) -> None:
    text = str(e)
    assert isinstance(e, SaveFailed), (type(e), text)
    assert str(root) in text and "could not be started" in text, text
    assert command in text and reason in text, text
    assert "async_save=True" in text, text  # (the remedy)


def assert_lock_free(root) -> None:
    model, opt = build()
    with unbroken.Checkpointer(root, model=model, optimizer=opt) as other:
        assert other.read_only is None
        other.save(0)
    assert gens(root) == [0]


def test_no_interpreter_at_construction(fast_tmp, monkeypatch):
    root = fast_tmp / "run"
    model, opt = build()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.raises(UnbrokenError) as raised:
        unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process")
    assert_not_started(raised.value, root, "/nonexistent/python3 -m unbroken.persist._worker",
                       "ENOENT")
    monkeypatch.undo()
    assert_lock_free(root)


def test_no_interpreter_at_a_save(fast_tmp, monkeypatch):
    """The persisting process died idle and no new one can start: the save raises the same
    typed error; once the interpreter is back, the next save works."""
    root = fast_tmp / "run"
    model, opt = build()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        update(ck, model, opt, 1)
        ck.save()
        assert ck.wait() is not None
        kill_and_reap(worker_pid(ck))
        update(ck, model, opt, 2)
        monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnbrokenWarning)  # ("had ended")
            with pytest.raises(UnbrokenError) as raised:
                ck.save()
        assert_not_started(raised.value, root, "/nonexistent/python3", "ENOENT")
        monkeypatch.undo()
        ck.save()
        want = snapshot(model, opt)
        assert ck.wait() is not None
    assert gens(root) == [1, 2]
    assert_bitwise(restored(root, build)[1], want)


def test_no_descriptors_at_construction(fast_tmp, monkeypatch):
    """Out of file descriptors (EMFILE) when the socket pair or the process is made."""
    import unbroken.persist.launch as launch

    def no_fds(*_a, **_k):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    root = fast_tmp / "run"
    model, opt = build()
    monkeypatch.setattr(launch.socket, "socketpair", no_fds)
    with pytest.raises(UnbrokenError) as raised:
        unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process")
    assert_not_started(raised.value, root, "-m unbroken.persist._worker", "EMFILE")
    monkeypatch.undo()
    assert_lock_free(root)


def test_descriptor_limit_at_construction(fast_tmp):
    """A real ``RLIMIT_NOFILE`` just above what is open: every outcome is a Checkpointer or a
    typed error, and at least one is the persisting process failing to start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    model, opt = build()
    outcomes = []
    for extra in range(0, 6):
        root = fast_tmp / f"run{extra}"
        ck = None
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + extra, hard))
        try:
            ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process")
            outcomes.append("ok")
        except UnbrokenError as e:
            outcomes.append(str(e))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if ck is not None:
            ck.close()
        else:
            assert_lock_free(root)
    assert any("could not be started" in o and "EMFILE" in o for o in outcomes), outcomes
    assert_no_workers_left()


# -- 3. a save after close() -----------------------------------------------------------------


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_save_after_close_reopens_and_saves(fast_tmp, mode):
    """Every mode alike: a save after ``close()`` takes the lock again and saves; ``close()``
    again releases it (another writer opens the run), with no persisting process left."""
    root = fast_tmp / "run"
    model, opt = build()
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save=mode)
    update(ck, model, opt, 1)
    ck.save()
    ck.close()
    update(ck, model, opt, 2)
    started = time.monotonic()
    ck.save()  # (before the fix, process mode: StoreLocked after 2 s, "another holds the run")
    want = snapshot(model, opt)
    ck.wait()
    ck.close()
    assert time.monotonic() - started < 30
    assert gens(root) == [1, 2]
    assert parent(root, 2)["generation"] == 1
    step, got = restored(root, build)
    assert step == 2
    assert_bitwise(got, want)
    assert_no_workers_left()

