"""SIGTERM and a loader's workers: a launcher (torchrun, SLURM) sends it to the whole process
group, and torch's DataLoader workers end on it, so the training loop fails on its next batch
before the stop save its own handler asked for. Workers started here drop it (their parent
shuts them down): `ResumableLoader`'s, and a plain DataLoader's iterating a
`ResumableSampler` while a handler for SIGTERM is installed (`quiet_dataloader_workers`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import signal
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data


def _worker_start(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    """A worker's start: SIGTERM taken by a handler that drops it, in every thread (its parent
    shuts it down through its queue; a handler, unlike SIG_IGN, is not inherited by the
    programs it runs), then the user's ``worker_init_fn``."""
    signal.signal(signal.SIGTERM, _dropped)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if user_init is not None:
        user_init(worker_id)


def _dropped(signum: int, frame: Any) -> None:
    """A worker's SIGTERM: dropped (see `_worker_start`)."""


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def quiet_dataloader_workers(depth: int = 2) -> None:
    """Called by a `ResumableSampler`'s ``__iter__``: when the caller ``depth`` frames up is a
    torch DataLoader's iterator starting its worker processes (it takes its batch sampler's
    iterator first) and this process handles SIGTERM itself (the Checkpointer's
    ``signals=[SIGTERM]``), the DataLoader's ``worker_init_fn`` becomes one that drops
    SIGTERM first, as `ResumableLoader`'s workers do, then runs the user's; and the iterator
    shuts its workers down at exit (torch leaves that to multiprocessing, whose SIGTERM they
    drop). (Reads the caller's ``loader`` and ``self``; anything unexpected leaves them.)"""
    if not callable(signal.getsignal(signal.SIGTERM)):
        return  # (nothing here stops cleanly on it: workers ending with the rest is right)
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return
    if frame.f_code.co_name != "__init__":
        return
    loader, it = frame.f_locals.get("loader"), frame.f_locals.get("self")
    if not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers:
        return
    init = loader.worker_init_fn
    if isinstance(init, functools.partial) and init.func is _worker_start:
        return  # (a ResumableLoader's: it shuts its own down)
    if init is None or callable(init):
        loader.worker_init_fn = functools.partial(_worker_start, init)
        if hasattr(it, "_shutdown_workers"):
            _QUIETED.add(it)
            _at_exit_once()


_QUIETED: weakref.WeakSet[Any] = weakref.WeakSet()


@functools.cache
def _at_exit_once() -> None:
    """Shut the quieted DataLoaders' workers down at exit, before multiprocessing's own exit
    handler ends its daemon processes with SIGTERM (registered after it: it runs first)."""
    import multiprocessing.util  # noqa: F401 -- (its exit handler registered first)

    atexit.register(_shut_quieted)


def _shut_quieted() -> None:
    for it in list(_QUIETED):
        with contextlib.suppress(Exception):
            it._shutdown_workers()
