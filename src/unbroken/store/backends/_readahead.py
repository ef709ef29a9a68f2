"""Reading a file ahead of its consumer: a reader thread fills one of two buffers while the
caller hashes the other, so a verify reads at the disk's speed instead of the disk's and the
hash's one after the other (the read waits in the kernel without the GIL)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator


def read_ahead(fd: int, chunk: int) -> Iterator[memoryview]:
    """The contents of ``fd`` from its offset to its end, in pieces of at most ``chunk``
    bytes; a piece is valid until the next one is asked for."""
    free: queue.Queue[memoryview | None] = queue.Queue()
    full: queue.Queue[tuple[memoryview, int] | BaseException] = queue.Queue()
    for _ in range(2):
        free.put(memoryview(bytearray(chunk)))

    def reader() -> None:
        while (buf := free.get()) is not None:
            try:
                n = os.readv(fd, [buf])
            except BaseException as e:  # noqa: BLE001 -- raised again by the consumer
                full.put(e)
                return
            full.put((buf, n))
            if n == 0:
                return

    thread = threading.Thread(target=reader, name="unbroken-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            got = full.get()
            if isinstance(got, BaseException):
                raise got
            buf, n = got
            if n == 0:
                return
            yield buf[:n]
            free.put(buf)
    finally:
        free.put(None)
        thread.join()
