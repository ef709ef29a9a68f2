"""One life of the training run in a forked child, in its own process group, optionally
SIGKILLed by a timer; and reading what a life left behind: its event log, its kill notes and
its error output."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..store.backends.killpoints import KILL_ENV, KILL_NOTE_ENV, KILL_OP_ENV
from ._job import KEEP_LAST, STEPS, train

_LIFE_TIMEOUT = 120.0


Script = Callable[[str, str, int, int, int], None]  # (run, log, steps, every, keep_last)


def _child(run: str, log: str, err: str, env: dict[str, str], every: int, job: Script) -> None:
    code = 1
    try:
        os.setsid()
        for key in (KILL_ENV, KILL_OP_ENV, KILL_NOTE_ENV):
            os.environ.pop(key, None)
        os.environ.update(env)
        f = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, 1)
        os.dup2(f, 2)
        os.close(f)
        torch.set_num_threads(1)  # fork-safe, and the same arithmetic in every life
        job(run, log, STEPS, every, KEEP_LAST)
        code = 0
    except BaseException:  # noqa: BLE001 -- reported through the exit status and err file
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _group_gone(pgid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True
        time.sleep(0.001)
    return False


@dataclass
class Life:
    code: int  # exit status, or -signal
    killed_by_timer: bool
    seconds: float
    group_gone: bool


def run_life(run: str, log: str, err: str, env: dict[str, str], every: int,
             delay: float | None, job: Script = train) -> Life:
    """Fork one life running ``job`` (by default `train`: restore, then train to the end);
    with ``delay``, SIGKILL its whole group after that many seconds. Returns once the child is
    reaped and no process of its group is left."""
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(run, log, err, env, every, job)
    timer = delay is not None
    deadline = started + (delay if delay is not None else _LIFE_TIMEOUT)
    fired = False
    try:  # wait on a pidfd where the kernel has them: no polling competes with the child
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            now = time.monotonic()
            if now >= deadline and not fired:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # so early that it has no group of its own yet
                    os.kill(pid, signal.SIGKILL)
                fired = True
                continue
            wait = max(0.0, deadline - now) if not fired else 0.05
            if pidfd is not None:
                select.select([pidfd], [], [], wait)
            else:
                time.sleep(min(0.0005, wait))
    finally:
        if pidfd is not None:
            os.close(pidfd)
    gone = _group_gone(pid)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return Life(code, fired and timer, time.monotonic() - started, gone)


def read_events(log: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:  # killed before it wrote anything
        return [], offset
    end = data.rfind(b"\n") + 1  # a partial last line (impossible with one write) is left
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


def count_lines(path: str) -> int:
    return len(read_lines(path))


def read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except FileNotFoundError:
        return []


def tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no output)"
