"""What a check found: each interruption (`KillResult`), each case (`CaseResult`) and the
whole report (`CheckReport`), as the harness fills them and the report shows them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .checkplan import Kill
from .equivalence import Comparison


@dataclass
class KillResult:
    """What happened at one interruption of a case."""

    kill: Kill
    reached: bool = False
    exit_code: int | None = None
    resumed_from: int | None = None  # the step the next process restored
    resume_failed: bool = False  # the process resumed after it failed: nothing was proved
    note: str = ""
    # the newest step the reference saved that a correct resume after this kill restores
    # (None: unknown); a resume from before it (an async save not yet committed when the
    # process was killed) did not test this place
    expected: int | None = None

    @property
    def covered(self) -> bool:
        """Interrupted as planned and resumed, from the generation planned, by a process that
        did not fail."""
        early = (self.expected is not None and self.resumed_from is not None
                 and self.resumed_from < self.expected)
        return self.reached and not self.resume_failed and not early

    def to_json(self) -> dict[str, Any]:
        return {**self.kill.to_json(), "reached": self.reached, "covered": self.covered,
                "exit_code": self.exit_code, "resumed_from": self.resumed_from,
                "note": self.note}


@dataclass
class CaseResult:
    """One case: a run interrupted at one point, or at a chain of points, then finished."""

    kills: list[KillResult]
    verdict: str  # equivalent | diverged | untested | error
    comparison: Comparison | None = None  # in a job, of the rank that explains the case
    note: str = ""
    rank: int | None = None  # in a job: the rank whose trace `comparison` is
    log: str = ""  # a failed process's whole output, relative to the working folder

    @property
    def resumed_from(self) -> int | None:
        return self.comparison.resumed_from if self.comparison else None

    def to_json(self) -> dict[str, Any]:
        d = self.comparison.first_divergence if self.comparison else None
        first = self.kills[0]
        return {"interrupt_at": first.kill.at, "phase": first.kill.phase, "rank": self.rank,
                "kills": [k.to_json() for k in self.kills],
                "resumed_from": self.resumed_from, "verdict": self.verdict, "note": self.note,
                "first_divergence": None if d is None else {
                    "step": d.step, "field": d.field, "state_part": d.state_part,
                    "kind": d.kind, "also": d.also, "expected": d.expected, "found": d.found,
                    "hint": d.hint},
                "restore_differs": self.comparison.restore_differs if self.comparison else [],
                "notes": self.comparison.notes if self.comparison else []}


@dataclass
class CheckReport:
    command: list[str]
    steps: int
    cases: list[CaseResult] = field(default_factory=list)
    reference_loss: list[tuple[int, float]] = field(default_factory=list)
    # The uninterrupted reference run failed (nothing was interrupted): why, and its log.
    error: str = ""
    log: str = ""

    @property
    def verdict(self) -> str:
        """diverged > error > untested > equivalent: the worst case decides."""
        verdicts = {c.verdict for c in self.cases} | ({"error"} if self.error else set())
        for v in ("diverged", "error", "untested"):
            if v in verdicts:
                return v
        return "equivalent" if self.cases else "untested"

    @property
    def covered(self) -> list[str]:
        """The places the interruptions covered (reached and resumed)."""
        return [f"{k.kill.place} (update {k.kill.at}, {k.kill.phase})" for c in self.cases
                for k in c.kills if k.covered]

    def to_json(self) -> dict[str, Any]:
        # (a case whose process failed says why in its note: the first such is the error)
        failed = next((c.note for c in self.cases if c.verdict == "error" and c.note), None)
        return {"verdict": self.verdict, "command": self.command, "steps": self.steps,
                "error": self.error or failed, "covered": self.covered,
                "cases": [c.to_json() for c in self.cases]}
