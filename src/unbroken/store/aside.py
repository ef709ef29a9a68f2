"""``RUN/aside/``: generations taken out of the listing, never loaded, kept for inspection:
refused (corrupt, torn, foreign), abandoned by a restore of an older one, or superseded by a
later save of the same step. Each is named ``gen-N-<reason>-<time>-<id>``. The folder is
bounded (`prune_aside`) only after a later save has committed, and foreign generations (maybe
another run's only copy) are never deleted."""

from __future__ import annotations

import datetime
import os
import re
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpoint
from .manifest import MANIFEST

if TYPE_CHECKING:
    from .generations import GenerationInfo

ASIDE = "aside"
# Why a generation was moved aside: the label in its name under aside/.
ASIDE_REASONS = ("corrupt", "torn", "foreign", "abandoned", "superseded")
# gen-N-<reason>-<YYYYmmddTHHMMSS>-<id> (versions before 0.2 wrote no time)
ASIDE_NAME = re.compile(r"(gen-[0-9]{9,})-([a-z]+)-(?:([0-9]{8}T[0-9]{12})-)?[0-9a-f]{8}",
                         re.ASCII)


@dataclass(frozen=True)
class AsideEntry:
    """One folder under ``aside/``: why it was moved there and when (``YYYYmmddTHHMMSSffffff``,
    local time)."""

    name: str
    path: str
    reason: str
    moved: str


class AsideFolder:
    """The ``aside/`` operations of a `GenerationStore` (a mixin: it needs the store's
    ``root``, ``fs``, ``_need_lock``, ``_remove`` and ``_verified``)."""

    root: str
    fs: Any
    _verified: dict[str, Any]

    def _need_lock(self) -> None:
        raise NotImplementedError

    def _remove(self, path: str) -> None:
        raise NotImplementedError

    def move_aside(self, info: GenerationInfo, why: str) -> str:
        """Move a generation to ``aside/`` under a unique name labelled with the reason (one of
        ``ASIDE_REASONS``) and the time; it is kept for inspection, never loaded. Nothing is
        deleted here: `prune_aside` bounds the folder, after a save succeeded."""
        self._need_lock()
        if why not in ASIDE_REASONS:
            raise ValueError(f"why={why!r}: one of {ASIDE_REASONS}")
        aside = os.path.join(self.root, ASIDE)
        if not os.path.lexists(aside):
            self.fs.mkdir(aside)
        elif not stat.S_ISDIR(os.lstat(aside).st_mode):
            raise CorruptCheckpoint(f"{aside}: not a folder (a symbolic link or file); "
                                    "generations are moved aside only inside the run folder")
        moved = datetime.datetime.now().strftime("%Y%m%dT%H%M%S%f")  # sorts oldest first
        dest = os.path.join(aside, f"gen-{info.generation:09d}-{why}-{moved}-"
                                   f"{uuid.uuid4().hex[:8]}")
        self.fs.rename(info.path, dest)
        self.fs.fsync_dir(self.root)
        self._verified.pop(info.path, None)
        return dest

    def put_back(self, moved: str, generation: int) -> None:
        """Move generation ``generation``, which a save of the same step moved aside to
        ``moved`` (`move_aside`), back into the listing: that save failed its read-back, and
        this was the step's last verified state. (Verified again before any use.)"""
        self._need_lock()
        final = os.path.join(self.root, f"gen-{generation:09d}")
        if os.path.lexists(final):
            raise CorruptCheckpoint(f"{final}: in the way of putting back {moved}")
        self.fs.rename(moved, final)
        self.fs.fsync_dir(self.root)

    def finish_superseding(self, staged: Mapping[int, list[str]]) -> list[int]:
        """Finish each save of the same step that was killed between moving the earlier save
        aside (superseded) and its own rename: that step has no generation in place, its
        superseded save is in ``aside/``, and the new one is complete in its staging folder
        (``staged``: each generation's staging folders), its manifest written. That one is
        renamed into place, as the rename would have done (and verified, as any generation,
        before it is used). The superseded state is not one the run continues from (it was
        replaced, as after an end-of-epoch scheduler step); without this, a run whose only
        generation it was started again from step 0. Returns the generations finished."""
        superseded = {m.group(1) for e in self.aside() if e.reason == "superseded"
                      for m in [ASIDE_NAME.fullmatch(e.name)] if m}
        done = []
        for number, folders in sorted(staged.items()):
            final = os.path.join(self.root, f"gen-{number:09d}")
            complete = [f for f in folders if os.path.isfile(os.path.join(f, MANIFEST))]
            if f"gen-{number:09d}" in superseded and complete and not os.path.lexists(final):
                self.fs.rename(max(complete, key=lambda f: os.stat(f).st_mtime_ns), final)
                self.fs.fsync_dir(self.root)
                done.append(number)
        return done

    def aside(self) -> list[AsideEntry]:
        """What ``aside/`` holds, oldest first (entries named by an older version sort first,
        with reason "unknown")."""
        folder = os.path.join(self.root, ASIDE)
        try:
            names = os.listdir(folder) if stat.S_ISDIR(os.lstat(folder).st_mode) else []
        except OSError:
            names = []
        out = []
        for name in names:
            m = ASIDE_NAME.fullmatch(name)
            out.append(AsideEntry(name, os.path.join(folder, name),
                                  m.group(2) if m else "unknown", m and m.group(3) or ""))
        return sorted(out, key=lambda e: (e.moved, e.name))

    def prune_aside(self, keep: int) -> None:
        """Delete the oldest entries of ``aside/`` beyond the newest ``keep``. Foreign
        generations (another run's, copied in) are never deleted: they may be the only copy of
        that run's state."""
        self._need_lock()
        entries = [e for e in self.aside() if e.reason != "foreign"]
        for e in entries[:max(0, len(entries) - keep)]:
            self._remove(e.path)
