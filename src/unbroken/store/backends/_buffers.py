"""Page-aligned I/O buffers reused from one read or write to the next, by any thread.

An async save runs on a thread of its own each time: buffers kept per thread were mapped anew
at every save, and filling them faulted every page in again. A ``bytearray`` is no better: one
of 8 MiB is zero-filled in full, holding the GIL (four of them took 14 ms of a background
save of 7,576 small tensors that the training loop waited out). These are anonymous mappings:
page-aligned, as ``O_DIRECT`` asks, and never written by Python before use."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator

_KEEP = 4  # buffers of one size kept for the next borrower; more are unmapped when returned

_lock = threading.Lock()
_free: dict[int, list[memoryview]] = {}


@contextlib.contextmanager
def borrowed(count: int, size: int) -> Iterator[list[memoryview]]:
    """``count`` writable, page-aligned buffers of ``size`` bytes, this borrower's alone until
    the block ends (what they held before is undefined)."""
    with _lock:
        spare = _free.get(size, [])
        got = [spare.pop() for _ in range(min(count, len(spare)))]
    # (private: a child forked meanwhile gets copies, never a view of what this process reads)
    got += [memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
            for _ in range(count - len(got))]
    try:
        yield got
    finally:
        with _lock:
            spare = _free.setdefault(size, [])
            spare.extend(got[:max(0, _KEEP - len(spare))])


def _after_fork_in_child() -> None:
    """Another thread may have held the lock at the fork: the child makes a lock of its own
    (and starts with no spare buffers)."""
    global _lock
    _lock = threading.Lock()
    _free.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
