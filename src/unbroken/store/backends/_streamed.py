"""A mapped file verified in the same pass that copies it into the live tensors.

A restore of one process records its copies out of a mapped file (`MappedFiles.copy`) instead
of making them; `hash_copies` then reads the file once, in order, each byte straight into the
live tensor it belongs to (the bytes no copy wants, such as the header, into a small scratch
buffer), and hashes every byte as it arrives. The file is read from the disk once instead of
twice (a hash pass, then a copy from the page cache it filled): on a disk of 4.6 GB/s the copy
pass alone was a quarter of the time of a 3 GiB restore. The price: a corrupt file is found
after some live tensors took its bytes, so a restore whose file fails its hash is partly
applied, and falls back to the previous verified generation, whose bytes overwrite every one
of them (`restoring`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import xxhash

from ._buffers import borrowed
from ._readahead import in_flight, read_scattered

_IOV = 512  # buffers a read is given at most (Linux takes 1,024)

Piece = tuple[int, list[memoryview]]


def hash_copies(fd: int, size: int, copies: list[tuple[int, memoryview]], chunk: int,
                advance: Callable[[int], None] | None = None
                ) -> tuple[int, str, list[tuple[int, memoryview]]]:
    """Read the file ``fd`` of ``size`` bytes once, each of ``copies`` (a file offset and the
    buffer its bytes go to) straight into its buffer, hashing every byte of the file in
    order. Returns the bytes read (fewer than ``size``: the file shrank), the xxh3-128 of
    them, and the copies not made (those whose bytes overlap another copy's: read them from
    the file afterwards)."""
    again: list[tuple[int, memoryview]] = []
    segments: list[tuple[int, memoryview | None]] = []  # (length, where: None = scratch)
    pos = 0
    for offset, into in sorted(copies, key=lambda c: c[0]):
        end = min(offset + into.nbytes, size)
        if offset < pos:  # (two tensors of one storage, saved once: read again after)
            again.append((offset, into))
            if end > pos:
                segments.append((end - pos, None))
                pos = end
            continue
        if offset > pos:
            segments.append((offset - pos, None))
        segments.append((end - offset, into[:end - offset]))
        pos = end
    if pos < size:
        segments.append((size - pos, None))
    h = xxhash.xxh3_128()
    got = 0
    depth = in_flight(fd, chunk)
    with borrowed(depth, chunk) as scratch:
        pieces = list(_pieces(segments, chunk, scratch))
        for bufs, n in read_scattered(fd, pieces, depth):
            left = n
            for buf in bufs:
                if left <= 0:
                    break
                h.update(buf[:left])
                left -= buf.nbytes
            got += n
            if advance is not None:
                advance(n)
            if n < sum(b.nbytes for b in bufs):
                break  # (the file ended inside this piece)
    return got, h.hexdigest(), again


def _pieces(segments: list[tuple[int, memoryview | None]], chunk: int,
            scratch: list[memoryview]) -> Iterator[Piece]:
    """The reads of ``segments`` laid end to end from offset 0: pieces of ``chunk`` bytes
    at most (and `_IOV` buffers). Piece ``k``'s scratch bytes come from ``scratch[k %
    len(scratch)]``: the reader of that slot has one piece at a time, and its next one
    begins only once the consumer took this one (`_readahead.read_scattered`)."""
    k, offset, bufs, size, used = 0, 0, [], 0, 0
    for length, where in segments:
        at = 0
        while at < length:
            n = min(length - at, chunk - size)
            if where is None:
                bufs.append(scratch[k % len(scratch)][used:used + n])
                used += n
            else:
                bufs.append(where[at:at + n])
            at += n
            size += n
            if size == chunk or len(bufs) == _IOV:
                yield offset, bufs
                k, offset, bufs, size, used = k + 1, offset + size, [], 0, 0
    if bufs:
        yield offset, bufs
