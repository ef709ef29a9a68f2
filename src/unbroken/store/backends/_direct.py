"""Writes that bypass the page cache (``O_DIRECT``) where the filesystem allows it.

A buffered write of a large checkpoint copies every byte into freshly allocated page-cache
pages (on a VM whose balloon hands freed memory back to the host, at a third of memcpy speed),
and the fsync that follows writes them out again. Instead the bytes are copied into one
page-aligned buffer reused from write to write and written from it with ``O_DIRECT``, in
aligned blocks; the last block is padded to the alignment and the file truncated to its true
size. Filesystems that refuse ``O_DIRECT`` (tmpfs, some network and FUSE filesystems) get the
buffered path."""

from __future__ import annotations

import fcntl
import os
import queue
import threading
from collections.abc import Callable, Iterable

import numpy as np

from ..._pacing import tick
from ._buffers import borrowed

BLOCK = 4096  # the alignment O_DIRECT asks of offsets, sizes and memory on Linux
_BUFFER = 16 << 20  # bytes per write
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Pieces from this size are copied by NumPy, which lets go of the GIL while it copies (a
# memoryview's slice assignment holds it: a background save copying 16 MiB pieces halved the
# speed of a Python loop beside it); smaller ones by the slice, cheaper to start.
_NUMPY_COPY = 256 << 10


def try_direct(fd: int) -> bool:
    """Switch ``fd`` to ``O_DIRECT``; False where the filesystem (or the platform) refuses."""
    if not _O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
    except OSError:
        return False
    return True


def is_direct(fd: int) -> bool:
    """Whether ``fd`` writes with ``O_DIRECT``."""
    return bool(_O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)


def drop_direct(fd: int) -> None:
    """Back to buffered writes (any length, any alignment)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def write_direct(fd: int, chunks: Iterable[memoryview | bytes],
                 write: Callable[[memoryview], None]) -> int:
    """Write the bytes of ``chunks`` to ``fd`` (already ``O_DIRECT``) and return their count.
    This thread copies them into one of two page-aligned buffers (`_buffers`, reused),
    while a writer thread hands the other to ``write`` (which writes it whole): the copy
    overlaps the disk. The last block is padded to the alignment; the caller truncates the
    file to the returned size."""
    with borrowed(2, _BUFFER) as buffers:
        return _write_through(fd, chunks, write, buffers)


def _write_through(fd: int, chunks: Iterable[memoryview | bytes],
                   write: Callable[[memoryview], None], buffers: list[memoryview]) -> int:
    free: queue.Queue[memoryview] = queue.Queue()
    full: queue.Queue[memoryview | None] = queue.Queue()
    for b in buffers:
        free.put(b)
    failed: list[BaseException] = []

    def writer() -> None:
        while (block := full.get()) is not None:
            try:
                if not failed:
                    write(block)
            except BaseException as e:  # noqa: BLE001 -- raised again by the filling thread
                failed.append(e)
            free.put(buffers[0] if block.obj is buffers[0].obj else buffers[1])

    thread = threading.Thread(target=writer, name="unbroken-direct-write", daemon=True)
    thread.start()
    size = fill = 0
    buf = free.get()
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            size += len(view)
            while view:
                n = min(len(view), _BUFFER - fill)
                if n >= _NUMPY_COPY:
                    np.copyto(np.frombuffer(buf[fill:fill + n], dtype=np.uint8),
                              np.frombuffer(view[:n], dtype=np.uint8))
                else:
                    buf[fill:fill + n] = view[:n]
                fill += n
                view = view[n:]
                if fill == _BUFFER:
                    full.put(buf)
                    tick()  # (a paced save waits here, `_pacing`)
                    buf, fill = free.get(), 0
                    if failed:
                        raise failed[0]
        if fill:
            padded = -(-fill // BLOCK) * BLOCK
            buf[fill:padded] = bytes(padded - fill)
            full.put(buf[:padded])
    finally:
        full.put(None)
        thread.join()
    if failed:
        raise failed[0]
    return size
