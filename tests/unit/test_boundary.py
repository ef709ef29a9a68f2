"""Update boundaries: a save outside step_done must prove nothing moved since it; the rate the
optimizer applied; signals recorded and honoured at the next boundary; hyperparameter changes
warned on a continuation."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import unbroken
from unbroken.errors import UnbrokenWarning, UpdateBoundaryError
from unbroken.trace import read_trace


def setup(root, accumulation=1, **kw):
    torch.manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = unbroken.ResumableSampler(len(ds), batch_size=8, seed=0)
    loader = unbroken.ResumableLoader(ds, sampler, accumulation=accumulation)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, scheduler=sched, data=loader,
                                 **kw)
    return model, opt, sched, loader, ckpt


def test_save_after_optimizer_step_before_step_done_is_refused(tmp_path):
    model, opt, sched, loader, ckpt = setup(tmp_path / "run")
    ckpt.restore()
    it = iter(loader)
    x, y = next(it)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    with pytest.raises(UpdateBoundaryError, match=r"optimizer.step\(\) ran 1 time.*data loader"):
        ckpt.save()
    sched.step()
    ckpt.step_done(1)
    ckpt.save()  # now at the boundary
    x, y = next(it)
    with pytest.raises(UpdateBoundaryError, match="handed out batches"):
        ckpt.save()  # a batch taken, nothing stepped yet: its samples would be skipped
    assert [g.name for g in (tmp_path / "run").iterdir() if g.name.startswith("gen-")] == [
        "gen-000000001"]
    ckpt.close()


def test_save_with_an_explicit_later_step_declares_the_boundary(tmp_path):
    model, opt, sched, loader, ckpt = setup(tmp_path / "run")
    ckpt.restore()
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        break
    ckpt.save(1)  # a loop without step_done says how many updates completed
    assert ckpt.step == 1
    ckpt.close()


class _Flaky:
    """An extra whose state cannot be stored while ``bad`` (a set is neither JSON nor a
    tensor): that save fails in encoding, after the step was declared."""

    def __init__(self) -> None:
        self.bad = False

    def state_dict(self) -> dict:
        return {"seen": {1, 2}} if self.bad else {"seen": [1, 2]}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize("async_save", [False, True, "process"])
def test_a_step_declared_by_save_is_a_boundary_for_the_saves_that_follow(tmp_path,
                                                                         async_save):
    """A loop without step_done: save(N) declares N updates. Saving N again (a no-op, or a
    superseding save after an end-of-epoch scheduler step), save() without a step, and a
    retry of a save that failed are all at that boundary; an update after it is not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    flaky = _Flaky()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 scheduler=sched, extras={"flaky": flaky},
                                 async_save=async_save)
    ckpt.restore()

    def update() -> None:
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        update()
    ckpt.save(3)
    first = ckpt.wait()
    assert first is not None and first.generation == 3
    assert ckpt.save(3) is None and ckpt.save() is None  # nothing changed: no-ops
    ckpt.wait()
    sched.step()  # end of epoch: the same step, another rate
    ckpt.save(3)
    again = ckpt.wait()
    assert again is not None and again.generation == 3  # supersedes
    update()
    flaky.bad = True
    with pytest.raises(unbroken.UnbrokenError, match="flaky"):
        ckpt.save(4)
        ckpt.wait()
    flaky.bad = False
    ckpt.save(4)  # the retry: update 4 was declared by the save that failed
    retried = ckpt.wait()
    assert retried is not None and retried.generation == 4
    update()  # not declared: a save of the same count is after an update it did not see
    with pytest.raises(UpdateBoundaryError, match=r"optimizer.step\(\) ran 1 time"):
        ckpt.save()
    ckpt.save(5)
    assert ckpt.wait().generation == 5
    ckpt.close()
    restored = torch.nn.Linear(4, 1)
    ropt = torch.optim.SGD(restored.parameters(), lr=0.1)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.5)
    with unbroken.Checkpointer(tmp_path / "run", model=restored, optimizer=ropt,
                               scheduler=rsched, extras={"flaky": _Flaky()}) as reader:
        assert reader.restore() == 5
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 restored.state_dict().values()))
    assert rsched.state_dict() == sched.state_dict()


def test_the_trace_records_the_rate_the_optimizer_applied_and_the_metrics(tmp_path):
    trace = tmp_path / "t.jsonl"
    model, opt, sched, loader, ckpt = setup(tmp_path / "run", trace=trace)
    ckpt.restore()
    step = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        ckpt.step_done(step, loss=loss, val=torch.tensor(float("nan")), acc=0.5)
        if step == 3:
            break
    sched.step()  # a scheduler stepped only after the loop: the applied rates never moved
    ckpt.close()
    updates = [r for r in read_trace(trace) if r["event"] == "update"]
    assert [[float.fromhex(v) for v in r["lr"]] for r in updates] == [[0.1]] * 3
    assert [r["opt_steps"] for r in updates] == [1, 1, 1]
    assert updates[0]["metrics"] == {"val": "nan", "acc": (0.5).hex()}
    assert [r["epoch"] for r in updates] == [0, 0, 0]


def test_a_changed_hyperparameter_is_warned_on_continue_but_a_scheduled_rate_is_not(tmp_path):
    model, opt, sched, loader, ckpt = setup(tmp_path / "run")
    ckpt.restore()
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()  # the rate halves: a scheduled change, not the user's
        ckpt.step_done(1)
        break
    ckpt.save()
    ckpt.close()
    model, opt, sched, loader, ckpt = setup(tmp_path / "run")
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.warns(UnbrokenWarning) as caught:
        ckpt.restore()
    text = " ".join(str(w.message) for w in caught)
    assert "'weight_decay': saved 0.01, live 0.1" in text and "'lr'" not in text
    assert opt.param_groups[0]["weight_decay"] == 0.01  # restored, as said
    ckpt.close()


_SIGNALLED = textwrap.dedent("""
    import os, signal, sys, time, torch, unbroken
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt,
                                 signals=[signal.SIGTERM, signal.SIGUSR1], stop_deadline=2.0)
    step = ckpt.restore()
    while not ckpt.should_stop:
        model(torch.ones(2)).sum().backward()
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # lands mid-update
            if len(sys.argv) > 2:
                time.sleep(30)  # never reaches the boundary: the deadline ends the process
        opt.step()
        opt.zero_grad()
        step += 1
        ckpt.step_done(step)
    print(step)
    """)


def test_a_signal_is_honoured_at_the_next_boundary(tmp_path):
    r = subprocess.run([sys.executable, "-c", _SIGNALLED, str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4" and "SIGUSR1 received" in r.stderr
    assert sorted(p.name for p in (tmp_path / "run").glob("gen-*")) == ["gen-000000004"]


def test_no_boundary_within_the_deadline_ends_the_process_as_the_signal_would(tmp_path):
    r = subprocess.run([sys.executable, "-c", _SIGNALLED, str(tmp_path / "run"), "stuck"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGUSR1, r.stderr
    assert "no update boundary within 2 s of SIGUSR1" in r.stderr
    assert not list((tmp_path / "run").glob("gen-*"))


def test_signals_need_the_main_thread(tmp_path):
    import threading

    box = {}

    def build():
        try:
            setup(tmp_path / "run", signals=[signal.SIGTERM])
        except unbroken.UnbrokenError as e:
            box["e"] = e

    t = threading.Thread(target=build)
    t.start()
    t.join(60)
    assert "main thread" in str(box["e"])


def test_a_handler_replaced_after_the_checkpointer_is_reported(tmp_path, caplog):
    previous = signal.getsignal(signal.SIGUSR2)
    model, opt, sched, loader, ckpt = setup(tmp_path / "run", signals=[signal.SIGUSR2])
    try:
        ckpt.restore()
        signal.signal(signal.SIGUSR2, lambda *a: None)  # the script's own, installed later
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            with caplog.at_level("WARNING", logger="unbroken"):
                ckpt.step_done(1)
            break
        assert "SIGUSR2 was given a handler of the script's own" in caplog.text
    finally:
        ckpt.close()
        signal.signal(signal.SIGUSR2, previous)
