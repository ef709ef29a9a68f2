"""The proof harness: run a training command uninterrupted, then interrupt copies of it with a
real SIGKILL at chosen points, resume each in a fresh process, and compare the traces.

The command is any script that uses `unbroken.Checkpointer`; it is steered through the
environment only (``$UNBROKEN_ROOT``, ``$UNBROKEN_TRACE``, ``$UNBROKEN_SAVE_AT``,
``$UNBROKEN_KILL_AT``, ``$UNBROKEN_FAULT_DROP``), so it runs unchanged."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._fs import KILL_ENV
from .checkpointer import ROOT_ENV, SAVE_AT_ENV
from .equivalence import Comparison, compare
from .errors import UnbrokenError
from .faults import DROP_ENV
from .trace import TRACE_ENV, TRACE_HASH_ENV, read_trace

PHASES = ("after-update", "mid-save", "after-commit")


@dataclass(frozen=True)
class Case:
    """One interruption: kill at update ``at`` in ``phase``."""

    at: int
    phase: str

    def env(self) -> dict[str, str]:
        """How the interrupted process is made to save and die at this point."""
        k = self.at
        if self.phase == "after-update":  # saved one update earlier; the kill loses update k
            return {SAVE_AT_ENV: str(max(1, k - 1)), KILL_ENV: f"step-done@{k}"}
        if self.phase == "mid-save":  # dies inside the save of k, after its first file
            return {SAVE_AT_ENV: f"{max(1, k - 1)},{k}", KILL_ENV: f"artifact-1-written@{k}"}
        if self.phase == "after-commit":  # generation k is committed, nothing after it ran
            return {SAVE_AT_ENV: str(k), KILL_ENV: f"after-rename@{k}"}
        raise ValueError(f"phase {self.phase!r}: one of {PHASES}")


@dataclass
class CaseResult:
    case: Case
    verdict: str  # equivalent | diverged | untested | error
    resumed_from: int | None = None
    comparison: Comparison | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        d = self.comparison.first_divergence if self.comparison else None
        return {"interrupt_at": self.case.at, "phase": self.case.phase,
                "resumed_from": self.resumed_from, "verdict": self.verdict, "note": self.note,
                "first_divergence": None if d is None else {
                    "step": d.step, "field": d.field, "state_part": d.state_part,
                    "kind": d.kind, "also": d.also, "expected": d.expected, "found": d.found},
                "restore_differs": self.comparison.restore_differs if self.comparison else []}


@dataclass
class CheckReport:
    command: list[str]
    steps: int
    cases: list[CaseResult] = field(default_factory=list)
    reference_loss: list[tuple[int, float]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if any(c.verdict in ("diverged", "error") for c in self.cases):
            return "diverged"
        if not self.cases or any(c.verdict == "untested" for c in self.cases):
            return "untested"
        return "equivalent"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "command": self.command, "steps": self.steps,
                "cases": [c.to_json() for c in self.cases]}


def plan(steps: int, at: Sequence[int] = (), random_n: int = 0, seed: int = 0,
         phases: Sequence[str] = ()) -> list[Case]:
    """Interruption points: every ``at`` in every phase, plus ``random_n`` random points in
    [2, steps - 1] cycling through the phases (so a handful covers all three)."""
    phases = tuple(phases) or PHASES
    for p in phases:
        if p not in PHASES:
            raise UnbrokenError(f"--phase {p!r}: one of {', '.join(PHASES)}")
    cases = [Case(k, p) for k in at for p in phases]
    if random_n:
        if steps < 3:
            raise UnbrokenError(f"the reference run made {steps} updates; random interruption "
                                "points need at least 3")
        rng = random.Random(seed)
        points = [rng.randint(2, steps - 1) for _ in range(random_n)]
        cases += [Case(k, phases[i % len(phases)]) for i, k in enumerate(points)]
    for c in cases:
        if not 1 <= c.at <= steps:
            raise UnbrokenError(f"--at {c.at}: the reference run made {steps} updates")
    return cases


def _clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    # A check compares every digest at every update, whatever cadence the script chose: the
    # reference cannot know where the interrupted copies will resume.
    env[TRACE_HASH_ENV] = "1"
    env.update(extra)
    return env


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the process group (workers included)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


class Timeout(UnbrokenError):
    """A process of the check ran past its time limit (and was killed)."""


def run_process(cmd: Sequence[str], env: Mapping[str, str], log: str,
                timeout: float) -> int:
    """Run ``cmd`` in its own process group; afterwards SIGKILL whatever is left of the group
    and wait until it is empty, so no worker of a killed run outlives it. Raises `Timeout`
    past ``timeout`` seconds; an interrupt (Ctrl-C) of the check takes the group down too
    (it runs in its own session, so the terminal's signal does not reach it)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(cmd), env=_clean_env(env), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _wait_group_gone(proc.pid)
            if isinstance(e, subprocess.TimeoutExpired):
                out.write(f"\n[unbroken check] killed after {timeout:.0f} s\n".encode())
                raise Timeout(f"{' '.join(cmd)} ran past {timeout:.0f} s (see {log})") from None
            raise
    _wait_group_gone(proc.pid)
    return code


def _wait_group_gone(pgid: int) -> None:
    deadline = time.monotonic() + 30
    while _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            raise UnbrokenError(f"processes of group {pgid} survive SIGKILL")
        time.sleep(0.02)


def run_check(cmd: Sequence[str], workdir: str, *, at: Sequence[int] = (), random_n: int = 0,
              seed: int = 0, phases: Sequence[str] = (), rtol: float = 0.0, atol: float = 0.0,
              exact_steps: int | None = None, drop: str | None = None,
              reference_trace: str | None = None, timeout: float = 600.0,
              progress: Any = None) -> CheckReport:
    """Run the whole proof; ``drop`` injects a defect (a state part not restored);
    ``reference_trace`` reuses the trace of an earlier uninterrupted run of the same command."""
    say = progress or (lambda msg: None)
    os.makedirs(workdir, exist_ok=True)
    if reference_trace is None:
        ref_dir = os.path.join(workdir, "reference")
        os.makedirs(ref_dir, exist_ok=True)
        reference_trace = os.path.join(ref_dir, "trace.jsonl")
        say("reference run (uninterrupted) ...")
        code = run_process(cmd, {ROOT_ENV: os.path.join(ref_dir, "run"),
                                 TRACE_ENV: reference_trace},
                           os.path.join(ref_dir, "output.log"), timeout)
        if code != 0 or not os.path.exists(reference_trace):
            raise UnbrokenError(f"the reference run exited with {code} (see "
                                f"{os.path.join(ref_dir, 'output.log')}); or it wrote no "
                                "trace: does the script use unbroken.Checkpointer?")
    reference = read_trace(reference_trace)
    steps = max((r["step"] for r in reference if r["event"] == "update"), default=0)
    report = CheckReport(list(cmd), steps)
    from .equivalence import _as_float  # the loss curve for the plot

    report.reference_loss = [(r["step"], _as_float(r.get("loss")) or float("nan"))
                             for r in reference if r["event"] == "update"]
    for i, case in enumerate(plan(steps, at, random_n, seed, phases)):
        say(f"case {i + 1}: kill at update {case.at} ({case.phase}) ...")
        report.cases.append(_run_case(cmd, case, os.path.join(workdir, f"case-{i + 1:02d}"),
                                      reference, rtol, atol, exact_steps, drop, timeout))
    return report


def _run_case(cmd: Sequence[str], case: Case, folder: str, reference: list[dict[str, Any]],
              rtol: float, atol: float, exact_steps: int | None, drop: str | None,
              timeout: float) -> CaseResult:
    os.makedirs(folder, exist_ok=True)
    root = os.path.join(folder, "run")
    first, second = os.path.join(folder, "killed.jsonl"), os.path.join(folder, "resumed.jsonl")
    log = os.path.join(folder, "output.log")
    try:
        code = run_process(cmd, {ROOT_ENV: root, TRACE_ENV: first, **case.env()}, log, timeout)
    except Timeout as e:
        return CaseResult(case, "error", note=f"the interrupted run hung: {e}")
    records = read_trace(first) if os.path.exists(first) else []
    reached = max((r["step"] for r in records if r["event"] == "update"), default=0)
    if code != -signal.SIGKILL or reached < case.at:
        return CaseResult(case, "untested", note=f"the interrupted run exited with {code} "
                          f"after update {reached}, before reaching the kill point")
    resume_env = {ROOT_ENV: root, TRACE_ENV: second}
    if drop:
        resume_env[DROP_ENV] = drop
    try:
        code = run_process(cmd, resume_env, log, timeout)
    except Timeout as e:
        return CaseResult(case, "error", note=f"the resumed run hung: {e}")
    if code != 0:
        return CaseResult(case, "error", note=f"the resumed run exited with {code}; see {log}")
    result = compare(reference, [read_trace(first), read_trace(second)], rtol=rtol, atol=atol,
                     exact_steps=exact_steps)
    verdict = result.verdict
    note = ""
    if result.resumed_from in (None, 0):
        verdict = "untested" if verdict == "untested" else verdict
        note = "resumed from step 0: the resume was not exercised"
    return CaseResult(case, verdict, result.resumed_from, result, note)


def format_report(report: CheckReport, workdir: str) -> str:
    """The terminal report: one row per interruption and a verdict."""
    from ._table import table

    rows = []
    for c in report.cases:
        d = c.comparison.first_divergence if c.comparison else None
        where = "-" if d is None else f"step {d.step}: {d.field} -> {d.state_part} ({d.kind})"
        rows.append([c.case.at, c.case.phase, "-" if c.resumed_from is None else c.resumed_from,
                     c.verdict, where if d else (c.note or "-")])
    lines = [f"unbroken check: {' '.join(report.command)}",
             f"reference: {report.steps} updates, uninterrupted", "",
             table(["killed at", "phase", "resumed from", "verdict", "first divergence"], rows,
                   right=(0, 2), indent="  "), ""]
    for c in report.cases:
        d = c.comparison.first_divergence if c.comparison else None
        if d is not None:
            lines.append(f"  killed at {c.case.at} ({c.case.phase}): first differs at update "
                         f"{d.step} in {d.field!r}: expected {d.expected!r}, found {d.found!r}")
            lines.append(f"    explained by: {d.state_part}" +
                         (f"; also differs: {', '.join(d.also)}" if d.also else "") +
                         f"; a {d.kind}" + {"jump": " at the resume step (missing state)",
                                            "drift": " from tiny values (numerics)",
                                            "irreproducible": " before the interruption (the "
                                            "script is not deterministic)"}.get(d.kind, ""))
    verdict = {"equivalent": "EQUIVALENT: every resumed run matches the uninterrupted one",
               "diverged": "DIVERGED", "untested": "UNTESTED: some resume was not exercised"}
    lines += ["", f"verdict: {verdict[report.verdict]}", f"runs, traces and logs: {workdir}"]
    return "\n".join(lines)
