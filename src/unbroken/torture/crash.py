"""Crash torture: a small real training run, killed with SIGKILL again and again, restarted
until it completes; every recovery is checked against an uninterrupted run.

The training loop runs in forked children of the torture process (which imported torch once
and ran no kernel before forking), each in its own process group. A child restores only from
disk, so it is a real new process as far as the checkpoint is concerned. Kills are chosen by
the seed: numbered I/O operations (``$UNBROKEN_KILL_AT_OP``), named fault points of the commit
protocol (``$UNBROKEN_KILL_AT``) and timers in the parent that SIGKILL the child's group after
a random delay. After every kill the parent waits until the group is empty and checks the run
folder before it restarts the run. Between some lives an event happens first (see `_events`):
the newest generation rots on disk, or a script starts without ``restore()``."""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ..checkpointer import Checkpointer
from ..store.backends.killpoints import KILL_ENV, KILL_NOTE_ENV, KILL_OP_ENV
from ..store.lock import persister_gone
from ._disk import POINT_PHASE, DiskState, inspect_run, phase_of_note, phase_of_state
from ._events import EVENTS, Episode, Events
from ._figures import KINDS, Figures
from ._job import KEEP_LAST, STEPS, prepare_parent, start_without_restore, train
from ._life import count_lines, read_events, read_lines, run_life, tail

# Kill kinds in a fixed rotation (half numbered I/O operations, 30% timers, 20% named points),
# and the named points in a fixed order, so that every run of 10 kills covers all kinds and the
# first named-point kills cover the commit and retention.
_ROTATION = ("op", "timer", "point", "op", "op", "timer", "op", "point", "timer", "op")
POINTS = ("before-rename", "retention-unlinked", "artifact-1-written", "after-rename",
           "manifest-written", "artifact-2-written", "step-done", "artifact-4-written")


class Torture(Events):
    def __init__(self, kills: int, seed: int, workdir: str, kinds: tuple[str, ...] = KINDS,
                 keep: bool = False, events: tuple[str, ...] = EVENTS,
                 async_save: str = "off", points: tuple[str, ...] = POINTS,
                 persist_share: float | None = None) -> None:
        self.f = Figures(seed=seed, kills_requested=kills, async_save=async_save,
                         persist_share=persist_share)
        mode: bool | str = False if async_save == "off" else async_save
        self.async_save = mode
        self.job = partial(train, async_save=mode, persist_share=persist_share)
        self.no_restore_job = partial(start_without_restore, async_save=mode,
                                      persist_share=persist_share)
        self.points = points
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.kinds = kinds
        self.keep = keep
        self.events = events
        self.erng = random.Random(f"{seed}:events")  # the kills draw from self.rng alone
        self._event_no = self.erng.randrange(5)
        self._event_pending: str | None = None
        self._aside_seen: set[tuple[str, str]] = set()
        self.ref: dict[int, str] = {}
        self.ref_start = 0.0  # seconds from fork to "restored" in a fresh life
        self.ref_train = 0.0  # seconds of the training loop of a whole run
        self._plans = self._points = 0
        self._walk = self.rng.random()
        # (run folder, status, generation); status torn / corrupt / rot
        self._seen_bad: set[tuple[str, str, int]] = set()
        self._pending_bad: dict[tuple[str, str, int], None] = {}

    def fail(self, message: str) -> None:
        self.f.failures.append(message)

    # The reference: one uninterrupted life.
    def reference(self) -> bool:
        d = os.path.join(self.workdir, "reference")
        os.makedirs(d)
        run, log = os.path.join(d, "run"), os.path.join(d, "log.jsonl")
        t0 = time.monotonic()
        life = run_life(run, log, os.path.join(d, "err.txt"), {}, 2, None, self.job)
        self._persister_gone(run, "the uninterrupted reference run")
        events, _ = read_events(log, 0) if os.path.exists(log) else ([], 0)
        if life.code != 0 or not events or events[-1]["e"] != "done":
            self.fail(f"the uninterrupted reference run failed (exit {life.code}): "
                      f"{tail(os.path.join(d, 'err.txt'))}")
            return False
        for e in events:
            if e["e"] in ("restored", "step"):
                self.ref[e["step"]] = e["digest"]
        start = next(e for e in events if e["e"] == "restored")
        self.ref_start = max(0.001, start["t"] - t0)
        self.ref_train = max(0.001, events[-1]["t"] - start["t"])
        self.f.reference_ops = events[-1]["ops"]
        self.f.reference_seconds = round(life.seconds, 3)
        return True

    def _plan(self, expected: int, every: int) -> tuple[str, dict[str, str], float | None, str]:
        """Choose how the next life dies: (kind, env, timer delay, description)."""
        remaining = max(1, STEPS - expected)
        rotation = [k for k in _ROTATION if k in self.kinds]
        kind = rotation[self._plans % len(rotation)]
        self._plans += 1
        if kind == "point" and expected >= STEPS:  # nothing left to train: no named point
            kind = "op" if "op" in self.kinds else "timer"
        if kind == "op":
            # Restores and debris cleanup cost a few operations; saves the rest.
            # Successive op kills walk the operation space by the golden ratio from a seeded
            # start: evenly spread over every write, fsync, rename and unlink, never clustered.
            span = max(2, round(self.f.reference_ops * remaining / STEPS) + 8)
            self._walk = (self._walk + 0.6180339887498949) % 1.0
            k = 1 + int(self._walk * span)
            return kind, {KILL_OP_ENV: str(k)}, None, f"I/O operation {k}"
        if kind == "timer":
            delay = self.rng.uniform(0, self.ref_start + self.ref_train * remaining / STEPS)
            return kind, {}, delay, f"after {delay * 1000:.1f} ms"
        saves = [s for s in range(expected + 1, STEPS + 1) if s % every == 0] or [STEPS]
        point = self.points[self._points % len(self.points)]
        self._points += 1
        at = self.rng.choice(saves)
        if point == "retention-unlinked":
            at = max(every, at - KEEP_LAST * every)  # the generation the save of `at` deletes
            at -= at % every
        elif point == "step-done" and self.async_save:
            # right after the next save() returned (save on failure): one trial per save
            at = saves[0]
        elif point == "step-done":
            at = self.rng.randint(expected + 1, STEPS)
        return kind, {KILL_ENV: f"{point}@{at}"}, None, f"{point}@{at}"

    def episode(self, number: int, budget: int) -> int:
        """Run one training run to completion, killing it up to ``budget`` times."""
        d = os.path.join(self.workdir, f"episode-{number:03d}")
        os.makedirs(d)
        ep = Episode(number, d, os.path.join(d, "run"), self.rng.choice((2, 3)))
        log, note = os.path.join(d, "log.jsonl"), os.path.join(d, "kill-notes.txt")
        expected = 0  # the step the next life must restore
        offset = 0
        kills = 0
        unrecovered = 0  # kills not yet followed by a checked restore
        life_no = 0
        self.f.episodes += 1
        while True:
            life_no += 1
            self.f.lives += 1
            if kills < budget:
                kind, env, delay, desc = self._plan(expected, ep.every)
            else:
                kind, env, delay, desc = "none", {}, None, "no kill"
            if env.get(KILL_OP_ENV):
                env[KILL_NOTE_ENV] = note
            notes_before = count_lines(note)
            err = os.path.join(d, f"life-{life_no:03d}.err")
            life = run_life(ep.run, log, err, env, ep.every, delay, self.job)
            where = f"episode {number} life {life_no} ({kind}: {desc})"
            if not life.group_gone:
                self.fail(f"{where}: processes of the killed group survived")
                return kills
            if not self._persister_gone(ep.run, where):
                return kills
            events, offset = read_events(log, offset)
            restored = [e for e in events if e["e"] == "restored"]
            if restored and self._check_restore(restored[0], expected, where, ep):
                self.f.recoveries += unrecovered
                unrecovered = 0
            for e in events:
                if e["e"] == "step":
                    if e["digest"] != self.ref.get(e["step"]):
                        self.fail(f"{where}: state after update {e['step']} differs from the "
                                  "uninterrupted run")
                    if e["saved"]:
                        ep.committed(e["step"])
                        self.f.generations_reported += 1
                elif e["e"] == "committed":  # an async save, confirmed
                    ep.committed(e["step"])
                    self.f.generations_reported += 1
            if life.code == 0:
                done = [e for e in events if e["e"] == "done"]
                self._check_finished(ep, done, where)
                return kills
            if life.code != -signal.SIGKILL:
                self.fail(f"{where}: exit status {life.code}: {tail(err)}")
                return kills
            # Killed: account for it, then check what the disk holds before restarting.
            kills += 1
            unrecovered += 1
            self.f.kills += 1
            self.f.kills_by_kind[kind] += 1
            state = inspect_run(ep.run)
            if kind == "op":
                lines = read_lines(note)[notes_before:]
                phase = phase_of_note(lines[-1], ep.run) if lines else "unknown"
            elif kind == "point":
                name = env[KILL_ENV].split("@")[0]
                phase = POINT_PHASE["artifact" if name.startswith("artifact") else name]
            else:
                phase = phase_of_state(state)
            self.f.kills_by_phase[phase] = self.f.kills_by_phase.get(phase, 0) + 1
            pending = self._count_in_flight(events, env, ep, state) if self.async_save else 0
            entry = {"episode": number, "life": life_no, "kind": kind, "at": desc,
                     "phase": phase, "complete": state.complete, "torn": state.torn,
                     "corrupt": state.corrupt,
                     # (an async save in flight: committed after the kill, or lost with it)
                     **({"in_flight": {"step": pending, "committed": pending in state.complete}}
                        if pending else {})}
            self.f.kills_log.append(entry)
            self._after_kill(state, ep, where)
            expected, event = self.between_lives(ep, state, max(state.complete, default=0),
                                                 where)
            if event:
                entry["event"] = event

    def _persister_gone(self, run: str, where: str) -> bool:
        """(async_save="process") Wait for the persisting process of the life that ended: a
        killed trainer's persisting process goes on committing its last save, and the disk is
        checked once it is done."""
        if self.async_save != "process" or persister_gone(run, 120.0):
            return True
        self.fail(f"{where}: the persisting process still holds the run 120 s after its "
                  "writer ended")
        return False

    def _count_in_flight(self, events: list[dict[str, Any]], env: dict[str, str],
                         ep: Episode, state: DiskState) -> int:
        """An async save handed over and not confirmed when the life was killed: committed all
        the same, or lost (then the restore falls back, which the usual checks verify).
        Returns its step (0: none was in flight)."""
        handed = {e["step"] for e in events if e["e"] == "step" and e.get("handed")}
        point, _, at = env.get(KILL_ENV, "").partition("@")
        returned = point == "step-done" and int(at) % ep.every == 0
        if returned:  # killed inside step_done(at), after its save() returned
            handed.add(int(at))
        confirmed = {e["step"] for e in events if e["e"] == "committed"}
        pending = max(handed, default=0)
        if pending == 0 or pending in confirmed:
            return 0
        committed = pending in state.complete
        self.f.kills_in_flight += 1
        self.f.committed_in_flight += committed
        if returned:
            self.f.kills_after_save_returned += 1
            self.f.committed_after_save_returned += committed
            if self.async_save == "process" and not committed:
                self.fail(f"episode {ep.number}: the trainer was killed right after save() of "
                          f"generation {pending} returned, and its persisting process did not "
                          f"commit it (the disk holds {state.complete})")
        return pending

    def _after_kill(self, state: DiskState, ep: Episode, where: str) -> None:
        for status, gens in (("torn", state.torn), ("corrupt", state.corrupt)):
            for g in gens:
                key = (ep.key, status, g)
                if key not in self._seen_bad and not (status == "corrupt" and g in ep.rotten):
                    self._seen_bad.add(key)
                    self._pending_bad[key] = None
                    if status == "torn":
                        self.f.torn_seen += 1
                    else:
                        self.f.corrupt_seen += 1
        self.f.staging_debris_seen += state.staging
        self.f.trash_debris_seen += state.trash
        self.check_aside(state, ep, where)
        self.check_kept(state, ep, where)

    def _check_restore(self, e: dict[str, Any], expected: int, where: str, ep: Episode) -> bool:
        """Check a life's restore against the disk state seen after the last kill (and the
        event that followed it)."""
        failures = len(self.f.failures)
        step = e["step"]
        if step != expected:
            self.fail(f"{where}: restored step {step}; the newest verified generation was "
                      f"{expected}")
        if e["digest"] != self.ref.get(step):
            self.f.wrong_state_restored += 1
            self.fail(f"{where}: the state restored at step {step} differs from the "
                      "uninterrupted run at that step")
        if step == 0:
            self.f.restored_from_nothing += 1
        if e["rejected"]:
            self.f.fell_back += 1
            ep.refused |= {int(name.split("-")[1]) for name in e["rejected"]}
        for key in [k for k in self._pending_bad if k[0] == ep.key]:
            del self._pending_bad[key]
            if key[2] == step and step != 0:
                self.f.torn_or_corrupt_loaded += 1
                self.fail(f"{where}: loaded generation {step}, which was {key[1]}")
            else:
                self.settle(key[1])
        return len(self.f.failures) == failures

    def _check_finished(self, ep: Episode, done: list[dict[str, Any]], where: str) -> None:
        if not done:
            self.fail(f"{where}: exited 0 without finishing")
            return
        state = inspect_run(ep.run)
        saves = [s for s in range(ep.every, STEPS + 1, ep.every)]
        want = saves[-KEEP_LAST:]
        # Retention runs after each save: a run killed after committing its last generation
        # finishes without another save, so older generations (or a torn one whose deletion
        # was interrupted) may remain until the next save. Nothing newer may be missing.
        leftover = [g for g in state.complete + state.torn if g not in want]
        if (not set(want) <= set(state.complete) or state.corrupt
                or any(g > want[0] or g not in saves for g in leftover)):
            self.fail(f"{where}: finished run holds complete {state.complete}, torn "
                      f"{state.torn}, corrupt {state.corrupt}; expected {want}")
        if state.staging or state.trash:
            self.fail(f"{where}: finished run left debris (staging {state.staging}, trash "
                      f"{state.trash})")
        self.check_aside(state, ep, f"{where}: finished run")
        self.check_kept(state, ep, f"{where}: finished run")
        if done[0]["digest"] == self.ref.get(STEPS):
            self.f.episodes_equal += 1
        else:
            self.fail(f"{where}: the final state differs from the uninterrupted run")

    def run(self) -> Figures:
        started = time.monotonic()
        if self.reference():
            number = 0
            while self.f.kills < self.f.kills_requested and not self.f.failures:
                number += 1
                self.episode(number, min(12, self.f.kills_requested - self.f.kills))
            self.f.final_equal = (self.f.episodes > 0
                                  and self.f.episodes_equal == self.f.episodes)
        self.f.seconds = round(time.monotonic() - started, 2)
        return self.f


def _retention_first() -> Callable[[], None]:
    """Accelerate's bug, on purpose: delete old generations *before* writing the new one."""
    # The method every save goes through (step_done and save() both call it when it exists).
    name = "_save" if hasattr(Checkpointer, "_save") else "save"
    original = getattr(Checkpointer, name)

    def save(self: Checkpointer, *args: Any, **kw: Any) -> Any:
        self.wait()  # (the previous save's read-back and retention, in the background)
        for g in [g for g in self.store.scan() if g.ok][:-1]:
            self.store.delete(g)
        return original(self, *args, **kw)

    setattr(Checkpointer, name, save)
    return lambda: setattr(Checkpointer, name, original)


def _skip_hash() -> Callable[[], None]:
    """A loader that trusts sizes and never re-hashes content: it loads rotten generations."""
    from .corrupt import SABOTAGE as FUZZ_SABOTAGE

    return FUZZ_SABOTAGE["skip-hash"]()


def _first_save_unchecked() -> Callable[[], None]:
    """A first save without restore() that goes ahead in a used folder."""
    from ..writer import RunWriter

    original = RunWriter.check_first_save
    RunWriter.check_first_save = lambda self, restore_tried=False: None  # type: ignore[method-assign]
    return lambda: setattr(RunWriter, "check_first_save", original)


# Known-bad implementations the torture must catch (a test of the test: exit status 1).
SABOTAGE: dict[str, Callable[[], Callable[[], None]]] = {
    "retention-first": _retention_first, "skip-hash": _skip_hash,
    "first-save-unchecked": _first_save_unchecked}


def crash(kills: int, seed: int, workdir: str | None = None, kinds: tuple[str, ...] = KINDS,
          keep: bool = False, sabotage: str | None = None,
          events: tuple[str, ...] = EVENTS, async_save: str = "off",
          points: tuple[str, ...] = POINTS, persist_share: float | None = None) -> Figures:
    prepare_parent()
    own = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="unbroken-torture-")
    os.makedirs(work, exist_ok=True)
    undo = SABOTAGE[sabotage]() if sabotage else None  # forked lives inherit it
    try:
        return Torture(kills, seed, work, kinds, keep, events, async_save, points,
                       persist_share).run()
    finally:
        if undo is not None:
            undo()
        if own and not keep:
            shutil.rmtree(work, ignore_errors=True)
