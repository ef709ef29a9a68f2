"""`LocalFS.read_hashed` (and `read_file`, the same reading): a whole file read into a fresh
buffer with several reads in flight, hashed piece by piece as it arrives, gives exactly the
file's bytes and their xxh3-128, aligned when asked; a file that shrinks, or a read that
fails, is an error naming the file, never a shorter buffer taken for the file."""

from __future__ import annotations

import errno
import os
import subprocess
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
    real, calls = _readahead._read_all, []

    def failing(fd, bufs, offset):
        calls.append(offset)
        if offset >= 2 * PIECE:
            raise OSError(errno.EIO, "injected", str(path))
        return real(fd, bufs, offset)

    monkeypatch.setattr(_readahead, "_read_all", failing)
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



def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
                break
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux mappings")
def test_a_large_aligned_buffer_asks_for_no_huge_pages():
    """NumPy advises huge pages for a large array; where the kernel compacts memory to fault
    one in, reading a 2 GiB file into such a buffer took 3x as long. The buffer a file is
    read whole into (a resumed job's optimizer state) is torch's memory, which does not ask.
    (In a fresh process: the mappings earlier tests of a worker left are not this one's.)"""
    code = ("import numpy as np, test_read_hashed as t\n"
            "from unbroken.store.backends import local\n"
            "view = local.whole_buffer(64 << 20, True, 'f')\n"
            "address = np.frombuffer(view, dtype=np.uint8).ctypes.data\n"
            "assert address % local.ALIGN == 0\n"
            "print(' '.join(t._vm_flags(address + (32 << 20))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    assert "hg" not in out.stdout.split()  # hg: MADV_HUGEPAGE


def test_will_read_hints_regular_files_up_to_its_size_and_never_blocks(tmp_path, monkeypatch):
    """`LocalFS.will_read` asks the kernel to read ahead the regular files it is given up to
    `_AHEAD` bytes; a FIFO (never opened blocking), a symbolic link (never followed), a
    missing or larger file gets no hint and no error."""
    monkeypatch.setattr(local, "_AHEAD", 100)
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(b"x" * 100)
    large.write_bytes(b"x" * 101)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(small)
    hinted: list[int] = []
    real = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        hinted.append(os.fstat(fd).st_ino)
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    LocalFS().will_read([str(p) for p in (fifo, link, tmp_path / "missing", large, small)])
    assert hinted == [small.stat().st_ino]


def test_a_restore_reads_ahead_every_file_it_reads_whole(tmp_path, monkeypatch):
    """Before a restore reads a generation's files one after the other, it hints every one of
    them (their reads overlap)."""
    import torch

    import unbroken

    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(0)
    hinted: list[list[str]] = []
    real = LocalFS.will_read
    monkeypatch.setattr(LocalFS, "will_read",
                        lambda self, paths: hinted.append(list(paths)) or real(self, paths))
    read: list[str] = []
    real_read = LocalFS.read_hashed

    def read_hashed(self, path, limit, aligned=False):
        read.append(path)
        return real_read(self, path, limit, aligned)

    monkeypatch.setattr(LocalFS, "read_hashed", read_hashed)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
    assert read and any(set(read) <= set(paths) for paths in hinted)
