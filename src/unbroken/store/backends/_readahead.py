"""Reading a file ahead of its consumer: reader threads keep several reads of consecutive pieces
in flight while the caller hashes the piece it was given, so a verify reads at the disk's speed
instead of the disk's and the hash's one after the other (a read waits in the kernel without
the GIL).

Several reads in flight, not one: a virtual disk can serve one stream of reads at a fraction of
its bandwidth. On 2026-12-02, 3 GiB written by `LocalFS.write_file` and hashed cold here, four
rounds: one read of 8 MiB at a time 0.41-1.32 GB/s, four in flight 2.10-2.57 GB/s (O_DIRECT
reads of 64 MiB, one at a time: 0.94-1.95). Generations read right after they were written
(`benchmarks/save_load.py`) hashed at ~2 GB/s either way: this VM's host seems to serve
recent writes from its own cache, as it does a restore right after a save."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator

from ._buffers import borrowed

DEPTH = 4  # reads in flight; the memory held is this many pieces


def _read_piece(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; fewer bytes only at the file's end (a read may return
    less than asked for, a signal or a network filesystem: that is not the end)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def read_ahead(fd: int, chunk: int, depth: int = DEPTH, into: memoryview | None = None
               ) -> Iterator[memoryview]:
    """The contents of ``fd`` from its offset to its end, in pieces of ``chunk`` bytes (the
    last one shorter); a piece is valid until the next one is asked for. The offset of ``fd``
    itself is not moved (pieces are read with ``preadv``). ``into``: each piece is read
    straight into its place in this buffer (and stays valid), up to its end at most."""
    start = os.lseek(fd, 0, os.SEEK_CUR)
    # no more reads in flight than the file has pieces (a file that grows meanwhile is still
    # read to its end, with fewer reads ahead)
    depth = max(1, min(depth, -(-(os.fstat(fd).st_size - start) // chunk)))
    if into is not None:
        # (the pages of a fresh buffer are faulted in by the readers, beside the disk's wait)
        yield from _pieces(fd, chunk, depth, start, lambda slot, at: into[at:at + chunk])
        return
    with borrowed(depth, chunk) as bufs:
        yield from _pieces(fd, chunk, depth, start, lambda slot, at: bufs[slot])


def _pieces(fd: int, chunk: int, depth: int, start: int,
            target: Callable[[int, int], memoryview]) -> Iterator[memoryview]:
    """(``target(slot, at)``: where the piece ``at`` bytes past ``start`` is read, by the
    reader of ``slot``; a slot has one read at a time.)"""
    # Plain threads, not a ThreadPoolExecutor: its pool refuses work once the main thread has
    # ended, and an async save left to finish at the interpreter's exit reads back then.
    jobs: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    done: list[queue.SimpleQueue[tuple[memoryview, int] | BaseException]] = [
        queue.SimpleQueue() for _ in range(depth)]
    stopped = threading.Event()  # the consumer is gone: reads not begun are skipped

    def reader() -> None:
        while (job := jobs.get()) is not None:
            slot, at = job
            try:
                buf = target(slot, at)
                done[slot].put((buf, 0 if stopped.is_set() else
                                _read_piece(fd, buf, start + at)))
            except BaseException as e:  # noqa: BLE001 -- raised again by the consumer
                done[slot].put(e)

    threads = [threading.Thread(target=reader, name=f"unbroken-read-ahead-{i}", daemon=True)
               for i in range(depth)]
    for thread in threads:
        thread.start()
    try:
        for k in range(depth):
            jobs.put((k, k * chunk))
        k = 0
        while True:
            # (a slot has one read at a time: its results come in the order asked for)
            got = done[k % depth].get()
            if isinstance(got, BaseException):
                raise got
            buf, n = got
            if n:
                yield buf[:n]
            if n < chunk:
                return
            # The consumer asked for the next piece: the one it was given is done with, and
            # its slot takes the read ``depth`` pieces ahead.
            jobs.put((k % depth, (k + depth) * chunk))
            k += 1
    finally:
        stopped.set()
        for _ in threads:
            jobs.put(None)
        for thread in threads:
            thread.join()
