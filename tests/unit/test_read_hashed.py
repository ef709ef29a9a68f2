"""`LocalFS.read_hashed` (and `read_file`, the same reading): a whole file read into a fresh
buffer with several reads in flight, hashed piece by piece as it arrives, gives exactly the
file's bytes and their xxh3-128, aligned when asked; a file that shrinks, or a read that
fails, is an error naming the file, never a shorter buffer taken for the file."""

from __future__ import annotations

import errno
import os
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.errors import CorruptCheckpoint
from unbroken.store.backends import _readahead, local
from unbroken.store.backends.local import LocalFS

PIECE = 4096  # pieces this small make every size below cross several of them


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    monkeypatch.setattr(local, "_PIECE", PIECE)


@settings(max_examples=80, deadline=None)
@given(size=st.sampled_from([0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE, 3 * PIECE + 5])
       | st.integers(0, 9 * PIECE), aligned=st.booleans())
def test_the_bytes_and_hash_are_the_file_s(tmp_path_factory, size, aligned):
    data = os.urandom(size)
    path = tmp_path_factory.mktemp("rh") / "f"
    path.write_bytes(data)
    got, digest = LocalFS().read_hashed(str(path), size, aligned=aligned)
    assert bytes(got) == data
    assert digest == xxhash.xxh3_128(data).hexdigest()
    assert bytes(LocalFS().read_file(str(path), size, aligned=aligned)) == data
    if aligned:
        assert isinstance(got, memoryview) and not got.readonly
        assert np.frombuffer(got, dtype=np.uint8).ctypes.data % local.ALIGN == 0 or size == 0
    else:
        assert isinstance(got, bytearray)


@pytest.mark.parametrize("size", [PIECE // 2, 5 * PIECE + 3])
def test_a_file_that_shrinks_while_read_is_refused_by_name(tmp_path, monkeypatch, size):
    """The buffer is sized from the file's stat; fewer bytes arriving is a shrunk file, not a
    file of that size (a torn or truncated artifact must never be hashed short)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(size))
    real = local._open_regular

    def grown_stat(p, limit):
        fd, st = real(p, limit)
        fields = list(st)
        fields[6] = st.st_size + 7  # st_size: as stat said before the file shrank
        return fd, os.stat_result(fields)

    monkeypatch.setattr(local, "_open_regular", grown_stat)
    for read in (LocalFS().read_hashed, LocalFS().read_file):
        with pytest.raises(CorruptCheckpoint, match=r"f: shrank while being read"):
            read(str(path), 10 * PIECE, aligned=True)


def test_a_failing_read_in_flight_raises_and_leaves_no_reader(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(6 * PIECE))
    real, calls = _readahead._read_piece, []

    def failing(fd, buf, offset):
        calls.append(offset)
        if offset >= 2 * PIECE:
            raise OSError(errno.EIO, "injected", str(path))
        return real(fd, buf, offset)

    monkeypatch.setattr(_readahead, "_read_piece", failing)
    with pytest.raises(OSError, match="injected"):
        LocalFS().read_hashed(str(path), 6 * PIECE)
    assert calls
    assert not [t for t in _readahead.threading.enumerate()
                if t.name.startswith("unbroken-read-ahead")]


def test_a_read_artifact_that_fails_its_hash_is_corrupt(tmp_path):
    """Through the store: the hash computed while reading is the one compared."""
    import torch

    import unbroken
    model = torch.nn.Linear(64, 64)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    [f] = (tmp_path / "run").glob("gen-*/model.safetensors")
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x10
    f.write_bytes(bytes(raw))
    info = ckpt.store.scan()[-1]
    with pytest.raises(CorruptCheckpoint, match=r"model\.safetensors: content hash"):
        ckpt.store.read_verified(info, ["model.safetensors"])


class _Recording:
    """Stands in for libc: records each ``madvise`` and answers ``result`` (None: libc's)."""

    def __init__(self, result=None):
        import ctypes
        self.libc, self.result, self.calls = ctypes.CDLL(None, use_errno=True), result, []

    def madvise(self, addr, length, advice):
        self.calls.append((addr.value, length.value, advice))
        return self.libc.madvise(addr, length, advice) if self.result is None else self.result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
@pytest.mark.parametrize("refused", [False, True], ids=["populated", "kernel-refuses"])
def test_a_fresh_buffer_is_faulted_in_ahead_of_the_readers(tmp_path, monkeypatch, refused):
    """The buffer's whole pages are populated a step at a time, only inside the buffer; the
    bytes are the file's either way, and a kernel without the advice (an error) only stops
    the populating, never the read."""
    monkeypatch.setattr(_readahead, "_POPULATE_STEP", 2 * PIECE)
    libc = _Recording(-1 if refused else None)
    monkeypatch.setattr(_readahead, "_libc", libc)
    data = os.urandom(40 * PIECE + 123)
    (tmp_path / "f").write_bytes(data)
    got, digest = LocalFS().read_hashed(str(tmp_path / "f"), len(data), aligned=True)
    assert bytes(got) == data and digest == xxhash.xxh3_128(data).hexdigest()
    base = np.frombuffer(got, dtype=np.uint8).ctypes.data
    assert libc.calls and all(advice == _readahead._MADV_POPULATE_WRITE
                              for _, _, advice in libc.calls)
    if refused:
        assert len(libc.calls) == 1
        return
    page = _readahead.mmap.PAGESIZE
    assert all(at % page == 0 and base <= at and at + n <= base + len(data)
               for at, n, _ in libc.calls)
    assert sum(n for _, n, _ in libc.calls) > len(data) - 2 * page  # every whole page
