"""The terminal report of `unbroken check`: one row per interruption, each case's first
divergence with the part to fix and what kind of difference it is, and the verdict.

A failed process's whole log is named by its real path only when the working folder outlives
the check (``--keep``, ``--workdir``); otherwise the report says it was removed."""

from __future__ import annotations

import math
import os
import textwrap
from typing import TYPE_CHECKING

from .attribution import Divergence
from .fields import as_float

if TYPE_CHECKING:
    from .results import CaseResult, CheckReport

_VERDICT = {"equivalent": "EQUIVALENT: every resumed run matches the uninterrupted one",
            "diverged": "DIVERGED", "error": "ERROR: a process failed (see above)",
            "untested": "UNTESTED: some resume was not exercised"}


def kind_text(d: Divergence, resumes: list[int]) -> str:
    """What kind of difference ``d`` is, as a phrase (``resumes``: the run's resume steps)."""
    if d.kind == "jump":
        before = [s for s in resumes if s < d.step]
        return (f"a jump after the resume from update {before[-1]} (missing state)" if before
                else "a jump (missing state)")
    if d.kind == "drift":
        return "a drift from tiny values (numerics)"
    if d.kind == "irreproducible":
        return ("irreproducible: the runs differ before the interruption (the script is not "
                "deterministic)")
    return d.kind


def _divergence_lines(d: Divergence, case: CaseResult) -> list[str]:
    resumes = case.comparison.resumes if case.comparison else []
    # The headline names the field: "also" lists the others (JSON keeps them all).
    also = [a for a in d.also if a != d.field]
    lines = [f"    fix: {d.state_part}" + (f"; also differs: {', '.join(also)}" if also else "")
             + f"; {kind_text(d, resumes)}"]
    if d.hint:
        lines += textwrap.wrap(d.hint, 96, initial_indent="    why: ",
                               subsequent_indent="         ")
    return lines


def _log_line(log: str, workdir: str | None) -> list[str]:
    return [f"    whole output: {os.path.join(workdir, log)}"] if log and workdir else []


def format_report(report: CheckReport, workdir: str | None) -> str:
    """The report; ``workdir``: the working folder when it is kept (None: it was removed)."""
    from .._table import table

    lines = [f"unbroken check: {' '.join(report.command)}"]
    if report.error:
        lines += ["reference: the uninterrupted run FAILED (nothing was interrupted)",
                  f"  {report.error}", *_log_line(report.log, workdir)]
    else:
        rows = [[n, k.kill.at, k.kill.phase, k.kill.place,
                 "-" if k.resumed_from is None else k.resumed_from,
                 "yes" if k.covered else "no" if not k.reached else
                 "no (the resume failed)" if k.resume_failed else
                 f"no (resumed before the save at {k.expected})"]
                for n, c in enumerate(report.cases, 1) for k in c.kills]
        lines += [f"reference: {report.steps} updates, uninterrupted", "",
                  table(["case", "killed at", "phase", "place", "resumed from", "covered"],
                        rows, right=(0, 1, 4), indent="  "), ""]
    for n, c in enumerate(report.cases, 1):
        d = c.comparison.first_divergence if c.comparison else None
        head = f"  case {n}: {c.verdict.upper()}" + (
            f" on rank {c.rank}" if c.rank is not None and c.verdict == "diverged" else "")
        if d is not None:
            lines.append(f"{head}: first differs at update {d.step} in {d.field!r}: expected "
                         f"{_shown(d.expected)}, found {_shown(d.found)}")
            lines += _divergence_lines(d, c)
        else:
            lines.append(head + (f": {c.note}" if c.note else ""))
            lines += _log_line(c.log, workdir)
        for note in c.comparison.notes if c.comparison else []:
            lines.append(f"    note: {note}")
    lines += ["", f"verdict: {_VERDICT[report.verdict]}"]
    if workdir:
        lines.append(f"runs, traces and logs: {workdir}")
    elif report.log or any(c.log for c in report.cases):
        lines.append("(the working folder was removed with its logs; rerun with --keep or "
                     "--workdir DIR to keep them)")
    return "\n".join(lines)


def _shown(value: object) -> str:
    """A traced value as the report prints it: a float (traced as its exact hex) with its
    decimal beside it, a list of them likewise; anything else as it is."""
    if isinstance(value, list) and value and all(map(_hex_float, value)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    number = as_float(value) if _hex_float(value) else None
    if number is None or not math.isfinite(number):
        return repr(value) if number is None else str(value)
    return f"{number!r} ({value})"


def _hex_float(value: object) -> bool:
    """Whether ``value`` is a float as the trace writes it (``float.hex``), not a digest."""
    return isinstance(value, str) and (value.lstrip("-")[:2] == "0x"
                                       or value.lstrip("-") in ("inf", "nan"))
