"""Review of the shared I/O buffer pool (`_buffers`), the multi-read `read_ahead`, `write_direct`
on pooled buffers and the `LocalFS.hash_file` / `write_file` paths that use them: sizes at the
chunk and buffer boundaries, files that grow or shrink while hashed, consumers that abandon or
raise, odd chunk types, concurrent writers and hashers, failures midway, fork, and interpreter
exit. Every wait is bounded."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import xxhash
from _forks import reaped
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.store.backends import _buffers, _direct, local
from unbroken.store.backends._buffers import borrowed
from unbroken.store.backends._readahead import read_ahead
from unbroken.store.backends.local import LocalFS

MiB = 1 << 20
_RNG = np.random.default_rng(20261202)
POOL = _RNG.integers(0, 256, 48 * MiB, dtype=np.uint8).tobytes()  # random bytes to slice


def _data(size: int, seed: int = 0) -> bytes:
    at = (seed * 7919) % (len(POOL) - size) if size < len(POOL) else 0
    return POOL[at:at + size]


def _xxh(b: bytes | memoryview) -> str:
    return xxhash.xxh3_128(b).hexdigest()


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def _no_threads_left(prefix: str) -> bool:
    """Checked at once: the contract is that none is left once the consumer has stopped."""
    return not _threads(prefix)


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _pool_bounded() -> bool:
    with _buffers._lock:
        return all(len(v) <= _buffers._KEEP for v in _buffers._free.values())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _join_all(threads: list[threading.Thread], within: float) -> None:
    deadline = time.monotonic() + within
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {within}s: {alive}"




# -- hash_file / read_ahead: sizes and offsets --------------------------------------------------


@pytest.mark.parametrize("chunk", [4096, 65_537])
@pytest.mark.parametrize("pieces,extra", [(0, 0), (0, 1), (1, -1), (1, 0), (1, 1), (2, 0),
                                          (3, -1), (3, 0), (3, 1), (4, 0), (5, 0), (9, 7)])
def test_hash_file_at_chunk_boundaries_is_the_whole_files_hash(tmp_path, chunk, pieces, extra):
    size = max(0, pieces * chunk + extra)
    data = _data(size, pieces)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert LocalFS().hash_file(str(path), size, chunk=chunk) == (size, _xxh(data))
    assert _no_threads_left("unbroken-read-ahead")


@pytest.mark.parametrize("depth", [1, 3, 4, 8])
@pytest.mark.parametrize("size,offset", [(3 * 4096, 4096), (3 * 4096, 3 * 4096),
                                         (3 * 4096, 5 * 4096), (3 * 4096 + 1, 3 * 4096),
                                         (3 * 4096 - 1, 1), (8 * 4096, 4095), (0, 0)])
def test_read_ahead_from_a_nonzero_offset_reads_to_the_end_and_leaves_the_offset(
        tmp_path, depth, size, offset):
    data = _data(size, size + offset)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        pieces = [bytes(p) for p in read_ahead(fd, 4096, depth)]
        assert b"".join(pieces) == data[offset:]
        assert all(0 < len(p) <= 4096 for p in pieces)
        assert os.lseek(fd, 0, os.SEEK_CUR) == offset
    finally:
        os.close(fd)
    assert _no_threads_left("unbroken-read-ahead")


# (A slow consumer's pieces: test_readahead.py, at depths 1, 2 and 4.)


# -- files that change while hashed -------------------------------------------------------------


def test_a_file_that_grows_while_hashed_gives_a_consistent_prefix(tmp_path, monkeypatch):
    chunk = 4096
    first = _data(6 * chunk + 10, 1)
    more = _data(20 * chunk + 3, 2)
    path = tmp_path / "f"
    path.write_bytes(first)
    calls = []

    def grow() -> None:
        calls.append(1)
        if len(calls) == 1:
            with open(path, "ab") as f:
                f.write(more)

    monkeypatch.setattr(local, "tick", grow)
    size, digest = LocalFS().hash_file(str(path), 1 << 30, chunk=chunk)
    final = first + more
    assert len(first) <= size <= len(final)
    assert digest == _xxh(final[:size])
    assert _no_threads_left("unbroken-read-ahead")


@pytest.mark.parametrize("to", [0, 1, 4096, 2 * 4096 + 100, 6 * 4096])
def test_a_file_truncated_while_hashed_gives_a_consistent_prefix(tmp_path, monkeypatch, to):
    chunk = 4096
    data = _data(10 * chunk + 7, to)
    path = tmp_path / "f"
    path.write_bytes(data)
    calls = []

    def shrink() -> None:
        calls.append(1)
        if len(calls) == 1:
            os.truncate(path, to)

    monkeypatch.setattr(local, "tick", shrink)
    size, digest = LocalFS().hash_file(str(path), 1 << 30, chunk=chunk)
    assert chunk <= size <= len(data)  # (the first piece was read before the truncation)
    assert digest == _xxh(data[:size])
    assert _no_threads_left("unbroken-read-ahead")


def test_hash_file_while_another_thread_appends_and_truncates_never_hangs(tmp_path):
    """Appends (write-once bytes) race the reads: each hash is a prefix of the final file;
    then truncations race them too: each hash finishes, with a result or an OSError."""
    chunk = 8192
    path = tmp_path / "f"
    path.write_bytes(_data(5 * chunk, 9))
    stop = threading.Event()

    def appender() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            i = 0
            while not stop.is_set() and i < 400:
                os.write(fd, _data(1000 + (i * 37) % 9000, i))
                i += 1
        finally:
            os.close(fd)

    t = threading.Thread(target=appender)
    t.start()
    results = []
    try:
        deadline = time.monotonic() + 3
        while True:  # (at least once: on a loaded machine the appender may finish first)
            results.append(LocalFS().hash_file(str(path), 1 << 30, chunk=chunk))
            if not t.is_alive() or time.monotonic() > deadline:
                break
    finally:
        stop.set()
        _join_all([t], 10)
    final = path.read_bytes()
    assert results
    for size, digest in results:
        assert digest == _xxh(final[:size])

    stop.clear()

    def truncator() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            os.truncate(path, rng.randrange(0, 12 * chunk))
            time.sleep(0.0005)

    # (within the truncator's range before the first hash: on a loaded machine a hash could
    # otherwise run before the thread's first truncation and see the appended file's size)
    os.truncate(path, 12 * chunk)
    t = threading.Thread(target=truncator)
    t.start()
    ended = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                size, _ = LocalFS().hash_file(str(path), 1 << 30, chunk=chunk)
                assert 0 <= size <= 12 * chunk
            except OSError:
                pass
            ended += 1
    finally:
        stop.set()
        _join_all([t], 10)
    assert ended > 0
    assert _no_threads_left("unbroken-read-ahead")


# -- consumers that stop, abandon or raise ------------------------------------------------------


def test_an_abandoned_generator_ends_its_readers_and_returns_its_buffers_when_dropped(tmp_path):
    chunk = 4096 * 3 + 8  # a size no other test borrows
    (tmp_path / "f").write_bytes(_data(40 * chunk, 4))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        gen = read_ahead(fd, chunk, 4)
        first = bytes(next(gen))
        assert first == _data(40 * chunk, 4)[:chunk]
        assert _threads("unbroken-read-ahead")  # reads in flight while the consumer holds one
        del gen  # never closed explicitly
        assert _no_threads_left("unbroken-read-ahead")
        with _buffers._lock:
            assert len(_buffers._free.get(chunk, [])) == 4  # all four came back
    finally:
        os.close(fd)


def test_a_generator_abandoned_in_a_finished_thread_leaves_no_reader(tmp_path):
    (tmp_path / "f").write_bytes(_data(64 * 4096, 5))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    got = []

    def consume() -> None:
        for i, piece in enumerate(read_ahead(fd, 4096, 4)):
            got.append(len(piece))
            if i == 2:
                return  # the frame drops the generator

    try:
        t = threading.Thread(target=consume)
        t.start()
        _join_all([t], 10)
        assert got == [4096] * 3
        assert _no_threads_left("unbroken-read-ahead")
    finally:
        os.close(fd)


def test_an_exception_in_the_consumer_of_hash_file_leaves_no_reader_and_no_fd(tmp_path,
                                                                               monkeypatch):
    (tmp_path / "f").write_bytes(_data(30 * 4096, 6))
    calls = []

    class Boom(Exception):
        pass

    def boom() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Boom

    monkeypatch.setattr(local, "tick", boom)
    before = _open_fds()
    with pytest.raises(Boom):
        LocalFS().hash_file(str(tmp_path / "f"), 1 << 30, chunk=4096)
    assert _no_threads_left("unbroken-read-ahead")
    assert _open_fds() == before
    monkeypatch.setattr(local, "tick", lambda: None)
    data = (tmp_path / "f").read_bytes()
    assert LocalFS().hash_file(str(tmp_path / "f"), 1 << 30, chunk=4096) == (len(data),
                                                                              _xxh(data))


def test_a_read_error_midway_in_hash_file_is_raised_and_leaves_no_reader(tmp_path, monkeypatch):
    from unbroken.store.backends import _readahead

    (tmp_path / "f").write_bytes(_data(30 * 4096, 7))
    real, calls = os.preadv, []

    def failing(fd, buffers, offset):
        calls.append(offset)
        if offset >= 10 * 4096:
            time.sleep(0.005)
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(_readahead.os, "preadv", failing)
    before = _open_fds()
    with pytest.raises(OSError, match="Input/output"):
        LocalFS().hash_file(str(tmp_path / "f"), 1 << 30, chunk=4096)
    assert _no_threads_left("unbroken-read-ahead")
    assert _open_fds() == before


# -- write_file: chunk types, sizes and boundaries ----------------------------------------------


def _check_written(tmp_path, name: str, chunks, expect: bytes) -> None:
    path = tmp_path / name
    assert LocalFS().write_file(str(path), chunks) == (len(expect), _xxh(expect))
    assert path.read_bytes() == expect
    assert LocalFS().hash_file(str(path), 1 << 30) == (len(expect), _xxh(expect))


@pytest.mark.parametrize("total", [100, 9 * MiB, 16 * MiB + 4097])
def test_write_file_takes_read_only_bytes_and_memoryviews_of_any_format(tmp_path, total):
    raw = _data(total - total % 4, 11)
    f32 = np.frombuffer(raw, dtype=np.float32).copy()
    f32.flags.writeable = False
    i16_2d = np.frombuffer(raw, dtype=np.int16).copy().reshape(-1, 2)
    chunks = [raw, memoryview(f32), memoryview(i16_2d), memoryview(raw)[3:],
              memoryview(bytearray(raw[:1000]))]
    expect = raw + raw + raw + raw[3:] + raw[:1000]
    _check_written(tmp_path, "f", chunks, expect)


def test_write_file_of_many_tiny_chunks_across_the_direct_threshold(tmp_path):
    pieces = [_data(1 + i % 97, i) for i in range(200_000)]  # ~9.7 MiB in tiny chunks
    expect = b"".join(pieces)
    assert len(expect) > 8 * MiB
    _check_written(tmp_path, "f", pieces, expect)


def test_write_file_of_one_huge_chunk(tmp_path):
    data = _data(40 * MiB + 4095, 12)
    _check_written(tmp_path, "f", [data], data)


@pytest.mark.parametrize("sizes", [
    [256 * 1024] * 40,                                 # exactly the NumPy-copy threshold
    [256 * 1024 - 1] * 40,                             # just under it
    [256 * 1024 + 1] * 40,
    [16 * MiB],                                        # one buffer exactly (no padding)
    [16 * MiB - 1, 1, 16 * MiB, 1],                    # filling the buffer by 1 byte
    [8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB - 4096],       # two buffers, last one block short
    [16 * MiB - 256 * 1024, 256 * 1024 + 1, 5],        # piece ends 1 past the boundary
    [16 * MiB - 100, 256 * 1024, 256 * 1024 - 1],      # a NumPy copy split by the boundary
    [32 * MiB + 1],                                    # one chunk crossing two boundaries
    [0, 9 * MiB, 0, 0, 7 * MiB, 0],                    # empty chunks in between
])
def test_write_file_at_the_copy_threshold_and_the_buffer_boundaries(tmp_path, sizes):
    pieces = [_data(n, i + n) for i, n in enumerate(sizes)]
    _check_written(tmp_path, "f", pieces, b"".join(pieces))


@settings(max_examples=12, deadline=None, database=None)
@given(st.lists(st.one_of(st.integers(0, 300_000), st.sampled_from(
    [256 * 1024 - 1, 256 * 1024, 4 * MiB, 8 * MiB, 16 * MiB - 1, 16 * MiB])),
    min_size=1, max_size=8), st.sampled_from(["bytes", "memoryview", "float32", "bytearray"]))
def test_write_file_of_any_chunk_layout_is_the_concatenation(tmp_path_factory, sizes, kind):
    pieces = [_data(n - n % 4, i) for i, n in enumerate(sizes)]
    as_kind = {"bytes": lambda b: b, "memoryview": memoryview, "bytearray": bytearray,
               "float32": lambda b: memoryview(np.frombuffer(b, dtype=np.float32))}[kind]
    path = tmp_path_factory.mktemp("w") / "f"
    expect = b"".join(pieces)
    assert LocalFS().write_file(str(path), [as_kind(p) for p in pieces]) == (len(expect),
                                                                              _xxh(expect))
    assert path.read_bytes() == expect


# -- concurrency --------------------------------------------------------------------------------


def test_concurrent_writes_and_hashes_from_many_threads_are_each_correct(tmp_path):
    """Sixteen threads at once write files of random sizes (to 20 MiB) in random chunks and
    hash them with chunks that share the pool's sizes (16 MiB: write_direct's buffers)."""
    errors: list[str] = []
    start = threading.Barrier(16, timeout=20)

    def work(tag: int) -> None:
        rng = random.Random(tag)
        try:
            start.wait()
            for round_ in range(2):
                size = rng.choice([0, 1, 8 * MiB, 16 * MiB, 16 * MiB + 1,
                                   rng.randrange(0, 20 * MiB)])
                data = _data(size, tag * 10 + round_)
                cuts = sorted(rng.randrange(0, size + 1) for _ in range(rng.randrange(0, 6)))
                pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size])]
                path = tmp_path / f"f{tag}-{round_}"
                got = LocalFS().write_file(str(path), pieces)
                if got != (size, _xxh(data)):
                    errors.append(f"{tag}/{round_}: write_file gave {got[0]} for {size}")
                chunk = rng.choice([4096, 1 * MiB, 8 * MiB, 16 * MiB])
                got = LocalFS().hash_file(str(path), 1 << 30, chunk=chunk)
                if got != (size, _xxh(data)):
                    errors.append(f"{tag}/{round_}: hash_file (chunk {chunk}) gave {got[0]} "
                                  f"for {size}")
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(f"{tag}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    _join_all(threads, 60)
    assert not errors
    assert _pool_bounded()
    assert _no_threads_left("unbroken-read-ahead")
    assert _no_threads_left("unbroken-direct-write")


def test_nested_borrows_in_one_thread_never_share_a_buffer():
    size = 5 * 4096 + 16
    with borrowed(3, size) as outer:
        for i, b in enumerate(outer):
            b[:] = bytes([i + 1]) * size
        with borrowed(3, size) as inner:
            assert not {_address(b) for b in outer} & {_address(b) for b in inner}
            for b in inner:
                b[:] = b"\xee" * size
            with borrowed(_buffers._KEEP + 1, size) as third:
                seen = {_address(b) for b in outer} | {_address(b) for b in inner}
                assert not seen & {_address(b) for b in third}
        assert [bytes(b) for b in outer] == [bytes([i + 1]) * size for i in range(3)]
    with _buffers._lock:
        assert len(_buffers._free[size]) == _buffers._KEEP


def test_a_borrower_that_raises_returns_its_buffers():
    size = 5 * 4096 + 32

    class Oops(Exception):
        pass

    with pytest.raises(Oops), borrowed(2, size) as bufs:
        lent = {id(b) for b in bufs}
        raise Oops
    with _buffers._lock:
        assert {id(b) for b in _buffers._free[size]} == lent
    with borrowed(2, size) as again:
        assert {id(b) for b in again} == lent


def test_many_threads_borrowing_and_returning_never_share_and_stay_bounded():
    size = 5 * 4096 + 48
    errors: list[str] = []
    holders: dict[int, int] = {}
    guard = threading.Lock()

    def borrow(tag: int) -> None:
        rng = random.Random(tag)
        for _ in range(60):
            with borrowed(rng.randrange(1, 4), size) as bufs:
                with guard:
                    for b in bufs:
                        a = _address(b)
                        if a in holders:
                            errors.append(f"{a:#x} lent to {holders[a]} and {tag}")
                        holders[a] = tag
                if rng.random() < 0.3:
                    time.sleep(0.0002)
                with guard:
                    for b in bufs:
                        holders.pop(_address(b), None)

    threads = [threading.Thread(target=borrow, args=(t,)) for t in range(12)]
    for t in threads:
        t.start()
    _join_all(threads, 20)
    assert not errors
    assert _pool_bounded()


# -- write_direct failing midway ----------------------------------------------------------------


class _FailingWrites(LocalFS):
    def __init__(self, at: int) -> None:
        self.at, self.writes = at, 0

    def _op(self, kind, path, before_death=None):
        if kind == "write":
            self.writes += 1
            if self.writes == self.at:
                raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("at", [1, 2, 3])
@pytest.mark.parametrize("total", [40 * MiB, 16 * MiB + 5])
def test_a_direct_write_that_fails_midway_returns_its_buffers(tmp_path, monkeypatch, at, total):
    used: list[list[object]] = []
    real = _direct._write_through

    def spying(fd, chunks, write, buffers):
        used.append([b.obj for b in buffers])
        return real(fd, chunks, write, buffers)

    monkeypatch.setattr(_direct, "_write_through", spying)
    data = _data(total, at)
    fs = _FailingWrites(at)
    if at > -(-total // (16 * MiB)):
        assert fs.write_file(str(tmp_path / "ok"), [data]) == (total, _xxh(data))
        return
    with pytest.raises(OSError, match="No space"):
        fs.write_file(str(tmp_path / "f"), [data])
    assert _no_threads_left("unbroken-direct-write")
    assert _pool_bounded()
    with _buffers._lock:
        pooled = {id(b.obj) for b in _buffers._free.get(16 * MiB, [])}
    assert {id(o) for o in used[0]} <= pooled  # both came back
    _check_written(tmp_path, "g", [data], data)
    assert {id(o) for o in used[1]} == {id(o) for o in used[0]}


def test_a_chunk_source_that_raises_midway_returns_the_buffers(tmp_path):
    class Broken(Exception):
        pass

    def chunks():
        yield _data(12 * MiB, 1)
        yield _data(12 * MiB, 2)
        raise Broken

    with pytest.raises(Broken):
        LocalFS().write_file(str(tmp_path / "f"), chunks())
    assert _no_threads_left("unbroken-direct-write")
    assert _pool_bounded()
    data = _data(20 * MiB, 3)
    _check_written(tmp_path, "g", [data], data)


# -- fork and interpreter exit ------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_child_forked_while_another_thread_reads_ahead_can_hash_and_write(tmp_path):
    big = _data(64 * 4096 + 11, 13)
    (tmp_path / "big").write_bytes(big)
    (tmp_path / "other").write_bytes(_data(20 * 4096 + 3, 14))
    reading, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow_reader() -> None:
        fd = os.open(tmp_path / "big", os.O_RDONLY)
        try:
            for piece in read_ahead(fd, 4096, 4):
                seen.append(len(piece))
                reading.set()
                release.wait(0.02)
        finally:
            os.close(fd)

    t = threading.Thread(target=slow_reader)
    t.start()
    try:
        assert reading.wait(10)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                want = (tmp_path / "other").read_bytes()
                ok = LocalFS().hash_file(str(tmp_path / "other"), 1 << 30,
                                         chunk=4096) == (len(want), _xxh(want))
                data = _data(17 * MiB, 15)
                ok = ok and LocalFS().write_file(str(tmp_path / "child"), [data]) == (
                    len(data), _xxh(data))
                ok = ok and (tmp_path / "child").read_bytes() == data
                code = 0 if ok else 2
            finally:
                os._exit(code)
        assert reaped(pid, 30) == 0
    finally:
        release.set()
        _join_all([t], 20)
    assert sum(seen) == len(big)  # the parent's read ran on, undisturbed
    assert _no_threads_left("unbroken-read-ahead")


def _run_script(tmp_path, body: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_mid_read_ahead_elsewhere_exits_normally(tmp_path):
    """The child ends through the interpreter's own exit (not os._exit): its stale copies of
    the parent's reader threads must not hang it."""
    proc = _run_script(tmp_path, """
        import os, sys, threading, time
        from unbroken.store.backends._readahead import read_ahead
        from unbroken.store.backends.local import LocalFS
        d = sys.argv[1]
        with open(os.path.join(d, "big"), "wb") as f:
            f.write(os.urandom(4 << 20))
        started = threading.Event()
        def reader():
            fd = os.open(os.path.join(d, "big"), os.O_RDONLY)
            for _ in read_ahead(fd, 4096, 4):
                started.set()
                time.sleep(0.001)
            os.close(fd)
        t = threading.Thread(target=reader)
        t.start()
        started.wait(10)
        pid = os.fork()
        if pid == 0:
            print("child", LocalFS().hash_file(os.path.join(d, "big"), 1 << 30,
                                                chunk=65536)[0], flush=True)
            sys.exit(0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status), flush=True)
                break
            time.sleep(0.01)
        else:
            os.kill(pid, 9)
            print("child hung", flush=True)
        t.join(20)
    """)
    assert "child exit 0" in proc.stdout, proc.stdout + proc.stderr
    assert f"child {4 << 20}" in proc.stdout


def test_hash_file_in_a_thread_that_outlives_the_main_thread(tmp_path):
    proc = _run_script(tmp_path, """
        import os, sys, threading, time
        from unbroken.store.backends.local import LocalFS
        p = os.path.join(sys.argv[1], "f")
        with open(p, "wb") as f:
            f.write(os.urandom(20 << 20))
        def late():
            time.sleep(0.5)  # the main thread has returned: the interpreter is exiting
            try:
                print("OK", LocalFS().hash_file(p, 1 << 30)[0], flush=True)
            except BaseException as e:
                print("FAIL", type(e).__name__, e, flush=True)
        threading.Thread(target=late).start()
    """)
    assert f"OK {20 << 20}" in proc.stdout, proc.stdout + proc.stderr


def test_an_async_save_left_to_finish_at_exit_succeeds(tmp_path):
    proc = _run_script(tmp_path, """
        import sys, torch, unbroken
        model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights: hashed with read-ahead
        ckpt = unbroken.Checkpointer(sys.argv[1] + "/run", model=model, async_save=True)
        ckpt.step_done(1)
        ckpt.save()
        # ends without close(): the save thread finishes at interpreter exit
    """, timeout=120)
    assert proc.returncode == 0
    assert "failed" not in proc.stderr, proc.stderr
