"""The saving half of the Checkpointer: persisting a generation (in the training thread, in
a background thread from a snapshot, or in a persisting process from shared memory), waiting
for one in flight, what a committed generation changes for the next save, and closing (the
save in flight first, then what the Checkpointer holds)."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any, Self

from ._pacing import Pacer
from ._progress import Progress
from .boundary import Preemption, UpdateWatch
from .dist.commit import (
    SharedFileFailed,
    check_replicas,
    commit_job,
    read_back,
    save_failed,
    stage_job,
)
from .dist.filegroup import FileGroup, stage
from .dist.group import Group, saving
from .errors import SaveFailed, StoreLocked, UnbrokenWarning
from .persist.aftermath import settle_died_save
from .persist.background import InFlight, Worker
from .persist.process import ProcessPersister
from .restoring import gc_paused
from .saving import encode_share, replicated, saved_unchanged, stamps
from .state.environment import environment
from .state.identity import Identity
from .state.incremental import HeldFile, Plan, held_files
from .store.generations import GenerationInfo, GenerationStore, generation_name
from .store.manifest import TO_COMMIT, Artifact, Manifest
from .store.retention import Keep
from .store.runrecord import RunRecord
from .store.sources import Linked
from .trace import TraceRecorder
from .writer import RunWriter

log = logging.getLogger("unbroken")


class Persisting:
    """Persisting generations, and what it needs of the Checkpointer it is mixed into."""

    identity: Identity
    model: Any  # (a torch.nn.Module: this module imports no torch)
    store: GenerationStore
    keep: Keep
    fstype: str
    incarnation: int
    _group: Group
    _save_group: Group
    _writer: RunWriter
    _run: RunRecord
    _run_written: bool
    _restored: bool
    _restore_tried: bool
    _origin: dict[str, Any] | None
    _parent: dict[str, Any] | None
    _last_saved: int | None
    # A step whose save failed although its generation may be in place (its persisting
    # process died before it replied): saving that step again writes it anew, never a no-op
    _unconfirmed: int | None = None
    # The first-save rule passed (`RunWriter.check_first_save`): from then on this writer holds
    # the lock, and any generation in the folder is its own, even one whose save failed after
    # its commit without the writer knowing (a job's leader whose persisting process died)
    _first_checked: bool = False
    _held: dict[str, list[HeldFile]]
    _in_flight: InFlight | None
    _worker: Worker
    _layouts: dict[str, Any]
    _per_rank: frozenset[str]  # the parts each rank stores its own of (`state.parts.PerRank`)
    _persister: ProcessPersister | None
    _read_back_later: bool
    _persist_share: float | None
    _pid: int  # the process that made this Checkpointer: its lock's, its saves'
    _trace: TraceRecorder | None
    _watch: UpdateWatch
    _preemption: Preemption

    @property
    def run_id(self) -> str:
        raise NotImplementedError

    def _forked(self, what: str) -> None:
        """Refuse ``what`` (a save, a restore) in a process forked from the one that made this
        Checkpointer: the run's writer lock is that process's (a lock is not inherited across
        a fork), and so is its save in flight, whose thread the fork does not have (waiting
        for it hung the child)."""
        if os.getpid() != self._pid:
            raise StoreLocked(
                f"{self.store.root}: {what} in process {os.getpid()}, a fork of process "
                f"{self._pid}, which made this Checkpointer and holds the run's writer lock; "
                f"{what} from process {self._pid}, or make a Checkpointer in this process once "
                f"{self._pid}'s is closed")

    def wait(self) -> GenerationInfo | None:
        """Block until the async save in flight (if any) is committed and verified; return its
        generation (None: nothing in flight, or nothing changed since the last save). Raises
        the save's error. (In a forked process: None, the save in flight is its parent's.)"""
        in_flight = self._in_flight
        if in_flight is None or os.getpid() != self._pid:
            return None
        try:
            info: GenerationInfo | None = in_flight.wait()
        except BaseException as e:
            if in_flight.raised(e):  # the save's own error, reported once
                self._in_flight = None
            raise  # else interrupted (Ctrl-C, even as the save ended): still owned
        self._in_flight = None
        return info

    def _buffer_names(self) -> list[str]:
        """The model's buffers by name (asked once by a save whose model replicas differ)."""
        return [name for name, _ in self.model.named_buffers()]

    @gc_paused
    @saving
    def _persist(self, step: int, tree: dict[str, Any], values: dict[str, float], again: bool,
                 started: float, plan: Plan | None = None, snapshot: bool = False
                 ) -> GenerationInfo | None:
        """Write, commit, read back and verify generation ``step`` of ``tree``, then apply
        retention (an async save runs this in the background, on a snapshot: ``snapshot``,
        its tensors the snapshot's own buffers)."""
        # What runs in the training thread (a sync save) talks to the other ranks on the
        # job's own group, within its timeout (a rank that hangs fails the save then); what
        # runs beside the loop (an async save, a read-back later) on the save group.
        group = self._save_group if snapshot else self._group
        later = self._read_back_later and not snapshot  # (a sync save's read-back, beside)
        if group.active:  # (first: the ranks' steps agree before any other collective)
            check_replicas(group, step, replicated(tree, self._per_rank), self._buffer_names)
        if again and saved_unchanged(self.store, group, step, tree, values, plan,
                                           self._per_rank):
            return None  # the same state saved twice
        meta = stamps(step, self.incarnation, self.run_id)
        # (refuses what restore could not read)
        encoded = encode_share(group, tree, meta, plan, self._layouts, owned=snapshot,
                               per_rank=self._per_rank)
        total = sum(memoryview(c).nbytes for chunks in encoded.values()
                    if not isinstance(chunks, Linked) for c in chunks)
        progress = Progress(f"saving {generation_name(step)}", 2 * total)
        artifacts = {name: chunks if isinstance(chunks, Linked) else progress.wrap(chunks)
                     for name, chunks in encoded.items()}
        fields = self._manifest_fields(step, tree, values, group.size)

        def make_manifest(written: list[Artifact]) -> Manifest:
            return Manifest(artifacts=written, **fields,
                            timings={TO_COMMIT: round(time.monotonic() - started, 6)})

        try:
            if group.active:
                info = commit_job(group, self.store, step,
                                  lambda: self._prepare_write(step, again), artifacts,
                                  make_manifest, again)
            else:
                info = self.store.commit(step, artifacts, make_manifest, supersede=again)
        except OSError as e:
            progress.close()
            raise save_failed(self.store.root, step, e) from e
        except BaseException:
            progress.close()
            raise

        linked = [name for name, chunks in encoded.items() if isinstance(chunks, Linked)]

        @saving
        def verify_and_retain() -> GenerationInfo:
            try:
                read_back(self._save_group if later else group, self.store, info, progress,
                          linked)
            except SaveFailed as e:
                self._held = {}  # (what it linked may be what failed: the next save writes all)
                if getattr(e, "in_place", False):
                    # committed, left in place unverified (this machine could not read it
                    # back): this Checkpointer's own, which a save of the step supersedes
                    self._last_saved = self._unconfirmed = step
                raise
            self._committed(step, info, plan)
            self._writer.retain(step)
            if self._trace is not None:
                self._trace.saved(step)
            log.info("saved %s (%d bytes) in %.3f s", info.path,
                     info.manifest.total_bytes if info.manifest else 0,
                     time.monotonic() - started)
            return info

        if later:
            # committed and durable; the read-back and retention go on beside the loop, and
            # retention still waits for the read-back (the next save waits for both)
            # (not gc_paused: it re-hashes files, and the loop runs beside it for seconds)
            self._in_flight = InFlight(step, verify_and_retain, self._pacer(),
                                       worker=self._worker)
            return info
        try:
            return verify_and_retain()
        except SharedFileFailed as e:
            # The state saved is still at hand (the live one, or the snapshot's buffers): this
            # save is written again, every file anew, at once (the failed one went aside).
            warnings.warn(f"{e}; writing generation {step} again in full now", UnbrokenWarning,
                          stacklevel=2)
            return self._persist(step, tree, values, again, started,
                                 None if plan is None else Plan(step, {}, plan.frozen),
                                 snapshot)

    @saving
    def _hand_over(self, step: int, tree: dict[str, Any], values: dict[str, float],
                   again: bool, started: float, plan: Plan | None) -> None:
        """``async_save="process"``: the snapshot into shared memory, and the rest of the
        save to the persisting process (`persist.process`), which finishes it even if this
        process dies. In a job, the ranks check their replicas and the leader prepares and
        stages here, together; then each rank's persisting process writes its own files and
        they commit together (`dist.filegroup`)."""
        group, persister = self._group, self._persister
        assert persister is not None  # (made with the Checkpointer)
        if group.active:  # (first: the ranks' steps agree before any other collective)
            check_replicas(self._save_group, step, replicated(tree, self._per_rank),
                           self._buffer_names)
        if again and step != self._unconfirmed and saved_unchanged(
                self.store, group, step, tree, values, plan, self._per_rank):
            return  # the same state saved twice
        request: dict[str, Any] = {
            "step": step, "again": again, "keep": self.keep.to_json(),
            "share": self._persist_share,
            "manifest": self._manifest_fields(step, tree, values, group.size)}
        if group.active:

            def staged() -> str:
                self._prepare_write(step, again)
                return stage(self.store, step, again)

            request["job"] = {"staging": stage_job(self._save_group, staged),
                              "rank": group.rank, "size": group.size,
                              "timeout": persister.timeout}
            persister.announce(step, request["job"])

        def give_up(e: BaseException) -> None:
            """This rank's persisting process will post nothing more for this save: say so in
            its place, so the others' stop waiting for it now, not at the timeout."""
            if group.active:
                FileGroup(self.store.fs, request["job"]["staging"], step, group.rank,
                          group.size, persister.timeout).close(e)

        try:
            # (small tensors gathered straight into the shared memory: no copy at submit)
            encoded = encode_share(group, tree, stamps(step, self.incarnation, self.run_id),
                                   plan, self._layouts, persister.room(),
                                   per_rank=self._per_rank)
            persister.submit(request, encoded)
        except BaseException as e:
            give_up(e)
            raise
        log.info("snapshot of step %d (%d bytes, %d of them built in place) in %.3f s; "
                 "persisting in process", step, persister.nbytes, persister.built,
                 time.monotonic() - started)

        def collect() -> GenerationInfo:
            try:
                reply = persister.result()
            except BaseException as e:
                if persister.died or persister.committed or isinstance(e, SharedFileFailed):
                    # What it linked may be what failed (its read-back failed, or it is not
                    # known how far it got): the next save writes all, as `_persist` does. A
                    # save that failed before its commit (a write: ENOSPC) changed nothing the
                    # next save may link: it links those files, as the other modes do.
                    self._held = {}
                if not isinstance(e, SaveFailed):
                    raise
                if persister.died:  # (one that replied posted its own done)
                    give_up(e)
                    if not group.active:
                        raise self._settle(step, again, plan, e) from e
                raise
            for message in reply["warnings"]:
                warnings.warn(message, UnbrokenWarning, stacklevel=2)
            info = self.store.scan_one(step)
            self._committed(step, info, plan)
            self._unconfirmed = None
            if self._trace is not None:
                self._trace.saved(step)
            return info

        self._in_flight = InFlight(step, collect,
                                   hurry=persister.hurry if self._persist_share else None,
                                   worker=self._worker)

    def _settle(self, step: int, again: bool, plan: Plan | None,
                failed: SaveFailed) -> SaveFailed:
        """The persisting process died with the save of ``step`` before it replied: what it
        left is looked at here (`persist.aftermath`), so the next save is neither refused as
        a first save into a folder of foreign history (the generation is this Checkpointer's
        own) nor built on a generation that is torn or does not verify. The error to raise,
        saying what was found."""
        info, found = settle_died_save(self.store, self._writer, step, again)
        if info is not None:
            self._committed(step, info, plan)  # (verified here: the next save's parent)
        self._unconfirmed = step
        return SaveFailed(f"{failed}. Checked since by this process: {found}")

    def _pacer(self) -> Pacer | None:
        """The pacing of a save persisting in a thread of this process (``persist_share``)."""
        return None if self._persist_share is None else Pacer(self._persist_share)

    def _manifest_fields(self, step: int, tree: dict[str, Any], values: dict[str, float],
                         world_size: int) -> dict[str, Any]:
        """Every field of generation ``step``'s manifest but its artifacts."""
        return {"generation": step, "step": step, "run_id": self.run_id,
                "incarnation": self.incarnation, "parts": sorted(tree), "parent": self._parent,
                "origin": self._origin, "identity": self.identity.fingerprint(),
                "environment": {**environment(), "filesystem": self.fstype},
                "retention": self.keep.to_json(), "metrics": values,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": world_size}

    def _committed(self, step: int, info: GenerationInfo, plan: Plan | None) -> None:
        """After generation ``step`` committed and read back: the next save's parent, and
        (incremental saves) the files it may link."""
        if plan is not None and info.manifest is not None:
            self._held = held_files(plan.layout, info.path, {
                a.name: (a.size, a.xxh3_128) for a in info.manifest.artifacts},
                self.store.fs.ident)
        self._last_saved = step
        self._parent = {"run_id": self.run_id, "generation": step,
                        "incarnation": self.incarnation}

    def _prepare_write(self, step: int, again: bool) -> None:
        """(The writer: the leader of a job.) See `RunWriter.prepare`."""
        try:
            self._writer.prepare(step, again, not (self._restored or self._first_checked
                                                   or self._last_saved is not None),
                                 self._run, self._run_written, self._restore_tried)
        except OSError as e:  # (the run folder replaced by a file, an I/O error)
            raise save_failed(self.store.root, step, e) from e
        self._run_written = self._first_checked = True

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the run folder's writer lock, the optimizer hooks and signal handlers, and
        close the trace, after waiting for an async save in flight (its error is raised once
        everything is released). In a job, each rank releases its own and does not wait for
        the others (the leader may still be applying retention after its save).
        Interrupted (Ctrl-C) while a save is still in flight, it releases nothing: the save
        keeps the lock it needs, and ``close()`` again finishes it. In a process forked from
        the one that made it, nothing: what it holds (the lock, a lease, the trace, the save
        in flight) is that process's."""
        if os.getpid() != self._pid:
            return
        try:
            self.wait()
        except BaseException:
            if self._in_flight is not None:
                raise
            self._release()
            raise
        self._release()

    def _release(self) -> None:
        # In a job, no rank waits for the others here: one that closes while the others
        # train on (it handled its own error) would hold them in their next collective, DDP's
        # or a save's, until its timeout; its process ending fails theirs at once instead.
        if self._persister is not None:
            self._persister.close()
        if self._save_group is not self._group:  # (this rank's last collective on it is over)
            self._save_group.destroy()
        self._writer.close()
        self._watch.close()
        self._preemption.close()
        if self._trace is not None:
            self._trace.close()
        self._worker.stop(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
