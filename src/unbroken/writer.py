"""The writer side of a run folder, for one Checkpointer: the single-writer lock (taken late
when the folder could not be written at first), refused and abandoned generations moved
aside (or left in place and retried), the first-save rule, and retention decided on verified
generations."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .dist.group import Group
from .errors import (
    CorruptCheckpoint,
    ReadOnlyRun,
    RunNotRestored,
    RunUnreadable,
    SaveFailed,
    UnbrokenWarning,
)
from .store.generations import GenerationInfo, GenerationStore
from .store.retention import Keep, select_kept
from .store.runrecord import RunRecord, folder_run, new_run_id, read_run_record, write_run_record
from .store.verifying import UNREADABLE


class RunWriter:
    """Changes to ``store`` on behalf of a Checkpointer (see module doc)."""

    def __init__(self, store: GenerationStore, keep: Keep, leader: bool = True,
                 take_lock: bool = True) -> None:
        self.store = store
        self.keep = keep
        # In a job of many ranks only the leader (rank 0) writes: it holds the lock, moves
        # generations aside and deletes; the other ranks only write their own files into the
        # staging folder it creates (dist.commit).
        self.leader = leader
        # Why this writer cannot write (None: it holds the lock). Restoring needs no lock, so
        # read-only media still restore; a save raises this.
        self.read_only: ReadOnlyRun | None = None
        self._pending: list[tuple[GenerationInfo, str]] = []  # to move aside once writing
        self._credit = 0  # bytes of milestones retention may hash now (`_check_milestones`)
        if not leader or not take_lock:  # a persisting process writes under its writer's lock
            return
        try:
            store.lock()
        except ReadOnlyRun as e:
            self.read_only = e
            warnings.warn(f"opened read-only: {e}", UnbrokenWarning, stacklevel=3)

    def agreed_run(self, group: Group) -> tuple[RunRecord, bool, str | None]:
        """The run the folder holds, whether RUN.json says so as it stands, and why a
        continuation cannot tell (None: it can). In a job, as the leader read it: every rank
        names the same run."""
        decided: dict[str, Any] | None = None
        if group.leader:
            found = folder_run(self.store.root, self.store.fs,
                               (g.manifest.run_id for g in self.store.scan()
                                if g.ok and g.manifest is not None))
            if found.problem is not None and found.ambiguous is None:
                warnings.warn(f"{found.problem}; the run is taken from the run that wrote most "
                              "of the generations, and the record is rewritten at the next "
                              "save", UnbrokenWarning, stacklevel=4)
            record = found.record or RunRecord(new_run_id())
            decided = {"run_id": record.run_id, "lineage": record.lineage,
                       "created": record.created, "on_disk": found.on_disk,
                       "ambiguous": found.ambiguous}
        decided = group.broadcast(decided, "agreeing on the run")
        assert decided is not None
        return (RunRecord(decided["run_id"], decided["lineage"], decided["created"]),
                decided["on_disk"], decided["ambiguous"])

    def become_writer(self) -> None:
        """Take the lock if the folder opened read-only (the disk may have been freed since),
        then do what had to wait for a writer; else `ReadOnlyRun`."""
        if not self.leader:
            return
        if not self.store.locked:
            try:
                self.store.lock()
            except ReadOnlyRun as e:
                self.read_only = e
                raise ReadOnlyRun(f"cannot save: {e}") from None
            self.read_only = None
        pending, self._pending = self._pending, []
        for info, why in pending:
            self.set_aside(info, why)

    def prepare(self, step: int, again: bool, first_save: bool, run: RunRecord,
                run_written: bool, restore_tried: bool = False) -> None:
        """Before a save: become the writer, apply the first-save rule, clear a leftover out
        of the way (unless ``again``: the same step superseded), and record the run before
        its first generation. ``restore_tried``: restore() was called, and raised."""
        self.become_writer()
        if first_save:
            self.check_first_save(restore_tried)
        if not again:
            self.clear_the_way(step)
        if not run_written:
            write_run_record(self.store.root, self.store.fs, run)

    def check_first_save(self, restore_tried: bool = False) -> None:
        """The first save of a Checkpointer that never restored must start a new run: into a
        folder that holds generations it would branch from, or be pruned against, a history
        it never loaded."""
        found = self.store.scan()
        if not found:
            return
        good = [g.manifest for g in found if g.ok and g.manifest is not None]
        newest = (f"the newest complete one is step {good[-1].step} of run {good[-1].run_id}"
                  if good else "none of them is complete")
        if restore_tried:
            raise RunNotRestored(
                f"{self.store.root}: holds {len(found)} generation(s) and this Checkpointer's "
                "restore() raised, so it continues none of them (and where that error said so, "
                f"the live objects hold bytes of a corrupt one); {newest}. Deal with what "
                "restore() said (its error names the files) and call it again, or point this "
                "run at another (empty) folder")
        raise RunNotRestored(
            f"{self.store.root}: holds {len(found)} generation(s) and this Checkpointer did not "
            f"call restore(); {newest}. Call ckpt.restore() before training to continue that "
            "run, or point this run at another (empty) folder")

    def clear_the_way(self, step: int) -> None:
        """A folder named like the generation about to be written can only be a leftover that
        restore could not move aside (abandoned or corrupt): move it now, never overwrite."""
        existing = self.store.scan_one(step)
        if not self.store.present(existing):
            return
        why = "abandoned" if existing.ok else existing.status
        try:
            self.store.move_aside(existing, why)
        except (OSError, CorruptCheckpoint) as e:
            raise SaveFailed(f"{existing.path}: a leftover generation ({why}) is in the way of "
                             f"generation {step} and could not be moved aside ({e}); move it "
                             "out of the run folder by hand") from e

    def set_aside(self, info: GenerationInfo, why: str) -> None:
        """Move a refused or abandoned generation aside (never deleting anything); if that
        fails (a read-only folder, an I/O error) leave it where it is and say so: restore never
        depends on it."""
        if not self.leader:
            return
        if not self.store.locked:
            self._pending.append((info, why))  # a writer moves it (become_writer)
            return
        if not self.store.present(info):
            return
        try:
            self.store.move_aside(info, why)
        except (OSError, CorruptCheckpoint) as e:
            self._pending.append((info, why))  # tried again at the next save
            warnings.warn(f"{info.path}: {why}; could not be moved aside ({e}), left in place "
                          "(restore refuses it; moving it is retried at the next save)",
                          UnbrokenWarning, stacklevel=4)

    def apply_retention(self, just_saved: int) -> None:
        """Delete what the policy does not keep, deciding on verified generations only: the
        one just saved and the newest that verifies are never deleted, and a generation that
        fails verification is reported and moved aside, never counted as a kept copy."""
        if not self.leader:
            return
        gens = self.store.scan()
        complete = {g.generation: g for g in gens if g.ok and g.manifest is not None}
        failed = {g.generation: g.reason for g in gens if g.status == "corrupt"}
        # What this machine may not read is neither judged nor counted as kept: left alone
        unreadable = {g.generation: g.reason for g in gens if g.status == UNREADABLE}
        # A generation of another run (copied in) verifies, but no restore of this run loads
        # it: it is never counted as a kept copy, nor deleted (maybe that run's only copy).
        just = complete.get(just_saved)
        foreign = {n: g for n, g in complete.items() if not self._ours(g, just)}
        for n in foreign:
            del complete[n]

        checked: set[int] = set()

        def good(n: int) -> bool:
            checked.add(n)
            try:
                why = self.store.verified(complete[n])
            except RunUnreadable as e:
                unreadable[n] = str(e)
                return False
            if why is not None:
                failed[n] = why
            return why is None

        kept = select_kept([(n, g.manifest.step, g.manifest.metrics)  # type: ignore[union-attr]
                            for n, g in complete.items()], self.keep, {just_saved}, good)
        self._check_milestones(complete, kept - checked - {just_saved}, just, good)
        kept -= failed.keys() | unreadable.keys()
        for why in unreadable.values():
            warnings.warn(f"retention left in place a generation it may not read (not counted "
                          f"as a kept copy): {why}", UnbrokenWarning, stacklevel=5)
        by_number = {g.generation: g for g in gens}
        for n, why in failed.items():
            warnings.warn(f"retention found a corrupt generation, moved aside: {why}",
                          UnbrokenWarning, stacklevel=5)
            self.set_aside(by_number[n], "corrupt")
        for n, g in foreign.items():
            warnings.warn(f"retention found {g.path}, a generation of another run, moved "
                          "aside as foreign (never deleted)", UnbrokenWarning, stacklevel=5)
            self.set_aside(g, "foreign")
        for g in gens:
            # (what is neither kept, failed nor foreign: complete generations the policy lets
            # go, and torn remains of an interrupted deletion, a manifest deleted first:
            # nothing but this writer deletes or commits here while it holds the lock)
            if g.generation not in kept and g.generation not in failed and (
                    g.generation not in foreign) and g.generation not in unreadable:
                self.store.delete(g)
        # Only now, with a new generation committed and verified, may aside/ shrink: what a
        # restore moved there (an abandoned branch) stays until the run has moved on.
        self.store.prune_aside(self.keep.aside)

    def _check_milestones(self, complete: dict[int, GenerationInfo], unchecked: set[int],
                          just: GenerationInfo | None, good: Callable[[int], bool]) -> None:
        """Verify the kept generations the policy keeps whatever they hold (``every``
        milestones), so that one that rotted is reported and moved aside, not kept as a copy
        that cannot be restored. A verdict this store holds for their files as they are
        costs a few ``lstat`` calls; hashing is spread over saves, newest first: each save
        adds its own bytes (``just``, in a job its bytes per rank: the leader hashes alone) to
        what may be hashed, so the first save after a restart does not re-read a hundred of
        them, nor the leader of a job its whole share of each."""
        sizes = {n: sum(a.size for a in info.manifest.artifacts) for n in unchecked
                 if (info := complete.get(n)) is not None and info.manifest is not None}
        if just is not None and just.manifest is not None:
            size = sum(a.size for a in just.manifest.artifacts)
            share = size // max(1, just.manifest.world_size)
            # (capped: no burst of hashing after many saves with nothing to hash)
            self._credit = min(self._credit + share, max(2 * size, *sizes.values(), 0))
        for n in sorted(sizes, reverse=True):
            info = complete[n]
            if self.store.hash_needed(info):
                if sizes[n] > self._credit:
                    continue
                self._credit -= sizes[n]
            good(n)

    def _ours(self, info: GenerationInfo, just: GenerationInfo | None) -> bool:
        """Whether generation ``info`` belongs to the run of the generation just saved
        (``just``): that run, or one in its lineage as RUN.json records it."""
        assert info.manifest is not None
        run_id = info.manifest.run_id
        mine = just.manifest.run_id if just is not None and just.manifest is not None else None
        if mine is None or run_id == mine:
            return True
        try:
            record = read_run_record(self.store.root, self.store.fs)
        except CorruptCheckpoint:
            return False
        return record is not None and record.accepts(mine) and record.accepts(run_id)

    def retain(self, just_saved: int) -> None:
        """`apply_retention` after a save; an I/O error only warns (the save is committed)."""
        try:
            self.apply_retention(just_saved)
        except OSError as e:
            warnings.warn(f"{self.store.root}: retention could not delete an old generation "
                          f"({e}); generation {just_saved} is committed and verified, and "
                          "retention is retried after the next save", UnbrokenWarning,
                          stacklevel=3)

    def close(self) -> None:
        self.store.unlock()
