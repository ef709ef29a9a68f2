"""A background save's share of the CPU while the training loop runs (``persist_share``).

Why: where every core trains (two torch threads on two cores, a busy data-loading pool), each
millisecond the save spends copying and hashing on a core stalls the loop's thread there, and
with it the loop's other threads at their next barrier: the loop measured 42% slower while a
save persisted at full speed. The same work spread thinner costs each step about the share
instead, at the price of a later durable point. Once the loop waits for the save (the next
save, ``wait()``, ``close()``) nothing is left to protect: the save is released and runs at
full speed.

The persisting thread calls `tick` between blocks of work (a 16 MiB write, an 8 MiB hash); a
thread without an installed `Pacer` (every restore, every synchronous save) never waits."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

_SLICE = 0.02  # the longest single sleep: a release is noticed within it
_local = threading.local()
_at_exit: weakref.WeakSet[Any] = weakref.WeakSet()  # what `release_at_exit` was given


class Pacer:
    """Keeps the CPU time of the work it paces (``clock``: `time.thread_time` for a thread,
    `time.process_time` for a persisting process) under ``share`` of the wall time since
    `start`, until `release` (or until ``hurried()`` says so: a flag another process sets)."""

    def __init__(self, share: float, clock: Callable[[], float] = time.thread_time,
                 hurried: Callable[[], bool] | None = None) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"persist_share={share!r}: a share of one core, in (0, 1]")
        self.share = share
        self._clock = clock
        self._released = False
        self._hurried = hurried
        self._wall0 = time.monotonic()
        self._cpu0 = clock()
        self.slept = 0.0  # seconds spent waiting, for the log

    def start(self) -> None:
        """Count from now, in the thread that does the work (a thread's clock is its own)."""
        self._wall0, self._cpu0 = time.monotonic(), self._clock()

    def release(self) -> None:
        """Full speed from now on (the loop waits for the save)."""
        self._released = True

    def tick(self) -> None:
        """Wait until the CPU time used so far is within the share of the time elapsed."""
        while not self._released:
            if self._hurried is not None and self._hurried():
                self._released = True
                return
            ahead = ((self._clock() - self._cpu0) / self.share
                     - (time.monotonic() - self._wall0))
            if ahead <= 0.001:
                return
            pause = min(ahead, _SLICE)
            time.sleep(pause)
            self.slept += pause


@contextlib.contextmanager
def installed(pacer: Pacer | None) -> Iterator[None]:
    """Pace this thread's `tick` calls by ``pacer`` (None: not at all) inside the block."""
    before = getattr(_local, "pacer", None)
    _local.pacer = pacer
    if pacer is not None:
        pacer.start()
    try:
        yield
    finally:
        _local.pacer = before


def paced() -> bool:
    """Whether this thread's work is paced (a save persisting beside the loop for long)."""
    return getattr(_local, "pacer", None) is not None


def tick() -> None:
    """A point between blocks of a save's work: waits only in a paced thread."""
    pacer = getattr(_local, "pacer", None)
    if pacer is not None:
        pacer.tick()


def release_at_exit(paced: Any) -> None:
    """Call ``paced.release()`` when the interpreter exits (before it waits for its threads):
    a script that ends without ``close()`` waits for the save in flight at full speed."""
    _at_exit.add(paced)


def _release_all() -> None:
    for paced in list(_at_exit):
        paced.release()


threading._register_atexit(_release_all)  # type: ignore[attr-defined]
