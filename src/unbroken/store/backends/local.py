"""The file-system seam: every write, fsync, rename and unlink of the store goes through here
(`LocalFS`), so tests can inject I/O faults and kill the process at named or numbered points
(`killpoints`).

`FaultyFS` is the matching test seam for I/O errors: it raises ``OSError`` (ENOSPC, EIO, ...)
at a chosen operation instead of killing."""

from __future__ import annotations

import errno
import functools
import itertools
import mmap
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import xxhash

from ..._pacing import tick
from ...errors import CorruptCheckpoint
from ._direct import BLOCK, drop_direct, is_direct, try_direct, write_direct
from ._readahead import read_ahead
from .killpoints import MUTATING, READ, io_fault_point

ALIGN = 64  # what torch's CPU allocator gives a fresh tensor
_PIECE = 8 << 20  # what a read in flight reads (`_readahead`)
_AHEAD = 64 << 20  # files up to this size are read ahead of their turn (`LocalFS.will_read`)


def _write_half(fd: int, view: memoryview) -> None:
    """What a process killed mid-write leaves: part of the chunk."""
    drop_direct(fd)  # half a block is not aligned
    os.write(fd, view[: len(view) // 2])


_DIRECT_MIN = 8 << 20  # smaller files are written through the page cache (cheaper there)


def _head(chunks: Iterator[memoryview | bytes]) -> tuple[list[memoryview | bytes], bool]:
    """The first chunks of ``chunks``, up to ``_DIRECT_MIN`` bytes, and whether the file
    reaches that size."""
    head: list[memoryview | bytes] = []
    total = 0
    for chunk in chunks:
        head.append(chunk)
        total += memoryview(chunk).nbytes
        if total >= _DIRECT_MIN:
            return head, True
    return head, False


def _hashing(chunks: Iterable[memoryview | bytes], h: Any) -> Iterator[memoryview | bytes]:
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        # (in pieces: a paced save, `_pacing`, must never hash a 1 GiB tensor in one burst)
        for at in range(0, len(view), _HASH_PIECE):
            h.update(view[at:at + _HASH_PIECE])
            tick()
        yield chunk


def _open_regular(path: str, limit: int) -> tuple[int, os.stat_result]:
    """Open an artifact for reading: O_NOFOLLOW | O_NONBLOCK + fstat, so a symlink, FIFO or
    device in its place is refused without following it or hanging on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpoint(f"{path}: is a symbolic link; the files unbroken reads "
                                    "(a generation's manifest and artifacts, the run's records) "
                                    "must be regular files in place") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{path}: not a regular file (mode {oct(st.st_mode)})")
        raise CorruptCheckpoint(f"{path}: {st.st_size} bytes, over the {limit}-byte limit")
    return fd, st


_SMALL = 256 << 10  # chunks below this are gathered into one write (10,000 small tensors)
_GATHER = 4 << 20
_HASH_PIECE = 16 << 20


def _coalesced(chunks: Iterable[memoryview | bytes]) -> Iterator[memoryview]:
    """The bytes of ``chunks`` in order, small ones gathered into writes of up to 4 MiB and
    large ones as they are (no copy): one system call per tensor costs more than its bytes."""
    pending = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if len(view) < _SMALL:
            pending += view
            if len(pending) < _GATHER:
                continue
            view, pending = memoryview(pending), bytearray()
        elif pending:
            gathered, pending = pending, bytearray()
            yield memoryview(gathered)
        yield view
    if pending:
        yield memoryview(pending)


def whole_buffer(size: int, aligned: bool, path: str) -> memoryview:
    """A writable buffer for the ``size`` bytes of the file at ``path``, not zero-filled: a
    ``bytearray``'s view, or with ``aligned`` a view whose first byte is 64-byte aligned
    (`CorruptCheckpoint` naming the file when it cannot fit in memory). The aligned one is
    torch's memory, not NumPy's: NumPy asks for transparent huge pages for a large array, and
    where the kernel compacts memory to fault one in, reading a 2 GiB file (from the page
    cache) into it took 1.9-3.5 s, against 0.6-0.9 s into a tensor (fresh processes here)."""
    try:
        if aligned:
            import torch  # (here: the persisting process writes files and never imports it)

            raw = torch.empty(size + ALIGN, dtype=torch.uint8).numpy()
            skip = -raw.ctypes.data % ALIGN
            return raw[skip:skip + size].data
        return memoryview(bytearray(size))
    except (MemoryError, OverflowError, ValueError, RuntimeError):  # (torch's: RuntimeError)
        raise CorruptCheckpoint(f"{path}: {size} bytes do not fit in memory") from None


class LocalFS:
    """POSIX file operations with the durability steps the commit protocol needs.

    Every primitive operation first calls ``_op(kind, path)``: the hook that counts it for
    ``$UNBROKEN_KILL_AT_OP`` and that `FaultyFS` overrides to inject errors."""

    def _op(self, kind: str, path: str, before_death: Callable[[], None] | None = None) -> None:
        io_fault_point(kind, path, before_death)

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> tuple[int, str]:
        """Create ``path`` (never overwrite), write, fsync; return (size, xxh3-128 hex)."""
        h = xxhash.xxh3_128()
        size = 0
        self._op("create", path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            hashed = _hashing(chunks, h)

            def write(view: memoryview) -> None:
                while view:
                    self._op("write", path, functools.partial(_write_half, fd, view))
                    try:
                        written = os.write(fd, view)
                    except OSError as e:
                        # O_DIRECT refuses a write that a limit (the file-size limit, a
                        # quota) would cut off the block grid with EINVAL, hiding the cause:
                        # written buffered, it fails with the real one (EFBIG).
                        if e.errno != errno.EINVAL or not is_direct(fd):
                            raise
                        drop_direct(fd)
                        continue
                    view = view[written:]
                    if view and written % BLOCK:  # (the same, cut short instead)
                        drop_direct(fd)

            head, large = _head(hashed)
            if large and try_direct(fd):
                size = write_direct(fd, itertools.chain(head, hashed), write)
                os.ftruncate(fd, size)  # the last block's padding
            else:
                for view in _coalesced(itertools.chain(head, hashed)):
                    write(view)
                    size += len(view)
                    tick()
            self._op("fsync", path)
            os.fsync(fd)
        except OSError as e:  # (os.write and os.fsync name no file: the message must)
            if e.filename is None:
                e.filename = path
            raise
        finally:
            os.close(fd)
        return size, h.hexdigest()

    def hash_file(self, path: str, limit: int, drop_cache: bool = False,
                  chunk: int = _PIECE) -> tuple[int, str]:
        """Size and xxh3-128 of a regular file of at most ``limit`` bytes, read through a
        few small buffers with several reads in flight (no copy of the file is held;
        `_readahead`). ``drop_cache`` first evicts the
        file's pages (clean once fsynced) so that the bytes come from the disk, not from the
        page cache that the write just filled."""
        self._op(READ, path)
        fd, st = _open_regular(path, limit)
        try:
            if drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            h = xxhash.xxh3_128()
            size = 0
            if st.st_size > chunk:  # read ahead while hashing
                for piece in read_ahead(fd, chunk):
                    h.update(piece)
                    size += len(piece)
                    tick()
            else:
                view = memoryview(bytearray(max(st.st_size, 1)))
                while n := os.readv(fd, [view]):
                    h.update(view[:n])
                    size += n
            if drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return size, h.hexdigest()
        finally:
            os.close(fd)

    def read_file(self, path: str, limit: int, aligned: bool = False) -> Any:
        """Read a regular file of at most ``limit`` bytes: a ``bytearray``, or with ``aligned`` a
        writable memoryview whose first byte is 64-byte aligned (tensors are then decoded as
        views into it, aligned as torch aligns a fresh tensor: no copy). Only a regular file
        is read (see `_open_regular`)."""
        return self._read(path, limit, aligned, None)

    def read_hashed(self, path: str, limit: int, aligned: bool = False) -> tuple[Any, str]:
        """`read_file`'s result and the xxh3-128 of its bytes, hashed as they arrive: a file
        larger than a piece is read with several reads in flight straight into its buffer
        (`_readahead`), so the hash, and the page faults of a fresh buffer, happen while
        the disk works, not in a pass after it."""
        h = xxhash.xxh3_128()
        return self._read(path, limit, aligned, h), h.hexdigest()

    def _read(self, path: str, limit: int, aligned: bool, h: Any) -> Any:
        self._op(READ, path)
        fd, st = _open_regular(path, limit)
        try:
            view = whole_buffer(st.st_size, aligned, path)
            got = 0
            if st.st_size > _PIECE:
                for piece in read_ahead(fd, _PIECE, into=view):
                    if h is not None:
                        h.update(piece)
                    got += len(piece)
                    tick()
            else:
                while got < st.st_size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break
                    got += n
                if h is not None:
                    h.update(view[:got])
            if got != st.st_size:
                raise CorruptCheckpoint(f"{path}: shrank while being read ({got} of {st.st_size})")
            return view if aligned else view.obj
        finally:
            os.close(fd)

    def will_read(self, paths: Iterable[str]) -> None:
        """A hint that ``paths`` are read next, one after the other: the kernel starts
        reading each regular file of at most `_AHEAD` bytes now, so a restore of many small
        tensors reads its files side by side, not one after the other (~4 ms of a 10,000
        tensor restore's 20 ms of reads). Larger files are read with several reads in flight
        already (`_readahead`); nothing here fails (a file that is no regular file is
        refused when read)."""
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_size <= _AHEAD:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def map_file(self, path: str, limit: int) -> memoryview:
        """A regular file of at most ``limit`` bytes mapped copy-on-write: a writable view
        (tensors decode as views into it) whose pages are read only when touched, so
        decoding a generation's structure costs its headers, not its size."""
        self._op(READ, path)
        fd, st = _open_regular(path, limit)
        try:
            if st.st_size == 0:
                return memoryview(bytearray())
            return memoryview(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY))
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        """Whether anything (a symbolic link too) is at ``path``."""
        return os.path.lexists(path)

    def ident(self, path: str) -> tuple[object, ...]:
        """What changes when the file at ``path`` is replaced or written: its device, inode,
        size and modification time (an incremental save links a file only while they hold)."""
        st = os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def fsync_dir(self, path: str) -> None:
        self._op("fsync_dir", path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def mkdir(self, path: str) -> None:
        self._op("mkdir", path)
        os.mkdir(path, 0o755)

    def rename(self, src: str, dst: str) -> None:
        """Rename without replacing: Linux lets a directory rename replace an empty directory."""
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "refusing to replace", dst)
        self._op("rename", src)
        os.rename(src, dst)

    def replace(self, src: str, dst: str) -> None:
        """Rename a file over another (atomic on POSIX): for small records, never artifacts."""
        self._op("rename", src)
        os.replace(src, dst)

    def link(self, src: str, dst: str) -> None:
        """A hard link ``dst`` to the regular file ``src`` (never following a symlink)."""
        self._op("link", dst)
        os.link(src, dst, follow_symlinks=False)

    def unlink(self, path: str) -> None:
        self._op("unlink", path)
        os.unlink(path)

    def rmtree(self, path: str) -> None:
        """Remove a folder and everything in it, one counted operation per entry. Symbolic
        links are removed, never followed; a non-folder ``path`` is simply unlinked."""
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            self._op("unlink", path)
            os.unlink(path)
            return
        with os.scandir(path) as it:
            entries = [(e.path, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                self.rmtree(child)
            else:
                self._op("unlink", child)
                os.unlink(child)
        self._op("rmdir", path)
        os.rmdir(path)


class FaultyFS(LocalFS):
    """A `LocalFS` that fails on purpose: the documented seam for I/O-fault tests.

    ``FaultyFS(kind="fsync", nth=2, err=errno.EIO)`` raises ``OSError(EIO)`` instead of the
    second fsync of a file; ``kind=None`` counts every mutating operation (``read`` must be
    named explicitly); ``match`` limits counting to paths containing that text; ``times`` is
    how many consecutive matching operations fail (``-1``: all from ``nth`` on, a full disk).
    A failing ``write`` first writes half of its chunk, as a disk that filled up mid-write
    does. ``ops`` records every operation as ``(kind, path)``; ``failed`` the ones that
    raised. Install with ``store.fs = FaultyFS(...)`` (``checkpointer.store.fs`` for a
    Checkpointer)."""

    def __init__(self, kind: str | None = None, nth: int = 1, err: int = errno.ENOSPC,
                 match: str | None = None, times: int = 1) -> None:
        if kind is not None and kind not in (*MUTATING, READ):
            raise ValueError(f"kind={kind!r}: one of {(*MUTATING, READ)} or None")
        if nth < 1:
            raise ValueError(f"nth={nth!r}: 1-based")
        self.kind, self.nth, self.err, self.match, self.times = kind, nth, err, match, times
        self.seen = 0
        self.ops: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str]] = []

    def _op(self, kind: str, path: str, before_death: Callable[[], None] | None = None) -> None:
        super()._op(kind, path, before_death)
        self.ops.append((kind, path))
        if (kind != self.kind if self.kind is not None else kind == READ):
            return
        if self.match is not None and self.match not in path:
            return
        self.seen += 1
        if self.seen < self.nth or (0 <= self.times <= len(self.failed)):
            return
        if kind == "write" and before_death is not None:
            before_death()  # half the chunk reached the disk before it filled up
        self.failed.append((kind, path))
        raise OSError(self.err, os.strerror(self.err), path)

