"""The proof harness: run a training command uninterrupted, then interrupt copies of it with a
real SIGKILL at chosen points, resume each in a fresh process, and compare the traces.

The command is any script that uses `unbroken.Checkpointer`; it is steered through the
environment only (``$UNBROKEN_ROOT``, ``$UNBROKEN_TRACE``, ``$UNBROKEN_SAVE_AT``,
``$UNBROKEN_KILL_AT``, ``$UNBROKEN_FAULT_DROP``), so it runs unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checkpointer import ROOT_ENV
from ..errors import UnbrokenError
from ..faults import DROP_ENV
from ..trace import TRACE_ENV, TRACE_HASH_ENV, read_trace
from .checkplan import PHASES, Kill, default_plan, explicit_plan
from .equivalence import Comparison, as_float, compare

__all__ = ["PHASES", "CheckReport", "format_report", "run_check"]

@dataclass
class KillResult:
    """What happened at one interruption of a case."""

    kill: Kill
    reached: bool = False
    exit_code: int | None = None
    resumed_from: int | None = None  # the step the next process restored
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**self.kill.to_json(), "reached": self.reached, "exit_code": self.exit_code,
                "resumed_from": self.resumed_from, "note": self.note}


@dataclass
class CaseResult:
    """One case: a run interrupted at one point, or at a chain of points, then finished."""

    kills: list[KillResult]
    verdict: str  # equivalent | diverged | untested | error
    comparison: Comparison | None = None
    note: str = ""

    @property
    def resumed_from(self) -> int | None:
        return self.comparison.resumed_from if self.comparison else None

    def to_json(self) -> dict[str, Any]:
        d = self.comparison.first_divergence if self.comparison else None
        first = self.kills[0]
        return {"interrupt_at": first.kill.at, "phase": first.kill.phase,
                "kills": [k.to_json() for k in self.kills],
                "resumed_from": self.resumed_from, "verdict": self.verdict, "note": self.note,
                "first_divergence": None if d is None else {
                    "step": d.step, "field": d.field, "state_part": d.state_part,
                    "kind": d.kind, "also": d.also, "expected": d.expected, "found": d.found},
                "restore_differs": self.comparison.restore_differs if self.comparison else [],
                "notes": self.comparison.notes if self.comparison else []}


@dataclass
class CheckReport:
    command: list[str]
    steps: int
    cases: list[CaseResult] = field(default_factory=list)
    reference_loss: list[tuple[int, float]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """diverged > error > untested > equivalent: the worst case decides."""
        verdicts = {c.verdict for c in self.cases}
        for v in ("diverged", "error", "untested"):
            if v in verdicts:
                return v
        return "equivalent" if self.cases else "untested"

    @property
    def covered(self) -> list[str]:
        """The places the interruptions covered (reached and resumed)."""
        return [f"{k.kill.place} (update {k.kill.at}, {k.kill.phase})" for c in self.cases
                for k in c.kills if k.reached]

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "command": self.command, "steps": self.steps,
                "covered": self.covered, "cases": [c.to_json() for c in self.cases]}


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


def _tail(path: str, lines: int = 15) -> str:
    """The end of a process's own output, to show why it failed."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_check(cmd: Sequence[str], workdir: str, *, at: Sequence[int] = (), random_n: int = 0,
              seed: int = 0, phases: Sequence[str] = (), rtol: float = 0.0, atol: float = 0.0,
              exact_steps: int | None = None, drop: str | None = None,
              reference_trace: str | None = None, timeout: float = 600.0,
              progress: Any = None) -> CheckReport:
    """Run the whole proof; ``drop`` injects a defect (a state part not restored);
    ``reference_trace`` reuses the trace of an earlier uninterrupted run of the same command.
    Without ``at``, the run is interrupted at the structurally risky places of the reference
    (`checkplan.default_plan`) plus ``random_n`` random points, as one chain."""
    say = progress or (lambda msg: None)
    os.makedirs(workdir, exist_ok=True)
    if reference_trace is None:
        ref_dir = os.path.join(workdir, "reference")
        os.makedirs(ref_dir, exist_ok=True)
        reference_trace = os.path.join(ref_dir, "trace.jsonl")
        log = os.path.join(ref_dir, "output.log")
        say("reference run (uninterrupted) ...")
        code = run_process(cmd, {ROOT_ENV: os.path.join(ref_dir, "run"),
                                 TRACE_ENV: reference_trace}, log, timeout)
        if code != 0:
            raise UnbrokenError(f"the uninterrupted reference run exited with {code}; the end "
                                f"of its output ({log}):\n{_tail(log)}")
        if not os.path.exists(reference_trace):
            raise UnbrokenError("the reference run wrote no trace: does the script build an "
                                f"unbroken.Checkpointer? (output: {log})")
    reference = read_trace(reference_trace)
    steps = max((r["step"] for r in reference if r["event"] == "update"), default=0)
    report = CheckReport(list(cmd), steps)
    report.reference_loss = [(r["step"], as_float(r.get("loss")) or float("nan"))
                             for r in reference if r["event"] == "update"]
    cases = (explicit_plan(steps, at, phases) if at else
             [default_plan(reference, random_n, seed, phases)])
    for i, kills in enumerate(cases):
        where = ", ".join(f"{k.at} ({k.phase})" for k in kills)
        say(f"case {i + 1}: interrupt at update {where} ...")
        report.cases.append(_run_case(cmd, kills, os.path.join(workdir, f"case-{i + 1:02d}"),
                                      reference, rtol, atol, exact_steps, drop, timeout, say))
    return report


def _run_case(cmd: Sequence[str], kills: list[Kill], folder: str,
              reference: list[dict[str, Any]], rtol: float, atol: float,
              exact_steps: int | None, drop: str | None, timeout: float, say: Any
              ) -> CaseResult:
    """Run ``cmd`` interrupted at each of ``kills`` in turn (each life resumes the previous
    one), then to the end; compare the stitched trace with the reference."""
    os.makedirs(folder, exist_ok=True)
    root, log = os.path.join(folder, "run"), os.path.join(folder, "output.log")
    results = [KillResult(k) for k in kills]
    traces: list[str] = []
    previous: KillResult | None = None  # the last interruption that ran
    for result in [*results, None]:
        trace = os.path.join(folder, f"life-{len(traces) + 1:02d}.jsonl")
        env = {ROOT_ENV: root, TRACE_ENV: trace}
        if previous is not None and drop:
            env[DROP_ENV] = drop
        if result is not None:
            ahead = _newest_step(root) if previous is not None else None
            if ahead is not None and ahead >= result.kill.at:
                # The run resumes past this point (the script saved there by itself).
                result.note = f"skipped: the run resumes from {ahead}, past this point"
                continue
            env.update(result.kill.env())
        traces.append(trace)
        try:
            code = run_process(cmd, env, log, timeout)
        except Timeout as e:
            return CaseResult(results, "error", note=f"a process hung: {e}")
        records = read_trace(trace) if os.path.exists(trace) else []
        if previous is not None:
            previous.resumed_from = next((r["step"] for r in records
                                          if r["event"] == "restore"), None)
        if result is None:
            if code != 0:
                return CaseResult(results, "error", note=f"the resumed run exited with {code}; "
                                  f"the end of its output ({log}):\n{_tail(log)}")
            break
        result.exit_code = code
        problem = _interrupted(result.kill, code, records)
        if problem:
            result.note = problem
            verdict = "error" if result.kill.phase == "sigterm" or code not in (0, -9) else \
                "untested"
            if result.kill.phase == "sigterm" or code not in (0, -signal.SIGKILL):
                problem += f"; the end of its output ({log}):\n{_tail(log)}"
            return CaseResult(results, verdict, note=problem)
        result.reached = True
        previous = result
    segments = [read_trace(t) if os.path.exists(t) else [] for t in traces]
    comparison = compare(reference, segments, rtol=rtol, atol=atol, exact_steps=exact_steps)
    note = "" if comparison.verdict != "untested" else \
        "every resume started from step 0: the resume was not exercised"
    return CaseResult(results, comparison.verdict, comparison, note)


def _newest_step(root: str) -> int | None:
    """The step of the newest complete generation in ``root`` (where a resume starts)."""
    from ..store.generations import GenerationStore

    complete = [g for g in GenerationStore(root).scan() if g.ok and g.manifest is not None]
    return complete[-1].manifest.step if complete else None  # type: ignore[union-attr]


def _interrupted(kill: Kill, code: int, records: list[dict[str, Any]]) -> str:
    """Why this life did not interrupt as planned ("" when it did)."""
    reached = max((r["step"] for r in records if r["event"] in ("update", "restore")),
                  default=0)
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
        return (f"the interrupted run exited with {code} after update {reached}, before "
                f"reaching update {kill.at}")
    return ""


def format_report(report: CheckReport, workdir: str | None) -> str:
    """The terminal report: one row per interruption, the first divergence, and a verdict."""
    from .._table import table

    rows = []
    for n, c in enumerate(report.cases, 1):
        for k in c.kills:
            rows.append([n, k.kill.at, k.kill.phase, k.kill.place,
                         "-" if k.resumed_from is None else k.resumed_from,
                         "yes" if k.reached else "no"])
    lines = [f"unbroken check: {' '.join(report.command)}",
             f"reference: {report.steps} updates, uninterrupted", "",
             table(["case", "killed at", "phase", "place", "resumed from", "covered"], rows,
                   right=(0, 1, 4), indent="  "), ""]
    for n, c in enumerate(report.cases, 1):
        d = c.comparison.first_divergence if c.comparison else None
        head = f"  case {n}: {c.verdict.upper()}"
        if d is not None:
            lines.append(f"{head}: first differs at update {d.step} in {d.field!r}: expected "
                         f"{d.expected!r}, found {d.found!r}")
            lines.append(f"    fix: {d.state_part}" +
                         (f"; also differs: {', '.join(d.also)}" if d.also else "") +
                         f"; {'an' if d.kind[0] in 'aeiou' else 'a'} {d.kind}" +
                         {"jump": " after a resume (missing state)",
                                            "drift": " from tiny values (numerics)",
                                            "irreproducible": " before the interruption (the "
                                            "script is not deterministic)"}.get(d.kind, ""))
        else:
            lines.append(head + (f": {c.note}" if c.note else ""))
        for note in c.comparison.notes if c.comparison else []:
            lines.append(f"    note: {note}")
    verdict = {"equivalent": "EQUIVALENT: every resumed run matches the uninterrupted one",
               "diverged": "DIVERGED", "error": "ERROR: a process failed (see above)",
               "untested": "UNTESTED: some resume was not exercised"}
    lines += ["", f"verdict: {verdict[report.verdict]}"]
    if workdir:
        lines.append(f"runs, traces and logs: {workdir}")
    return "\n".join(lines)
