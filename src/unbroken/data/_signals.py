"""SIGTERM and a loader's workers: a launcher (torchrun, SLURM) sends it to the whole process
group, and torch's DataLoader workers end on it, so the training loop fails on its next batch
before the stop save its own handler asked for. Workers started here ignore it (their parent
shuts them down)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator


def _worker_start(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if user_init is not None:
        user_init(worker_id)


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
