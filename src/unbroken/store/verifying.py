"""Verifying generations: re-hashing their files (streaming, or while reading them for a
restore), and remembering a verdict by file identity so that a generation verified once costs
a few ``lstat`` calls until one of its files changes. Mixed into `GenerationStore`."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpoint, RunUnreadable, UnbrokenError
from .backends.local import LocalFS
from .manifest import MANIFEST, Artifact, Manifest

if TYPE_CHECKING:  # (it needs torch, which the persisting process never imports)
    from .backends._mapped import MappedFiles


def _memory_bytes() -> int:
    """Physical memory: no artifact larger than this can be read (and verified) whole."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


UNREADABLE = "unreadable"  # the status of a generation this machine may not read
# Errors of this machine, not of a file's content: a generation that meets one is not judged
# (moved aside as corrupt, a restore falling back past it) but left as it is, and the error
# raised (`RunUnreadable`): a good generation behind a permission was rolled back over. So
# are those of a network file system or store that did not answer (a stale handle, a
# timeout, a connection refused or reset), or answered that it could not serve the read
# now (an object store's 503 SlowDown and 409 are EBUSY in s3fs, its 500 InternalError
# EREMOTEIO, a redirect to another region EREMCHG, an unimplemented call ENOSYS; a client
# library's own error, `backends.objects`, is EREMOTEIO): they say nothing of the bytes either.
MACHINE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE,
                            errno.ENOMEM, errno.ENOBUFS, errno.ESTALE, errno.ENOTCONN,
                            errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                            errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                            errno.ENETDOWN, errno.ENETRESET, errno.EHOSTDOWN, errno.EBUSY,
                            errno.EAGAIN, errno.ENOSYS, errno.ECANCELED,
                            getattr(errno, "EREMOTEIO", errno.EBUSY),
                            getattr(errno, "EREMCHG", errno.EBUSY)})


def unreadable(path: str, e: OSError) -> UnbrokenError:
    """The error for ``path`` that could not be read: `RunUnreadable` for a reason of this
    machine (`MACHINE_ERRNOS`), else `CorruptCheckpoint` (an I/O error, a file gone bad)."""
    if e.errno in MACHINE_ERRNOS or isinstance(e, (TimeoutError, ConnectionError)):
        name = errno.errorcode.get(e.errno or 0, "")
        return RunUnreadable(f"{path}: cannot be read ({e.strerror or e} [{name}]), which says "
                             "nothing of its content: it was not judged, nor moved; fix the "
                             "cause (its permissions, the process's file or memory limits, "
                             "the network or store) and run again")
    return CorruptCheckpoint(f"{path}: unreadable ({e})")


def present(path: str) -> bool | OSError:
    """Whether ``path`` exists (``os.path.lexists``, which says False for any error), or the
    error that kept this machine from telling (a stale handle, a permission)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        return e
    return True


def looked_at(generation: int, path: str, e: OSError) -> GenerationInfo:
    """A generation whose folder could not be looked at: unreadable (not judged, never
    changed) for an error of this machine, else corrupt (`unreadable`)."""
    failed = unreadable(getattr(e, "filename", None) or path, e)
    return GenerationInfo(generation, path, "corrupt" if isinstance(failed, CorruptCheckpoint)
                          else UNREADABLE, str(failed))


def not_loadable(info: GenerationInfo) -> UnbrokenError:
    """The error for a generation listing did not find complete: `RunUnreadable` for one this
    machine may not read (not judged), else `CorruptCheckpoint` with the reason."""
    why = info.reason or f"{info.path}: {info.status}"
    return RunUnreadable(why) if info.status == UNREADABLE else CorruptCheckpoint(why)


def generation_of(path: str) -> str:
    """The ``gen-*`` name in a generation's path (on an object store the path ends in the
    generation's upload folder)."""
    parts = path.rstrip("/").split("/")
    return next((p for p in reversed(parts) if p.startswith("gen-")), parts[-1])


@dataclass
class GenerationInfo:
    """What listing found in one ``gen-*`` folder. ``status``: complete / torn / corrupt, or
    unreadable (this machine may not read it: `unreadable`; not judged, never changed)."""

    generation: int
    path: str
    status: str
    reason: str = ""
    manifest: Manifest | None = None
    # (just committed by a save of the same step again) where the generation it replaced
    # went under aside/: put back should this one fail its read-back
    superseded: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "complete"

    @property
    def name(self) -> str:
        """``gen-NNNNNNNNN`` (on an object store ``path`` is its upload folder inside that)."""
        return f"gen-{self.generation:09d}"


def stat_identity(st: os.stat_result) -> tuple[int, ...]:
    """A file's device, inode, size, mtime and ctime: what a remembered verdict is bound to."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Verifying:
    """Verification of the generations of a run folder (see module doc)."""

    fs: LocalFS
    _verified: dict[str, tuple[tuple[int, ...], ...]]

    @property
    def read_the_store(self) -> bool:
        """Whether the last `read_verified` read every artifact from the store itself (an
        object store may serve them from a local cache: right bytes, but no verdict on the
        objects, which an incremental save must then not copy)."""
        return True

    def file_identity(self, info: GenerationInfo) -> tuple[tuple[int, ...], ...] | None:
        """Device, inode, size, mtime and ctime of the manifest and every artifact: any write,
        replacement or truncation of a file changes it. ``None`` if a file is missing."""
        assert info.manifest is not None
        try:
            return tuple(stat_identity(os.lstat(os.path.join(info.path, n)))
                         for n in (MANIFEST, *(a.name for a in info.manifest.artifacts)))
        except OSError:
            return None

    def verified_elsewhere(self, info: GenerationInfo,
                           ident: tuple[tuple[int, ...], ...] | None) -> None:
        """Remember ``info`` as verified by other processes (every rank of a job re-hashed
        its share), as of ``ident`` (`file_identity` taken before they started): retention
        then does not hash the whole job's files again on the leader."""
        if ident is not None:
            self._verified[info.path] = ident

    def verified(self, info: GenerationInfo) -> str | None:
        """``None`` when every byte of the generation matches its manifest, else the reason;
        `RunUnreadable` when this machine may not read it (its content not judged).

        The verdict is remembered by file identity (see ``file_identity``): a generation
        verified since it was committed or restored by this store costs a few ``lstat`` calls;
        one whose files changed since is re-hashed."""
        if not info.ok or info.manifest is None:
            return info.reason or f"{info.path}: {info.status}"
        ident = self.file_identity(info)
        if ident is not None and self._verified.get(info.path) == ident:
            return None
        return self.hashed_verdict(info)

    def hash_needed(self, info: GenerationInfo) -> bool:
        """Whether `verified` would hash ``info`` (no verdict of this store's bound to its
        files as they are): retention spreads such work over saves."""
        ident = None if info.manifest is None else self.file_identity(info)
        return ident is None or self._verified.get(info.path) != ident

    def hashed_verdict(self, info: GenerationInfo) -> str | None:
        """`verify` ``info`` (every byte hashed): ``None``, or why it fails."""
        try:
            self.verify(info)
        except CorruptCheckpoint as e:  # (`RunUnreadable` is raised: nothing was judged)
            return str(e)
        return None

    def read_verified(self, info: GenerationInfo, names: Iterable[str] | None = None,
                      advance: Callable[[int], None] | None = None,
                      mapped: MappedFiles | None = None,
                      map_if: Callable[[Artifact], bool] = lambda a: False
                      ) -> dict[str, Any]:
        """Read artifacts (all by default) and check each one's size and content hash;
        ``advance(nbytes)`` is called after each (a progress bar). With ``mapped``, an
        artifact for which ``map_if`` holds is hashed streaming and then mapped (registered in
        ``mapped``), not read into memory: a restore copies from it into live tensors. If
        ``mapped.defers``, it is only mapped here, and hashed as it is copied from (neither
        ``advance`` nor this generation's verdict then waits for it: `MappedFiles`)."""
        if not info.ok or info.manifest is None:
            raise not_loadable(info)
        ident = self.file_identity(info) if names is None else None
        wanted = set(names) if names is not None else None
        out: dict[str, Any] = {}
        self.fs.will_read([os.path.join(info.path, a.name) for a in info.manifest.artifacts
                           if (wanted is None or a.name in wanted) and not map_if(a)])
        deferred = False
        for a in info.manifest.artifacts:
            if wanted is not None and a.name not in wanted:
                continue
            later = mapped is not None and mapped.defers and map_if(a)
            try:
                out[a.name] = self._read_one(info.path, a, mapped if map_if(a) else None)
            except CorruptCheckpoint:
                self._forget_sharing(info.path, a.name)
                raise
            deferred |= later
            if advance is not None and not later:
                advance(a.size)
        if ident is not None:
            if deferred and mapped is not None:
                mapped.when_verified(lambda: self._verified.__setitem__(info.path, ident))
            else:
                self._verified[info.path] = ident
        return out

    def _read_one(self, folder: str, a: Artifact, mapped: MappedFiles | None) -> Any:
        """One artifact's verified contents: read into memory, or (``mapped``) hashed
        streaming and then mapped."""
        if mapped is None:
            return self._read_artifact(folder, a)
        path = os.path.join(folder, a.name)
        self._check_loadable(path, a)
        try:
            before = os.lstat(path)
            if not mapped.defers:
                self._check_artifact(folder, a)
            elif before.st_size != a.size:  # (its hash: as it is copied from, `MappedFiles`)
                raise CorruptCheckpoint(f"{path}: {before.st_size} bytes, the manifest lists "
                                        f"{a.size}")
            view = mapped.add(self.fs.map_file(path, a.size), path, before,
                              a.xxh3_128 if mapped.defers else None,
                              lambda: self._forget_sharing(folder, a.name))
        except OSError as e:
            raise unreadable(path, e) from None
        if len(view) != a.size:
            raise CorruptCheckpoint(f"{path}: changed size while being read")
        return view

    @staticmethod
    def _check_loadable(path: str, a: Artifact) -> None:
        """An artifact larger than this machine's memory could never be restored here: refuse
        it before reading (a sparse 8 TiB file would take hours to hash)."""
        if a.size > _memory_bytes():
            raise CorruptCheckpoint(f"{path}: the manifest lists {a.size} bytes, more than this "
                                    f"machine's memory ({_memory_bytes()}); refusing to read it")

    def _read_artifact(self, folder: str, a: Artifact) -> bytes:
        path = os.path.join(folder, a.name)
        self._check_loadable(path, a)
        try:
            data, digest = self.fs.read_hashed(path, a.size,
                                               aligned=a.name.endswith(".safetensors"))
        except OSError as e:
            raise unreadable(path, e) from None
        if len(data) != a.size:
            raise CorruptCheckpoint(f"{path}: {len(data)} bytes, the manifest lists {a.size}")
        if digest != a.xxh3_128:
            raise CorruptCheckpoint(f"{path}: content hash {digest}, the manifest lists "
                                    f"{a.xxh3_128} (the file changed after commit)")
        return data

    def verify(self, info: GenerationInfo, from_disk: bool = False,
               advance: Callable[[int], None] | None = None,
               names: set[str] | None = None, failed: list[str] | None = None) -> None:
        """Re-hash every artifact of a generation, streaming (no file is held in memory);
        raise ``CorruptCheckpoint`` on the first bad one (its name appended to ``failed``
        first). ``from_disk``: evict each file's cached pages first, so a just-written
        generation is read from the disk itself. ``names``: only those artifacts (one rank's
        share of a generation of many ranks)."""
        if not info.ok or info.manifest is None:
            raise not_loadable(info)
        ident = self.file_identity(info) if names is None else None
        chosen = [a for a in info.manifest.artifacts if names is None or a.name in names]
        for a in chosen:
            self._check_loadable(os.path.join(info.path, a.name), a)
        for a in chosen:
            try:
                self._check_artifact(info.path, a, from_disk)
            except CorruptCheckpoint:
                self._forget_sharing(info.path, a.name)
                if failed is not None:
                    failed.append(a.name)
                raise
            if advance is not None:
                advance(a.size)
        if ident is not None:
            self._verified[info.path] = ident

    def _forget_sharing(self, folder: str, name: str) -> None:
        """``folder/name`` failed its hash: forget the verdict of every generation that holds
        the same file (a hard link of an incremental save). Rot that changed no metadata
        leaves their file identities as they were verified, and retention would go on
        counting them as kept copies."""
        try:
            st = os.lstat(os.path.join(folder, name))
        except OSError:
            return
        for other, ident in list(self._verified.items()):
            if any(entry[:2] == (st.st_dev, st.st_ino) for entry in ident):
                del self._verified[other]

    def _check_artifact(self, folder: str, a: Artifact, from_disk: bool = False) -> None:
        """Hash one artifact streaming (no copy of it is held); `CorruptCheckpoint` unless it
        has the listed size and hash."""
        path = os.path.join(folder, a.name)
        try:
            size, digest = self.fs.hash_file(path, a.size, drop_cache=from_disk)
        except OSError as e:
            raise unreadable(path, e) from None
        if size != a.size:
            raise CorruptCheckpoint(f"{path}: {size} bytes, the manifest lists {a.size}")
        if digest != a.xxh3_128:
            raise CorruptCheckpoint(f"{path}: content hash {digest}, the manifest lists "
                                    f"{a.xxh3_128} (the file changed after commit)")
