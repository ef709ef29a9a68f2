"""The restoring half of the Checkpointer: restore by intent (a continuation of this run, or
a warm start from another), over `picking`, which finds the generation that loads."""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ._pacing import paced
from .boundary import UpdateWatch
from .data.loader import unsaved_loaders
from .dist.alike import check_alike
from .dist.group import Group
from .errors import (
    CorruptCheckpoint,
    NoCheckpoint,
    ReadOnlyRun,
    UnbrokenError,
    UnbrokenWarning,
)
from .faults import DROP_ENV, drop_parts
from .picking import Pick, check_continuable, none_verifies, partly, pick_generation
from .state import parts as S
from .state.applying import apply
from .state.fresh import check_patterns
from .state.identity import Identity, check_identity
from .state.incremental import HeldFile, held_files
from .state.settings import live_settings, put_back_settings
from .store.aside import ASIDE_NAME
from .store.generations import GenerationInfo, GenerationStore
from .store.opening import is_url, location_key, open_store
from .store.runrecord import RunRecord
from .store.verifying import generation_of
from .trace import TraceRecorder
from .writer import RunWriter

log = logging.getLogger("unbroken")


_gc_lock = threading.Lock()
_gc_holders = 0  # saves and restores under way, in any thread
_gc_local = threading.local()  # this thread's share of them (``n``)
_gc_was_enabled = False


def gc_paused(fn: Any) -> Any:
    """Pause the cyclic garbage collector during a save or restore: encoding or decoding
    thousands of tensors allocates enough containers to trigger full collections, and each
    one walks every object of the process (importing torch alone makes ~10^6). Counted across
    threads: an async save persisting in the background keeps it paused until it ends, and the
    collector comes back (if it was on) when the last one ends. A paced save
    (``persist_share``) never pauses it: it runs beside the loop for many times its work, and
    the loop must keep collecting meanwhile."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _gc_holders, _gc_was_enabled
        if paced():
            return fn(*args, **kwargs)
        with _gc_lock:
            if _gc_holders == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_holders += 1
        _gc_local.n = getattr(_gc_local, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _gc_local.n -= 1
            with _gc_lock:
                _gc_holders -= 1
                if _gc_holders == 0 and _gc_was_enabled:
                    gc.enable()

    return wrapper


def _gc_after_fork() -> None:
    """(In a child just forked.) Only the forking thread lives on: a save persisting in
    another one (a DataLoader worker forked during a background read-back or async save)
    never ends here, so the holders are the forking thread's alone, and the collector comes
    back when there are none. The lock is made anew: a thread that held it at the fork is
    gone."""
    global _gc_lock, _gc_holders
    _gc_lock = threading.Lock()
    held, _gc_holders = _gc_holders, getattr(_gc_local, "n", 0)
    if held and not _gc_holders and _gc_was_enabled:
        gc.enable()


os.register_at_fork(after_in_child=_gc_after_fork)


class Restoring:
    """``restore()`` and what it needs of the Checkpointer it is mixed into."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    identity: Identity
    store: GenerationStore
    incarnation: int
    rejected: list[tuple[str, str]]
    _parts: dict[str, Any]
    _group: Group
    _writer: RunWriter
    _run: RunRecord
    _run_written: bool
    _ambiguous: str | None
    _restored: bool
    _restore_tried: bool
    _origin: dict[str, Any] | None
    _storage_options: Mapping[str, Any] | None
    _parent: dict[str, Any] | None
    _last_saved: int | None
    _counters: S.Counters
    _watch: UpdateWatch
    _trace: TraceRecorder | None
    _incremental: bool
    _held: dict[str, list[HeldFile]]

    @property
    def run_id(self) -> str:
        raise NotImplementedError

    @property
    def read_only(self) -> Any:
        raise NotImplementedError

    def wait(self) -> Any:
        raise NotImplementedError

    def _forked(self, what: str) -> None:
        raise NotImplementedError

    @gc_paused
    def restore(self, intent: str = "continue", *, generation: int | None = None,
                source: str | os.PathLike[str] | None = None,
                allow: Iterable[str] = (), adopt: bool = False,
                fresh: Iterable[str] | None = ()) -> int:
        """Restore by intent and return the completed-update count to continue from.

        ``"continue"`` (default): everything, from the newest generation of this run that
        verifies (or ``generation``); 0 only when the run folder holds no generation at all. A
        torn, corrupt or foreign newer generation is reported and moved aside, and the previous
        verified one is used. A generation written by another run (copied into this folder) is
        foreign: ``adopt=True`` continues from it deliberately and records that run in this
        run's lineage. Any missing part, identity change or shape mismatch raises before any
        live object changes. A large file is hashed as it is read into the live tensors (in a
        job of one process): one found corrupt then refuses its generation, and the previous
        verified one is loaded over it; where none is, `CorruptCheckpoint` says the live
        model and optimizer hold the corrupt generation's bytes. ``"warm_start"``: model
        weights only, from another run folder ``source``; this run starts at 0 with a lineage
        naming its parent. Config or tokenizer changes must be named in ``allow``. ``fresh``
        (warm start only): glob patterns of the model's names that keep their live values (a
        new head: ``fresh=["head.*"]``); the checkpoint's names they match need not exist
        live, every other name must match."""
        self._forked("restore")
        if intent not in S.INTENTS:
            raise ValueError(f"intent={intent!r}: one of {S.INTENTS}")
        if generation is not None:
            if (isinstance(generation, bool) or not isinstance(generation, (int, np.integer))
                    or generation < 0):
                raise TypeError(f"generation={generation!r}: a generation number, an int >= 0 "
                                "(its step)")
            generation = int(generation)
        # A misnamed field in ``allow``, or ``allow`` on a continuation, is the caller's
        # error: said before any generation is read, not as a failure of every generation.
        allow = (allow,) if isinstance(allow, str) else tuple(allow)  # (read twice)
        check_identity({}, {}, intent=intent, allow=allow)
        patterns = check_patterns(fresh, intent)
        check_alike(self._group, {
            "intent": intent, "generation=": generation, "allow=": sorted(allow),
            "adopt=": bool(adopt), "fresh=": list(patterns),
            "source=": None if source is None else location_key(source)},
            call="call restore()")
        self._restore_tried = True
        self.wait()  # an async save in flight is committed first
        if intent == "warm_start":
            return self._warm_start(source, generation, allow, patterns)
        if source is not None:
            raise ValueError("source= is for warm_start; a continuation reads its own run folder")
        if S.DATA not in self._parts and unsaved_loaders():
            warnings.warn(f"{self.store.root}: a ResumableLoader is live in this process but "
                          "was given to no Checkpointer (data=...): its position is "
                          "neither saved nor restored, and a resumed run starts its epoch "
                          "over; pass the training loader as data=", UnbrokenWarning,
                          stacklevel=3)
        scanned = self.store.scan()
        if not scanned:
            if self.read_only is not None:  # nothing to read, and nothing could be written
                raise ReadOnlyRun(f"nothing to restore, and no save could be written: "
                                  f"{self.read_only}")
            if self._last_saved is not None or self._counters.step:
                # 0 means "start fresh", and the live objects are not fresh: they hold the
                # updates this Checkpointer counted (and saved, into generations now gone)
                done = (f"saved step {self._last_saved}" if self._last_saved is not None
                        else f"counted {self._counters.step} completed updates")
                raise NoCheckpoint(
                    f"{self.store.root}: no generation to restore, but this Checkpointer "
                    f"{done} in this process and the live model holds them; its generations "
                    "are gone (a save whose read-back failed goes to aside/, as the error "
                    "raised then said; or the folder was emptied outside unbroken). Restore "
                    "from a copy of the run, or begin a new run with a new Checkpointer and "
                    "freshly built model and optimizer")
            aside = self.store.aside()
            if aside and self._run_written:
                # (this run's RUN.json and its generations set aside, none in place: a start
                # from 0 may be meant, e.g. after moving them by hand, but is never silent)
                warnings.warn(f"{self.store.root}: no generation in place, but {len(aside)} "
                              f"set aside in aside/ ({aside[-1].name} the newest): starting "
                              "this run from step 0; to continue from one, move it back into "
                              "the run folder (its name: gen-<step>) and restore again",
                              UnbrokenWarning, stacklevel=2)
            self._restored = True
            self._after_restore(0, None)
            return 0
        if self._ambiguous and not adopt:
            raise CorruptCheckpoint(self._ambiguous)
        pick = self._continue_from(scanned, generation, allow, adopt)
        info = pick.info
        assert info is not None and info.manifest is not None
        if generation is None:
            _superseded_uncommitted(self.store, scanned, info.generation)
        manifest = info.manifest
        self._restored = True
        for g in scanned:  # the abandoned branch: never overwritten, never loaded again
            if g.generation > info.generation:
                self._writer.set_aside(g, pick.labels.get(g.path, "abandoned"))
        if not self._run.accepts(manifest.run_id):  # adopted: now part of this run's lineage
            self._run.lineage.append(manifest.run_id)
            self._run_written = False
            log.warning("adopted %s of run %s into run %s", info.path, manifest.run_id,
                        self.run_id)
        self.incarnation = 1 + max(g.manifest.incarnation for g in scanned if g.manifest)
        self._origin = manifest.origin
        self._parent = {"run_id": manifest.run_id, "generation": manifest.generation,
                        "incarnation": manifest.incarnation}
        self._last_saved = manifest.step
        if self._incremental and manifest.run_id == self.run_id:  # the next save links
            # what did not change since (files of an adopted run are stamped with its id)
            self._held = held_files(pick.layout, info.path, {
                a.name: (a.size, a.xxh3_128) for a in manifest.artifacts}, self.store.fs.ident,
                self.store.read_the_store)
        log.info("restored %s (step %d)", info.path, manifest.step)
        self._after_restore(manifest.step, info)
        return manifest.step

    def _continue_from(self, scanned: list[GenerationInfo], generation: int | None,
                       allow: tuple[str, ...], adopt: bool) -> Pick:
        """Pick the generation to continue from and load it into the live objects. Its large
        files are hashed as they are copied into the live tensors (`MappedFiles.defers`): one
        that fails its hash refuses the generation, and the next older one that verifies is
        picked and loaded over it (every tensor it held is overwritten)."""
        before = Pick()
        settings = live_settings(self.optimizer, self._parts.get(S.SCHEDULER))
        while True:
            try:
                pick = self._pick(self.store, scanned, generation, "continue", allow, adopt,
                                  defer=True, before=before)
            except UnbrokenError as e:
                if not before.rejected:
                    raise
                raise type(e)(f"{e}\n{partly(before)}") from None
            try:
                said = check_continuable(pick, self.store.root, self.optimizer, self._parts)
                apply(pick.ready, drop_parts(self._parts, pick.ready,
                                             os.environ.get(DROP_ENV, ""), self._group.rank),
                      mapped=pick.mapped, walked=pick.walked)
                pick.mapped.verify_rest()
                for message in said:  # (of the generation loaded, not of those refused)
                    warnings.warn(message, UnbrokenWarning, stacklevel=4)
                return pick
            except UnbrokenError:
                if pick.mapped.refused is None:
                    try:  # (refused by code that read bytes not hashed yet: the file's?)
                        pick.mapped.verify_unhashed(drop=True)
                    except UnbrokenError:
                        pass
                if pick.mapped.refused is None:
                    raise
                assert pick.info is not None
                why = pick.mapped.refused[1]
                log.warning("rejected %s: %s", pick.info.path, why)
                before.rejected.append((pick.info.path, why))
                before.labels[pick.info.path] = "corrupt"
                before.info = pick.info  # (the last one whose bytes went into live tensors)
                if generation is not None:  # (that one, and no other)
                    raise CorruptCheckpoint(f"{pick.info.path}: {why}\n{partly(before)}"
                                            ) from None
                scanned = [g for g in scanned if g.generation < pick.info.generation]
                if not scanned:
                    raise CorruptCheckpoint(f"{none_verifies(self.store.root, before)}\n"
                                            f"{partly(before)}") from None
                # (what the next candidate's warnings compare with: as before this restore)
                put_back_settings(self.optimizer, self._parts.get(S.SCHEDULER), settings)
            finally:
                pick.mapped.close()

    def _pick(self, store: GenerationStore, scanned: list[GenerationInfo],
              generation: int | None, intent: str, allow: Iterable[str], adopt: bool,
              fresh: tuple[str, ...] = (), defer: bool = False,
              before: Pick | None = None) -> Pick:
        """`picking.pick_generation` for this Checkpointer's live objects; ``rejected`` says
        what it refused, even when nothing loads (``before``: refused already)."""
        pick = (Pick(rejected=list(before.rejected), labels=dict(before.labels)) if before
                else Pick())
        self.rejected = pick.rejected
        return pick_generation(store, scanned, generation, intent, allow, adopt,
                               parts=self._parts, model=self.model, identity=self.identity,
                               run=self._run, pick=pick, group=self._group, fresh=fresh,
                               defer=defer)

    def _after_restore(self, step: int, info: GenerationInfo | None) -> None:
        self._watch.boundary(step, self._counters.epoch)
        if self._trace is not None:
            self._trace.restored(step, info.name if info else None,
                                 [generation_of(p) for p, _ in self.rejected])

    def _warm_start(self, source: str | os.PathLike[str] | None, generation: int | None,
                    allow: Iterable[str], fresh: tuple[str, ...]) -> int:
        if source is None or (str(source).rstrip("/") == self.store.root if is_url(source)
                              else os.path.realpath(source) == os.path.realpath(self.store.root)):
            raise UnbrokenError(
                "warm_start begins a new run: give it its own folder and name the parent, e.g. "
                "Checkpointer('runs/new', ...).restore(intent='warm_start', source='runs/old')")
        if self.store.scan():
            raise UnbrokenError(f"{self.store.root} already holds generations; a warm start "
                                "writes a new run into an empty folder (or use continue)")
        src = open_store(source, self._storage_options)
        scanned = src.scan()
        if not scanned:
            raise NoCheckpoint(f"{src.root}: no generation to warm-start from")
        pick = self._pick(src, scanned, generation, "warm_start", allow, False, fresh)
        info = pick.info
        assert info is not None and info.manifest is not None
        if fresh and pick.tree.get(S.MODEL) and not pick.ready.get(S.MODEL):
            warnings.warn(f"{info.path}: fresh={list(fresh)!r} keeps every name of the model: "
                          "the warm start loads no weight", UnbrokenWarning, stacklevel=4)
        try:
            apply(pick.ready, {S.MODEL: self.model}, mapped=pick.mapped, walked=pick.walked,
                  fresh=bool(fresh))
        finally:
            pick.mapped.close()
        self._restored = True
        self._after_restore(0, None)
        self._origin = {"operation": "warm_start", "source": src.root,
                        "run_id": info.manifest.run_id, "generation": info.generation,
                        "incarnation": info.manifest.incarnation, "allowed": sorted(allow)}
        if fresh:
            self._origin["fresh"] = list(fresh)
        log.info("warm start from %s; new run %s", info.path, self.run_id)
        return 0


def _superseded_uncommitted(store: GenerationStore, scanned: list[GenerationInfo],
                            restored: int) -> None:
    """Say so when the run stopped while a save of the same step replaced a newer generation
    than the one restored: the earlier save of that step was moved aside as superseded and
    the new one never committed. The restore is right to take the one before (the superseded
    state is not one the run continues from: it was replaced, as after an end-of-epoch
    scheduler step), but never silently."""
    present = {g.generation for g in scanned}
    try:
        entries = store.aside()
    except (OSError, UnbrokenError):  # (what aside/ holds is for a message only)
        return
    for entry in reversed(entries):
        m = ASIDE_NAME.fullmatch(entry.name)
        number = int(m.group(1)[len("gen-"):]) if m else -1
        if entry.reason == "superseded" and number > restored and number not in present:
            warnings.warn(f"{store.root}: the run stopped while generation {number} was being "
                          f"saved again (a save of the same step); its earlier save is in "
                          f"{entry.path} (superseded, kept for inspection) and the new one was "
                          f"never committed: continuing from generation {restored}, which "
                          "replays the updates after it", UnbrokenWarning, stacklevel=4)
            return
