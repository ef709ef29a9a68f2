"""A process forked from one whose Checkpointer has a save in flight (a DataLoader worker, a
``ddp_fork`` rank, an evaluation process) made its next save, wait or close wait for that save
forever: the save's thread is not in the fork. The fork holds none of what the Checkpointer
holds (the run's writer lock is not inherited across a fork, nor the save in flight): its save
and restore are refused (`StoreLocked`, naming both processes), its wait has nothing to wait
for and its close releases nothing; the parent's saves go on and commit. A fork keeps the
Checkpointer's signal handlers, so that Ctrl-C, which reaches the loader's workers too, leaves
them serving the parent until its stop save; and a fork that exits leaves the parent's loader
workers running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _forks import reaped

import unbroken
from unbroken.errors import StoreLocked

SCRIPTS = Path(__file__).parent / "scripts"

_CHILD_S = 60.0  # for the fork to report (it hung forever before)


def _in_child(ckpt: unbroken.Checkpointer) -> int:
    """What the fork does with its parent's Checkpointer: 0 if each call behaves as above."""
    try:
        ckpt.save(2)
        return 1
    except StoreLocked as e:
        if f"a fork of process {os.getppid()}" not in str(e):
            return 2
    if ckpt.wait() is not None:
        return 3
    try:
        ckpt.restore()
        return 4
    except StoreLocked:
        pass
    ckpt.close()
    return 0


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_a_fork_refuses_its_parents_saves_and_leaves_them_going(tmp_path, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    opt = torch.optim.AdamW(model.parameters())
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 async_save=mode)
    try:
        ckpt.save(0)
        ckpt.wait()
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        ckpt.save(1)  # (async: in flight as the fork is made; sync: its read-back may be)
        pid = os.fork()
        if pid == 0:
            code = 9
            try:
                code = _in_child(ckpt)
            finally:
                os._exit(code)
        assert reaped(pid, _CHILD_S, "the fork (hung in the Checkpointer)") == 0
        assert ckpt.wait() is None or ckpt.store.scan_one(1).ok
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        ckpt.save(2)
        assert ckpt.wait() is not None or mode is False
    finally:
        ckpt.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    with unbroken.Checkpointer(tmp_path / "run", model=fresh,
                               optimizer=torch.optim.AdamW(fresh.parameters())) as again:
        assert again.restore() == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_a_fork_s_step_done_saves_nothing_into_its_parent_s_run(tmp_path, mode):
    """``step_done`` saves too (``every=``): in a fork it raised nothing and wrote generations
    into the parent's run without its lock (sync), or hung in the snapshot (thread)."""
    model = torch.nn.Linear(8, 8)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, async_save=mode, every=2)
    try:
        ckpt.step_done(1)
        ckpt.step_done(2)
        pid = os.fork()
        if pid == 0:
            code = 9
            try:
                with torch.no_grad():
                    model.weight.fill_(666.0)
                try:
                    ckpt.step_done(3)
                    ckpt.step_done(4)
                    code = 1
                except StoreLocked:
                    code = 0
            finally:
                os._exit(code)
        assert reaped(pid, _CHILD_S, "the fork (hung in the Checkpointer)") == 0
        ckpt.wait()
    finally:
        ckpt.close()
    assert [g.generation for g in ckpt.store.scan() if g.ok] == [2]


@pytest.mark.parametrize("kind", ["torch", "resumable"])
def test_ctrl_c_reaches_the_workers_too_and_the_stop_save_still_happens(tmp_path, kind):
    """Ctrl-C signals the whole process group, the loader's forked workers too, which hold
    the Checkpointer's handler: they must keep serving batches until the parent reaches its
    boundary, saves and stops (a fork passing SIGINT on to Python's default handler made each
    worker end, and the parent failed before its boundary: nothing saved)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "ctrl_c_workers.py"), str(run), kind],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=_CHILD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    stopped = [line for line in out.splitlines() if line.startswith("stopped at ")]
    assert stopped, out
    step = int(stopped[0].split()[-1])
    with unbroken.Checkpointer(run, model=torch.nn.Linear(8, 8)) as again:
        assert [g.generation for g in again.store.scan() if g.ok] == [step]


def test_a_fork_that_exits_leaves_its_parent_s_loader_workers_running():
    """A fork that exits normally ran the loader's exit handler, and torch's iterators' own
    shutdown, on its copies of the parent's loaders, which stopped the parent's workers: the
    parent then waited for a batch forever. And a loader whose construction failed made the
    exit print an AttributeError."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fork_exit_loader.py")],
                          capture_output=True, text=True, timeout=_CHILD_S)
    assert proc.returncode == 0, proc.stderr
    assert "parent got 200 batches" in proc.stdout
    # (multiprocessing's own exit handler in the fork complains of the parent's workers,
    # which it may not join: Python's, not unbroken's)
    assert "unbroken" not in proc.stderr and "_dl" not in proc.stderr, proc.stderr
