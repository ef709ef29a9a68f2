"""`read_ahead`: several reads in flight while the consumer hashes, pieces delivered in order,
exactly the file's bytes from its offset, no reader left running once the consumer stops (it
closes the file next), a buffer never refilled while the consumer holds it."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.store.backends import _readahead
from unbroken.store.backends._readahead import read_ahead
from unbroken.store.backends.local import LocalFS


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("unbroken-read-ahead")]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 5000), chunk=st.integers(1, 700), offset=st.integers(0, 50),
       seed=st.binary(min_size=1, max_size=16), depth=st.integers(1, 5))
def test_the_pieces_are_the_file_from_its_offset_in_order(tmp_path_factory, size, chunk, offset,
                                                          seed, depth):
    data = (seed * (size // len(seed) + 1))[:size]
    path = tmp_path_factory.mktemp("ra") / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, min(offset, size), os.SEEK_SET)
        pieces = [bytes(p) for p in read_ahead(fd, chunk, depth)]
        assert b"".join(pieces) == data[min(offset, size):]
        assert all(0 < len(p) <= chunk for p in pieces)
    finally:
        os.close(fd)
    assert not _readers()


def test_a_short_read_in_the_middle_is_not_the_end_of_the_file(tmp_path, monkeypatch):
    """A read may return less than asked for (a signal, a network filesystem): the piece is
    completed, not taken for the file's end (which would fail a good file as truncated)."""
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    real = os.preadv

    def short(fd, buffers, offset):
        [buf] = buffers
        return real(fd, [buf[:max(1, len(buf) // 3)]], offset)

    monkeypatch.setattr(_readahead.os, "preadv", short)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert b"".join(bytes(p) for p in read_ahead(fd, 1024)) == data
    finally:
        os.close(fd)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_piece_held_by_the_consumer_is_not_overwritten_by_the_reads_ahead(tmp_path, depth):
    """The reads in flight finish while the consumer still holds its piece (it sleeps): the
    piece must still be the file's bytes when the consumer is done with it."""
    data = os.urandom(64 * 1024 + 5)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        at = 0
        for piece in read_ahead(fd, 4096, depth):
            time.sleep(0.002)
            assert bytes(piece) == data[at:at + len(piece)]
            at += len(piece)
        assert at == len(data)
    finally:
        os.close(fd)


def test_a_consumer_that_stops_early_leaves_no_read_running(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(1 << 20))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        pieces = read_ahead(fd, 4096)
        first = bytes(next(pieces))
        pieces.close()  # (a hash mismatch, an exception in the consumer)
        assert len(first) == 4096 and not _readers()
    finally:
        os.close(fd)


def test_a_failing_read_is_raised_to_the_consumer(tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(os.urandom(100_000))
    real, calls = os.preadv, []

    def failing(fd, buffers, offset):
        calls.append(fd)
        if len(calls) > 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(_readahead.os, "preadv", failing)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Input/output"):
            for _ in read_ahead(fd, 10_000):
                pass
    finally:
        os.close(fd)
    assert not _readers()


def test_hash_file_of_a_file_larger_than_its_chunk_is_the_whole_files_hash(tmp_path):
    data = os.urandom(3 * 4096 + 17)
    (tmp_path / "f").write_bytes(data)
    for drop in (False, True):
        size, digest = LocalFS().hash_file(str(tmp_path / "f"), len(data), drop_cache=drop,
                                           chunk=4096)
        assert (size, digest) == (len(data), xxhash.xxh3_128(data).hexdigest())


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 5000), chunk=st.integers(1, 700), room=st.integers(-40, 40),
       depth=st.integers(1, 5))
def test_pieces_read_into_a_buffer_are_its_slices_and_stay_valid(tmp_path_factory, size, chunk,
                                                                  room, depth):
    """With ``into`` every piece is read straight into its place in that buffer (no pool
    buffer, no copy), so each stays valid after the next one is asked for; a buffer shorter
    than the file ends the pieces at its end."""
    data = os.urandom(size)
    path = tmp_path_factory.mktemp("ra") / "f"
    path.write_bytes(data)
    into = memoryview(bytearray(max(0, size + room)))
    fd = os.open(path, os.O_RDONLY)
    try:
        pieces = list(read_ahead(fd, chunk, depth, into=into))
    finally:
        os.close(fd)
    assert not _readers()
    got = b"".join(bytes(p) for p in pieces)
    assert got == data[:len(into)]
    assert bytes(into[:len(got)]) == got  # the pieces were the buffer itself
    at = 0
    for p in pieces:
        assert p.obj is into.obj and 0 < len(p) <= chunk
        assert bytes(p) == data[at:at + len(p)]
        at += len(p)
