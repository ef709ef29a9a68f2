"""What an `ObjectStore` keeps from its listings, so that a restart or a save costs a few
requests rather than a download of every kept generation: manifests parsed once per version,
each generation's object identities as last listed, and the verdicts built on them.

What this relies on (an object store, not a disk):

* An object's listed size and version tag change whenever it is uploaded again with other
  bytes (S3's ETag is the MD5 of its bytes, or of its parts'; GCS's generation is new at every
  upload). A manifest whose listed identity is the one parsed before is the one parsed before;
  a generation whose objects are listed with the identities they had when this process
  hashed them holds the bytes it hashed (the store keeps stored bytes intact: S3 and GCS
  check their own checksums, so nothing rots silently under an unchanged tag).
* Retention deletes nothing without a generation this process verified: it runs only after
  the read-back of the generation just saved has re-hashed every byte of it from the store,
  and that generation, the newest, is always kept (`writer.apply_retention`). Whatever else
  retention counts as a kept copy, the last good one stays.

So a generation that this process has not hashed is judged by listing alone for retention
(`verified`): present, its manifest naming it, every artifact in place with its listed size,
as its writer committed it after uploading and checking each size, and as that writer then
read it back. Hashing all of them again at every restart would download every kept
generation. It is hashed when a restore loads it (a restore reads nothing it did not hash) and
by ``unbroken verify``, which re-hashes every byte. A generation this process did hash is
hashed again whenever its listed identities differ from those it had then, and one it has
reason to doubt (`_doubt`) before it counts again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .backends.objects import ObjectFS, is_checksum, version_of
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .verifying import GenerationInfo, Verifying

Identity = tuple[tuple[int, ...], ...]


def _tag(info: Mapping[str, Any]) -> str | None:
    """An object's version tag when it changes at every upload of other bytes (a checksum or
    a store generation; a time may not, within its resolution)."""
    tag = version_of(info)
    return tag if is_checksum(tag) or tag.startswith("generation=") else None


class _Known(Verifying):
    """(A mixin of `ObjectStore`, listed before `GenerationStore` among its bases: it needs
    the store's ``fs`` and ``_prefix``.)"""

    fs: ObjectFS  # type: ignore[assignment]
    _manifests: dict[str, tuple[tuple[object, ...], Manifest]]
    _listed: dict[str, Identity]
    _prefix: Callable[[int], str]

    def _manifest(self, where: str, listed: Mapping[str, Any]) -> Manifest:
        """The manifest at ``where`` (``listed``: its listing entry), read and parsed only if
        this version of it was not parsed before (`CorruptCheckpoint` if it does not parse)."""
        tag = _tag(listed)
        seen = self._manifests.get(where)
        key = (listed.get("size"), tag)
        if tag is not None and seen is not None and seen[0] == key:
            return seen[1]
        manifest = parse_manifest(bytes(self.fs.read_file(where, MAX_MANIFEST_BYTES)), where)
        if tag is not None:
            self._manifests[where] = (key, manifest)
        return manifest

    def _forget(self, manifests: set[str], paths: set[str]) -> None:
        """Drop what is kept of generations a full listing no longer shows (``manifests``
        and ``paths``: those it shows), so that neither grows with the run's history."""
        for where in set(self._manifests) - manifests:
            del self._manifests[where]
        for path in set(self._listed) - paths:
            del self._listed[path]

    def _note_listing(self, info: GenerationInfo, objects: Mapping[str, Mapping[str, Any]]
                      ) -> Identity | None:
        """Record the identities of a complete generation's objects as ``objects`` (its
        prefix's listing, by key inside it) shows them; the identity, or None if one is
        missing."""
        assert info.manifest is not None
        folder = info.manifest.folder
        keys = [MANIFEST, *(f"{folder}/{a.name}" for a in info.manifest.artifacts)]
        if any(k not in objects for k in keys):
            self._listed.pop(info.path, None)
            return None
        ident = tuple((objects[k].get("size", -1), hash(version_of(objects[k]))) for k in keys)
        self._listed[info.path] = ident
        return ident

    def file_identity(self, info: GenerationInfo) -> Identity | None:
        """Size and version tag (ETag, generation or mtime) of the manifest and every
        artifact, as the latest listing of the generation showed them (every scan lists, and
        each caller of this scanned just before), or from a listing of its own when none did:
        a re-upload of any of them changes it."""
        known = self._listed.get(info.path)
        if known is not None:
            return known
        prefix = self._prefix(info.generation)
        objects = {url[len(prefix) + 1:]: entry for url, entry in self.fs.listing(prefix).items()}
        return self._note_listing(info, objects)

    def _doubt(self, path: str) -> None:
        """Have the generation at ``path`` hashed before it counts again (`verified`), whatever
        its listing says: it was restored from the local cache, not the store, or it was
        replaced by a save of its step that failed, and is being put back."""
        self._verified[path] = ()  # (no listing has this identity)

    def hash_needed(self, info: GenerationInfo) -> bool:
        """Whether `verified` would hash ``info`` (hashed before, changed since, or in doubt)."""
        if info.manifest is None:
            return False
        before = self._verified.get(info.path)
        return before is not None and before != self.file_identity(info)

    def verified(self, info: GenerationInfo) -> str | None:
        """``None`` when the generation counts as good, else the reason: hashed again when
        this process hashed it before and its objects changed since, or when it is in doubt
        (`_doubt`); when this process never hashed it, judged by its listing (see the module
        doc: what that relies on)."""
        if not info.ok or info.manifest is None:
            return info.reason or f"{info.path}: {info.status}"
        before = self._verified.get(info.path)
        if before is None or before == self.file_identity(info):
            return None
        return self.hashed_verdict(info)
