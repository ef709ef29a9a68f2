"""The proof harness: run a training command uninterrupted, then interrupt copies of it with a
real SIGKILL at chosen points, resume each in a fresh process, and compare the traces.

The command is any script that uses `unbroken.Checkpointer`; it is steered through the
environment only (``$UNBROKEN_ROOT``, ``$UNBROKEN_TRACE``, ``$UNBROKEN_SAVE_AT``,
``$UNBROKEN_KILL_AT``, ``$UNBROKEN_FAULT_DROP``), so it runs unchanged."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _procs
from .._runview import UsageError
from ..checkpointer import ROOT_ENV
from ..errors import CorruptCheckpoint, UnbrokenError
from ..faults import DROP_ENV
from ..trace import TRACE_ENV, TRACE_HASH_ENV, read_trace
from .checkplan import PHASES, Kill, default_plan, explicit_plan, missed
from .equivalence import Comparison, compare
from .fields import as_float
from .report import format_report
from .results import CaseResult, CheckReport, KillResult

__all__ = ["PHASES", "CheckReport", "format_report", "run_check"]
_POLL = 0.05  # seconds between looks at the job's processes (and its exit)

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
    """The end of a process's output, for a message or a case's note; never the log's name.

    The output itself goes into the message rather than the working folder being kept: a
    failed check would otherwise leave its runs (checkpoints: often gigabytes) in /tmp on every
    failure, while what the user needs is why the script failed, which is at the end of its
    output. Only the report knows whether the working folder outlives the check (removed
    unless --keep or --workdir), so it alone names the whole log, and only when it is kept."""
    tail = _tail(log)
    return f"the end of its output:\n{tail}" if tail else "it printed nothing"


def _relative(log: str, workdir: str) -> str:
    """``log``'s place in the working folder (``case-01/output.log``), for the report."""
    return os.path.relpath(log, workdir)


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
    _check_command(cmd)
    os.makedirs(workdir, exist_ok=True)
    if reference_trace is None:
        ref_dir = os.path.join(workdir, "reference")
        os.makedirs(ref_dir, exist_ok=True)
        reference_trace = os.path.join(ref_dir, "trace.jsonl")
        log = os.path.join(ref_dir, "output.log")
        say("reference run (uninterrupted) ...")
        # A run of the script that fails is a problem the check found (exit 1), as in a case;
        # one that cannot be checked (no trace, too short) is an error of its use (exit 2).
        try:
            code = run_process(cmd, {ROOT_ENV: os.path.join(ref_dir, "run"),
                                     TRACE_ENV: reference_trace}, log, timeout)
            failed = "" if code == 0 else (f"the uninterrupted reference run exited with "
                                           f"{code}; {_output_of(log)}")
        except Timeout as e:
            failed = f"the uninterrupted reference run hung: {e}"
        if failed:
            return CheckReport(list(cmd), 0, error=failed, log=_relative(log, workdir))
        if not rank_traces(reference_trace):
            raise UnbrokenError("the reference run wrote no trace (does the script build an "
                                f"unbroken.Checkpointer?); {_output_of(log)}")
    try:  # (a reference that cannot be used is an error of the check's use: exit 2)
        references = {r: read_trace(t) for r, t in rank_traces(reference_trace).items()}
    except CorruptCheckpoint as e:
        raise UnbrokenError(f"the reference trace cannot be used: {e}") from None
    if not references:
        raise UnbrokenError(f"{reference_trace}: no such trace (nor one per rank, .rank0 ...)")
    for rank, records in references.items():
        bare = next((r["step"] for r in records if r["event"] == "update"
                     and not {"params", "state", "rng"} <= r.keys()), None)
        if bare is not None:  # (each field absent on one side is skipped: it compared nothing)
            raise UnbrokenError(
                f"{rank_traces(reference_trace)[rank]}: its record of update {bare} holds no "
                "digests (params, state, rng), which every trace unbroken writes holds: "
                "nothing of the state could be compared; give the trace of an uninterrupted "
                "run as unbroken wrote it")
    reference = references[min(references, key=lambda r: -1 if r is None else r)]
    _check_drop(drop, references)
    steps = max((r["step"] for r in reference if r["event"] == "update"), default=0)
    report = CheckReport(list(cmd), steps)
    report.reference_loss = [(r["step"], as_float(r.get("loss")) or float("nan"))
                             for r in reference if r["event"] == "update"]
    cases = (explicit_plan(steps, at, phases) if at else
             [default_plan(reference, random_n, seed, phases)])
    for i, kills in enumerate(cases):
        where = ", ".join(f"{k.at} ({k.phase})" for k in kills)
        say(f"case {i + 1}: interrupt at update {where} ...")
        case = _run_case(cmd, kills, os.path.join(workdir, f"case-{i + 1:02d}"), references,
                         rtol, atol, exact_steps, drop, timeout, say)
        case.log = _relative(case.log, workdir) if case.log else ""
        report.cases.append(case)
    return report


def _check_drop(drop: str | None, references: dict[int | None, list[dict[str, Any]]]
                ) -> None:
    """Refuse, before anything is interrupted, a ``drop`` naming a part the script does not
    register (its reference trace digests every one): each life would fail at its restore,
    after the runs before it ran for nothing. (A stream, ``rng.NAME``, is the fault layer's
    to judge: its names are not the trace's.)"""
    parts: set[str] = {"weights_only", "rng"}
    for records in references.values():
        for r in records:
            parts.update(r.get("state") or {})
    parts.discard("optimizer-meta")  # (a digest of the optimizer's, no part)
    for entry in (drop or "").split(","):
        name = entry.partition("@")[0].strip()
        if name and not name.startswith("rng.") and name not in parts:
            raise UsageError(f"--drop {entry!r}: the script registers no {name!r}; it has "
                             f"{', '.join(sorted(parts))}")


def _check_command(cmd: Sequence[str]) -> None:
    """Refuse, before any run, a command that is not there or a Python script that is not:
    an error in how the check was called (exit 2, and no working folder to speak of), not a
    failure of the script (exit 1)."""
    if not cmd or shutil.which(cmd[0]) is None:
        raise UsageError(f"{cmd[0] if cmd else '(empty)'}: no such command")
    if not os.path.basename(cmd[0]).startswith("python"):
        return
    args = iter(cmd[1:])
    for a in args:
        if a == "-" or a[:1] == "-" and a[1:2] != "-" and set(a[1:]) & {"c", "m"}:
            return  # no script file: code (-c), a module (-m) or stdin
        if a in ("-X", "-W"):  # options that take a value
            next(args, None)
        elif not a.startswith("-"):
            if not os.path.isfile(a):
                raise UsageError(f"{a}: no such script (the command was {' '.join(cmd)})")
            return


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
    reference = references[min(references, key=lambda r: -1 if r is None else r)]
    # (not a save at the last update: the script's save() after its loop comes after the
    # step_done a kill at that update interrupts, and a correct resume is from before it)
    last = max((r["step"] for r in reference if r["event"] == "update"), default=0)
    saves = sorted({r["step"] for r in reference if r["event"] == "save"} - {last})
    results = [KillResult(k, expected=_expected(k, saves)) for k in kills]
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
            env.update(result.kill.env(saves))
        traces.append(trace)
        try:
            code = run_process(cmd, env, log, timeout)
        except Timeout as e:
            return _failed(results, previous, f"a process hung: {e}", log)
        written = rank_traces(trace)
        records = read_trace(written[min(written, key=lambda r: r or 0)]) if written else []
        if previous is not None:
            previous.resumed_from = next((r["step"] for r in records
                                          if r["event"] == "restore"), None)
            if not previous.covered and previous.reached and not previous.resume_failed:
                previous.note = (f"resumed from {previous.resumed_from}, not from "
                                 f"{previous.expected}: the save at {previous.expected} was not "
                                 "committed when the process was killed (a background save "
                                 "still persisting), so this place was not tested")
        who = _who(previous, result)

        def cut_short(note: str) -> CaseResult | None:
            """The lives that ran, compared: a difference they already show is the case's
            verdict (a defect that ends or breaks a resumed life hid its own divergence)."""
            rank, comparison = _compared(references, traces, rtol, atol, exact_steps)
            first = comparison.first_divergence
            if first is None or first.field in ("missing", "extra"):
                return None
            return CaseResult(results, "diverged", comparison, note, rank)

        if result is None:
            if code != 0:
                note = f"{who} exited with {code}; {_output_of(log)}"
                return cut_short(note) or _failed(results, previous, note, log)
            break
        result.exit_code = code
        problem = missed(result.kill, code, records, who)
        if problem:
            result.note = problem
            if result.kill.phase == "sigterm" or code not in (0, -signal.SIGKILL):
                note = f"{problem}; {_output_of(log)}"
                return cut_short(note) or _failed(results, previous, note, log)
            return cut_short(problem) or CaseResult(results, "untested", note=problem)
        result.reached = True
        previous = result
    rank, comparison = _compared(references, traces, rtol, atol, exact_steps)
    note = "" if comparison.verdict != "untested" else \
        "every resume started from step 0: the resume was not exercised"
    return CaseResult(results, comparison.verdict, comparison, note, rank)


def _expected(kill: Kill, saves: list[int]) -> int:
    """The newest save of the reference a correct resume after ``kill`` restores: the last at
    or before its update (before it, when killed inside that update or its save)."""
    inside = kill.phase in ("mid-update", "mid-save")
    return max((s for s in saves if s < kill.at or s == kill.at and not inside), default=0)


def _compared(references: dict[int | None, list[dict[str, Any]]], traces: list[str],
              rtol: float, atol: float, exact_steps: int | None
              ) -> tuple[int | None, Comparison]:
    """The lives' stitched traces against the reference (in a job, every rank's against
    that rank's): the rank that decides, and its comparison."""
    by_rank = {}
    for rank, reference in references.items():
        suffix = "" if rank is None else f".rank{rank}"
        segments = [read_trace(t + suffix) if os.path.exists(t + suffix) else [] for t in traces]
        by_rank[rank] = compare(reference, segments, rtol=rtol, atol=atol,
                                exact_steps=exact_steps)
    return _explaining(by_rank)


def _failed(results: list[KillResult], previous: KillResult | None, note: str, log: str
            ) -> CaseResult:
    """A case whose process failed: the interruption it resumed after is not covered."""
    if previous is not None:
        previous.resume_failed = True
    return CaseResult(results, "error", note=note, log=log)


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


def _who(previous: KillResult | None, result: KillResult | None) -> str:
    """The process of a case that is running, for a message: the first one, or one resumed
    after an interruption (and to be interrupted again, or run to the end)."""
    if previous is None:
        return "the run"
    frm = "" if previous.resumed_from is None else f"from update {previous.resumed_from} "
    then = "to run to the end" if result is None else \
        f"to be interrupted at update {result.kill.at}"
    return f"the run resumed {frm}after the interruption at update {previous.kill.at} ({then})"
