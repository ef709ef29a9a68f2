"""Generations on a local filesystem: staging, commit by rename, listing, verification,
moving aside and deletion, and the single-writer lock.

Layout (see DESIGN.md)::

    RUN/gen-000000500/            a committed generation; it exists only if its manifest verifies
    RUN/.staging-000000600-<id>/  a save in progress; never read; removed by the next writer
    RUN/.trash-<id>/              a deletion in progress; never read; removed by the next writer
    RUN/aside/                    abandoned or corrupt generations, moved here, never overwritten
    RUN/LOCK                      single writer (POSIX fcntl lock: not inherited by forked workers)

Uncommitted generations are ignored: listing reads only ``gen-*`` folders, and a folder counts
as a generation only when it is a real folder (not a symbolic link), its ``MANIFEST.json``
parses, names the same generation, and every listed file exists as a regular file with its
listed size (``verify`` then re-hashes every byte).

Readers need no lock and may list while a writer commits and deletes: a generation appears
whole (one rename), and one being deleted loses its manifest first (``torn``) and then
vanishes from the listing; it is never reported ``corrupt`` for that reason.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from collections.abc import Callable, Mapping

from ..errors import CorruptCheckpoint, RunUnreadable, SharedFileFailed
from .aside import AsideFolder
from .backends.killpoints import fault_point
from .backends.local import LocalFS
from .lock import acquire_writer_lock, errno_text, hand_over, release_writer_lock
from .manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Artifact,
    Manifest,
    parse_manifest,
    valid_artifact_name,
)
from .sources import Linked, Source
from .verifying import (
    MACHINE_ERRNOS,
    UNREADABLE,
    GenerationInfo,
    Verifying,
    looked_at,
    present,
    stat_identity,
    unreadable,
)

_GEN = re.compile(r"gen-([0-9]{9,})", re.ASCII)  # fullmatch: no Unicode digits, no "\n"
# What an operating system's file browser or an NFS client leaves in any folder it opens
# (macOS's .DS_Store and ._ files, Windows' Thumbs.db and desktop.ini, NFS's silly renames):
# never a generation's content, so no reason to refuse it (a restore would fall back past it)
_LITTER = re.compile(r"\.DS_Store|\._.+|Thumbs\.db|desktop\.ini|\.nfs[0-9A-Fa-f]{8,}.*",
                     re.IGNORECASE)
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"


def generation_name(generation: int) -> str:
    return f"gen-{generation:09d}"


def generation_number(name: str) -> int | None:
    """The generation a folder (or object prefix) of this name holds: N for exactly
    ``generation_name(N)``; None for any other name. ``gen-0000000003`` beside
    ``gen-000000003`` (a copy, a hand-made name) would be a second generation 3, and which
    one a restore continued from would depend on the listing's order: it is not one."""
    m = _GEN.fullmatch(name)
    if m is None:
        return None
    number = int(m.group(1))
    return number if name == generation_name(number) else None


def _litter(folder: str, name: str) -> bool:
    """A file an OS or NFS client left in a generation folder (`_LITTER`): a plain file."""
    if not _LITTER.fullmatch(name):
        return False
    try:
        return stat.S_ISREG(os.lstat(os.path.join(folder, name)).st_mode)
    except OSError:
        return False


class GenerationStore(AsideFolder, Verifying):
    """The run folder. Reading needs no lock; every method that changes it needs ``lock()``."""

    def __init__(self, root: str | os.PathLike[str], fs: LocalFS | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.fs = fs or LocalFS()
        self._lock_fd: int | None = None
        # path -> identity of its files when every byte last verified (see verified())
        self._verified: dict[str, tuple[tuple[int, ...], ...]] = {}

    # -- the single-writer lock ---------------------------------------------------------------

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def lock(self) -> None:
        """Become the only writer (see `lock.acquire_writer_lock`), then finish what a dead
        writer left: a save of the same step killed just before its rename committed
        (`finish_superseding`), debris removed."""
        self._lock_fd = acquire_writer_lock(self.root)
        staged: dict[int, list[str]] = {}
        for name in self._names():
            number = name[len(STAGING_PREFIX):][:9]
            if name.startswith(STAGING_PREFIX) and number.isdigit():
                staged.setdefault(int(number), []).append(os.path.join(self.root, name))
        if staged:
            self.finish_superseding(staged)
        self._clean_debris()

    def hand_over(self) -> None:
        """(The writer.) Let a persisting process write on its behalf (`lock.hand_over`)."""
        self._need_lock()
        assert self._lock_fd is not None
        hand_over(self._lock_fd)

    def adopt_lock(self, fd: int) -> None:
        """(A persisting process.) Write on behalf of the writer that handed its lock over;
        ``fd`` holds the persister byte (`lock.take_persister`)."""
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            release_writer_lock(self.root, self._lock_fd)
            self._lock_fd = None

    def _need_lock(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError("the run folder must be locked before it is changed")

    def _names(self) -> list[str]:
        """What the run folder holds, sorted ([] where it cannot be listed)."""
        try:
            return sorted(os.listdir(self.root))
        except OSError:
            return []

    def _clean_debris(self) -> None:
        """Staging and trash folders belong to a dead writer: nothing in them was committed.
        Best effort: debris is never read, and the next writer tries again."""
        for name in self._names():
            if name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
                try:
                    self.fs.rmtree(os.path.join(self.root, name))
                except OSError:
                    pass

    # -- listing and verification -------------------------------------------------------------

    def scan(self) -> list[GenerationInfo]:
        """Every ``gen-*`` folder, oldest first, checked cheaply (manifest, names, sizes)."""
        if not os.path.isdir(self.root):
            return []
        found = []
        try:
            names = os.listdir(self.root)
        except OSError as e:  # (a folder it may not list: no verdict on any generation)
            failed = unreadable(self.root, e)
            if isinstance(failed, RunUnreadable):
                raise failed from None
            raise
        for name in names:
            number = generation_number(name)
            if number is not None:
                info = self._check(number, os.path.join(self.root, name))
                if info is not None:  # None: deleted while we looked at it
                    found.append(info)
        return sorted(found, key=lambda g: g.generation)

    def present(self, info: GenerationInfo) -> bool:
        """Whether the generation ``info`` describes is still in the listing."""
        return os.path.lexists(info.path)

    def manifest_path(self, info: GenerationInfo) -> str:
        """Where the manifest of ``info`` is (messages name it)."""
        return os.path.join(info.path, MANIFEST)

    def scan_one(self, generation: int) -> GenerationInfo:
        """The cheap check of one generation by number."""
        path = os.path.join(self.root, generation_name(generation))
        info = self._check(generation, path)
        if info is None:
            return GenerationInfo(generation, path, "torn", f"{path}: missing")
        return info

    def _check(self, generation: int, path: str) -> GenerationInfo | None:
        where = os.path.join(path, MANIFEST)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        except OSError as e:  # (the folder's own entry unreadable: not judged by a machine error)
            return looked_at(generation, path, e)
        if not stat.S_ISDIR(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else f"not a folder (mode {oct(mode)})"
            return GenerationInfo(generation, path, "corrupt", f"{path}: {kind}; a generation "
                                  "is a real folder inside the run, never a symbolic link")
        try:
            os.lstat(where)
        except FileNotFoundError:
            there = present(path)
            if there is not True:  # (gone; or not known: `present`)
                return None if there is False else looked_at(generation, path, there)
            return GenerationInfo(generation, path, "torn", f"{where}: missing (never committed, "
                                  "or deletion interrupted)")
        except OSError as e:  # (a folder it may not read: not a missing manifest)
            return GenerationInfo(generation, path, UNREADABLE if e.errno in MACHINE_ERRNOS
                                  else "corrupt", f"{path}: cannot be read ({errno_text(e)}); "
                                  "fix its permissions, then run again")
        try:
            manifest = parse_manifest(self.fs.read_file(where, MAX_MANIFEST_BYTES), where)
            if manifest.generation != generation:
                raise CorruptCheckpoint(f"{where}: names generation {manifest.generation}, the "
                                        f"folder is generation {generation}")
            if manifest.folder:
                raise CorruptCheckpoint(f"{where}: names an upload folder "
                                        f"({manifest.folder!r}), as on an object store; a "
                                        "local generation's files are beside its manifest")
            listed = {a.name for a in manifest.artifacts}
            for entry in sorted(os.listdir(path)):
                if entry != MANIFEST and entry not in listed and not _litter(path, entry):
                    raise CorruptCheckpoint(f"{os.path.join(path, entry)}: not listed in the "
                                            "manifest (a generation never changes after commit)")
            for a in manifest.artifacts:
                file = os.path.join(path, a.name)
                try:
                    st = os.lstat(file)
                except FileNotFoundError:
                    raise CorruptCheckpoint(f"{file}: missing; the manifest lists {a.size} "
                                            "bytes") from None
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptCheckpoint(f"{file}: not a regular file (mode "
                                            f"{oct(st.st_mode)})")
                if st.st_size != a.size:
                    raise CorruptCheckpoint(f"{file}: {st.st_size} bytes, the manifest lists "
                                            f"{a.size}")
        except (CorruptCheckpoint, OSError) as e:
            # A concurrent deletion (manifest first, then the folder) is not corruption. (An
            # existence this machine could not tell, a flapping ESTALE: not judged either.)
            there = present(path)
            if there is False:
                return None
            manifest_there = present(where) if there is True else there
            if manifest_there is False:
                return GenerationInfo(generation, path, "torn", f"{where}: missing (deletion "
                                      "in progress or interrupted)")
            if manifest_there is not True:
                return looked_at(generation, path, manifest_there)
            if isinstance(e, CorruptCheckpoint):
                return GenerationInfo(generation, path, "corrupt", str(e))
            return looked_at(generation, path, e)
        return GenerationInfo(generation, path, "complete", "", manifest)

    # -- changing the folder (writer only) -----------------------------------------------------

    def commit(self, generation: int, artifacts: Mapping[str, Source],
               make_manifest: Callable[[list[Artifact]], Manifest],
               supersede: bool = False) -> GenerationInfo:
        """Write a generation: staging folder, every artifact fsynced, manifest last, rename.

        A crash at any point leaves either the complete generation or debris that listing
        ignores; older generations are never touched. With ``supersede``, an existing
        generation of that number (a save of the same step whose state has changed since) is
        moved aside as "superseded" once the new one is complete, just before its rename: a
        crash between the two leaves the superseded one in ``aside/`` and the new one complete
        in its staging folder, never a mixture, and the next writer renames it into place.
        (A job of many ranks runs the same steps apart: `stage`, `write_artifacts` on every
        rank, `publish` on the leader.)"""
        staging = self.stage(generation, supersede)
        try:
            manifest = make_manifest(self.write_artifacts(staging, artifacts, generation))
        except BaseException:
            self._discard(staging)
            raise
        return self.publish(staging, generation, manifest, supersede)

    def stage(self, generation: int, supersede: bool = False) -> str:
        """Create the staging folder of ``generation`` (writer only) and return its path."""
        self._need_lock()
        final = os.path.join(self.root, generation_name(generation))
        if os.path.lexists(final) and not supersede:
            raise FileExistsError(f"{final} already exists; move it aside before saving over it")
        staging = os.path.join(self.root,
                               f"{STAGING_PREFIX}{generation:09d}-{uuid.uuid4().hex[:12]}")
        self.fs.mkdir(staging)
        return staging

    def write_artifacts(self, staging: str,
                        artifacts: Mapping[str, Source],
                        generation: int, first: int = 1) -> list[Artifact]:
        """Write and fsync each artifact into ``staging`` (any rank may, without the lock);
        return their names, sizes and content hashes. ``first`` numbers the fault points."""
        bad = [n for n in artifacts if not valid_artifact_name(n)]
        if bad:
            raise ValueError(f"artifact names {bad} are not plain file names")
        written = []
        for name, chunks in artifacts.items():
            path = os.path.join(staging, name)
            if isinstance(chunks, Linked) and self._link(chunks, path):
                size, digest = chunks.size, chunks.xxh3_128
                chunks.linked = True
            elif isinstance(chunks, Linked):  # written anew: it must be what it replaces
                size, digest = self.fs.write_file(path, chunks.write())
                if (size, digest) != (chunks.size, chunks.xxh3_128):
                    raise SharedFileFailed(
                        f"{path}: written anew from {chunks.source} (a link could not be "
                        f"made), it hashes {digest} ({size} bytes) where the file it replaces "
                        f"was {chunks.xxh3_128} ({chunks.size} bytes)")
            else:
                size, digest = self.fs.write_file(path, chunks)
            written.append(Artifact(name, size, digest))
            fault_point(f"artifact-{first + len(written) - 1}-written", generation)
        return written

    def _link(self, linked: Linked, path: str) -> bool:
        """Link a stable file of an earlier generation (incremental saves) into ``path``;
        False where that cannot be done (another filesystem, no hard links, the source gone
        or changed since it was verified): the caller writes it anew. The source folder's
        verdict stays remembered (a link changes its file's ctime, not its content)."""
        try:
            was = stat_identity(os.lstat(linked.source))
            self.fs.link(linked.source, path)
        except OSError:
            return False
        now = stat_identity(os.lstat(path))
        if now[2] != linked.size or now[:2] != was[:2]:
            self.fs.unlink(path)
            return False
        # The link changed the shared file's ctime in every generation that holds it: a
        # verdict that knew the file as it was just before the link stands. One that knew it
        # otherwise does not: the file changed since (rot that kept its size and mtime
        # changes its ctime, and only that), and the generation is hashed again.
        for folder, before in list(self._verified.items()):
            self._verified[folder] = tuple(now if entry == was else entry for entry in before)
        return True

    def publish(self, staging: str, generation: int, manifest: Manifest,
                supersede: bool = False) -> GenerationInfo:
        """Write the manifest last, fsync, rename into place and fsync the run folder (writer
        only); on any failure nothing is committed and the staging folder goes."""
        final = os.path.join(self.root, generation_name(generation))
        superseded = None
        try:
            self.fs.write_file(os.path.join(staging, MANIFEST), [manifest.to_bytes()])
            fault_point("manifest-written", generation)
            self.fs.fsync_dir(staging)
            fault_point("before-rename", generation)
            if supersede and os.path.lexists(final):
                # (killed from here to the rename: the next writer commits it, `lock`)
                superseded = self.move_aside(self.scan_one(generation), "superseded")
                fault_point("superseded-moved", generation)
            self.fs.rename(staging, final)
        except BaseException:
            self._discard(staging)
            raise
        try:
            self.fs.fsync_dir(self.root)
        except OSError:
            # The rename may not be durable. Take the generation back, so that a save reported
            # as failed never leaves a generation behind (if that fails too, what stays is a
            # complete, verifiable generation).
            try:
                self.fs.rename(final, staging)
            except OSError:
                pass
            else:
                self._discard(staging)
            raise
        fault_point("after-rename", generation)
        return GenerationInfo(generation, final, "complete", "", manifest, superseded)

    def discard(self, staging: str) -> None:
        """Remove a staging folder whose generation will not be committed."""
        self._discard(staging)

    def _discard(self, staging: str) -> None:
        try:
            self.fs.rmtree(staging)
        except OSError:
            pass  # the next writer removes staging debris on lock()

    def delete(self, info: GenerationInfo) -> None:
        """Delete a generation: manifest first (so a half-deleted folder can never verify),
        then rename out of the listing, then remove the files."""
        self._need_lock()
        manifest = os.path.join(info.path, MANIFEST)
        real_folder = stat.S_ISDIR(os.lstat(info.path).st_mode)  # never follow a symlink out
        if real_folder and os.path.lexists(manifest):
            self.fs.unlink(manifest)
            self.fs.fsync_dir(info.path)
        fault_point("retention-unlinked", info.generation)
        self._verified.pop(info.path, None)
        self._remove(info.path)

    def _remove(self, path: str) -> None:
        """Rename out of the listing (one atomic step), then remove the files."""
        trash = os.path.join(self.root, f"{TRASH_PREFIX}{uuid.uuid4().hex[:12]}")
        self.fs.rename(path, trash)
        self.fs.fsync_dir(self.root)
        self.fs.rmtree(trash)
        # Trash an earlier deletion left behind (it failed midway, e.g. on an I/O error).
        for name in sorted(os.listdir(self.root)):
            if name.startswith(TRASH_PREFIX):
                self.fs.rmtree(os.path.join(self.root, name))
