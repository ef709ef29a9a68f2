"""``stop_deadline=S`` bounds the wait for an update boundary after a stop signal, not the stop
save (session 27): once the boundary is reached within S seconds the deadline no longer
applies, however long the save takes and in every save mode, and the script leaves normally;
a run that reaches no boundary within S seconds is still ended as the signal would end it.
Real processes, real SIGTERM; the stop save is made slower than the deadline on purpose (a
state part whose ``state_dict()`` takes longer than S)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import unbroken

pytestmark = pytest.mark.usefixtures("hang_watchdog")

DEADLINE = 0.3  # seconds; the stop save takes SLOW_SAVE > DEADLINE
SLOW_SAVE = 1.0

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch, unbroken

    class Slow:
        # a state part whose capture takes longer than the deadline: the stop save outlasts it
        def __init__(self): self.n, self.slept = 0, False
        def state_dict(self):
            if self.n == 3 and not self.slept:  # the stop save's capture, once
                self.slept = True
                time.sleep(float(os.environ["SLOW_SAVE"]))
            return {"n": self.n}
        def load_state_dict(self, sd): self.n = sd["n"]

    run, mode, stuck, ref = sys.argv[1], sys.argv[2], sys.argv[3] == "stuck", sys.argv[4]
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    slow = Slow()
    async_save = {"sync": False, "thread": True, "process": "process"}[mode]
    ckpt = unbroken.Checkpointer(run, model=model, optimizer=opt, extras={"slow": slow},
                                 signals=[signal.SIGTERM], every=2, async_save=async_save,
                                 stop_deadline=float(os.environ["DEADLINE"]))
    step = ckpt.restore()
    while not ckpt.should_stop:
        x = torch.randn(16, 64)
        model(x).pow(2).mean().backward()
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the notice lands in update 3
            if stuck:
                print("stuck", flush=True)
                time.sleep(30)  # no boundary within the deadline: it ends the process
        opt.step()
        opt.zero_grad()
        step += 1
        slow.n = step
        t0 = time.monotonic()
        ckpt.step_done(step)
    print(f"stopped after update {step}; step_done took {time.monotonic() - t0:.2f} s",
          flush=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ref)
    ckpt.close()
    print("closed", flush=True)
    """)


def _run(tmp_path, mode: str, stuck: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "DEADLINE": str(DEADLINE), "SLOW_SAVE": str(SLOW_SAVE)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), mode,
                        "stuck" if stuck else "-", str(tmp_path / "ref.pt")],
                       capture_output=True, text=True, timeout=45, env=env)
    return r, time.monotonic() - t0


def _generations(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run").glob("gen-*"))


def _staging(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run").rglob(".staging-*"))


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_a_boundary_in_time_saves_and_leaves_normally_though_the_save_outlasts_the_deadline(
        tmp_path, mode):
    r, _ = _run(tmp_path, mode, stuck=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped after update 3" in r.stdout and "closed" in r.stdout, r.stdout
    assert "no update boundary within" not in r.stderr, r.stderr[-3000:]
    assert "generation 3 is committed" in r.stderr
    assert _generations(tmp_path) == ["gen-000000002", "gen-000000003"]
    assert not _staging(tmp_path)
    # the stop save took longer than the deadline: the deadline really was outlasted
    took = float(r.stdout.split("step_done took ")[1].split()[0])
    assert took > DEADLINE

    # resumed: bitwise the state the stop save held
    ref = torch.load(tmp_path / "ref.pt")
    torch.manual_seed(1)  # not the run's: everything must come from the generation
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class Part:
        n = -1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    part = Part()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               extras={"slow": part}) as ckpt:
        assert ckpt.restore() == 3
    assert part.n == 3
    for name, t in ref["model"].items():
        assert torch.equal(model.state_dict()[name], t), name
    got = opt.state_dict()["state"]
    assert got.keys() == ref["opt"]["state"].keys()
    for k, st in ref["opt"]["state"].items():
        assert torch.equal(got[k]["momentum_buffer"], st["momentum_buffer"]), k


def test_no_boundary_within_the_deadline_still_ends_the_process_as_the_signal_would(tmp_path):
    r, took = _run(tmp_path, "sync", stuck=True)
    assert r.returncode == -signal.SIGTERM, r.stderr[-3000:]
    assert "stuck" in r.stdout and "stopped" not in r.stdout
    # the deadline as given, not rounded to "0 s"
    assert f"no update boundary within {DEADLINE:g} s of SIGTERM" in r.stderr, r.stderr[-3000:]
    assert took < 25  # ended by the deadline, not by the end of the 30 s wait
    assert _generations(tmp_path) == ["gen-000000002"]  # the previous generation stays newest


LATE_TIMER = textwrap.dedent("""
    import os, signal, sys, torch, unbroken
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt,
                                 signals=[signal.SIGTERM], stop_deadline=30.0)
    ckpt.restore()
    model(torch.ones(4)).sum().backward()
    os.kill(os.getpid(), signal.SIGTERM)
    opt.step()
    ckpt.step_done(1)
    # the timer thread fires just as the main thread reached the boundary (it lost the race
    # for the lock): it must stand down instead of ending the process
    ckpt._preemption._give_up()
    print("alive", ckpt.should_stop, flush=True)
    ckpt.close()
    """)


def test_a_deadline_timer_that_fires_after_the_boundary_stands_down(tmp_path):
    r = subprocess.run([sys.executable, "-c", LATE_TIMER, str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=45)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "alive True"
    assert "no update boundary within" not in r.stderr
    assert _generations(tmp_path) == ["gen-000000001"]
