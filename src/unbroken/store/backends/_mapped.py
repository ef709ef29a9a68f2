"""Verified files mapped for a restore that copies straight into the live tensors.

Two ways to verify. By default every byte is verified before any live object changes, so a
generation is read twice: first streamed through a small buffer and hashed, then copied from
the (now cached) file into the live parameters and optimizer state. With ``defer`` (a restore
of one process, which falls back to the previous generation when a file fails its hash), a
file is hashed in the pass that copies it (`_streamed`): read once.

The file is mapped so that decoding and validation see every tensor (as a view; only headers
are touched), and ``copy`` then reads each tensor's bytes from the file straight into its
destination (``preadv``): no buffer of the file's size, no page of the mapping faulted in, so
the memory a restore adds stays near the largest new tensor instead of the whole generation."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import CorruptCheckpoint
from ...state.tensorfile import tensor_bytes
from ..verifying import unreadable
from ._streamed import hash_copies


def _ident(st: os.stat_result) -> tuple[int, ...]:
    # (not the ctime: a hard link to the file, which an incremental save makes to a stable
    # file at every save, or a chmod, changes it and not a byte; a write changes the mtime)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_FAULTED_MAX = 32 << 20  # bytes copied from the mappings (odd layouts) before a release
# Tensors at least this large are read by a pool of threads, in pieces of this size: one
# thread copying from the page cache runs at a fraction of the memory's bandwidth, and
# ``preadv`` releases the GIL (3 GiB restored: the copy pass took 0.7 s on one thread).
_PIECE = 8 << 20
_READERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(eq=False)
class _Span:
    """A mapped file: its first address and size in memory, the mapping, a descriptor of the
    file as its hash was checked (or, ``digest`` given, as it was mapped), its path, that
    file's identity then (`_ident`), and whether bytes were copied from it (``used``).
    ``digest``: the hash the file must have, not checked yet; ``copies`` wait for it."""

    start: int
    size: int
    mm: Any
    fd: int
    path: str
    ident: tuple[int, ...]
    used: bool = False
    digest: str | None = None
    forget: Callable[[], None] | None = None  # (called when the file fails its hash)
    copies: list[tuple[int, memoryview]] = field(default_factory=list)


def _read_into(span: _Span, into: memoryview, offset: int) -> None:
    done = 0
    while done < into.nbytes:
        n = os.preadv(span.fd, [into[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpoint(
                f"{span.path}: shrank while being restored (bytes {offset}-"
                f"{offset + into.nbytes} of the {span.size} its hash was checked over came back "
                f"as {done})")
        done += n


class MappedFiles:
    """The mapped files of one restore, by address range, and page release after a copy."""

    def __init__(self, defer: bool = False) -> None:
        self.defers = defer  # hash each file in the pass that copies it (`add`'s ``digest``)
        self.refused: tuple[str, str] | None = None  # (path, why): a file failed its hash
        self.progress: Any = None  # (`_progress.Progress`: bytes hashed; closed by `close`)
        self._verified: list[Callable[[], None]] = []  # called once every file hashed right
        self._spans: list[_Span] = []
        self._faulted = 0  # bytes of small tensors copied from the mappings since a release
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def add(self, view: memoryview, path: str, hashed: os.stat_result, digest: str | None = None,
            forget: Callable[[], None] | None = None) -> memoryview:
        """Register ``path`` mapped as ``view`` (`LocalFS.map_file`); returns the view.
        ``hashed``: the file as it was when its hash was checked (``digest``: when it was
        mapped, its hash to be checked as it is copied from); a file replaced or written since
        is refused (`CorruptCheckpoint`). ``forget``: called if it fails that hash."""
        if view.nbytes and isinstance(view.obj, mmap.mmap):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            st = os.fstat(fd)
            if _ident(st) != _ident(hashed):
                os.close(fd)
                raise CorruptCheckpoint(f"{path}: changed while being restored (replaced or "
                                        "written after its hash was checked)")
            self._spans.append(_Span(np.frombuffer(view, dtype=np.uint8).ctypes.data,
                                     view.nbytes, view.obj, fd, path, _ident(st),
                                     digest=digest, forget=forget))
        return view

    def _span(self, t: torch.Tensor) -> _Span | None:
        start = t.data_ptr()
        for span in self._spans:
            if span.start <= start < span.start + span.size:
                return span
        return None

    def maps(self) -> bool:
        """Whether any file is mapped (else `copy` only copies, and the rest does nothing)."""
        return bool(self._spans)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views a mapped file (else it is this process's own memory)."""
        return bool(self._spans) and self._span(t) is not None

    def copy(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """``src``'s value in ``dst`` (same shape and dtype; under ``no_grad`` when it is a
        parameter), returned. Without ``dst``: a new tensor when ``src`` views a mapped file,
        else ``src`` itself (memory of this process's own, adopted as it is). A large tensor
        is read in the background: its value is there once `finish` returned."""
        span = self._span(src) if self._spans and src.numel() else None
        if span is None:
            if dst is None:
                return src
            dst.copy_(src)
            return dst
        span.used = True
        if dst is None:
            dst = torch.empty(src.shape, dtype=src.dtype)
        if (not src.is_contiguous() or not dst.is_contiguous() or not dst.is_cpu
                or dst.dtype != src.dtype or dst.shape != src.shape
                or dst.is_neg() or dst.is_conj()):  # (lazy views: memory is not their value)
            dst.copy_(src)
            self._faulted += src.numel() * src.element_size()
            if self._faulted > _FAULTED_MAX:
                self._release_all()
            return dst
        # Even a small tensor is read, not copied from the mapping: touching one page of a
        # cached file maps its whole folio (2 MiB on ext4 with large folios), so 61 biases
        # of 8 KiB once mapped 120 MiB into this process.
        into = tensor_bytes(dst)
        offset = src.data_ptr() - span.start
        if span.digest is not None:  # (read as the file is hashed, by `finish`)
            span.copies.append((offset, into))
            return dst
        if into.nbytes < _PIECE or _READERS == 1:
            _read_into(span, into, offset)
            return dst
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="unbroken-restore")
        for at in range(0, into.nbytes, _PIECE):
            try:
                self._pending.append(self._pool.submit(
                    _read_into, span, into[at:at + _PIECE], offset + at))
            except RuntimeError:  # (the pool refuses work once the main thread has ended: a
                _read_into(span, into[at:at + _PIECE], offset + at)  # restore in a thread then)
        return dst

    def finish(self) -> None:
        """Wait for every background read `copy` started; the first failure is raised (after
        all ended: none still writes into a live tensor). Then every mapped file copied from
        must still be the file whose hash was checked: the copies read it a second time, and
        bytes written into it meanwhile (in place, same size) were never verified
        (`CorruptCheckpoint`; a file not copied from yet is checked after its own copies)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for f in pending:
            e = f.exception()
            error = error or e
        if error is not None:
            raise error
        for span in self._spans:
            if span.copies:
                self._hash(span)
        for span in self._spans:
            if not span.used:
                continue
            now = os.fstat(span.fd)
            if now.st_size != span.size:
                raise CorruptCheckpoint(f"{span.path}: {now.st_size} bytes while being restored, "
                                        f"{span.size} when its hash was checked: the bytes "
                                        "copied from it are unverified")
            if _ident(now) != span.ident:
                raise CorruptCheckpoint(f"{span.path}: written while being restored (after its "
                                        "hash was checked): the bytes copied from it are "
                                        "unverified")

    def verify_rest(self) -> None:
        """Hash every file not hashed yet (none copied from it through `copy`), then report
        them all verified (the callbacks of `when_verified`). `CorruptCheckpoint` if one
        fails its hash (then `refused` says which)."""
        self.finish()
        self.verify_unhashed()
        for confirm in self._verified:
            confirm()
        self._verified.clear()

    def verify_unhashed(self, drop: bool = False) -> None:
        """Hash every file not hashed yet, making the copies recorded from it (``drop``: a
        failed restore's, left unmade): before code other than this module reads the mapped
        bytes (a module's own ``load_state_dict``), or to tell whether a refusal came from
        unverified bytes. `CorruptCheckpoint` (or `RunUnreadable`) as `_hash` says."""
        for span in self._spans:
            if span.digest is not None:
                if drop:
                    span.copies.clear()
                self._hash(span)

    def when_verified(self, confirm: Callable[[], None]) -> None:
        """Call ``confirm`` once every file of this restore is hashed right (`verify_rest`)."""
        self._verified.append(confirm)

    def _hash(self, span: _Span) -> None:
        """Read ``span``'s file once, its recorded copies straight into their tensors, and
        check its hash (`_streamed.hash_copies`)."""
        copies, span.copies = span.copies, []
        expected, span.digest = span.digest, None
        try:
            got, digest, again = hash_copies(span.fd, span.size, copies, _PIECE,
                                             self.progress and self.progress.advance)
        except OSError as e:  # (an I/O error: the file gone bad, as in a hash pass)
            error = unreadable(span.path, e)
            if isinstance(error, CorruptCheckpoint):
                self.refused = (span.path, str(error))
            raise error from None
        why = (f"{span.path}: {got} bytes, the manifest lists {span.size}" if got != span.size
               else f"{span.path}: content hash {digest}, the manifest lists {expected} (the "
               "file changed after commit)" if digest != expected else None)
        if why is not None:
            self.refused = (span.path, why)
            if span.forget is not None:
                span.forget()
            raise CorruptCheckpoint(why)
        for offset, into in again:
            _read_into(span, into, offset)

    def release(self, t: torch.Tensor) -> None:
        """Drop from this process the whole pages of a mapped file that ``t`` (a view into
        it, already copied) occupies; a tensor not in a mapped file is left alone."""
        span = self._span(t) if self._spans and t.numel() else None
        if span is None:
            return
        base = span.start
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first = -(-(start - base) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (min(end, base + span.size) - base) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            span.mm.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _release_all(self) -> None:
        """Drop every page of every mapping from this process (those of tensors not copied
        yet are read again when touched: the mappings are private and never written)."""
        for span in self._spans:
            try:
                span.mm.madvise(mmap.MADV_DONTNEED, 0, span.size)
            except (ValueError, OSError):
                pass  # closed already
        self._faulted = 0

    def close(self) -> None:
        """Release every page still held (what was copied without `release`) and the
        descriptors; the mappings themselves go with the last tensor that views them."""
        for span in self._spans:  # (copies not made by now are abandoned: a failed restore)
            span.copies.clear()
        try:
            self.finish()
        except (OSError, CorruptCheckpoint):
            pass  # (reported by the `finish` of the restore; this one only must not leak)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._release_all()
        for span in self._spans:
            os.close(span.fd)
        self._spans.clear()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
