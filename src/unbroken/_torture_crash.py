"""Crash torture: a small real training run, killed with SIGKILL again and again, restarted
until it completes; every recovery is checked against an uninterrupted run.

The training loop runs in forked children of the torture process (which imported torch once
and ran no kernel before forking), each in its own process group. A child restores only from
disk, so it is a real new process as far as the checkpoint is concerned. Kills are chosen by
the seed: numbered I/O operations (``$UNBROKEN_KILL_AT_OP``), named fault points of the commit
protocol (``$UNBROKEN_KILL_AT``) and timers in the parent that SIGKILL the child's group after
a random delay. After every kill the parent waits until the group is empty and checks the run
folder before it restarts the run."""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ._fs import KILL_ENV, KILL_NOTE_ENV, KILL_OP_ENV, io_count
from .checkpointer import Checkpointer
from .codec import encode_tree
from .errors import CorruptCheckpoint
from .identity import Identity
from .retention import Keep
from .store import ASIDE, STAGING_PREFIX, TRASH_PREFIX, GenerationStore

STEPS = 24
KEEP_LAST = 2
KINDS = ("op", "timer", "point")
# Kill kinds in a fixed rotation (half numbered I/O operations, 30% timers, 20% named points),
# and the named points in a fixed order, so that every run of 10 kills covers all kinds and the
# first named-point kills cover the commit and retention.
_ROTATION = ("op", "timer", "point", "op", "op", "timer", "op", "point", "timer", "op")
_POINTS = ("before-rename", "retention-unlinked", "artifact-1-written", "after-rename",
           "manifest-written", "artifact-2-written", "step-done", "artifact-4-written")
_LIFE_TIMEOUT = 120.0


# -- the training run ---------------------------------------------------------------------------


@dataclass
class Job:
    """The live objects of one training process."""

    ckpt: Checkpointer
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    data: torch.Generator


def build(run: str, every: int | None, keep_last: int) -> Job:
    """A small model with everything a resume can get wrong: AdamW moments, a warm-up
    schedule, dropout (global torch RNG), a registered data generator, NumPy and Python
    randomness. Deterministic given the seeds set here."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    data = torch.Generator().manual_seed(1)
    ckpt = Checkpointer(run, model=model, optimizer=opt, scheduler=sched,
                        generators={"data": data},
                        identity=Identity(config={"torture": 1, "width": 16}),
                        every=every, keep=Keep(last=keep_last))
    return Job(ckpt, model, opt, sched, data)


def state_digest(job: Job) -> str:
    """One digest of everything that decides the next update: parameters, optimizer and
    scheduler state, and every RNG stream (Python, NumPy, torch, the data generator). Taken
    from the live objects directly, independent of how unbroken captures them."""
    h = xxhash.xxh3_64()
    tree = {"model": job.model.state_dict(), "optimizer": job.opt.state_dict(),
            "scheduler": job.sched.state_dict(), "python": random.getstate(),
            "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "data": job.data.get_state(), "step": job.ckpt.step}
    skeleton, tensors = encode_tree(tree)
    h.update(json.dumps(skeleton, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def update(job: Job) -> torch.Tensor:
    """One training update (forward, backward, clip, optimizer and scheduler step)."""
    x = torch.randn(16, 8, generator=job.data)
    y = x.sum(1, keepdim=True) + float(np.random.normal(0, 1e-2)) + random.gauss(0, 1e-2)
    loss = (job.model(x) - y).pow(2).mean()
    job.opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1.0)
    job.opt.step()
    job.sched.step()
    return loss


def train(run: str, log: str, steps: int = STEPS, every: int = 2,
          keep_last: int = KEEP_LAST) -> None:
    """One life of the run: restore from disk, train to ``steps``, logging exact digests."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def emit(**record: Any) -> None:  # one write per line: a kill never tears a record
        os.write(fd, (json.dumps({**record, "t": time.monotonic()}) + "\n").encode())

    emit(e="start", pid=os.getpid())
    job = build(run, every, keep_last)
    start = job.ckpt.restore()
    emit(e="restored", step=start, digest=state_digest(job),
         rejected=[os.path.basename(p) for p, _ in job.ckpt.rejected])
    for step in range(start + 1, steps + 1):
        loss = update(job)
        saved = job.ckpt.step_done(step, loss=loss)
        emit(e="step", step=step, saved=saved, digest=state_digest(job))
    job.ckpt.close()
    emit(e="done", step=steps, digest=state_digest(job), ops=io_count())
    os.close(fd)


# -- one life in a forked child ------------------------------------------------------------------


def _child(run: str, log: str, err: str, env: dict[str, str], every: int) -> None:
    code = 1
    try:
        os.setsid()
        for key in (KILL_ENV, KILL_OP_ENV, KILL_NOTE_ENV):
            os.environ.pop(key, None)
        os.environ.update(env)
        f = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, 1)
        os.dup2(f, 2)
        os.close(f)
        torch.set_num_threads(1)  # fork-safe, and the same arithmetic in every life
        train(run, log, STEPS, every, KEEP_LAST)
        code = 0
    except BaseException:  # noqa: BLE001 -- reported through the exit status and err file
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _group_gone(pgid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True
        time.sleep(0.001)
    return False


@dataclass
class Life:
    code: int  # exit status, or -signal
    killed_by_timer: bool
    seconds: float
    group_gone: bool


def run_life(run: str, log: str, err: str, env: dict[str, str], every: int,
             delay: float | None) -> Life:
    """Fork one life; with ``delay``, SIGKILL its whole group after that many seconds. Returns
    once the child is reaped and no process of its group is left."""
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(run, log, err, env, every)
    timer = delay is not None
    deadline = started + (delay if delay is not None else _LIFE_TIMEOUT)
    fired = False
    try:  # wait on a pidfd where the kernel has them: no polling competes with the child
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            now = time.monotonic()
            if now >= deadline and not fired:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # so early that it has no group of its own yet
                    os.kill(pid, signal.SIGKILL)
                fired = True
                continue
            wait = max(0.0, deadline - now) if not fired else 0.05
            if pidfd is not None:
                select.select([pidfd], [], [], wait)
            else:
                time.sleep(min(0.0005, wait))
    finally:
        if pidfd is not None:
            os.close(pidfd)
    gone = _group_gone(pid)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return Life(code, fired and timer, time.monotonic() - started, gone)


# -- checks between lives ------------------------------------------------------------------------


def read_events(log: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:  # killed before it wrote anything
        return [], offset
    end = data.rfind(b"\n") + 1  # a partial last line (impossible with one write) is left
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


@dataclass
class DiskState:
    complete: list[int]
    torn: list[int]
    corrupt: list[int]  # includes "complete" generations that failed hash verification
    staging: int
    trash: int
    aside: int


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
    return DiskState(complete, torn, corrupt,
                     sum(n.startswith(STAGING_PREFIX) for n in names),
                     sum(n.startswith(TRASH_PREFIX) for n in names),
                     len(os.listdir(aside)) if os.path.isdir(aside) else 0)


def lost_generations(reported: set[int], complete: list[int], keep_last: int) -> list[int]:
    """Reported-committed generations missing from disk although retention had to keep them:
    a generation may only be gone once ``keep_last`` newer complete generations exist."""
    return sorted(g for g in reported
                  if g not in complete and sum(c > g for c in complete) < keep_last)


def _phase_of_note(line: str, run: str) -> str:
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


def _phase_of_state(state: DiskState) -> str:
    if state.staging:
        return "timer: inside a save (staging left)"
    if state.trash or state.torn:
        return "timer: inside retention (trash or torn left)"
    return "timer: between I/O (training, restore, checks)"


_POINT_PHASE = {"artifact": "save: write artifacts", "manifest-written": "save: write manifest",
                "before-rename": "commit: rename into place",
                "after-rename": "commit: after rename, before read-back",
                "retention-unlinked": "retention: unlink manifest",
                "step-done": "training: after an update"}


# -- the torture ---------------------------------------------------------------------------------


@dataclass
class Figures:
    seed: int
    kills_requested: int
    kills: int = 0
    kills_by_kind: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    kills_by_phase: dict[str, int] = field(default_factory=dict)
    lives: int = 0
    recoveries: int = 0
    restored_from_nothing: int = 0
    fell_back: int = 0
    torn_seen: int = 0
    torn_refused: int = 0
    corrupt_seen: int = 0
    corrupt_refused: int = 0
    staging_debris_seen: int = 0
    trash_debris_seen: int = 0
    generations_reported: int = 0
    generations_lost: int = 0
    torn_or_corrupt_loaded: int = 0
    wrong_state_restored: int = 0
    episodes: int = 0
    episodes_equal: int = 0
    final_equal: bool = False
    reference_ops: int = 0
    reference_seconds: float = 0.0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    kills_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.failures and self.generations_lost == 0 and self.final_equal
                and self.torn_or_corrupt_loaded == 0 and self.wrong_state_restored == 0
                and self.kills >= self.kills_requested and self.recoveries == self.kills
                and self.torn_refused == self.torn_seen
                and self.corrupt_refused == self.corrupt_seen)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["ok"] = self.ok
        return d


class Torture:
    def __init__(self, kills: int, seed: int, workdir: str, kinds: tuple[str, ...] = KINDS,
                 keep: bool = False) -> None:
        self.f = Figures(seed=seed, kills_requested=kills)
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.kinds = kinds
        self.keep = keep
        self.ref: dict[int, str] = {}
        self.ref_start = 0.0  # seconds from fork to "restored" in a fresh life
        self.ref_train = 0.0  # seconds of the training loop of a whole run
        self._plans = self._points = 0
        self._walk = self.rng.random()
        self._seen_bad: set[tuple[int, str, int]] = set()  # (episode, status, generation)
        self._pending_bad: dict[tuple[int, str, int], None] = {}

    def fail(self, message: str) -> None:
        self.f.failures.append(message)

    # The reference: one uninterrupted life.
    def reference(self) -> bool:
        d = os.path.join(self.workdir, "reference")
        os.makedirs(d)
        run, log = os.path.join(d, "run"), os.path.join(d, "log.jsonl")
        t0 = time.monotonic()
        life = run_life(run, log, os.path.join(d, "err.txt"), {}, 2, None)
        events, _ = read_events(log, 0) if os.path.exists(log) else ([], 0)
        if life.code != 0 or not events or events[-1]["e"] != "done":
            self.fail(f"the uninterrupted reference run failed (exit {life.code}): "
                      f"{_tail(os.path.join(d, 'err.txt'))}")
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
        point = _POINTS[self._points % len(_POINTS)]
        self._points += 1
        at = self.rng.choice(saves)
        if point == "retention-unlinked":
            at = max(every, at - KEEP_LAST * every)  # the generation the save of `at` deletes
            at -= at % every
        elif point == "step-done":
            at = self.rng.randint(expected + 1, STEPS)
        return kind, {KILL_ENV: f"{point}@{at}"}, None, f"{point}@{at}"

    def episode(self, number: int, budget: int) -> int:
        """Run one training run to completion, killing it up to ``budget`` times."""
        d = os.path.join(self.workdir, f"episode-{number:03d}")
        os.makedirs(d)
        run, log, note = (os.path.join(d, "run"), os.path.join(d, "log.jsonl"),
                          os.path.join(d, "kill-notes.txt"))
        every = self.rng.choice((2, 3))
        reported: set[int] = set()
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
                kind, env, delay, desc = self._plan(expected, every)
            else:
                kind, env, delay, desc = "none", {}, None, "no kill"
            if env.get(KILL_OP_ENV):
                env[KILL_NOTE_ENV] = note
            notes_before = _count_lines(note)
            err = os.path.join(d, f"life-{life_no:03d}.err")
            life = run_life(run, log, err, env, every, delay)
            where = f"episode {number} life {life_no} ({kind}: {desc})"
            if not life.group_gone:
                self.fail(f"{where}: processes of the killed group survived")
                return kills
            events, offset = read_events(log, offset)
            restored = [e for e in events if e["e"] == "restored"]
            if restored and self._check_restore(restored[0], expected, where, number):
                self.f.recoveries += unrecovered
                unrecovered = 0
            for e in events:
                if e["e"] == "step":
                    if e["digest"] != self.ref.get(e["step"]):
                        self.fail(f"{where}: state after update {e['step']} differs from the "
                                  "uninterrupted run")
                    if e["saved"]:
                        reported.add(e["step"])
                        self.f.generations_reported += 1
            if life.code == 0:
                done = [e for e in events if e["e"] == "done"]
                self._check_finished(run, done, reported, every, where)
                return kills
            if life.code != -signal.SIGKILL:
                self.fail(f"{where}: exit status {life.code}: {_tail(err)}")
                return kills
            # Killed: account for it, then check what the disk holds before restarting.
            kills += 1
            unrecovered += 1
            self.f.kills += 1
            self.f.kills_by_kind[kind] += 1
            state = inspect_run(run)
            if kind == "op":
                lines = _read_lines(note)[notes_before:]
                phase = _phase_of_note(lines[-1], run) if lines else "unknown"
            elif kind == "point":
                name = env[KILL_ENV].split("@")[0]
                phase = _POINT_PHASE["artifact" if name.startswith("artifact") else name]
            else:
                phase = _phase_of_state(state)
            self.f.kills_by_phase[phase] = self.f.kills_by_phase.get(phase, 0) + 1
            self.f.kills_log.append({"episode": number, "life": life_no, "kind": kind,
                                     "at": desc, "phase": phase, "complete": state.complete,
                                     "torn": state.torn, "corrupt": state.corrupt})
            self._after_kill(state, reported, where, number)
            expected = max(state.complete, default=0)

    def _after_kill(self, state: DiskState, reported: set[int], where: str, ep: int) -> None:
        for status, gens in (("torn", state.torn), ("corrupt", state.corrupt)):
            for g in gens:
                key = (ep, status, g)
                if key not in self._seen_bad:
                    self._seen_bad.add(key)
                    self._pending_bad[key] = None
                    if status == "torn":
                        self.f.torn_seen += 1
                    else:
                        self.f.corrupt_seen += 1
        self.f.staging_debris_seen += state.staging
        self.f.trash_debris_seen += state.trash
        if state.aside:
            self.fail(f"{where}: {state.aside} generation(s) moved aside after a crash")
        lost = lost_generations(reported, state.complete, KEEP_LAST)
        if lost:
            self.f.generations_lost += len(lost)
            self.fail(f"{where}: generations {lost} were reported committed and retention "
                      f"had to keep them, but the disk holds only {state.complete}")
        if not state.complete and reported:
            self.fail(f"{where}: no verified generation after commits of {sorted(reported)}")

    def _check_restore(self, e: dict[str, Any], expected: int, where: str, ep: int) -> bool:
        """Check a life's restore against the disk state seen after the last kill."""
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
        for key in list(self._pending_bad):
            if key[0] != ep:
                continue
            del self._pending_bad[key]
            if key[2] == step and step != 0:
                self.f.torn_or_corrupt_loaded += 1
                self.fail(f"{where}: loaded generation {step}, which was {key[1]}")
            elif key[1] == "torn":
                self.f.torn_refused += 1
            else:
                self.f.corrupt_refused += 1
        return len(self.f.failures) == failures

    def _check_finished(self, run: str, done: list[dict[str, Any]], reported: set[int],
                        every: int, where: str) -> None:
        if not done:
            self.fail(f"{where}: exited 0 without finishing")
            return
        state = inspect_run(run)
        saves = [s for s in range(every, STEPS + 1, every)]
        want = saves[-KEEP_LAST:]
        # Retention runs after each save: a run killed after committing its last generation
        # finishes without another save, so older generations (or a torn one whose deletion
        # was interrupted) may remain until the next save. Nothing newer may be missing.
        leftover = [g for g in state.complete + state.torn if g not in want]
        if (not set(want) <= set(state.complete) or state.corrupt
                or any(g > want[0] or g not in saves for g in leftover)):
            self.fail(f"{where}: finished run holds complete {state.complete}, torn "
                      f"{state.torn}, corrupt {state.corrupt}; expected {want}")
        if state.staging or state.trash or state.aside:
            self.fail(f"{where}: finished run left debris (staging {state.staging}, trash "
                      f"{state.trash}, aside {state.aside})")
        lost = lost_generations(reported, state.complete, KEEP_LAST)
        if lost:
            self.f.generations_lost += len(lost)
            self.fail(f"{where}: generations {lost} lost by the finished run")
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


def _count_lines(path: str) -> int:
    return len(_read_lines(path))


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no output)"


def prepare_parent() -> None:
    """Import what every life needs once, before any fork: building the first optimizer
    imports torch._dynamo (seconds); it runs no kernel, so no thread pool exists yet."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _retention_first() -> Callable[[], None]:
    """Accelerate's bug, on purpose: delete old generations *before* writing the new one."""
    original = Checkpointer.save

    def save(self: Checkpointer, step: int | None = None, **kw: Any) -> Any:
        for g in [g for g in self.store.scan() if g.ok][:-1]:
            self.store.delete(g)
        return original(self, step, **kw)

    Checkpointer.save = save  # type: ignore[method-assign]
    return lambda: setattr(Checkpointer, "save", original)


# Known-bad implementations the torture must catch (a test of the test: exit status 1).
SABOTAGE: dict[str, Callable[[], Callable[[], None]]] = {"retention-first": _retention_first}


def crash(kills: int, seed: int, workdir: str | None = None, kinds: tuple[str, ...] = KINDS,
          keep: bool = False, sabotage: str | None = None) -> Figures:
    prepare_parent()
    own = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="unbroken-torture-")
    os.makedirs(work, exist_ok=True)
    undo = SABOTAGE[sabotage]() if sabotage else None  # forked lives inherit it
    try:
        return Torture(kills, seed, work, kinds, keep).run()
    finally:
        if undo is not None:
            undo()
        if own and not keep:
            shutil.rmtree(work, ignore_errors=True)
