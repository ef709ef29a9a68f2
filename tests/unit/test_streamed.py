"""One pass that copies a file into its destinations and hashes every byte of it
(`store.backends._streamed`), and how many reads it keeps in flight (`_readahead.in_flight`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.store.backends import _readahead
from unbroken.store.backends._streamed import hash_copies


def _file(folder: Path, data: bytes) -> int:
    path = folder / "f"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 5000), chunk=st.sampled_from([1, 7, 64, 4096]),
       depth=st.integers(1, 4),
       ranges=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=12),
       data=st.data())
def test_every_copy_holds_its_bytes_and_the_hash_is_the_whole_files(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, size: int,
        chunk: int, depth: int, ranges: list[tuple[float, float]], data: st.DataObject) -> None:
    """Copies anywhere in the file, overlapping or not, in any order: each buffer ends with
    its bytes of the file, every byte of the file is hashed once and in order, and the
    copies whose bytes an earlier copy took are returned to be read again."""
    monkeypatch.setattr(_readahead, "in_flight", lambda fd, chunk: depth)
    content = bytes(data.draw(st.binary(min_size=size, max_size=size))) if size < 64 else \
        os.urandom(size)
    fd = _file(tmp_path_factory.mktemp("s"), content)
    try:
        copies = []
        for a, b in ranges:
            start = int(a * size)
            length = int(b * (size - start))
            copies.append((start, memoryview(bytearray(length))))
        got, digest, again = hash_copies(fd, size, copies, chunk)
    finally:
        os.close(fd)
    assert got == size
    assert digest == xxhash.xxh3_128(content).hexdigest()
    later = {id(into) for _, into in again}
    assert len(later) == len(again)
    for offset, into in copies:
        if id(into) not in later:
            assert bytes(into) == content[offset:offset + into.nbytes]
    for offset, into in again:  # (each begins inside the bytes of another copy)
        assert any(o <= offset < o + i.nbytes for o, i in copies if i is not into)

@pytest.mark.parametrize("depth", [1, 3])
def test_a_file_shorter_than_its_size_is_read_to_its_end_and_said(tmp_path, monkeypatch, depth):
    monkeypatch.setattr(_readahead, "in_flight", lambda fd, chunk: depth)
    content = os.urandom(10_000)
    fd = _file(tmp_path, content)
    into = memoryview(bytearray(4000))
    try:
        got, digest, _ = hash_copies(fd, 12_000, [(9000, into)], 1024)
    finally:
        os.close(fd)
    assert got == 10_000  # (the caller compares it with the size it expected)
    assert digest == xxhash.xxh3_128(content).hexdigest()
    assert bytes(into[:1000]) == content[9000:]


def test_a_failing_read_is_raised_and_leaves_no_reader(tmp_path, monkeypatch):
    monkeypatch.setattr(_readahead, "in_flight", lambda fd, chunk: 3)
    real, calls = _readahead._read_all, []

    def failing(fd, bufs, offset):
        calls.append(offset)
        if offset >= 4096:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(_readahead, "_read_all", failing)
    fd = _file(tmp_path, os.urandom(64 << 10))
    try:
        with pytest.raises(OSError, match="Input/output"):
            hash_copies(fd, 64 << 10, [(100, memoryview(bytearray(20_000)))], 1024)
    finally:
        os.close(fd)
    assert calls
    assert not [t for t in threading.enumerate() if t.name.startswith("unbroken-read-ahead")]


@pytest.mark.parametrize(("window", "expected"), [(8 << 20, 2), (16 << 20, 2), (128 << 10, 4),
                                                  (0, 4)])
def test_one_read_in_flight_only_where_the_kernel_reads_a_piece_ahead(
        tmp_path, monkeypatch, window, expected):
    monkeypatch.setattr(_readahead, "_window", lambda dev: window)
    fd = _file(tmp_path, b"x")
    try:
        assert _readahead.in_flight(fd, 8 << 20) == expected
    finally:
        os.close(fd)


def test_the_window_of_a_device_without_one_is_unknown():
    assert _readahead._window.__wrapped__(os.makedev(0, 0xFFFFF)) == 0

