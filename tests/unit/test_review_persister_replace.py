"""Review of the replacement of a persisting process that died before it took a save
(``async_save="process"``, `persist.process`: the ``took`` message). Attacked with real
processes and real signals: the persisting process SIGKILLed at random moments around a
save (after ``save()`` returned, stopped before the handover and killed after, killed
between two saves, killed and not yet reaped), its replacement dying too (before it said
ready, and after), ``close()`` and ``restore()`` right after a replaced save, and
incremental saves with frozen parameters across replacements. Every generation ``wait()``
returned is restored bit for bit in a fresh Checkpointer; a failed save is a typed
`SaveFailed` naming the run; the next save always succeeds; no persisting process is left
alive or unreaped. Every test is bounded by a SIGALRM watchdog."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import warnings

import pytest
import torch
from _persisting import assert_bitwise, gens, restored, snapshot, worker_pid, workers_of_me

import unbroken
from unbroken.errors import SaveFailed, UnbrokenError, UnbrokenWarning
from unbroken.persist.process import ProcessPersister

pytestmark = pytest.mark.usefixtures("hang_watchdog")  # (60 s a test: nothing may hang)


# -- helpers ---------------------------------------------------------------------------------


def small():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def frozen_net():
    """A frozen (requires_grad=False) layer an incremental save links, and a trained one."""
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16))
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)


def step_(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(8, model.in_features if hasattr(model, "in_features") else 256)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)




def bitwise_equal(got, want) -> bool:
    try:
        assert_bitwise(got, want)
    except AssertionError:
        return False
    return True





def unreaped(pids) -> list[int]:
    """Those of ``pids`` that are still zombies (or alive) children of this process."""
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # (reaped, even between open and read)
            continue
        if int(fields[1]) == os.getpid():
            left.append(pid)
    return left


def ended(pid: int) -> None:
    """Until the child ``pid`` can be reaped (every thread of it gone), without reaping it."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass  # reaped already



def replaced_warnings(caught, pid: int | None = None, step: int | None = None) -> list[str]:
    out = [str(w.message) for w in caught if issubclass(w.category, UnbrokenWarning)
           and "before it took the save" in str(w.message)]
    for m in out:
        if pid is not None:
            assert f"persisting process {pid} had ended (exit code -9" in m, m
        if step is not None:
            assert f"before it took the save of generation {step}; a new one takes it" in m, m
    return out


# -- 1. randomized kills around saves ----------------------------------------------------------

MODES = ("after_save", "stopped_then_killed", "between_reaped", "between_unreaped",
         "after_wait", "none")


# (seeds whose trials, on this machine, included a replacement after save() returned, failed
# saves and saves stopped before the handover; 240 trials of 24 seeds passed)
@pytest.mark.parametrize("seed,share", [(4, None), (1, 0.05), (3, 0.05)])
def test_random_kills_around_saves(fast_tmp, seed, share):
    """Each trial: one update, a save, and the persisting process SIGKILLed at a random
    moment around it. Invariants: ``wait()`` returns (that generation then restores bit for
    bit to the state at ``save()``) or raises SaveFailed naming the run -- the latter only
    where the process may have taken the save; one that could not have taken it (stopped
    before the handover, or dead before it) is replaced with exactly one warning naming it;
    the next save always succeeds; nothing is left alive or unreaped after ``close()``; the
    newest generation that restores is always one of the saved states."""
    rng = random.Random(seed)
    root = fast_tmp / "run"
    model, opt = small()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    ok: set[int] = set()
    failed: set[int] = set()
    killed: list[int] = []
    outcomes: list[tuple[str, str, int]] = []
    step = 0
    trials = 10
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               keep=unbroken.Keep(last=100), persist_share=share)
    try:
        # the first save: the persisting process is started at it
        step += 1
        step_(model, opt, step)
        ck.step_done(step)
        ck.save()
        saved[step] = snapshot(model, opt)
        assert ck.wait().generation == step
        ok.add(step)
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(trials):
            mode = rng.choice(MODES)
            delay = rng.uniform(0.0, 0.03)  # (after_save: half of them at once)
            step += 1
            step_(model, opt, step)
            ck.step_done(step)
            proc = ck._persister._proc
            if proc.poll() is not None:  # killed at the last trial, its end seen now
                mode = "dead_before"  # (a new one is started for this save, silently)
            pid = proc.pid
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outcome = "ok"
                try:
                    if mode == "between_reaped":  # ended before the save (reapable)
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # (not reaped)
                        ck.save()
                    elif mode == "between_unreaped":  # dead or dying as the save is handed
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                        ck.save()
                    elif mode == "stopped_then_killed":  # never reads the request
                        os.kill(pid, signal.SIGSTOP)
                        ck.save()
                        time.sleep(delay)
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    else:
                        ck.save()
                    if mode == "after_save":  # before, while or after it takes the save
                        if delay > 0.015:  # at once, else after a while (0 to 15 ms)
                            time.sleep(delay - 0.015)
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    saved[step] = snapshot(model, opt)
                    # the loop goes on in place at once: the snapshot must not see it
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(1.0)
                    info = ck.wait()
                    assert info is not None and info.generation == step, (mode, info)
                    if mode == "after_wait":  # it replied; killed before the next save
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                except SaveFailed as e:
                    outcome = "failed"
                    assert str(root) in str(e), e
                    # only a process that may have taken the save may fail it
                    assert mode == "after_save", (mode, str(e))
                    assert "before it replied" in str(e), e
                    assert ck._persister._taken, "failed though the save was never taken"
            said = replaced_warnings(caught, pid, step)
            outcomes.append((mode, outcome, len(said)))
            if mode == "stopped_then_killed":
                assert outcome == "ok" and len(said) == 1, (mode, outcome, said)
            elif mode in ("between_reaped", "none", "after_wait", "dead_before"):
                assert len(said) == 0, (mode, said)  # (one whose end was seen: silently)
            else:
                assert len(said) <= 1, (mode, said)
            if said:
                assert outcome == "ok", (mode, said)  # a replaced save commits
            cur = ck._persister._proc
            if cur is None:  # (its end told by the SaveFailed: the next save starts one)
                assert outcome == "failed" and workers_of_me() == [], (mode, outcome)
            elif cur.pid in killed:  # (killed after it replied)
                ended(cur.pid)
                assert workers_of_me() == []
            else:
                assert cur.poll() is None and workers_of_me() == [cur.pid], (mode, outcome)
                assert (cur.pid != pid) == bool(said) or mode in (
                    "between_reaped", "between_unreaped", "dead_before"), (mode, said)
            if outcome == "ok":
                ok.add(step)
                assert step in gens(root)
            else:
                failed.add(step)
                # the next save always succeeds (one more update: a new state)
                step += 1
                step_(model, opt, step)
                ck.step_done(step)
                ck.save()
                saved[step] = snapshot(model, opt)
                assert ck.wait().generation == step
                ok.add(step)
                assert workers_of_me() == [worker_pid(ck)]
        # no socket or segment of a replaced or failed persisting process left open here
        assert len(os.listdir("/proc/self/fd")) <= fds, os.listdir("/proc/self/fd")
        # and a last plain save after all of that
        step += 1
        step_(model, opt, step)
        ck.step_done(step)
        ck.save()
        saved[step] = snapshot(model, opt)
        assert ck.wait().generation == step
        ok.add(step)
    finally:
        ck.close()
    assert workers_of_me() == [], "a persisting process outlived close()"
    assert unreaped(killed) == [], "a killed persisting process was never reaped"
    have = gens(root)
    assert ok <= set(have), (sorted(ok - set(have)), outcomes)
    assert set(have) <= set(saved)
    newest, got = restored(root, small)
    assert newest == step and bitwise_equal(got, saved[step])
    # newest first (a writer restoring an older generation continues from it, and the newer
    # ones are abandoned)
    for s in reversed(have):  # committed: exactly the state at save() (a failed one too)
        try:
            got_step, got = restored(root, small, s)
        except UnbrokenError:
            assert s in failed, f"generation {s}, whose wait() returned, does not restore"
            continue
        assert got_step == s
        assert_bitwise(got, saved[s])
    # the trials did exercise a replacement (stopped_then_killed always does)
    assert any(m == "stopped_then_killed" for m, _, _ in outcomes) or any(
        n for _, _, n in outcomes), outcomes


def _stopped(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: a process running on the other core when
    the signal is sent may still read a request first (then it has taken the save)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in "Tt":
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


# -- 2. the replacement dies too --------------------------------------------------------------


def _kill_the_next_one(ck, first: int, stop: threading.Event, got: list[int]) -> threading.Thread:
    """A thread that SIGKILLs the persisting process started after ``first`` as soon as the
    writer knows it."""

    def run():
        while not stop.is_set():
            proc = ck._persister._proc
            if proc is not None and proc.pid != first:
                os.kill(proc.pid, signal.SIGKILL)
                got.append(proc.pid)
                return
            time.sleep(0.0005)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("when", ["before it said ready", "after it said ready"])
def test_a_replacement_that_also_dies_before_taking_the_save_is_save_failed(
        fast_tmp, monkeypatch, when):
    """At most one replacement per save: the second persisting process also ends before it
    took the save; ``wait()`` raises SaveFailed (no loop, no hang), after exactly one
    warning naming the first; the next save goes to a third one and succeeds."""
    root = fast_tmp / "run"
    model, opt = small()
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               keep=unbroken.Keep(last=100))
    extra: list[int] = []
    try:
        step_(model, opt, 1)
        ck.step_done(1)
        ck.save()
        first_state = snapshot(model, opt)
        assert ck.wait().generation == 1
        first = worker_pid(ck)
        step_(model, opt, 2)
        ck.step_done(2)
        stop = threading.Event()
        if when == "before it said ready":
            killer = _kill_the_next_one(ck, first, stop, extra)
        else:  # ready, then stopped before it reads the request, then killed
            ready = ProcessPersister._ready

            def stopped_once_ready(self):
                sock = ready(self)
                if self._proc.pid != first and not extra:
                    os.kill(self._proc.pid, signal.SIGSTOP)
                    extra.append(self._proc.pid)
                    threading.Timer(0.05, os.kill, (self._proc.pid, signal.SIGKILL)).start()
                return sock

            monkeypatch.setattr(ProcessPersister, "_ready", stopped_once_ready)
            killer = None
        _stopped(first)
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save()
            os.kill(first, signal.SIGKILL)
            with pytest.raises(SaveFailed) as raised:
                ck.wait()
        assert time.monotonic() - t0 < 30
        stop.set()
        if killer is not None:
            killer.join(5)
        monkeypatch.undo()
        assert len(extra) == 1, "the replacement was never started"
        assert str(root) in str(raised.value)
        assert str(extra[0]) in str(raised.value), raised.value  # names the one that ended
        said = replaced_warnings(caught, first, 2)
        assert len(said) == 1, said  # one replacement, not two
        assert ck._persister._started == 2  # the first, one replacement
        assert workers_of_me() == []
        # the next save succeeds, in a third persisting process
        step_(model, opt, 3)
        ck.step_done(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save()
            want = snapshot(model, opt)
            assert ck.wait().generation == 3
        assert replaced_warnings(caught) == []
        third = worker_pid(ck)
        assert third not in (first, extra[0])
        assert workers_of_me() == [third]
    finally:
        ck.close()
    assert workers_of_me() == []
    assert unreaped([first, *extra]) == []
    assert 2 not in gens(root)  # never taken by anyone: nothing of it written
    # (newest first: a writer restoring an older generation continues from it, and the
    # newer ones are abandoned)
    step, got = restored(root, small)
    assert step == 3
    assert_bitwise(got, want)
    assert_bitwise(restored(root, small, 1)[1], first_state)


# -- 3. close(), restore() and incremental saves across a replacement --------------------------


def test_close_right_after_a_save_whose_process_died_before_taking_it(fast_tmp):
    """``close()`` (no ``wait()`` first) hands the save to a new persisting process, commits
    it, ends that one and releases the run: another writer opens it and restores bitwise."""
    root = fast_tmp / "run"
    model, opt = small()
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.05)
    step_(model, opt, 1)
    ck.step_done(1)
    ck.save()
    ck.wait()
    first = worker_pid(ck)
    step_(model, opt, 2)
    ck.step_done(2)
    _stopped(first)
    # (the warning comes from the save's background thread, once the kill is seen)
    with pytest.warns(UnbrokenWarning, match=rf"persisting process {first} had ended \(exit "
                      r"code -9.*before it took the save of generation 2; a new one takes it"):
        ck.save()
        want = snapshot(model, opt)
        os.kill(first, signal.SIGKILL)
        ck.close()
    assert workers_of_me() == []
    assert unreaped([first]) == []
    assert gens(root) == [1, 2]
    m2, o2 = small()
    with unbroken.Checkpointer(root, model=m2, optimizer=o2, async_save="process") as again:
        assert again.read_only is None  # the lock came back with the replacement's end
        assert again.restore() == 2
        assert_bitwise(snapshot(m2, o2), want)
        step_(m2, o2, 3)
        again.step_done(3)
        again.save()
        assert again.wait().generation == 3
    assert workers_of_me() == []


def test_restore_on_the_writer_right_after_a_replaced_save(fast_tmp):
    """``restore()`` waits for the save in flight, which is replaced first: it then restores
    that generation, bit for bit the state at ``save()``, over a loop that moved on; the
    writer then saves on."""
    root = fast_tmp / "run"
    model, opt = small()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.05) as ck:
        step_(model, opt, 1)
        ck.step_done(1)
        ck.save()
        assert ck.wait().generation == 1
        step_(model, opt, 2)
        ck.step_done(2)
        first = worker_pid(ck)
        _stopped(first)  # it never reads the request
        # (the warning comes from the save's background thread, once the kill is seen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save()
            want = snapshot(model, opt)
            os.kill(first, signal.SIGKILL)
            step_(model, opt, 3)  # the loop moves on in place
            assert ck.restore() == 2
        assert len(replaced_warnings(caught, first, 2)) == 1
        assert_bitwise(snapshot(model, opt), want)
        second = worker_pid(ck)
        assert second != first and workers_of_me() == [second]
        # and it goes on saving from the restored state
        step_(model, opt, 3)
        ck.step_done(3)
        ck.save()
        want3 = snapshot(model, opt)
        assert ck.wait().generation == 3
    assert workers_of_me() == []
    assert unreaped([first]) == []
    step, got = restored(root, small)
    assert step == 3
    assert_bitwise(got, want3)
    assert_bitwise(restored(root, small, 2)[1], want)


def test_incremental_frozen_saves_across_replacements(fast_tmp):
    """Incremental saves (frozen parameters linked from the previous generation) with the
    persisting process replaced before it took a save, killed between saves, and killed
    after it took one: each generation ``wait()`` returned restores bit for bit, also once
    its older generations are gone (retention), and the frozen layer is linked, not lost."""
    root = fast_tmp / "run"
    model, opt = frozen_net()
    saved: dict[int, dict] = {}
    ok: list[int] = []
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               incremental=True, keep=unbroken.Keep(last=2),
                               persist_share=0.05) as ck:
        for s in range(1, 7):
            step_(model, opt, s)
            ck.step_done(s)
            pid = worker_pid(ck) if 1 < s < 6 else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if s in (2, 4):  # replaced before it took the save
                    os.kill(pid, signal.SIGSTOP)
                    ck.save()
                    os.kill(pid, signal.SIGKILL)
                elif s == 3:  # killed between two saves, its end not yet seen
                    os.kill(pid, signal.SIGKILL)
                    ck.save()
                else:
                    ck.save()
                saved[s] = snapshot(model, opt)
                if s == 5:  # after it took the (paced) save: typed failure, then saved again
                    time.sleep(0.1)  # most likely taken by now, and still paced
                    os.kill(pid, signal.SIGKILL)
                    try:
                        info = ck.wait()
                        ok.append(s)
                        assert info.generation == s
                        ended(pid)  # (it replied, then died: the next save starts one)
                    except SaveFailed as e:
                        assert str(root) in str(e)
                        ck.save(s)  # the same state saved again
                        assert ck.wait().generation == s
                        ok.append(s)
                else:
                    assert ck.wait().generation == s
                    ok.append(s)
            said = replaced_warnings(caught, pid, s)
            if s in (2, 4):
                assert len(said) == 1, (s, said)
            elif s in (1, 6):
                assert said == []  # (6: the one killed at 5 was seen dead: started silently)
            if s != 5:
                assert workers_of_me() == [worker_pid(ck)]
    assert workers_of_me() == []
    assert ok == [1, 2, 3, 4, 5, 6]
    assert gens(root) == [5, 6]
    for s in (6, 5):  # (newest first)
        step, got = restored(root, frozen_net, s)
        assert step == s
        assert_bitwise(got, saved[s])
    frozen_w = saved[6]["m.0.weight"]
    assert torch.equal(frozen_w, frozen_net()[0][0].weight.detach())  # it never changed
