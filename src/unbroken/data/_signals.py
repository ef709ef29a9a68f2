"""SIGTERM and a loader's workers: a launcher (torchrun, SLURM) sends it to the whole process
group, and torch's DataLoader workers end on it, so the training loop fails on its next batch
before the stop save its own handler asked for. Workers started here ignore it (their parent
shuts them down): `ResumableLoader`'s, and a plain DataLoader's iterating a
`ResumableSampler` while a handler for SIGTERM is installed (`quiet_dataloader_workers`)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data


def _worker_start(user_init: Callable[[int], None] | None, worker_id: int,
                  parent_ends: bool = False) -> None:
    """A worker's start: SIGTERM ignored (its parent shuts it down through its queue), then
    the user's ``worker_init_fn``. ``parent_ends``: a SIGTERM from the parent still ends it
    at once, as torch's own handler does (a plain DataLoader alive at exit: multiprocessing
    ends its daemon workers with SIGTERM, and waited forever for ones that ignore it)."""
    if parent_ends:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (taken by the thread)
        threading.Thread(target=_end_on_parents_term, args=(os.getppid(),), daemon=True,
                         name="unbroken-sigterm").start()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if user_init is not None:
        user_init(worker_id)


def _end_on_parents_term(parent: int) -> None:
    """Take every SIGTERM of this worker (blocked in its threads): one its parent sent ends it
    (its shutdown), any other (a launcher's, to the whole group) is dropped."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def quiet_dataloader_workers(depth: int = 2) -> None:
    """Called by a `ResumableSampler`'s ``__iter__``: when the caller ``depth`` frames up is a
    torch DataLoader that starts worker processes taking its batch sampler's iterator (its
    iterator's ``__init__``, which starts them right after) and this process handles SIGTERM
    itself (the Checkpointer's ``signals=[SIGTERM]``), the DataLoader's ``worker_init_fn``
    becomes one that ignores SIGTERM first, as `ResumableLoader`'s workers do, then runs the
    user's. (Reads the caller's ``loader``; anything unexpected leaves it as it is.)"""
    if not callable(signal.getsignal(signal.SIGTERM)):
        return  # (nothing here stops cleanly on it: workers ending with the rest is right)
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return
    loader: Any = frame.f_locals.get("loader") if frame.f_code.co_name == "__init__" else None
    if not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers:
        return
    init = loader.worker_init_fn
    if isinstance(init, functools.partial) and init.func is _worker_start:
        return  # (a ResumableLoader's, or quieted before)
    if init is None or callable(init):
        loader.worker_init_fn = functools.partial(_worker_start, init, parent_ends=True)
