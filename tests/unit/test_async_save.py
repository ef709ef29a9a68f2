"""Async saves (``async_save=True``): a consistent snapshot at the update boundary, persisted
in the background. What is written is the state at ``save()``, whatever the loop does next;
a resumed run is bitwise the uninterrupted one; at most one save in flight; errors surface at
the next save, ``wait()`` or ``close()``; a script that ends without ``close()`` still commits."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import unbroken
from unbroken.errors import SaveFailed, UnbrokenWarning
from unbroken.persist.process import ProcessPersister
from unbroken.persist.snapshot import SnapshotBuffers
from unbroken.store import lock
from unbroken.store.generations import GenerationStore


def net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1),
                                torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, ckpt, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start + 1, stop + 1):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step_done(step, loss=loss)
        losses.append(loss.item())
    return losses


def state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


@pytest.mark.parametrize("mode", [True, "process"])
def test_what_is_written_is_the_state_at_save_whatever_the_loop_does_next(tmp_path, mode):
    model, opt = net()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=mode) as ckpt:
        train(model, opt, ckpt, 0, 3)
        before = state(model, opt)
        rng_before = torch.get_rng_state()
        assert ckpt.save() is None  # snapshot taken, persisting
        with torch.no_grad():  # the loop goes on at once, in place
            for p in model.parameters():
                p.add_(100.0)
            for s in opt.state.values():
                s["exp_avg"].mul_(-3.0)
        torch.rand(1000)
        info = ckpt.wait()
        assert info is not None and info.manifest.step == 3
    restored, ropt = net()
    with unbroken.Checkpointer(tmp_path / "run", model=restored, optimizer=ropt) as ckpt:
        assert ckpt.restore() == 3
    after = state(restored, ropt)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_an_async_run_interrupted_and_resumed_is_bitwise_the_uninterrupted_one(tmp_path):
    # (async_save="process": test_kill_during_save, with real SIGKILLs)
    def run(folder, start_stop):
        random.seed(0), np.random.seed(0), torch.manual_seed(1)
        losses = []
        for start, stop in start_stop:
            model, opt = net()
            with unbroken.Checkpointer(folder, model=model, optimizer=opt, every=3,
                                       async_save=True) as ckpt:
                assert ckpt.restore() == start
                losses += train(model, opt, ckpt, start, stop)
        return losses, state(model, opt)

    ref_losses, ref_state = run(tmp_path / "ref", [(0, 12)])
    losses, final = run(tmp_path / "run", [(0, 7), (6, 12)])  # stopped after 7: resumes at 6
    assert losses[:7] == ref_losses[:7] and losses[7:] == ref_losses[6:]
    assert all(torch.equal(final[k], ref_state[k]) for k in ref_state)


def test_at_most_one_save_is_in_flight(tmp_path, monkeypatch):
    model, opt = net()
    inside, most = [0], [0]
    lock = threading.Lock()
    commit = GenerationStore.commit

    def slow_commit(self, *args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        try:
            return commit(self, *args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(GenerationStore, "commit", slow_commit)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=1,
                               async_save=True, keep=unbroken.Keep(last=10)) as ckpt:
        train(model, opt, ckpt, 0, 4)
    assert most[0] == 1
    assert [g.generation for g in GenerationStore(tmp_path / "run").scan()] == [1, 2, 3, 4]


def test_a_failed_background_save_raises_at_the_next_save_and_close_still_releases(
        tmp_path, monkeypatch):
    model, opt = net()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 async_save=True)
    train(model, opt, ckpt, 0, 1)
    ckpt.save()
    ckpt.wait()

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(GenerationStore, "commit", broken)
    train(model, opt, ckpt, 1, 2)
    ckpt.save()  # returns at once; the failure is reported at the next save
    train(model, opt, ckpt, 2, 3)
    with pytest.raises(SaveFailed, match="No space left on device"):
        ckpt.save()
    monkeypatch.undo()
    ckpt.save()  # the next one works again
    ckpt.close()
    assert [g.generation for g in GenerationStore(tmp_path / "run").scan()][-1] == 3
    other, oopt = net()
    with unbroken.Checkpointer(tmp_path / "run", model=other, optimizer=oopt) as again:
        assert again.restore() == 3  # the lock was released


def test_close_raises_the_error_of_the_save_in_flight_after_releasing(tmp_path, monkeypatch):
    model, opt = net()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 async_save=True)
    monkeypatch.setattr(GenerationStore, "commit",
                        lambda self, *a, **k: (_ for _ in ()).throw(OSError(5, "EIO")))
    train(model, opt, ckpt, 0, 1)
    ckpt.save()
    with pytest.raises(SaveFailed, match="EIO|Input/output"):
        ckpt.close()
    monkeypatch.undo()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as again:
        assert again.restore() == 0  # nothing was committed, and the lock is free


def test_snapshot_buffers_are_reused_and_tied_weights_stay_one_tensor():
    w = torch.randn(3, 3)
    tree = {"model": {"a": w, "b": w.detach()}, "extra": {"n": [1, 2], "t": (w[0],)}}
    buffers = SnapshotBuffers()
    first = buffers.take(tree)
    assert first["model"]["a"] is first["model"]["b"]  # one view of one storage
    assert first["model"]["a"].data_ptr() != w.data_ptr()
    assert first["extra"]["n"] == [1, 2] and first["extra"]["n"] is not tree["extra"]["n"]
    w.add_(1)
    second = buffers.take(tree)
    assert second["model"]["a"].data_ptr() == first["model"]["a"].data_ptr()  # reused
    assert torch.equal(second["model"]["a"], w)


def test_a_snapshot_rebuilds_every_container_and_shares_nothing_mutable():
    import collections

    import numpy as np

    Pair = collections.namedtuple("Pair", "a b")
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2)).state_dict()  # an OrderedDict + _metadata
    w = torch.randn(4, 6)
    tree = {"model": sd, "c": collections.Counter({3: 2}), "p": Pair(w[:, 1], 5),
            "np": np.arange(4), "t": (torch.tensor(1.5), torch.empty(0, 3),
                                      torch.randn(3).to(torch.bfloat16), w.t())}
    snap = SnapshotBuffers().take(tree)
    assert type(snap["model"]) is type(sd) and snap["model"]._metadata == sd._metadata
    assert snap["model"]._metadata is not sd._metadata
    assert type(snap["c"]) is collections.Counter and snap["c"] == tree["c"]
    assert type(snap["p"]) is Pair and torch.equal(snap["p"].a, w[:, 1])
    assert snap["np"] is not tree["np"] and (snap["np"] == tree["np"]).all()
    for got, want in zip([*snap["model"].values(), *snap["t"]], [*sd.values(), *tree["t"]]):
        assert torch.equal(got, want) and got.dtype == want.dtype and got.shape == want.shape
    before = {k: v.clone() for k, v in sd.items()}
    for v in sd.values():
        v.add_(1)  # the loop goes on: the snapshot keeps the state at take()
    w.add_(1)
    tree["np"][0] = 99
    assert all(torch.equal(snap["model"][k], before[k]) for k in before)
    assert not torch.equal(snap["p"].a, w[:, 1]) and snap["np"][0] == 0


def test_a_snapshot_keeps_a_conjugate_view_apart_from_its_base():
    x = torch.randn(3, dtype=torch.complex64)
    snap = SnapshotBuffers().take({"x": x, "c": x.conj()})
    assert snap["c"] is not snap["x"]
    assert torch.equal(snap["x"], x) and torch.equal(snap["c"], x.conj())


def test_a_snapshot_copies_tensor_dict_keys_and_keeps_attribute_buffers_apart():
    """A tensor used as a dict key is copied like any value (the loop may change it in place
    after save() returned); an OrderedDict's attributes never share a buffer with one of its
    entries, whatever the entry is called."""
    import collections

    key = torch.zeros(2)
    od = collections.OrderedDict(w=torch.ones(3))
    od.extra = {"w": torch.full((3,), 5.0)}  # an attribute holding a tensor of the same path
    tree = {"d": {key: 1}, "od": od}
    snap = SnapshotBuffers().take(tree)
    [snap_key] = snap["d"]
    assert snap_key is not key and torch.equal(snap_key, torch.zeros(2))
    key.add_(1)
    assert torch.equal(snap_key, torch.zeros(2))
    assert torch.equal(snap["od"]["w"], torch.ones(3))
    assert torch.equal(snap["od"].extra["w"], torch.full((3,), 5.0))


@pytest.mark.parametrize("mode", [True, "process"])
def test_a_script_that_ends_without_close_still_commits_its_async_save(tmp_path, mode):
    # The save is paced (persist_share) at a share that would take it minutes: at exit it is
    # released and committed at full speed (`_pacing.release_at_exit`).
    script = textwrap.dedent(f"""
        import torch, unbroken
        model = torch.nn.Linear(512, 512)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = unbroken.Checkpointer({str(tmp_path / "run")!r}, model=model, optimizer=opt,
                                     async_save={mode!r}, persist_share=0.00001)
        model(torch.ones(512)).sum().backward()
        opt.step()
        ckpt.step_done(1)
        ckpt.save()
        """)  # no close(), no wait(): the interpreter exits with the save in flight
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    gens = GenerationStore(tmp_path / "run").scan()
    assert [g.generation for g in gens] == [1] and gens[0].ok


# How a script's last saves meet the interpreter's exit (the saves' kept worker thread,
# `persist.background.Worker`): saves made by a thread after the main thread ended (the exit
# began: its thread-stopping callbacks ran), a first save made by a daemon thread (whose
# daemon flag a thread it starts would take), a save made by an atexit handler. Each script
# ends without close() and must exit, its last generation committed.
_EXITS = {
    "after_main": """
        import threading, time
        def train():
            time.sleep(0.5)  # (the main thread has ended: the exit began)
            for step in (1, 2, 3):
                ckpt.save(step)
        threading.Thread(target=train).start()
        """,
    "daemon_first": """
        import threading
        first = threading.Thread(target=lambda: ckpt.save(1), daemon=True)
        first.start()
        first.join()
        ckpt.wait()
        ckpt.save(3)
        """,
    "atexit": """
        import atexit
        ckpt.save(1)
        ckpt.wait()
        atexit.register(lambda: ckpt.save(3))
        """,
}


@pytest.mark.parametrize("mode", [True, "process"])
@pytest.mark.parametrize("how", sorted(_EXITS))
def test_the_last_save_of_a_script_commits_however_the_exit_meets_it(tmp_path, mode, how):
    script = textwrap.dedent(f"""
        import torch, unbroken
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        ckpt = unbroken.Checkpointer({str(tmp_path / "run")!r}, model=model,
                                     async_save={mode!r})
        """) + textwrap.dedent(_EXITS[how])
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    gens = GenerationStore(tmp_path / "run").scan()
    assert gens[-1].generation == 3 and all(g.ok for g in gens), gens


def test_a_checkpointers_worker_thread_ends_with_close_and_when_it_is_dropped(tmp_path):
    """One thread runs a Checkpointer's saves, kept between them: close() ends it (a save
    after close() starts another), and so does dropping the Checkpointer unclosed; neither
    leaves a finalizer behind per save."""
    import gc
    import weakref

    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "unbroken-save" and t.is_alive()]

    model = torch.nn.Linear(4, 4)
    before = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, async_save=True)
    for step in range(1, 6):
        ckpt.save(step)
        assert len(workers()) == 1
        ckpt.close()
        assert not workers()
    assert len(weakref.finalize._registry) <= before + 1  # type: ignore[attr-defined]
    dropped = unbroken.Checkpointer(tmp_path / "other", model=model, async_save=True)
    dropped.save(1)
    dropped.wait()
    assert len(workers()) == 1
    del dropped
    gc.collect()
    deadline = time.monotonic() + 10
    while workers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not workers()
    again = unbroken.Checkpointer(tmp_path / "run", model=model)
    try:
        assert again.restore() == 5
    finally:
        again.close()


def test_an_interrupted_wait_leaves_the_save_in_flight_and_owned(tmp_path, monkeypatch):
    import signal

    commit = GenerationStore.commit

    def slow_commit(self, *args, **kwargs):
        time.sleep(0.5)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(GenerationStore, "commit", slow_commit)
    model = torch.nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, async_save=True,
                                 keep=unbroken.Keep(last=5))
    ckpt.save(1)

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            ckpt.wait()  # Ctrl-C while waiting
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with torch.no_grad():
        model.weight.fill_(7.0)  # the next update, in place
    ckpt.save(2)  # waits for save 1 before its snapshot reuses the buffers
    ckpt.close()
    monkeypatch.undo()
    with torch.no_grad():
        model.weight.zero_()
    with unbroken.Checkpointer(tmp_path / "run", model=model) as again:
        assert again.restore(generation=1) == 1
    assert model.weight.unique().tolist() == [1.0]


def test_a_persisting_process_that_died_between_saves_is_replaced(tmp_path):
    model, opt = net()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save="process") as ckpt:
        train(model, opt, ckpt, 0, 1)
        ckpt.save()
        ckpt.wait()
        proc = ckpt._persister._proc
        proc.kill()
        proc.wait()
        train(model, opt, ckpt, 1, 2)
        # (found dead before the save is sent: said as when found at the handover; found from
        # outside, twenty-fourth session: it was replaced without a word)
        with pytest.warns(UnbrokenWarning, match=rf"persisting process {proc.pid} had ended "
                                                 r"\(exit code -9\) since the last save"):
            ckpt.save()
        assert ckpt.wait().generation == 2
    assert [g.generation for g in GenerationStore(tmp_path / "run").scan()] == [1, 2]


@pytest.mark.parametrize("when", ["dead, looking alive", "stopped, killed after save()"])
def test_a_save_the_persisting_process_never_took_goes_to_a_new_one(tmp_path, monkeypatch, when):
    """A persisting process SIGKILLed just before a save may still look alive when the save
    is handed over (until its last thread is gone): that save, which it never took, goes to a
    new persisting process, with a warning; it does not fail."""
    model, opt = net()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save="process") as ckpt:
        train(model, opt, ckpt, 0, 1)
        ckpt.save()
        ckpt.wait()
        proc = ckpt._persister._proc
        train(model, opt, ckpt, 1, 2)
        want = state(model, opt)
        with pytest.warns(UnbrokenWarning, match=rf"persisting process {proc.pid} had ended "
                          r"\(exit code -9.*before it took the save of generation 2; a new"):
            if when == "dead, looking alive":  # (the handover finds its socket closed)
                proc.kill()
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # gone, not reaped
                monkeypatch.setattr(proc, "poll", lambda: None)  # as it looks for a moment
                ckpt.save()
            else:  # (the request waits in its socket, not taken; the wait finds it closed)
                os.kill(proc.pid, signal.SIGSTOP)
                ckpt.save()
                proc.kill()
            assert ckpt.wait().generation == 2
        assert ckpt._persister._proc.pid != proc.pid
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert ckpt.restore() == 2
        got = state(model, opt)
        assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
        train(model, opt, ckpt, 2, 3)
        ckpt.save()  # the new process goes on
        assert ckpt.wait().generation == 3


def test_a_failed_save_in_the_persisting_process_raises_typed(tmp_path, monkeypatch):
    model, opt = net()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 async_save="process")
    train(model, opt, ckpt, 0, 1)
    submit = ProcessPersister.submit

    def garbled(self, request, artifacts):  # a manifest field the persisting process refuses
        submit(self, {**request, "manifest": {**request["manifest"], "bogus": 1}}, artifacts)

    monkeypatch.setattr(ProcessPersister, "submit", garbled)
    ckpt.save()
    with pytest.raises(SaveFailed, match="persisting process failed on generation 1"):
        ckpt.wait()
    monkeypatch.undo()
    train(model, opt, ckpt, 1, 2)
    ckpt.save()  # the same persisting process goes on
    assert ckpt.wait().generation == 2
    ckpt.close()
    assert [g.generation for g in GenerationStore(tmp_path / "run").scan()] == [2]


def test_a_forked_child_does_not_keep_the_persisting_process_waiting(tmp_path):
    script = textwrap.dedent(f"""
        import os, time, torch, unbroken
        model = torch.nn.Linear(8, 8)
        ckpt = unbroken.Checkpointer({str(tmp_path / "run")!r}, model=model,
                                     async_save="process")
        ckpt.step_done(1)
        ckpt.save()
        ckpt.wait()
        child = os.fork()  # a DataLoader worker, say, that outlives the writer
        if child == 0:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # (not holding the test's pipes open)
            os.dup2(null, 2)
            time.sleep(20)
            os._exit(0)
        print(child, ckpt._persister._proc.pid, flush=True)
        os._exit(0)  # the writer dies (no close())
        """)
    out = subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                         capture_output=True, text=True).stdout.split()
    child, persister = int(out[0]), int(out[1])
    try:
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{persister}") and time.monotonic() < deadline:
            time.sleep(0.05)  # it saw the writer's end although the fork holds on
        status = open(f"/proc/{persister}/stat").read().split()[2] \
            if os.path.exists(f"/proc/{persister}") else "gone"
        assert status in ("gone", "Z"), status
        assert os.path.exists(f"/proc/{child}")  # while the fork still lives
    finally:
        os.kill(child, 9)


def test_a_new_writer_waits_for_the_persisting_process_of_a_dead_one(tmp_path, monkeypatch):
    (tmp_path / "LOCK").touch()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from unbroken.store.lock import "
         "take_persister; take_persister(sys.argv[1]); print('held', flush=True); "
         "time.sleep(2)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    monkeypatch.setattr(lock, "PERSISTER_WAIT", 0.2)  # too impatient: refused, naming why
    with pytest.raises(unbroken.StoreLocked, match="persisting process of an earlier"):
        lock.acquire_writer_lock(str(tmp_path))
    monkeypatch.setattr(lock, "PERSISTER_WAIT", 30.0)
    fd = lock.acquire_writer_lock(str(tmp_path))  # once the save is in and the process ended
    assert holder.poll() is not None
    lock.release_writer_lock(str(tmp_path), fd)
    holder.wait(timeout=30)


def test_read_back_in_the_background_returns_at_commit_and_retains_after_verifying(
        tmp_path, monkeypatch):
    model, opt = net()
    release = threading.Event()
    verify = GenerationStore.verify

    def slow_verify(self, *args, **kwargs):
        assert release.wait(30)
        return verify(self, *args, **kwargs)

    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               keep=unbroken.Keep(last=1), read_back="background") as ckpt:
        train(model, opt, ckpt, 0, 1)
        ckpt.save()
        release.set()
        ckpt.wait()
        release.clear()
        monkeypatch.setattr(GenerationStore, "verify", slow_verify)
        train(model, opt, ckpt, 1, 2)
        info = ckpt.save()  # committed and durable, not yet read back
        assert info.generation == 2 and info.manifest is not None
        # retention waits for the read-back: generation 1 is still there
        assert [g.generation for g in GenerationStore(tmp_path / "run").scan()] == [1, 2]
        release.set()
        assert ckpt.wait().generation == 2
        assert [g.generation for g in GenerationStore(tmp_path / "run").scan()] == [2]


def test_a_failed_background_read_back_raises_later_and_keeps_the_older_generation(
        tmp_path, monkeypatch, caplog):
    model, opt = net()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 keep=unbroken.Keep(last=1))  # (the default read-back)
    train(model, opt, ckpt, 0, 1)
    ckpt.save()
    ckpt.wait()

    def corrupt(self, info, *args, **kwargs):
        raise unbroken.CorruptCheckpoint(f"{info.path}/model.safetensors: content hash x")

    monkeypatch.setattr(GenerationStore, "verify", corrupt)
    train(model, opt, ckpt, 1, 2)
    assert ckpt.save().generation == 2
    deadline = time.monotonic() + 30
    while not any("save of step 2 failed" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the failure was not logged when it happened"
        time.sleep(0.01)  # said at once, not only at the next save (a script may never save)
    with pytest.raises(SaveFailed, match="did not read back as written"):
        train(model, opt, ckpt, 2, 3)
        ckpt.save()
    ckpt.close()
    monkeypatch.undo()
    store = GenerationStore(tmp_path / "run")
    assert [g.generation for g in store.scan()] == [1]  # 2 moved aside, 1 never deleted
    store.verify(store.scan()[0])
