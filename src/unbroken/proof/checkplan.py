"""Where `unbroken check` interrupts a run: the structurally risky places of the reference run
by default, random points on top, or exactly the points a user names.

A kill point is an update number and a phase:

``after-update``  saved one update earlier, killed right after update K (K is replayed)
``mid-save``      killed inside the save of K, after its first file (resumes from K-1)
``after-commit``  generation K committed, killed before anything else ran (resumes from K)
``mid-update``    killed inside update K, after its optimizer step, before ``step_done``
                  recorded it (resumes from K-1)
``sigterm``       SIGTERM delivered inside update K, at its optimizer step: the script must
                  save at the next boundary and stop cleanly (``signals=``, ``should_stop``)

The default plan covers, from the reference trace: the first update, the last update of each
epoch saved exactly there (where an end-of-epoch scheduler step is lost by a script that saves
before it; a script that saves there itself is killed after its own first save there, so one
that saves after that step passes) so that the resume starts the next epoch, a save
interrupted midway, the update after a save, the first update after a resume killed inside
(after its optimizer step, before ``step_done``), and the final update. All of them run as
one *chain*: a run killed at the first point, resumed and killed at the next, and so on, then
finished; it costs about one run plus a process start per point. `missed` says why a process
was not interrupted as planned."""

from __future__ import annotations

import random
import signal
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from .._env import SAVE_AT_ENV, SIGNAL_AT_ENV
from ..errors import UnbrokenError
from ..store.backends.killpoints import KILL_ENV

PHASES = ("after-update", "mid-save", "after-commit", "mid-update", "sigterm")
RANDOM_PHASES = ("after-update", "mid-save", "after-commit")
_MAX_EPOCH_EDGES = 3  # epochs whose edges the default plan covers: the first ones and the last


@dataclass(frozen=True)
class Kill:
    """One interruption: at update ``at``, in ``phase``, chosen because of ``place``."""

    at: int
    phase: str
    place: str = "chosen"

    def env(self, saves: Collection[int] = ()) -> dict[str, str]:
        """How the interrupted process is made to save and die at this point (``saves``: the
        steps the script saves at by itself)."""
        k = self.at
        before = str(max(1, k - 1))
        if self.phase == "after-update":  # saved one update earlier; the kill loses update k
            return {SAVE_AT_ENV: before, KILL_ENV: f"step-done@{k}"}
        if self.phase == "mid-save":  # dies inside the save of k, after its first file
            return {SAVE_AT_ENV: f"{before},{k}", KILL_ENV: f"artifact-1-written@{k}"}
        if self.phase == "after-commit":  # generation k is committed, nothing after it ran
            # (at a step the script saves at itself, its own save: one it makes after its
            # end-of-epoch code holds that code's effect, and a save added at step_done would
            # not; where its own first save there comes before that code, that is tested)
            return ({KILL_ENV: f"after-rename@{k}"} if k in saves
                    else {SAVE_AT_ENV: str(k), KILL_ENV: f"after-rename@{k}"})
        if self.phase == "mid-update":  # weights updated, counters and trace not yet
            return {SAVE_AT_ENV: before, KILL_ENV: f"update-end@{k}"}
        if self.phase == "sigterm":
            return {SAVE_AT_ENV: before, SIGNAL_AT_ENV: str(k)}
        raise ValueError(f"phase {self.phase!r}: one of {PHASES}")

    def resumes_from(self, saves: Collection[int] = ()) -> int:
        """The step a correct resume after this kill restores (``saves``: the steps the script
        saves at by itself; an after-update kill at one of them comes after that save)."""
        if self.phase in ("after-commit", "sigterm") or (
                self.phase == "after-update" and self.at in saves):
            return self.at
        return max(1, self.at - 1)

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "phase": self.phase, "place": self.place}


def _check_phases(phases: Sequence[str]) -> None:
    for p in phases:
        if p not in PHASES:
            raise UnbrokenError(f"--phase {p!r}: one of {', '.join(PHASES)}")


def explicit_plan(steps: int, at: Sequence[int], phases: Sequence[str]) -> list[list[Kill]]:
    """``--at K``: one independent case per point and phase (default: the three classic)."""
    phases = tuple(phases) or RANDOM_PHASES
    _check_phases(phases)
    for k in at:
        if not 1 <= k <= steps:
            raise UnbrokenError(f"--at {k}: the reference run made {steps} updates")
    return [[Kill(k, p, "chosen (--at)")] for k in at for p in phases]


def default_plan(reference: list[dict[str, Any]], random_n: int = 0, seed: int = 0,
                 phases: Sequence[str] = ()) -> list[Kill]:
    """The chain of the structurally risky places of ``reference`` plus ``random_n`` random
    points. With ``phases``, every point uses those phases in turn instead.

    Every point is a process start, so one point covers several places where it can: the
    resumed process that dies inside its first update covers both "the first update after
    a resume" and "inside an update"; a save at an epoch's last update, resumed, covers that
    update and the first of the next epoch."""
    _check_phases(phases)
    updates = [r for r in reference if r.get("event") == "update"]
    steps = [r["step"] for r in updates]
    if len(steps) < 2:
        raise UnbrokenError(f"the reference run made {len(steps)} update(s); interrupting it "
                            "needs at least 2")
    final = steps[-1]
    wanted = [Kill(steps[0], "after-update", "first update of the run")]
    by_epoch: dict[int, list[int]] = {}
    for r in updates:
        if isinstance(r.get("epoch"), int):
            by_epoch.setdefault(r["epoch"], []).append(r["step"])
    edges = [e for e in sorted(by_epoch) if by_epoch[e][-1] != final]
    if len(edges) > _MAX_EPOCH_EDGES:
        edges = edges[:_MAX_EPOCH_EDGES - 1] + edges[-1:]
    for e in edges:
        wanted.append(Kill(by_epoch[e][-1], "after-commit", f"last update of epoch {e}, saved "
                           f"there (the resume starts epoch {e + 1})"))
    saves = sorted({r["step"] for r in reference if r.get("event") == "save"} - {final})
    s = saves[0] if saves else steps[len(steps) // 2]
    wanted.append(Kill(s, "mid-save", f"inside the save at {s}"))
    if s + 1 < final:
        wanted.append(Kill(s + 1, "after-update", f"the update after the save at {s}"))
        wanted.append(Kill(s + 1, "mid-update", "the first update after a resume, killed "
                           "after its optimizer step"))
    wanted.append(Kill(final, "after-update", "the final update"))
    if random_n:
        # Distinct updates, none a place above: a point drawn twice would be killed twice (or
        # dropped from the chain) and take a slot a new point could have; fewer when the run
        # has fewer updates left.
        free = sorted(set(steps[1:-1]) - {k.at for k in wanted})
        drawn = random.Random(seed).sample(free, min(random_n, len(free)))
        wanted += [Kill(at, RANDOM_PHASES[i % len(RANDOM_PHASES)], "random")
                   for i, at in enumerate(drawn)]
    if phases:
        wanted = [Kill(k.at, phases[i % len(phases)], k.place) for i, k in enumerate(wanted)]
    return _chain(wanted, set(saves))


def _chain(wanted: list[Kill], saves: Collection[int]) -> list[Kill]:
    """Order the points so that each is reachable from the resume before it (a later point
    lies after the previous resume). At most two points per update, the second only when
    the first resumes before it (it then kills the resumed process there again)."""
    order = {p: i for i, p in enumerate(PHASES)}
    chain: list[Kill] = []
    resumed = 0
    for k in sorted(wanted, key=lambda k: (k.at, k.place == "random", order[k.phase])):
        if k.at <= resumed:
            last = chain[-1] if chain else None
            if last and (last.at, last.phase) == (k.at, k.phase) and k.place not in last.place:
                chain[-1] = Kill(last.at, last.phase, f"{last.place}; {k.place}")  # same point
            continue
        chain.append(k)
        resumed = k.resumes_from(saves)
    return chain


def missed(kill: Kill, code: int, records: list[dict[str, Any]], who: str) -> str:
    """Why the process ``who`` (its exit ``code`` and trace ``records``) was not interrupted
    as ``kill`` planned ("" when it was)."""
    updates = [r["step"] for r in records if r["event"] == "update"]
    restored = next((r["step"] for r in records if r["event"] == "restore"), 0)
    reached = max([*updates, restored])
    if kill.phase == "sigterm":
        stops = [r for r in records if r["event"] == "stop"]
        if code == -signal.SIGTERM:
            return ("SIGTERM killed the script: pass signals=(signal.SIGTERM,) to the "
                    "Checkpointer and leave the training loop when ckpt.should_stop")
        if code != 0:
            return f"after SIGTERM the script exited with {code}, not 0"
        if not stops:
            return (f"SIGTERM at update {kill.at} did not stop the script (it ran to update "
                    f"{reached}): leave the training loop when ckpt.should_stop")
        if reached != stops[0]["step"]:
            return (f"the script went on after the stop save at {stops[0]['step']} (to "
                    f"{reached}): leave the training loop when ckpt.should_stop")
        return ""
    # killed inside update K (at its optimizer step), its record is not written
    needed = kill.at - 1 if kill.phase == "mid-update" else kill.at
    if code != -signal.SIGKILL or reached < needed:
        when = (f"after update {reached}" if updates else
                "right after its restore" if restored else "before its first update")
        return f"{who} exited with {code} {when}, before reaching update {kill.at}"
    return ""
