"""What the crash torture does between two lives, besides restarting: a newer generation rots
on disk (one byte of its tensor data flipped, the size unchanged, so only the content hash
can tell), or a script starts in the used run folder without calling ``restore()``.

A rotten generation is lost by the disk, not by unbroken: the next life must refuse it and
restore the previous verified generation; when it was the only one, the next life must refuse
the whole run (`CorruptCheckpoint`, "no generation verifies") without changing the folder, and
the torture then does what that error tells a person to do: it moves the run folder away and
starts the run over from step 0. A start without ``restore()`` must get `RunNotRestored` at its
first save, with nothing in the folder written or deleted."""

from __future__ import annotations

import os
import random
import stat
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ..store.generations import STAGING_PREFIX, TRASH_PREFIX, GenerationStore, generation_name
from ..store.lock import LOCK
from ._disk import DiskState, inspect_run, lost_generations
from ._job import KEEP_LAST
from ._life import Script, read_events, run_life, tail

if TYPE_CHECKING:
    from .crash import Figures

EVENTS = ("rot", "no-restore")
# One event every few kills, in a fixed rotation from a seeded start; an event that cannot
# happen yet (nothing committed, an empty folder) waits for the next kill.
_ROTATION: tuple[str | None, ...] = ("rot", None, "no-restore", None, None)


@dataclass
class Episode:
    """One training run of the torture, restarted after every kill until it completes."""

    number: int
    folder: str  # the episode's folder (logs, errors)
    run: str  # the run folder
    every: int
    restarts: int = 0  # times the run was refused whole and started over in a new folder
    specials: int = 0  # lives of events, numbering their logs
    reported: set[int] = field(default_factory=set)  # generations reported committed
    rotted: set[int] = field(default_factory=set)  # every generation a rot event hit
    rotten: set[int] = field(default_factory=set)  # rotted and not committed again since
    settled: set[int] = field(default_factory=set)  # gone (by retention) before a rot came
    refused: set[int] = field(default_factory=set)  # generations a restore rejected

    @property
    def key(self) -> str:
        """Identifies the run folder: a restart starts a new one at the same path."""
        return f"{self.number}.{self.restarts}"

    def committed(self, step: int) -> None:
        self.reported.add(step)
        self.rotten.discard(step)
        self.settled.discard(step)

    def must_keep(self) -> set[int]:
        """Reported generations the disk must still account for: not rotted since their
        commit, and not already (rightly) deleted by retention when a rot came. A rot takes a
        generation that retention counted as kept; older ones deleted before it are not
        missing because of unbroken."""
        return self.reported - self.rotten - self.settled

    def start_over(self) -> None:
        self.restarts += 1
        for s in (self.reported, self.rotted, self.rotten, self.settled, self.refused):
            s.clear()


def folder_snapshot(run: str) -> dict[str, str]:
    """Every entry of the run folder (links not followed) with its mode, inode, size, mtime
    and content hash; the lock file and dead writers' debris (which any writer's lock removes)
    are left out."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(run):
        if dirpath == run:
            dirnames[:] = [n for n in dirnames if not n.startswith((STAGING_PREFIX,
                                                                    TRASH_PREFIX))]
            filenames = [n for n in filenames
                         if n != LOCK and not n.startswith((STAGING_PREFIX, TRASH_PREFIX))]
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, run)] = f"{oct(st.st_mode)} {st.st_ino}"
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = xxhash.xxh3_64(f.read()).hexdigest()
                out[os.path.relpath(p, run)] += f" {st.st_size} {st.st_mtime_ns} {digest}"
    return out


def flip_tensor_byte(folder: str, rng: random.Random) -> str:
    """Flip bits of one byte inside the tensor data of one of the generation's safetensors
    files, in place: the size stays, the headers still parse; only the hash catches it."""
    spans = []
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            start = 8 + struct.unpack("<Q", f.read(8))[0]
        size = os.path.getsize(path)
        if size > start:
            spans.append((name, start, size))
    name, lo, hi = rng.choice(spans)
    pos, mask = rng.randrange(lo, hi), rng.randrange(1, 256)
    with open(os.path.join(folder, name), "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ mask]))
    return f"{name} byte {pos} ^ {mask:#04x}"


class Events:
    """The between-lives events of `crash.Torture` (a mixin: it shares the figures)."""

    f: Figures
    events: tuple[str, ...]
    erng: random.Random
    _event_no: int
    _event_pending: str | None
    _pending_bad: dict[tuple[str, str, int], None]
    _aside_seen: set[tuple[str, str]]
    _seen_bad: set[tuple[str, str, int]]
    job: Script  # a life of training (`_job.train`, with the torture's async mode)
    no_restore_job: Script  # a start without restore() (`_job.start_without_restore`)

    def fail(self, message: str) -> None:
        raise NotImplementedError

    def settle(self, status: str) -> None:
        """A torn, corrupt or rotten generation was not loaded: count the refusal."""
        if status == "torn":
            self.f.torn_refused += 1
        elif status == "rot":
            self.f.rots_refused += 1
        else:
            self.f.corrupt_refused += 1

    def check_kept(self, state: DiskState, ep: Episode, where: str) -> None:
        must = ep.must_keep()
        lost = lost_generations(must, state.complete, KEEP_LAST)
        if lost:
            self.f.generations_lost += len(lost)
            self.fail(f"{where}: generations {lost} were reported committed and retention "
                      f"had to keep them, but the disk holds only {state.complete}")
        if not state.complete and must:
            self.fail(f"{where}: no verified generation after commits of {sorted(must)}")

    def check_aside(self, state: DiskState, ep: Episode, where: str) -> None:
        """Every entry of aside/ must be explained: a rotten generation (moved by restore or
        by retention, labelled "corrupt"), or one that a restore refused."""
        for name, g, reason in state.aside_entries:
            if (ep.key, name) in self._aside_seen:
                continue
            self._aside_seen.add((ep.key, name))
            if (g in ep.rotted and reason == "corrupt" or g in ep.refused
                    or (ep.key, reason, g) in self._seen_bad):
                self.f.aside_explained += 1
            else:
                self.f.aside_unexplained += 1
                self.fail(f"{where}: aside/{name} is not explained by a rot or by a refusal "
                          "of restore")

    def between_lives(self, ep: Episode, state: DiskState, expected: int,
                      where: str) -> tuple[int, str]:
        """Maybe run the next event of the rotation; returns the step the next life must
        restore and what happened."""
        if self._event_pending is None:
            kind = _ROTATION[self._event_no % len(_ROTATION)]
            self._event_no += 1
            if kind is None or kind not in self.events:
                return expected, ""
            self._event_pending = kind
        if self._event_pending == "rot":
            if not state.complete:
                return expected, ""  # nothing committed yet
            self._event_pending = None
            return self._rot(ep, state, where)
        if not GenerationStore(ep.run).scan():
            return expected, ""  # an empty folder: a first save there is a new run
        self._event_pending = None
        return expected, self._no_restore(ep, where)

    def _special_life(self, ep: Episode, start_only: bool) -> tuple[int, list[dict[str, Any]], str]:
        ep.specials += 1
        log = os.path.join(ep.folder, f"event-{ep.specials:03d}.jsonl")
        err = os.path.join(ep.folder, f"event-{ep.specials:03d}.err")
        self.f.lives += 1
        life = run_life(ep.run, log, err, {}, ep.every, None,
                        self.no_restore_job if start_only else self.job)
        events, _ = read_events(log, 0)
        return life.code, events, tail(err, 4000)

    def _rot(self, ep: Episode, state: DiskState, where: str) -> tuple[int, str]:
        g = max(state.complete)
        how = flip_tensor_byte(os.path.join(ep.run, generation_name(g)), self.erng)
        self.f.rots += 1
        ep.settled |= {r for r in ep.reported if r not in state.complete}
        ep.rotted.add(g)
        ep.rotten.add(g)
        self._pending_bad[(ep.key, "rot", g)] = None
        desc = f"rot {generation_name(g)}/{how}"
        older = [c for c in state.complete if c != g]
        if older:
            return max(older), desc
        self._refused_run(ep, g, f"{where}, then {desc}")
        return 0, desc + "; the only verified one: run refused, moved away, started over"

    def _refused_run(self, ep: Episode, g: int, where: str) -> None:
        """The only verified generation rotted: the next life must refuse the run, name the
        generation and leave the folder as it was; then the run starts over elsewhere."""
        self.f.rots_only_generation += 1
        before = folder_snapshot(ep.run)
        code, events, err = self._special_life(ep, start_only=False)
        restored = [e for e in events if e["e"] == "restored"]
        if restored and restored[0]["step"] == g:
            self.f.torn_or_corrupt_loaded += 1
        if (code != 1 or restored or "CorruptCheckpoint" not in err
                or "no generation verifies" not in err or generation_name(g) not in err):
            self.fail(f"{where}: the next life must refuse the run (CorruptCheckpoint: no "
                      f"generation verifies, naming {generation_name(g)}); it exited {code}, "
                      f"restored {[e['step'] for e in restored]}: {err[-800:]}")
            return
        after = folder_snapshot(ep.run)
        if after != before:
            changed = sorted(set(before.items()) ^ set(after.items()))
            self.fail(f"{where}: the life that refused the run changed its folder: {changed[:4]}")
        for key in [k for k in self._pending_bad if k[0] == ep.key]:
            del self._pending_bad[key]  # nothing was loaded
            self.settle(key[1])
        # What the error tells a person to do: move the folder away, start a new run.
        os.rename(ep.run, f"{ep.run}-refused-{ep.restarts + 1}")
        ep.start_over()

    def _no_restore(self, ep: Episode, where: str) -> str:
        self.f.no_restore_starts += 1
        where = f"{where}, then a start without restore()"
        before = folder_snapshot(ep.run)
        code, events, err = self._special_life(ep, start_only=True)
        refused = [e for e in events if e["e"] == "refused"]
        after = folder_snapshot(ep.run)
        if after != before:
            self.f.no_restore_changed += 1
            changed = sorted(set(before.items()) ^ set(after.items()))
            self.fail(f"{where}: the run folder changed: {changed[:4]}")
        if code != 0 or not refused or refused[0]["error"] != "RunNotRestored":
            self.fail(f"{where}: expected RunNotRestored at the first save; exit {code}, "
                      f"events {[e['e'] for e in events]}: {err[-800:]}")
            return "no-restore: NOT refused"
        if os.path.abspath(ep.run) not in refused[0]["message"]:
            self.fail(f"{where}: RunNotRestored does not name the run folder: "
                      f"{refused[0]['message'][:300]}")
        state = inspect_run(ep.run)
        self.check_kept(state, ep, where)
        self.check_aside(state, ep, where)
        self.f.no_restore_refused += 1
        return f"no-restore: RunNotRestored at step {refused[0]['step']}"
