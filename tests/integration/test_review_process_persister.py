"""Review of the process-mode async save (``async_save="process"``): the persisting process
(`persist._worker`) writes, commits, verifies and retains what ``save()`` put in shared
memory. Attacked: a state whose shape changes between saves, the loop mutating every tensor
right after ``save()`` returned, the persisting process SIGKILLed idle and mid-save,
``close()`` with a paced save in flight, a fork of the trainer, two writers on one folder,
the same step saved twice, incremental saves with retention under kills; every restored state
compared bit for bit, and the persisting process never maps libtorch. Every wait is bounded
(SIGALRM per test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _persisting import assert_bitwise, gens, restored, snapshot, worker_pid, workers_of_me

import unbroken
from unbroken.errors import UnbrokenError

pytestmark = pytest.mark.usefixtures("hang_watchdog")  # (60 s a test: nothing may hang)


# -- helpers ---------------------------------------------------------------------------------






def assert_no_torch(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except FileNotFoundError:
        return  # (gone already)
    assert "libtorch" not in maps, f"persisting process {pid} mapped libtorch"
    assert "libc10" not in maps, f"persisting process {pid} mapped libc10"




def kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):  # (reaped, even between open and read)
            return
        time.sleep(0.02)
    raise AssertionError(f"{pid} survived SIGKILL")


def step_(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    loss = sum(p.float().square().sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_and_save(ck: unbroken.Checkpointer, model, opt, step: int) -> None:
    """One update (`step_`), declared done, and its save."""
    step_(model, opt, step)
    ck.step_done(step)
    ck.save()


class Net(torch.nn.Module):
    """Shape-shifting model: ``stage`` adds a parameter, changes a buffer's dtype, drops one."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        if stage < 3:
            self.b = torch.nn.Linear(16, 8)  # removed at stage 3
        if stage >= 1:
            self.grown = torch.nn.Parameter(torch.randn(512, 512))  # 1 MB: the segment grows
        dtype = torch.bfloat16 if stage >= 2 else torch.float32
        self.register_buffer("buf", torch.arange(64, dtype=torch.float32).to(dtype) / 3)


def build_stage(stage: int):
    def build():
        m = Net(stage)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)
    return build


# -- 1. the state changes shape between saves ------------------------------------------------


def test_state_changes_shape_between_process_saves(fast_tmp):
    """One Checkpointer, one model and optimizer object, changed in place between saves."""
    root = fast_tmp / "run"
    model, opt = build_stage(0)()
    group = opt.param_groups[0]

    def regroup():
        keep = list(model.parameters())
        for p in [p for p in opt.state if all(p is not q for q in keep)]:
            del opt.state[p]
        group["params"] = keep

    want = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               keep=unbroken.Keep(last=10)) as ck:
        for s in range(5):
            stage = max(s - 1, 0)
            if s == 2:  # a new parameter (the segment must grow)
                model.grown = torch.nn.Parameter(torch.randn(512, 512))
                regroup()
            elif s == 3:  # a buffer float32 -> bfloat16
                model.buf = model.buf.to(torch.bfloat16)
            elif s == 4:  # a parameter removed
                del model.b
                regroup()
            if s:  # (step 0: saved before any optimizer step: no optimizer state yet)
                step_(model, opt, s)
                ck.step_done(s)
            else:
                assert not opt.state
            ck.save(s)
            want[s] = (stage, snapshot(model, opt))
            pid = worker_pid(ck)
            assert_no_torch(pid)
            assert ck.wait() is not None, s
            assert_no_torch(pid)
    assert gens(root) == [0, 1, 2, 3, 4]
    for s in (4, 3, 2, 1, 0):  # (newest first: restoring an older one abandons newer ones)
        got_step, got = restored(root, build_stage(want[s][0]), s)
        assert got_step == s
        assert_bitwise(got, want[s][1])


def test_one_checkpointer_whose_model_grows_in_place(fast_tmp):
    """The same Checkpointer, the same model object: a parameter registered after the first
    save (segment must grow) and a buffer changing dtype in place."""
    root = fast_tmp / "run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model.register_buffer("buf", torch.ones(32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        ck.save(0)
        w0 = snapshot(model, opt)
        ck.wait()
        model.register_buffer("big", torch.randn(1024, 1024))  # 4 MB: a new segment
        model.buf = model.buf.to(torch.bfloat16) * 3
        step_(model, opt, 1)
        ck.save(1)
        w1 = snapshot(model, opt)
        assert ck.wait() is not None

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8))
        m.register_buffer("buf", torch.ones(32, dtype=torch.bfloat16))
        m.register_buffer("big", torch.zeros(1024, 1024))
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    step, got = restored(root, build, 1)
    assert step == 1
    assert_bitwise(got, w1)
    assert "o.0.momentum_buffer" not in w0 and "o.0.momentum_buffer" in w1


# -- 2. mutation right after save() returns --------------------------------------------------


class Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.out = torch.nn.Linear(32, 64, bias=False)
        self.out.weight = self.emb.weight  # tied: one Parameter under two names
        self.bf = torch.nn.Parameter(torch.randn(300, 7).to(torch.bfloat16))
        self.empty = torch.nn.Parameter(torch.zeros(0, 5))
        self.big = torch.nn.Parameter(torch.randn(700, 900))  # over the torch-copy chunk size
        self.register_buffer("tbuf", torch.randn(33, 65).t())  # non-contiguous
        assert not self.tbuf.is_contiguous()


def build_odd():
    m = Odd()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_in_place_mutation_after_save_does_not_change_what_is_written(fast_tmp):
    root = fast_tmp / "run"
    model, opt = build_odd()
    wants = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.05, keep=unbroken.Keep(last=10)) as ck:
        for s in (1, 2, 3):
            step_and_save(ck, model, opt, s)
            want = snapshot(model, opt)
            with torch.no_grad():  # scribble over everything, at once
                for p in model.parameters():
                    p.mul_(-7).add_(3)
                model.tbuf.fill_(float("inf"))
                for st in opt.state.values():
                    for v in st.values():
                        if torch.is_tensor(v):
                            v.fill_(123.0)
            assert_no_torch(worker_pid(ck))
            assert ck.wait() is not None
            wants[s] = want
            with torch.no_grad():  # back to the saved values, the next step goes on from them
                model.load_state_dict({k[2:]: v for k, v in want.items() if k.startswith("m.")})
    for s in (3, 2, 1):
        step, got = restored(root, build_odd, s)
        assert step == s
        assert_bitwise(got, wants[s])


def test_restore_keeps_ties_and_strides(fast_tmp):
    root = fast_tmp / "run"
    model, opt = build_odd()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        step_and_save(ck, model, opt, 1)
        ck.wait()
    m2, o2 = build_odd()
    with unbroken.Checkpointer(root, model=m2, optimizer=o2) as r:
        assert r.restore() == 1
    assert m2.out.weight is m2.emb.weight  # the tie survives a restore in place
    assert m2.bf.dtype == torch.bfloat16 and m2.empty.shape == (0, 5)


# -- 3. the persisting process is SIGKILLed ---------------------------------------------------


def small():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def test_persister_killed_while_idle_next_save_works(fast_tmp):
    root = fast_tmp / "run"
    model, opt = small()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        step_and_save(ck, model, opt, 1)
        ck.wait()
        first = worker_pid(ck)
        assert workers_of_me() == [first]
        kill_and_reap(first)
        step_(model, opt, 2)
        ck.step_done(2)
        try:
            ck.save()
            info = ck.wait()
        except UnbrokenError as e:  # allowed: typed, naming the run
            assert str(root) in str(e)
            ck.save(2)
            info = ck.wait()
        want = snapshot(model, opt)
        assert info is not None
        second = worker_pid(ck)
        assert second != first
        assert_no_torch(second)
    assert 2 in gens(root)
    assert restored(root, small)[0] == 2
    assert_bitwise(restored(root, small)[1], want)
    assert workers_of_me() == []


def big_model():
    m = torch.nn.Module()
    m.register_buffer("blob", torch.zeros(48 * 1024 * 1024 // 4))  # 48 MB
    m.lin = torch.nn.Linear(16, 16)
    return m, torch.optim.SGD(m.lin.parameters(), lr=0.1)


def test_persister_killed_mid_save_raises_typed_and_keeps_last_verified(fast_tmp):
    root = fast_tmp / "run"
    model, opt = big_model()
    with torch.no_grad():
        model.blob.copy_(torch.rand(model.blob.shape))
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.02)
    try:
        step_and_save(ck, model, opt, 1)
        want1 = snapshot(model, opt)
        assert ck.wait() is not None  # (hurried: full speed)
        step_(model, opt, 2)
        with torch.no_grad():
            model.blob.add_(1)
        ck.step_done(2)
        ck.save()
        pid = worker_pid(ck)
        time.sleep(0.3)
        assert_no_torch(pid)
        assert 2 not in gens(root), "not paced: the save was not in flight"
        kill_and_reap(pid)
        with pytest.raises(UnbrokenError) as raised:
            ck.wait()
        assert str(root) in str(raised.value)
    finally:
        try:
            ck.close()
        except UnbrokenError:
            pass
    step, got = restored(root, big_model)
    assert step == 1
    assert_bitwise(got, want1)
    assert workers_of_me() == []


def test_after_a_mid_save_kill_the_same_checkpointer_saves_again(fast_tmp):
    root = fast_tmp / "run"
    model, opt = big_model()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.02) as ck:
        ck.save(0)
        ck.wait()
        step_and_save(ck, model, opt, 1)
        pid = worker_pid(ck)
        time.sleep(0.3)
        kill_and_reap(pid)
        with pytest.raises(UnbrokenError):
            ck.wait()
        ck.save(1)  # retry the failed save with a fresh persisting process
        want = snapshot(model, opt)
        assert ck.wait() is not None
        assert_no_torch(worker_pid(ck))
    assert gens(root)[-1] == 1
    step, got = restored(root, big_model)
    assert step == 1
    assert_bitwise(got, want)


# -- 4. close() with a save in flight commits it ---------------------------------------------


def test_close_with_a_paced_save_in_flight_commits_it(fast_tmp):
    root = fast_tmp / "run"
    model, opt = big_model()
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               persist_share=0.02)
    step_and_save(ck, model, opt, 1)
    want = snapshot(model, opt)
    pid = worker_pid(ck)
    time.sleep(0.2)
    in_flight = 1 not in gens(root)
    assert_no_torch(pid)
    ck.close()  # waits (hurried), then ends the process
    assert 1 in gens(root)
    assert (root / "gen-000000001" / "MANIFEST.json").is_file()
    step, got = restored(root, big_model)
    assert step == 1
    assert_bitwise(got, want)
    deadline = time.monotonic() + 10
    while pid in workers_of_me() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid not in workers_of_me()
    assert in_flight  # (the paced save was surely in flight at close)


# -- 6. other attacks ------------------------------------------------------------------------


def test_fork_of_the_trainer_with_a_live_persister(fast_tmp):
    root = fast_tmp / "run"
    model, opt = small()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        ck.save(0)
        ck.wait()
        child = os.fork()
        if child == 0:  # a DataLoader-like child that lingers, then exits without cleanup
            try:
                time.sleep(3)
            finally:
                os._exit(0)
        try:
            step_and_save(ck, model, opt, 1)
            want = snapshot(model, opt)
            assert ck.wait() is not None
            t0 = time.monotonic()
            pid = worker_pid(ck)
            ck.close()  # must not wait for the forked child to let go
            assert time.monotonic() - t0 < 2.5
        finally:
            os.waitpid(child, 0)
    assert pid not in workers_of_me()
    assert_bitwise(restored(root, small)[1], want)


def test_two_process_checkpointers_on_one_folder(fast_tmp):
    root = fast_tmp / "run"
    m1, o1 = small()
    m2, o2 = small()
    with unbroken.Checkpointer(root, model=m1, optimizer=o1, async_save="process") as a:
        step_(m1, o1, 1)
        a.step_done(1)
        a.save()
        want = snapshot(m1, o1)
        try:
            b = unbroken.Checkpointer(root, model=m2, optimizer=o2, async_save="process")
        except UnbrokenError:
            b = None
        if b is not None:
            try:
                step_(m2, o2, 5)
                with torch.no_grad():
                    m2.weight.fill_(9)
                with pytest.raises(UnbrokenError):
                    b.save(7)
                    b.wait()
            finally:
                try:
                    b.close()
                except UnbrokenError:
                    pass
        assert a.wait() is not None
    assert gens(root) == [1]
    assert_bitwise(restored(root, small)[1], want)


def test_same_step_saved_twice_supersedes(fast_tmp):
    root = fast_tmp / "run"
    model, opt = small()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process") as ck:
        step_and_save(ck, model, opt, 1)
        ck.wait()
        ck.save()  # unchanged: a no-op
        assert ck.wait() is None
        with torch.no_grad():
            model.bias.add_(1)  # changed at the same step (an end-of-epoch change)
        ck.save()
        want = snapshot(model, opt)
        assert ck.wait() is not None
    assert gens(root) == [1]
    assert_bitwise(restored(root, small)[1], want)


@pytest.mark.parametrize("rep", range(3))
def test_incremental_retention_with_kills(fast_tmp, rep):
    """Killed after saves 3 and 5: mid-save (typed error, saved again) or just after it
    replied. Then the next save goes to a new persisting process even where the killed one
    still looks alive (it failed 2 times in 14 before the persisting process said which saves
    it took, `persist.process`)."""
    from _frozen import fresh, train_step
    root = fast_tmp / "run"
    model, opt = fresh(600)

    def build():
        return fresh(600)

    saved = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               incremental=True, keep=unbroken.Keep(last=2),
                               persist_share=0.05) as ck:
        for s in range(1, 7):
            train_step(model, opt, s)
            ck.step_done(s)
            ck.save()
            saved[s] = snapshot(model, opt)
            if s in (3, 5):  # killed mid-save (paced): in write, commit or retention
                time.sleep(0.05 * s)
                kill_and_reap(worker_pid(ck))
                try:
                    ck.wait()
                    assert s in gens(root)  # it replied before the kill: committed
                except UnbrokenError as e:
                    assert str(root) in str(e)
                    ck.save(s)
                    saved[s] = snapshot(model, opt)
                    assert ck.wait() is not None
            else:
                assert ck.wait() is not None
                assert_no_torch(worker_pid(ck))
    have = gens(root)
    assert have[-2:] == [5, 6], have
    for s in (6, 5):
        step, got = restored(root, build, s)
        assert step == s
        assert_bitwise(got, saved[s])


TRAINER = """
import sys, time, torch, unbroken
torch.manual_seed(0)
m = torch.nn.Linear(2048, 2048)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
ck = unbroken.Checkpointer(sys.argv[1], model=m, optimizer=opt, async_save="process",
                           persist_share=0.05)
ck.save(1)
print(ck._persister._proc.pid, flush=True)
time.sleep(120)
"""


def test_trainer_sigkilled_after_save_returned_the_save_is_still_committed(fast_tmp):
    root = fast_tmp / "run"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(root)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        worker = int(proc.stdout.readline())
        assert_no_torch(worker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
        committed_at_kill = 1 in gens(root)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)
    torch.manual_seed(0)
    m = torch.nn.Linear(2048, 2048)
    want = snapshot(m, None)
    with torch.no_grad():
        m.weight.zero_()
    with unbroken.Checkpointer(root, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)
                               ) as reader:  # waits for the orphaned persisting process
        assert reader.restore() == 1
    assert_bitwise(snapshot(m, None), want)
    del committed_at_kill  # (either way: the generation is there now, and verifies)


def test_close_after_the_idle_persister_was_killed_releases_the_run(fast_tmp):
    root = fast_tmp / "run"
    model, opt = small()
    ck = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process")
    step_and_save(ck, model, opt, 1)
    want = snapshot(model, opt)
    ck.wait()
    kill_and_reap(worker_pid(ck))
    t0 = time.monotonic()
    ck.close()  # nothing in flight: must neither raise nor hang
    assert time.monotonic() - t0 < 5
    m2, o2 = small()
    with unbroken.Checkpointer(root, model=m2, optimizer=o2, async_save="process") as again:
        assert again.restore() == 1  # the lock came back: a writer can open and save
        step_(m2, o2, 2)
        again.step_done(2)
        again.save()
        assert again.wait() is not None
    assert_bitwise(restored(root, small, 1)[1], want)
