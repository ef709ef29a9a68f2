"""What a killed run left on disk (verified, torn and corrupt generations, debris), which
committed generations it lost, and where in the protocol a kill landed."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..errors import CorruptCheckpoint
from ..store.aside import ASIDE
from ..store.generations import STAGING_PREFIX, TRASH_PREFIX, GenerationStore


@dataclass
class DiskState:
    complete: list[int]
    torn: list[int]
    corrupt: list[int]  # includes "complete" generations that failed hash verification
    staging: int
    trash: int
    aside: int
    aside_entries: list[tuple[str, int, str]] = field(default_factory=list)  # name, gen, reason


_ASIDE_ENTRY = re.compile(r"gen-([0-9]{9,})-([a-z]+)-")


def inspect_run(run: str) -> DiskState:
    store = GenerationStore(run)
    complete, torn, corrupt = [], [], []
    for info in store.scan():
        if info.ok:
            try:
                store.verify(info)
                complete.append(info.generation)
            except CorruptCheckpoint:
                corrupt.append(info.generation)
        elif info.status == "torn":
            torn.append(info.generation)
        else:
            corrupt.append(info.generation)
    names = os.listdir(run) if os.path.isdir(run) else []
    aside = os.path.join(run, ASIDE)
    entries = []
    for name in sorted(os.listdir(aside)) if os.path.isdir(aside) else []:
        m = _ASIDE_ENTRY.match(name)
        entries.append((name, int(m.group(1)), m.group(2)) if m else (name, -1, "unknown"))
    return DiskState(complete, torn, corrupt,
                     sum(n.startswith(STAGING_PREFIX) for n in names),
                     sum(n.startswith(TRASH_PREFIX) for n in names),
                     len(entries), entries)


def lost_generations(reported: set[int], complete: list[int], keep_last: int) -> list[int]:
    """Reported-committed generations missing from disk although retention had to keep them:
    a generation may only be gone once ``keep_last`` newer complete generations exist."""
    return sorted(g for g in reported
                  if g not in complete and sum(c > g for c in complete) < keep_last)


def phase_of_note(line: str, run: str) -> str:
    """Where an I/O-numbered kill landed, from the note the child wrote before dying."""
    parts = line.split(" ", 2)
    if len(parts) < 3:
        return "unknown"
    kind, path = parts[1], parts[2]
    rel = os.path.relpath(path, run)
    first = rel.split(os.sep)[0]
    if first.startswith(STAGING_PREFIX):
        if kind == "mkdir":
            return "save: create staging"
        if kind in ("create", "write", "fsync"):
            return ("save: write manifest" if rel.endswith("MANIFEST.json")
                    else "save: write artifacts")
        if kind == "fsync_dir":
            return "commit: fsync staging"
        if kind == "rename":
            return "commit: rename into place"
        return "cleanup: remove staging debris"
    if first.startswith(TRASH_PREFIX):
        return "retention: remove files"
    if first.startswith("gen-"):
        if kind == "rename":
            return "retention: rename to trash / move aside"
        return "retention: unlink manifest"
    if first == ASIDE:
        return "restore: move aside"
    if kind == "fsync_dir":
        return "commit/retention: fsync run folder"
    return f"other: {kind}"


def phase_of_state(state: DiskState) -> str:
    if state.staging:
        return "timer: inside a save (staging left)"
    if state.trash or state.torn:
        return "timer: inside retention (trash or torn left)"
    return "timer: between I/O (training, restore, checks)"


POINT_PHASE = {"artifact": "save: write artifacts", "manifest-written": "save: write manifest",
               "before-rename": "commit: rename into place",
               "after-rename": "commit: after rename, before read-back",
               "retention-unlinked": "retention: unlink manifest",
               "step-done": "training: after an update"}
