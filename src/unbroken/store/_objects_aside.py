"""Deleting a generation of an `ObjectStore`, moving it aside and putting it back, and listing
``aside/``: the operations that remove or copy a generation's objects, kept apart from
`objects` (listing, checking and committing) so that each module stays short. A mixin: it
needs the store's ``root``, ``fs``, ``_verified``, ``_uploading``, ``_need_lock``,
``_prefix`` and ``_doubt``."""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Callable
from typing import Any

from .aside import ASIDE, ASIDE_NAME, ASIDE_REASONS, AsideEntry
from .backends.killpoints import fault_point
from .backends.objects import ObjectFS
from .generations import GenerationInfo
from .manifest import MANIFEST, MAX_MANIFEST_BYTES


class _AsideOps:
    """The deleting and ``aside/`` operations of `ObjectStore` (which lists it before
    `GenerationStore` among its bases, so that these override the local store's)."""

    root: str
    fs: ObjectFS
    _verified: dict[str, Any]
    _uploading: str | None
    _need_lock: Callable[[], None]
    _prefix: Callable[[int], str]
    _doubt: Callable[[str], None]

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
        """Copy a generation's objects under ``aside/`` (`copy_aside`), then delete it
        (manifest first): kept for inspection, never loaded. One that superseded a generation
        of the same step (``info.superseded``: its read-back failed) is not deleted but
        replaced by that one (`_swap_back`), so that the step never goes without one."""
        dest = self.copy_aside(info, why)
        if info.superseded is not None:
            self._swap_back(info, info.superseded)
        else:
            self.delete(info)
        return dest

    def _swap_back(self, info: GenerationInfo, moved: str) -> None:
        """Put the generation ``info`` superseded back from ``moved`` under ``aside/`` as
        `ObjectStore.publish` superseded it, in reverse: its objects copied back beside
        ``info``'s, then the manifest replaced by its own in one conditional PUT, then
        ``info``'s objects deleted. A kill at any point leaves one of the two committed."""
        prefix = self._prefix(info.generation)
        where = f"{prefix}/{MANIFEST}"
        own = self._own(info)
        was = self.fs.ident(where)
        manifest = bytes(self.fs.read_file(f"{moved}/{MANIFEST}", MAX_MANIFEST_BYTES))
        for url in sorted(self.fs.listing(moved)):
            if url != f"{moved}/{MANIFEST}":
                self.fs.copy(url, prefix + url[len(moved):])
        self.fs.replace_file(where, manifest, was)
        self.drop_replaced(info, own)

    def copy_aside(self, info: GenerationInfo, why: str) -> str:
        """Copy a generation's objects under ``aside/``, labelled with the reason and the
        time, its manifest last (an entry without one is a copy that was interrupted); the
        generation itself is left as it is. Returns the entry's path."""
        self._need_lock()
        if why not in ASIDE_REASONS:
            raise ValueError(f"why={why!r}: one of {ASIDE_REASONS}")
        prefix = self._prefix(info.generation)
        moved = datetime.datetime.now().strftime("%Y%m%dT%H%M%S%f")
        dest = (f"{self.root}/{ASIDE}/gen-{info.generation:09d}-{why}-{moved}-"
                f"{uuid.uuid4().hex[:8]}")
        for url in sorted(self._own(info), key=lambda u: u == f"{prefix}/{MANIFEST}"):
            self.fs.copy(url, dest + url[len(prefix):])
        return dest

    def drop_replaced(self, info: GenerationInfo, own: list[str]) -> None:
        """Delete ``own``, the objects of generation ``info`` (`_own`, listed before), once a
        save of the same step replaced its manifest (`ObjectStore.publish`): no manifest
        names them now. Best effort: what stays is debris, never read, and the next writer
        removes it."""
        self._doubt(info.path)  # (should it come back: `_swap_back`)
        manifest = f"{self._prefix(info.generation)}/{MANIFEST}"  # now the new save's
        for url in own:
            if url != manifest:
                try:
                    self.fs.unlink(url)
                except OSError:
                    pass

    def put_back(self, moved: str, generation: int) -> None:
        """Copy generation ``generation``'s objects back from ``moved`` under ``aside/``
        (where a save of the same step put them, `move_aside`), the manifest last: that save
        failed its read-back, and this was the step's last verified state."""
        self._need_lock()
        prefix = self._prefix(generation)
        with contextlib.suppress(FileNotFoundError):
            there = self.fs.read_file(f"{prefix}/{MANIFEST}", MAX_MANIFEST_BYTES)
            if there == self.fs.read_file(f"{moved}/{MANIFEST}", MAX_MANIFEST_BYTES):
                return  # back already: `move_aside` swapped it back for its failed successor
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
