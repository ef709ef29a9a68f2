"""Generations on an object store (``s3://``, ``gs://``, ``memory://``, ... through fsspec):
commit without rename.

Layout::

    RUN/gen-000000500/MANIFEST.json      the commit: uploaded last, created only if absent
    RUN/gen-000000500/u-<id>/...         the artifacts of the save that committed it
    RUN/gen-000000600/u-<id>/...         a save in progress or interrupted: debris, never read
    RUN/aside/gen-N-<reason>-<time>-<id>/ copies of generations taken out of the listing
    RUN/LEASE.json                       the single writer's lease (conditional create, expiry)
    RUN/RUN.json                         the run record

Uncommitted generations are ignored: a ``gen-*`` prefix counts only when its manifest parses,
names that generation, and every listed artifact is in the manifest's upload folder with its
listed size (``verify`` then re-hashes every byte). Each save uploads into a folder of its own
(``u-<id>``), so no attempt ever overwrites another's bytes; the manifest names that folder.
"Newest" is found by listing, never by a pointer that could be written before the data. A
save of the same step again replaces the manifest in one conditional PUT instead, with the old
generation's objects copied aside before and deleted only after (`ObjectStore.publish`).

Where the store creates conditionally (`ObjectFS.atomic_create`: S3's If-None-Match, GCS
generation preconditions), two writers cannot both commit generation N: the second manifest
upload fails and that writer gets `CommitConflict`. The lease keeps a second writer out while
the first renews it; a lease past its expiry may be taken over (its writer stopped renewing),
and if two take it at once, the conditional manifest still lets only one commit each
generation. Deletion removes the manifest first: a half-deleted generation is debris."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..errors import CorruptCheckpoint, ReadOnlyRun, StoreLocked
from ._manifest_commit import Undecided, commit_manifest
from ._objects_aside import _AsideOps
from ._objects_known import _Known
from .backends.killpoints import fault_point
from .backends.objects import ObjectFS, is_checksum
from .cache import ReadCache
from .generations import GenerationInfo, GenerationStore, generation_name, generation_number
from .lease import LEASE, Lease
from .lock import errno_text
from .manifest import MANIFEST, Artifact, Manifest
from .sources import Linked

UPLOAD_PREFIX = "u-"
_UPLOAD = re.compile(r"u-[0-9a-f]{16}", re.ASCII)


class ObjectStore(_Known, _AsideOps, GenerationStore):
    """A run on an object store: the same contract as `GenerationStore` (reading needs no
    lock; changing needs ``lock()``), committed by a conditional manifest upload."""

    fs: ObjectFS  # type: ignore[assignment]

    def __init__(self, url: str, fs: ObjectFS, lease_seconds: float = 60.0,
                 cache: ReadCache | None = None) -> None:
        super().__init__(os.sep, None)
        self.root = url.rstrip("/")
        self.fs = fs
        self.lease = Lease(fs, f"{self.root}/{LEASE}", lease_seconds)
        self.cache = cache
        self._uploading: str | None = None  # the upload folder of the save being written
        self._from_cache = False  # the last read_verified used the cache (never a verdict)
        # the copies the save being written made of verified objects, by path: their identity
        # (size and checksum) as the store made them, the verified source's (see `_link`)
        self._copies: dict[str, tuple[object, ...]] = {}
        self._manifests = {}  # manifest URL -> (listed size and tag, parsed): `_manifest`
        self._listed = {}  # generation path -> its objects' identities as last listed

    # -- the lease ------------------------------------------------------------------------------

    @property
    def locked(self) -> bool:
        return self.lease.held

    def lock(self) -> None:
        """Take the run's lease (`lease.Lease`), then remove the debris a dead writer left."""
        try:
            self.lease.acquire()
        except OSError as e:
            raise ReadOnlyRun(f"{self.lease.path}: cannot take the run's lease: "
                              f"{errno_text(e)}. Restoring from this run works; saving needs "
                              "a store this process can write (check the credentials, the "
                              "endpoint and the bucket)") from None
        self._clean_debris()

    def renew(self) -> None:
        """Extend this writer's lease (each commit does); `StoreLocked` if it was lost."""
        self._need_lock()
        self.lease.renew()

    def unlock(self) -> None:
        self.lease.release()

    def hand_over(self) -> None:
        raise ValueError(f"{self.root}: a persisting process (async_save='process') writes to "
                         "a local run folder only")

    def adopt_lock(self, fd: int) -> None:
        self.hand_over()

    def _need_lock(self) -> None:
        if not self.lease.held:
            raise StoreLocked(f"{self.lease.path}: this writer does not hold the run's lease "
                              "(never taken, or lost to another writer); it cannot change the "
                              "run")

    # -- listing --------------------------------------------------------------------------------

    def _objects(self) -> dict[str, dict[str, dict[str, Any]]]:
        """One fresh listing: generation prefix name -> {key inside it: info}."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        base = self.root + "/"
        for url, info in self.fs.listing(self.root).items():
            if url.startswith(base):
                head, _, rest = url[len(base):].partition("/")
                if rest and generation_number(head) is not None:
                    out.setdefault(head, {})[rest] = info
        return out

    def scan(self) -> list[GenerationInfo]:
        """Every committed generation, oldest first, checked cheaply (manifest, names,
        sizes); prefixes without a manifest are debris and not listed."""
        found = []
        listed = self._objects()
        for name, objects in listed.items():
            info = self._check_objects(int(name[4:]), objects)
            if info is not None:
                found.append(info)
        self._forget({f"{self.root}/{name}/{MANIFEST}" for name in listed},
                     {g.path for g in found})
        return sorted(found, key=lambda g: g.generation)

    def scan_one(self, generation: int) -> GenerationInfo:
        name = generation_name(generation)
        objects = {url[len(self._prefix(generation)) + 1:]: info for url, info in
                   self.fs.listing(self._prefix(generation)).items()}
        info = self._check_objects(generation, objects)
        if info is None:
            return GenerationInfo(generation, f"{self.root}/{name}", "torn",
                                  f"{self.root}/{name}/{MANIFEST}: missing (never committed)")
        return info

    def present(self, info: GenerationInfo) -> bool:
        return self.fs.exists(self.manifest_path(info))

    def manifest_path(self, info: GenerationInfo) -> str:
        """(Beside its upload folder, which ``info.path`` names.)"""
        return f"{self._prefix(info.generation)}/{MANIFEST}"

    def _prefix(self, generation: int) -> str:
        return f"{self.root}/{generation_name(generation)}"

    def _check_objects(self, generation: int, objects: Mapping[str, Mapping[str, Any]]
                       ) -> GenerationInfo | None:
        prefix = self._prefix(generation)
        where = f"{prefix}/{MANIFEST}"
        if MANIFEST not in objects:
            return None
        try:
            manifest = self._manifest(where, objects[MANIFEST])
            if manifest.generation != generation:
                raise CorruptCheckpoint(f"{where}: names generation {manifest.generation}, the "
                                        f"prefix is generation {generation}")
            if not _UPLOAD.fullmatch(manifest.folder):
                raise CorruptCheckpoint(f"{where}: upload folder {manifest.folder!r:.40} is not "
                                        "u-<16 hex digits>")
            path = f"{prefix}/{manifest.folder}"
            inside = {k[len(manifest.folder) + 1:]: v for k, v in objects.items()
                      if k.startswith(manifest.folder + "/")}
            listed = {a.name for a in manifest.artifacts}
            for extra in sorted(set(inside) - listed):
                raise CorruptCheckpoint(f"{path}/{extra}: not listed in the manifest (a "
                                        "generation never changes after commit)")
            for a in manifest.artifacts:
                if a.name not in inside:
                    raise CorruptCheckpoint(f"{path}/{a.name}: missing; the manifest lists "
                                            f"{a.size} bytes")
                if inside[a.name].get("size") != a.size:
                    raise CorruptCheckpoint(f"{path}/{a.name}: {inside[a.name].get('size')} "
                                            f"bytes, the manifest lists {a.size}")
        except FileNotFoundError:
            return None  # deleted while we looked
        except CorruptCheckpoint as e:
            return GenerationInfo(generation, prefix, "corrupt", str(e))
        # Any other OSError propagates: a store that failed to answer (a timeout, a 503)
        # says nothing about the generation, which must not be moved aside for it.
        info = GenerationInfo(generation, path, "complete", "", manifest)
        self._note_listing(info, objects)
        return info

    @property
    def read_the_store(self) -> bool:
        return not self._from_cache

    def read_verified(self, info: GenerationInfo, names: Any = None, advance: Any = None,
                      mapped: Any = None, map_if: Any = None) -> dict[str, Any]:
        """As `GenerationStore.read_verified`; nothing is mapped from an object store, and
        with a `ReadCache` artifacts already cached (and hashing right) are read from it."""
        self._from_cache = False
        out = super().read_verified(info, names, advance)
        if self._from_cache:  # right bytes, but the store itself was not read: no verdict
            self._doubt(info.path)
        if self.cache is not None and info.manifest is not None:
            self.cache.keep_only(a for a in info.manifest.artifacts if a.name in out)
        return out

    def _read_artifact(self, folder: str, a: Artifact) -> bytes:
        cached = self.cache.get(a) if self.cache is not None else None
        if cached is not None:
            self._from_cache = True
            return cached  # type: ignore[no-any-return]
        data = super()._read_artifact(folder, a)  # from the store, hash-checked
        if self.cache is not None:
            self.cache.put(a, data)
        return data

    # -- changing the run (writer only) ---------------------------------------------------------

    def _clean_debris(self) -> None:
        """Upload folders no manifest names (saves that never committed, deletions that
        stopped midway) belong to a dead writer. Best effort: debris is never read."""
        try:
            listed = self._objects()
        except OSError:
            return
        for name, objects in sorted(listed.items()):
            try:
                info = self._check_objects(int(name[4:]), objects)
            except OSError:
                continue  # the store did not answer: leave this prefix for the next writer
            keep = info.manifest.folder if info is not None and info.manifest else None
            for key in sorted(objects):
                if key != MANIFEST and not key.startswith(f"{keep}/"):
                    if info is not None and not info.ok:
                        continue  # a corrupt generation is moved aside whole, not picked at
                    try:
                        self.fs.unlink(f"{self.root}/{name}/{key}")
                    except OSError:
                        pass

    def debris(self) -> list[tuple[str, str]]:
        """(name, note) of what listing ignores: upload folders no manifest names."""
        out = []
        for name, objects in sorted(self._objects().items()):
            info = self._check_objects(int(name[4:]), objects)
            keep = info.manifest.folder if info is not None and info.manifest else None
            folders = {k.partition("/")[0] for k in objects if "/" in k}
            out += [(f"{name}/{f}", "in-progress or interrupted save, ignored")
                    for f in sorted(folders) if f != keep]
        return out

    def stage(self, generation: int, supersede: bool = False) -> str:
        """The upload folder of a new save of ``generation`` (nothing is created yet)."""
        self._need_lock()
        if not supersede and self.fs.exists(f"{self._prefix(generation)}/{MANIFEST}"):
            raise FileExistsError(f"{self._prefix(generation)} already exists; move it aside "
                                  "before saving over it")
        self._uploading = f"{self._prefix(generation)}/{UPLOAD_PREFIX}{uuid.uuid4().hex[:16]}"
        self._copies = {}
        return self._uploading

    def _link(self, linked: Linked, path: str) -> bool:
        """An object store has no hard links: an unchanged stable file of an incremental
        save is copied by the store itself (S3's CopyObject: none of its bytes passes through
        this process), while the source is still the object that was verified. False where
        that fails (the caller uploads it anew). When the store's checksum of the copy (S3's
        ETag) is the one the source had when this process verified it, the copy holds those
        bytes, and the read-back does not download it (`_check_artifact`); otherwise the
        read-back hashes it like any other file, so a source that changed since fails this
        generation, not a later one."""
        try:
            was = self.fs.ident(linked.source)
            if was[0] != linked.size:
                return False
            self.fs.copy(linked.source, path)
            now = self.fs.ident(path)
        except OSError:
            return False
        if now[0] != linked.size:
            with contextlib.suppress(OSError):
                self.fs.unlink(path)
            return False
        if len(now) == 2 and is_checksum(now[1]) and now == linked.ident:
            self._copies[path] = now
        return True

    def _check_artifact(self, folder: str, a: Artifact, from_disk: bool = False) -> None:
        """As `GenerationStore._check_artifact`, but a copy this save made of a verified object
        (`_link`) is not downloaded while it still holds the checksum of the bytes verified:
        the store computed it over the copy's bytes."""
        path = f"{folder}/{a.name}"
        copied = self._copies.pop(path, None)
        if copied is not None and copied[0] == a.size:
            try:
                if self.fs.ident(path) == copied:
                    return
            except OSError:
                pass
        super()._check_artifact(folder, a, from_disk)

    def publish(self, staging: str, generation: int, manifest: Manifest,
                supersede: bool = False) -> GenerationInfo:
        """Upload the manifest last, only if no manifest of ``generation`` exists; on any
        failure nothing is committed and the upload folder goes. `CommitConflict` when
        another writer committed ``generation`` first.

        With ``supersede`` (a save of the same step again) an existing generation is replaced
        without ever leaving the step without one: its objects are first copied under
        ``aside/`` as *superseded* (nothing deleted), then its manifest is replaced by the new
        one in a single PUT, conditional on being still the one copied (`replace_file`), and
        only then are its objects, named by no manifest any more, deleted. Until that PUT the
        old manifest names the old objects, all in place; from it on, the new one names the
        new upload, complete. (A store cannot delete and create a manifest as one step, and
        a kill between the two would leave the step to an older generation, or none.)"""
        where = f"{self._prefix(generation)}/{MANIFEST}"
        manifest = replace(manifest, folder=staging.rsplit("/", 1)[1])
        data = manifest.to_bytes()
        superseded = None
        replaced: tuple[GenerationInfo, list[str]] | None = None
        try:
            self.renew()
            fault_point("before-rename", generation)
            was = self._manifest_ident(where) if supersede else None
            if was is None:
                commit_manifest(self.fs, where, manifest, lambda: self.fs.create_file(where, data))
            else:
                old = self.scan_one(generation)
                replaced = (old, self._own(old))
                superseded = self.copy_aside(old, "superseded")
                self.renew()  # (the copies may have taken a while)
                commit_manifest(self.fs, where, manifest,
                                lambda: self.fs.replace_file(where, data, was), was)
            fault_point("manifest-written", generation)
        except BaseException as e:
            if not isinstance(e, Undecided):
                self._discard(staging)
                if superseded is not None:  # the old generation stands: no copy of it needed
                    self._discard(superseded)
            raise e.cause if isinstance(e, Undecided) else e from None
        finally:
            self._uploading = None
        if replaced is not None:
            self.drop_replaced(*replaced)
        fault_point("after-rename", generation)
        return GenerationInfo(generation, staging, "complete", "", manifest, superseded)

    def _manifest_ident(self, where: str) -> tuple[object, ...] | None:
        try:
            return self.fs.ident(where)
        except FileNotFoundError:
            return None

    def _discard(self, staging: str) -> None:
        try:
            self.fs.rmtree(staging)
        except OSError:
            pass  # debris: the next writer removes it on lock()

