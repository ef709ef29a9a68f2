"""An optional local cache of artifacts read from an object store, by content hash.

``RUN`` on ``s3://`` restored on a machine with ``cache_dir="/local/ssd/cache"``: each
artifact downloaded for a restore is kept as ``<xxh3-128>-<size>`` in that folder, and the
next restore of a generation that lists the same content reads it from there. A cached file is
trusted only after it hashes to what the manifest lists (a damaged or stale one is read from
the store again); verification (``verify``, the read-back after a save) always reads the
store itself. The cache holds the artifacts of the generation restored last: older entries
are removed after each restore, so it never grows past one generation."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable
from typing import Any

from ..errors import CorruptCheckpoint
from .backends.local import LocalFS
from .manifest import Artifact

_TMP = ".tmp-"
# what `put` names an entry, or its temporary file
_ENTRY = re.compile(r"[0-9a-f]{32}-[0-9]+|\.tmp-[0-9a-f]{12}", re.ASCII)


class ReadCache:
    """Artifacts by content, in ``folder`` (created on first use)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.path.abspath(os.fspath(folder))
        self._fs = LocalFS()

    def _path(self, a: Artifact) -> str:
        return os.path.join(self.folder, f"{a.xxh3_128}-{a.size}")

    def get(self, a: Artifact) -> Any | None:
        """The cached bytes of ``a`` if present and hashing to its listed hash, else None."""
        try:
            data, digest = self._fs.read_hashed(self._path(a), a.size,
                                                aligned=a.name.endswith(".safetensors"))
        except (OSError, CorruptCheckpoint):
            return None
        if len(data) != a.size or digest != a.xxh3_128:
            return None
        return data

    def put(self, a: Artifact, data: Any) -> None:
        """Keep ``data`` (already verified against ``a``); best effort, never an error."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            tmp = os.path.join(self.folder, f"{_TMP}{uuid.uuid4().hex[:12]}")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(a))
        except OSError:
            pass

    def keep_only(self, artifacts: Iterable[Artifact]) -> None:
        """Remove every entry but those of ``artifacts`` (and leftovers of interrupted puts);
        files the cache did not write are never touched."""
        keep = {os.path.basename(self._path(a)) for a in artifacts}
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if name not in keep and _ENTRY.fullmatch(name):
                try:
                    os.unlink(os.path.join(self.folder, name))
                except OSError:
                    pass
