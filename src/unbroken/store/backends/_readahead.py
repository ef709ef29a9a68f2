"""Reading a file ahead of its consumer: reader threads keep reads of consecutive pieces in
flight while the caller hashes the piece it was given, so a verify reads at the disk's speed
instead of the disk's and the hash's one after the other (a read waits in the kernel without
the GIL).

How many reads in flight (`in_flight`) depends on the kernel's own read-ahead window for the
file's device. A small window (Linux's default is 128 KiB) leaves one reader's disk idle
between reads: on 2026-12-02, 3 GiB written by `LocalFS.write_file` and hashed cold, four
rounds: one read of 8 MiB at a time 0.41-1.32 GB/s, four in flight 2.10-2.57 GB/s (O_DIRECT
reads of 64 MiB, one at a time: 0.94-1.95). Where the window holds a piece (8 MiB on this
project's later VMs), the kernel reads ahead of each reader by itself, and four readers of one
file defeat its sequential detection: on 2026-12-06, a 3 GiB restore (one pass, cold) took
1.26 s with four reads of 8 MiB in flight, 0.97 s with two and 0.93 s with one, against 2.02 s
for O_DIRECT; 1 GiB: 0.53, 0.32 and 0.35 s. Two, not one: on the thirty-eighth session's host
a single stream was the fastest or the slowest by 4x from one file to the next (one read of
32 MiB at a time 2.42 s for 3 GiB, two of 32 MiB 0.63 s, four of 8 MiB 0.75 s; BENCHMARKS.md)"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator

from ._buffers import borrowed

DEPTH = 4  # reads in flight under a small read-ahead window; the memory held is this many pieces


@functools.cache
def _window(dev: int) -> int:
    """The kernel's read-ahead window in bytes for files on device ``dev`` (0: unknown)."""
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
            return int(f.read()) << 10
    except (OSError, ValueError):
        return 0


def in_flight(fd: int, chunk: int) -> int:
    """Reads to keep in flight when reading ``fd`` in pieces of ``chunk`` bytes: two where the
    kernel reads a piece's size ahead by itself, else `DEPTH`."""
    return 2 if _window(os.fstat(fd).st_dev) >= chunk else DEPTH


def _read_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` (one after the other) from ``offset``; fewer bytes only at the file's
    end (a read may return less than asked for, a signal or a network filesystem: that is
    not the end)."""
    got, at = 0, 0  # bytes read; the first buffer not full yet
    while at < len(bufs):
        n = os.preadv(fd, bufs[at:], offset + got)
        if n == 0:
            break
        got += n
        while at < len(bufs) and n >= bufs[at].nbytes:
            n -= bufs[at].nbytes
            at += 1
        if n:  # (a buffer filled in part: the rest of it next)
            bufs = [*bufs[:at], bufs[at][n:], *bufs[at + 1:]]
    return got


def read_ahead(fd: int, chunk: int, depth: int | None = None, into: memoryview | None = None
               ) -> Iterator[memoryview]:
    """The contents of ``fd`` from its offset to its end, in pieces of ``chunk`` bytes (the
    last one shorter); a piece is valid until the next one is asked for. The offset of ``fd``
    itself is not moved (pieces are read with ``preadv``). ``into``: each piece is read
    straight into its place in this buffer (and stays valid), up to its end at most.
    ``depth``: reads in flight (default: `in_flight`)."""
    start = os.lseek(fd, 0, os.SEEK_CUR)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # (the kernel reads further ahead)
    depth = in_flight(fd, chunk) if depth is None else depth
    # no more reads in flight than the file has pieces (a file that grows meanwhile is still
    # read to its end, with fewer reads ahead)
    depth = max(1, min(depth, -(-(os.fstat(fd).st_size - start) // chunk)))
    if into is not None:
        # (the pages of a fresh buffer are faulted in by the readers, beside the disk's wait)
        def target(slot: int, k: int) -> tuple[int, list[memoryview]]:
            return start + k * chunk, [into[k * chunk:(k + 1) * chunk]]
        for bufs, n in _pieces(fd, depth, target):
            if n:
                yield bufs[0][:n]
            if n < chunk:
                return
        return
    with borrowed(depth, chunk) as own:
        def target_own(slot: int, k: int) -> tuple[int, list[memoryview]]:
            return start + k * chunk, [own[slot]]
        for bufs, n in _pieces(fd, depth, target_own):
            if n:
                yield bufs[0][:n]
            if n < chunk:
                return


def read_scattered(fd: int, pieces: list[tuple[int, list[memoryview]]], depth: int
                   ) -> Iterator[tuple[list[memoryview], int]]:
    """Each of ``pieces`` (a file offset and the buffers its bytes go to, one after the
    other) read with ``depth`` reads in flight, yielded in order with the number of bytes
    read (fewer than the buffers hold only at the file's end). A piece's buffers are
    written by no other read once it was yielded."""
    def target(slot: int, k: int) -> tuple[int, list[memoryview]] | None:
        return pieces[k] if k < len(pieces) else None
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    depth = max(1, min(depth, len(pieces)))
    yield from _pieces(fd, depth, target)


def _pieces(fd: int, depth: int,
            target: Callable[[int, int], tuple[int, list[memoryview]] | None]
            ) -> Iterator[tuple[list[memoryview], int]]:
    """Piece ``k``'s buffers and the bytes read into them, in order, for k = 0, 1, ... until
    the consumer stops or ``target`` has no piece ``k`` (None). ``target(slot, k)``: the file
    offset of piece ``k`` and the buffers it is read into, by the reader of ``slot``; a slot
    has one read at a time, and its next read begins once the consumer asked for the piece
    after its last one."""
    # Plain threads, not a ThreadPoolExecutor: its pool refuses work once the main thread has
    # ended, and an async save left to finish at the interpreter's exit reads back then.
    jobs: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    done: list[queue.SimpleQueue[tuple[list[memoryview], int] | BaseException | None]] = [
        queue.SimpleQueue() for _ in range(depth)]
    stopped = threading.Event()  # the consumer is gone: reads not begun are skipped

    def reader() -> None:
        while (job := jobs.get()) is not None:
            slot, k = job
            try:
                piece = target(slot, k)
                if piece is None:
                    done[slot].put(None)
                    continue
                at, bufs = piece
                done[slot].put((bufs, 0 if stopped.is_set() else _read_all(fd, bufs, at)))
            except BaseException as e:  # noqa: BLE001 -- raised again by the consumer
                done[slot].put(e)

    threads = [threading.Thread(target=reader, name=f"unbroken-read-ahead-{i}", daemon=True)
               for i in range(depth)]
    for thread in threads:
        thread.start()
    try:
        for k in range(depth):
            jobs.put((k, k))
        k = 0
        while True:
            # (a slot has one read at a time: its results come in the order asked for)
            got = done[k % depth].get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got
            # The consumer asked for the next piece: the one it was given is done with, and
            # its slot takes the read ``depth`` pieces ahead.
            jobs.put((k % depth, k + depth))
            k += 1
    finally:
        stopped.set()
        for _ in threads:
            jobs.put(None)
        for thread in threads:
            thread.join()
