"""``persist_share``: a background save keeps its CPU time under a share of one core while the
loop runs, goes on at full speed once the loop waits for it (the next save, ``wait()``,
``close()``, the interpreter's exit: test_async_save.py's script without close()), and writes
exactly what an unpaced save writes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import unbroken
from unbroken._pacing import Pacer, installed, tick
from unbroken.persist.background import InFlight


def net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    return model, torch.optim.AdamW(model.parameters())


def burn(seconds: float) -> None:
    """``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_pacer_keeps_the_cpu_time_within_its_share_of_the_wall_time():
    pacer = Pacer(0.25)
    with installed(pacer):
        started = time.monotonic()
        for _ in range(4):
            burn(0.01)
            tick()
        wall = time.monotonic() - started
    assert wall >= 0.04 / 0.25 * 0.9  # 40 ms of CPU at a quarter of a core: >= 160 ms
    assert pacer.slept > 0


def test_tick_never_waits_without_a_pacer_or_once_released():
    burn(0.02)
    started = time.monotonic()
    tick()  # no pacer installed in this thread
    pacer = Pacer(0.001)
    with installed(pacer):
        burn(0.02)  # 20 s of wall time at this share
        pacer.release()
        tick()
    assert time.monotonic() - started < 1.0
    assert pacer.slept == 0


def test_a_pacer_hurried_by_another_process_stops_waiting():
    flag = threading.Event()
    pacer = Pacer(0.001, hurried=flag.is_set)
    with installed(pacer):
        burn(0.02)
        started = time.monotonic()
        threading.Timer(0.1, flag.set).start()  # (after the burn: a loaded machine is slow)
        tick()
    assert 0.05 < time.monotonic() - started < 5.0


def test_waiting_for_a_paced_save_releases_it():
    def work() -> int:
        for _ in range(20):
            burn(0.005)
            tick()  # at 0.001 of a core: 100 s unless released
        return 7

    in_flight = InFlight(1, work, Pacer(0.001))
    time.sleep(0.05)
    started = time.monotonic()
    assert in_flight.wait() == 7
    assert time.monotonic() - started < 10.0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(tmp_path, share):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="persist_share"):
        unbroken.Checkpointer(tmp_path / "run", model=model, async_save=True,
                              persist_share=share)


def test_a_share_without_a_background_save_is_refused(tmp_path):
    with pytest.raises(ValueError, match="persist_share paces the background part"):
        unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2), persist_share=0.2,
                              read_back="sync")


@pytest.mark.parametrize("mode", [{"async_save": True}, {"async_save": "process"},
                                  {"read_back": "background"}])
def test_a_paced_save_writes_the_state_at_save_and_waiting_finishes_it_at_full_speed(
        tmp_path, mode):
    model, opt = net()
    model(torch.ones(256)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               persist_share=0.0005, **mode) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after save() returned: not in the generation
        started = time.monotonic()
        ckpt.wait()  # its CPU time at 1/2000 of a core would take minutes
        assert time.monotonic() - started < 30.0
    fresh, fresh_opt = net()
    with unbroken.Checkpointer(tmp_path / "run", model=fresh, optimizer=fresh_opt) as again:
        again.restore()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
