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

from .. import _procs
from ..checkpointer import ROOT_ENV
from ..errors import UnbrokenError
from ..faults import DROP_ENV
from ..trace import TRACE_ENV, TRACE_HASH_ENV, read_trace
from .checkplan import PHASES, Kill, default_plan, explicit_plan
from .equivalence import Comparison, as_float, compare

__all__ = ["PHASES", "CheckReport", "format_report", "run_check"]
_POLL = 0.05  # seconds between looks at the job's processes (and its exit)

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
    comparison: Comparison | None = None  # in a job, of the rank that explains the case
    note: str = ""
    rank: int | None = None  # in a job: the rank whose trace `comparison` is

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


class Timeout(UnbrokenError):
    """A process of the check ran past its time limit (and was killed)."""


def run_process(cmd: Sequence[str], env: Mapping[str, str], log: str,
                timeout: float) -> int:
    """Run ``cmd`` in its own process group; afterwards SIGKILL whatever is left of the job
    and wait until it is gone, so no worker of a killed run outlives it. The job is the
    process group and every process started under it, followed by parent links while it runs:
    torchrun starts each rank in a session of its own. Raises `Timeout` past ``timeout``
    seconds; an interrupt (Ctrl-C) of the check takes the job down too (it runs in its own
    session, so the terminal's signal does not reach it).

    The group leader is reaped only after its group is gone: while it stands as a zombie, its
    pid (the group's id) cannot be given to another process, so the group's SIGKILLs never
    reach a process group that took the number over (a persisting process, which leads a
    session of its own, was killed so in a run of the test suite)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(cmd), env=_clean_env(env), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        seen: set[_procs.Process] = set()
        deadline = time.monotonic() + timeout
        try:
            while not _exited(proc.pid):
                seen |= _procs.tree(proc.pid)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(list(cmd), timeout)
                time.sleep(_POLL)
        except BaseException as e:
            os.killpg(proc.pid, signal.SIGKILL)  # (not reaped: the group is still its own)
            _wait_job_gone(proc.pid, seen)
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                out.write(f"\n[unbroken check] killed after {timeout:.0f} s\n".encode())
                out.flush()
                raise Timeout(f"{' '.join(cmd)} ran past {timeout:.0f} s; "
                              f"{_output_of(log)}") from None
            raise
    _wait_job_gone(proc.pid, seen)
    return proc.wait()


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has ended, without reaping it (it stays a zombie)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _wait_job_gone(pgid: int, seen: set[_procs.Process]) -> None:
    """SIGKILL what is left of the job until nothing is: ``seen`` (pinned, `_procs.kill`)
    and the group ``pgid``, whose leader, this process's child, is not reaped yet."""
    deadline = time.monotonic() + 30
    while _procs.kill(seen) or _procs.group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if time.monotonic() > deadline:
            raise UnbrokenError(f"processes of job {pgid} survive SIGKILL")
        time.sleep(0.02)


def _output_of(log: str) -> str:
    """The end of a process's output, for a message or a case's note, its log named by its
    place in the working folder (``reference/output.log``), never by its full path.

    The output itself goes into the message rather than the working folder being kept: a
    failed check would otherwise leave its runs (checkpoints: often gigabytes) in /tmp on every
    failure, while what the user needs is why the script failed, which is at the end of its
    output. `unbroken check` removes a temporary working folder before it shows the message,
    so a full path would name a deleted file; --keep or --workdir DIR keep the whole log."""
    where = f"{os.path.basename(os.path.dirname(log))}/{os.path.basename(log)}"
    tail = _tail(log)
    if not tail:
        return f"it printed nothing ({where} in the working folder is empty)"
    return f"the end of its output ({where} in the working folder):\n{tail}"


def _tail(path: str, lines: int = 40) -> str:
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
            raise UnbrokenError(f"the uninterrupted reference run exited with {code}; "
                                f"{_output_of(log)}")
        if not rank_traces(reference_trace):
            raise UnbrokenError("the reference run wrote no trace (does the script build an "
                                f"unbroken.Checkpointer?); {_output_of(log)}")
    references = {r: read_trace(t) for r, t in rank_traces(reference_trace).items()}
    if not references:
        raise UnbrokenError(f"{reference_trace}: no such trace (nor one per rank, .rank0 ...)")
    reference = references[min(references, key=lambda r: -1 if r is None else r)]
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
                                      references, rtol, atol, exact_steps, drop, timeout, say))
    return report


def rank_traces(path: str) -> dict[int | None, str]:
    """The trace a process wrote at ``path`` ({None: path}), or those the ranks of a job wrote
    (``path.rank0``, ``path.rank1``, ...: {0: ..., 1: ...})."""
    if os.path.isfile(path):
        return {None: path}
    found: dict[int | None, str] = {}
    folder, name = os.path.split(path)
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return found
    for entry in entries:
        rank = entry[len(name) + 5:] if entry.startswith(name + ".rank") else ""
        if rank.isdigit():
            found[int(rank)] = os.path.join(folder, entry)
    return found


def _run_case(cmd: Sequence[str], kills: list[Kill], folder: str,
              references: dict[int | None, list[dict[str, Any]]], rtol: float, atol: float,
              exact_steps: int | None, drop: str | None, timeout: float, say: Any
              ) -> CaseResult:
    """Run ``cmd`` interrupted at each of ``kills`` in turn (each life resumes the previous
    one), then to the end; compare the stitched trace with the reference (in a job, every
    rank's with that rank's)."""
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
        written = rank_traces(trace)
        records = read_trace(written[min(written, key=lambda r: r or 0)]) if written else []
        if previous is not None:
            previous.resumed_from = next((r["step"] for r in records
                                          if r["event"] == "restore"), None)
        if result is None:
            if code != 0:
                return CaseResult(results, "error", note=f"the resumed run exited with {code}; "
                                  f"{_output_of(log)}")
            break
        result.exit_code = code
        problem = _interrupted(result.kill, code, records)
        if problem:
            result.note = problem
            verdict = "error" if result.kill.phase == "sigterm" or code not in (0, -9) else \
                "untested"
            if result.kill.phase == "sigterm" or code not in (0, -signal.SIGKILL):
                problem += f"; {_output_of(log)}"
            return CaseResult(results, verdict, note=problem)
        result.reached = True
        previous = result
    by_rank = {}
    for rank, reference in references.items():
        suffix = "" if rank is None else f".rank{rank}"
        segments = [read_trace(t + suffix) if os.path.exists(t + suffix) else [] for t in traces]
        by_rank[rank] = compare(reference, segments, rtol=rtol, atol=atol,
                                exact_steps=exact_steps)
    rank, comparison = _explaining(by_rank)
    note = "" if comparison.verdict != "untested" else \
        "every resume started from step 0: the resume was not exercised"
    return CaseResult(results, comparison.verdict, comparison, note, rank)


def _explaining(by_rank: dict[int | None, Comparison]) -> tuple[int | None, Comparison]:
    """The rank whose comparison decides a job's case: the worst verdict; among diverged
    ranks the earliest divergence, and at the same update a rank whose state differed right
    after the resume (the cause: the other ranks differ through the gradients they share)."""
    def key(item: tuple[int | None, Comparison]) -> tuple[int, int, int, int]:
        rank, c = item
        d = c.first_divergence
        return ({"diverged": 0, "untested": 1}.get(c.verdict, 2),
                d.step if d is not None else 0, 0 if c.restore_differs else 1, rank or 0)

    return min(by_rank.items(), key=key)


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
        head = f"  case {n}: {c.verdict.upper()}" + (
            f" on rank {c.rank}" if c.rank is not None and c.verdict == "diverged" else "")
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
