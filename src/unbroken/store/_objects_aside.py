"""Deleting a generation of an `ObjectStore`, moving it aside and putting it back, and listing
``aside/``: the operations that remove or copy a generation's objects, kept apart from
`objects` (listing, checking and committing) so that each module stays short. A mixin: it
needs the store's ``root``, ``fs``, ``_verified``, ``_uploading``, ``_need_lock`` and
``_prefix``."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable
from typing import Any

from .aside import ASIDE, ASIDE_NAME, ASIDE_REASONS, AsideEntry
from .backends.killpoints import fault_point
from .backends.objects import ObjectFS
from .generations import GenerationInfo
from .manifest import MANIFEST


class _AsideOps:
    """The deleting and ``aside/`` operations of `ObjectStore` (which lists it before
    `GenerationStore` among its bases, so that these override the local store's)."""

    root: str
    fs: ObjectFS
    _verified: dict[str, Any]
    _uploading: str | None
    _need_lock: Callable[[], None]
    _prefix: Callable[[int], str]

    def delete(self, info: GenerationInfo) -> None:
        """Delete a generation: its manifest first (a half-deleted generation never
        verifies), then its own objects (`_own`): never an upload in progress beside it."""
        self._need_lock()
        prefix = self._prefix(info.generation)
        own = self._own(info)
        try:
            self.fs.unlink(f"{prefix}/{MANIFEST}")
        except FileNotFoundError:
            pass
        fault_point("retention-unlinked", info.generation)
        self._verified.pop(info.path, None)
        for url in own:
            if not url.endswith("/" + MANIFEST):
                try:
                    self.fs.unlink(url)
                except FileNotFoundError:
                    pass

    def _own(self, info: GenerationInfo) -> list[str]:
        """The objects of the generation ``info`` describes: its manifest and its upload
        folder; for one whose manifest cannot be read, everything under its prefix but the
        upload of the save now being written (a save of the same step supersedes it)."""
        prefix = self._prefix(info.generation)
        listed = sorted(self.fs.listing(prefix))
        if info.manifest is not None:
            mine = f"{prefix}/{info.manifest.folder}/"
            return [u for u in listed if u.startswith(mine) or u == f"{prefix}/{MANIFEST}"]
        busy = f"{self._uploading}/" if self._uploading else None
        return [u for u in listed if busy is None or not u.startswith(busy)]

    def _remove(self, path: str) -> None:
        self.fs.rmtree(path)

    # -- aside/ ----------------------------------------------------------------------------------

    def move_aside(self, info: GenerationInfo, why: str) -> str:
        """Copy a generation's objects under ``aside/`` (labelled with the reason and the
        time), then delete it (manifest first): kept for inspection, never loaded."""
        self._need_lock()
        if why not in ASIDE_REASONS:
            raise ValueError(f"why={why!r}: one of {ASIDE_REASONS}")
        prefix = self._prefix(info.generation)
        moved = datetime.datetime.now().strftime("%Y%m%dT%H%M%S%f")
        dest = (f"{self.root}/{ASIDE}/gen-{info.generation:09d}-{why}-{moved}-"
                f"{uuid.uuid4().hex[:8]}")
        for url in self._own(info):
            self.fs.copy(url, dest + url[len(prefix):])
        self.delete(info)
        return dest

    def put_back(self, moved: str, generation: int) -> None:
        """Copy generation ``generation``'s objects back from ``moved`` under ``aside/``
        (where a save of the same step put them, `move_aside`), the manifest last: that save
        failed its read-back, and this was the step's last verified state."""
        self._need_lock()
        prefix = self._prefix(generation)
        urls = sorted(self.fs.listing(moved), key=lambda u: u == f"{moved}/{MANIFEST}")
        for url in urls:
            self.fs.copy(url, prefix + url[len(moved):])

    def aside(self) -> list[AsideEntry]:
        folder = f"{self.root}/{ASIDE}"
        names = {url[len(folder) + 1:].partition("/")[0] for url in self.fs.listing(folder)}
        out = []
        for name in names:
            m = ASIDE_NAME.fullmatch(name)
            out.append(AsideEntry(name, f"{folder}/{name}", m.group(2) if m else "unknown",
                                  m and m.group(3) or ""))
        return sorted(out, key=lambda e: (e.moved, e.name))
