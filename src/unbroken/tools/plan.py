"""``unbroken plan``: how often to save, what saving costs and what a failure loses.

With C the cost of one save (seconds the loop stands still), T the compute time between two
saves (so one save every T + C of wall time), M the mean time between failures and R the time
a restart takes (scheduling, start-up, restore), all in seconds:

- overhead of saving at interval T: ``C / (T + C)`` (a 30 s save every 10 minutes costs
  30 / 630 = 4.76% of wall time);
- Young's interval (1974): ``T = sqrt(2 C M)``;
- Daly's interval (2006), the one recommended: for C < 2M,
  ``T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C``, else ``T = M``;
- work lost per failure: about half a period, plus the save in flight, plus the restart:
  ``(T + C) / 2 + R``;
- expected failures over a duration D: ``D / M``; expected work lost: that times the loss per
  failure;
- total overhead with failures (first order in 1/M): ``C / (T + C) + ((T + C) / 2 + R) / M``.

``unbroken plan RUN`` takes the checkpoint size, the observed time between saves and the save
cost from the run's manifests: each records the seconds from its save's start to its commit
(``timings``; a sync save's read-back comes after, so this is a lower bound of what a sync
save stops the loop). Older manifests hold no timings: then the save cost is given
(``--save-seconds``) or estimated from the size at a stated throughput (``--bandwidth``), and
the output says which.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from .._commands import arg, emit, tolerance, tool
from .._runview import UsageError, open_run
from .._table import human_size
from ..store.manifest import TO_COMMIT
from ._plan_output import _num, format_plan, plot_plan
from ._plan_output import duration as duration

# -- the arithmetic -----------------------------------------------------------------------------


def young(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum compute time between saves: ``sqrt(2 C M)`` seconds."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def daly(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's (2006) higher-order optimum compute time between saves, in seconds:
    ``sqrt(2CM) (1 + sqrt(C/2M)/3 + C/18M) - C`` for C < 2M, else M."""
    c, m = save_seconds, mtbf_seconds
    if c >= 2 * m:  # saving costs more than failures do: Daly's bound is the MTBF itself
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def _at(label: str, t: float, c: float, r: float, m: float | None, duration: float | None
        ) -> dict[str, Any]:
    """Every figure for compute time ``t`` between saves (``m``, ``duration``: None if
    unknown)."""
    lost = (t + c) / 2 + r
    failures = duration / m if m is not None and duration is not None else None
    return {"label": label, "seconds": t, "period_seconds": t + c,
            "save_overhead": c / (t + c), "lost_per_failure_seconds": lost,
            "failure_overhead": lost / m if m is not None else None,
            "total_overhead": c / (t + c) + lost / m if m is not None else None,
            "expected_lost_seconds": failures * lost if failures is not None else None}


def _positive(name: str, value: float | None, zero_ok: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name}={value!r}: expected a finite number "
                         f"{'>= 0' if zero_ok else '> 0'}")


def plan(save_seconds: float, mtbf_hours: float | None = None, restart_seconds: float = 0.0,
         interval_minutes: float | None = None, hours: float | None = None) -> dict[str, Any]:
    """The save-interval figures of the module docstring, as a JSON-ready dict.

    ``save_seconds`` is the cost C of one save; ``mtbf_hours`` the mean time between failures
    (needed for Young's and Daly's intervals and everything about failures);
    ``interval_minutes`` a compute time between saves to evaluate; ``hours`` a run length for
    the expected number of failures and the work they lose. At least one of ``mtbf_hours``
    and ``interval_minutes`` is needed; raises ``ValueError`` otherwise or for a value that is
    not a positive finite number (``restart_seconds`` may be 0).

    ``intervals`` lists the evaluated intervals (label ``given``, ``Young``, ``Daly``), each
    with ``seconds`` (compute between saves), ``period_seconds``, ``save_overhead``,
    ``lost_per_failure_seconds``, ``failure_overhead``, ``total_overhead`` and
    ``expected_lost_seconds`` (fractions, seconds; None where the MTBF or duration is
    unknown). ``recommended`` names Daly's when the MTBF is known."""
    for name, value in (("save_seconds", save_seconds), ("mtbf_hours", mtbf_hours),
                        ("interval_minutes", interval_minutes), ("hours", hours)):
        _positive(name, value)
    _positive("restart_seconds", restart_seconds, zero_ok=True)
    if mtbf_hours is None and interval_minutes is None:
        raise ValueError("nothing to compute: give an MTBF (for the best interval) or an "
                         "interval (for its overhead), or both")
    try:
        out = _figures(float(save_seconds), mtbf_hours, float(restart_seconds),
                       interval_minutes, hours)
    except (ZeroDivisionError, OverflowError):
        out = None
    # (a float overflows to inf or a difference vanishes to 0 far outside any real run: said,
    # rather than printed as inf or nan, or raised from deep inside)
    if out is None or not all(_finite(v) for v in [*out.values(), *(
            x for i in out["intervals"] for x in i.values())]) or not all(
            i["seconds"] > 0 for i in out["intervals"]):
        raise ValueError(
            f"save_seconds={save_seconds!r}, mtbf_hours={mtbf_hours!r}, "
            f"interval_minutes={interval_minutes!r}, hours={hours!r}: the figures overflow "
            "or vanish in floating point; give values in a realistic range (a save of "
            "seconds to hours, an MTBF of minutes to years)")
    return out


def _finite(value: Any) -> bool:
    """Whether a figure of `plan` is a number it can show (None, a label or a list: yes)."""
    return not isinstance(value, float) or math.isfinite(value)


def _figures(c: float, mtbf_hours: float | None, r: float, interval_minutes: float | None,
             hours: float | None) -> dict[str, Any]:
    """`plan`'s figures, its inputs checked (``c``, ``r``: seconds)."""
    m = mtbf_hours * 3600 if mtbf_hours is not None else None
    duration = hours * 3600 if hours is not None else None
    intervals = []
    if interval_minutes is not None:
        intervals.append(_at("given", interval_minutes * 60, c, r, m, duration))
    out: dict[str, Any] = {
        "save_seconds": c, "mtbf_hours": mtbf_hours, "restart_seconds": r, "hours": hours,
        "young_seconds": None, "daly_seconds": None, "recommended": None,
        "recommended_seconds": None, "daly_bounded": None,
        "expected_failures": duration / m if m is not None and duration is not None else None}
    if m is not None:
        ty, td = young(c, m), daly(c, m)
        intervals += [_at("Young", ty, c, r, m, duration), _at("Daly", td, c, r, m, duration)]
        out.update(young_seconds=ty, daly_seconds=td, recommended="Daly",
                   recommended_seconds=td, daly_bounded=c >= 2 * m)
    out["intervals"] = intervals
    return out


# -- what a run tells ---------------------------------------------------------------------------


def observed_period(saves: Iterable[tuple[str, int, int, str]]) -> dict[str, Any] | None:
    """The wall time between two saves of a run, from its manifests' ``(run_id,
    incarnation, step, created)``: the median gap between consecutive generations written by
    the same process (a restart in between is no save period). Retention may have removed
    generations, so only the pairs the fewest steps apart count. None when no pair is left or
    the timestamps (to the second) cannot tell the saves apart."""
    by_process: dict[tuple[str, int], list[tuple[int, datetime]]] = {}
    for run_id, incarnation, step, created in saves:
        try:
            when = datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z")
        except ValueError:
            continue  # an old or hand-written manifest: no usable time
        by_process.setdefault((run_id, incarnation), []).append((step, when))
    pairs = []
    for found in by_process.values():
        found.sort()
        pairs += [(b[0] - a[0], (b[1] - a[1]).total_seconds()) for a, b in zip(found, found[1:])
                  if b[0] > a[0]]
    if not pairs:
        return None
    fewest = min(steps for steps, _ in pairs)
    gaps = [gap for steps, gap in pairs if steps == fewest]
    median = statistics.median(gaps)
    if median <= 0:
        return None
    return {"period_seconds": median, "steps": fewest, "pairs": len(gaps)}


def measure_run(path: str) -> dict[str, Any]:
    """What the run at ``path`` (a folder or URL) tells about its saves: the complete
    generations, the median checkpoint size, and the observed save period (or None)."""
    store = open_run(path)
    complete = [g.manifest for g in store.scan() if g.ok and g.manifest is not None]
    sizes = [m.total_bytes for m in complete]
    timed = [m.timings[TO_COMMIT] for m in complete if TO_COMMIT in m.timings]
    return {"path": store.root, "generations": len(complete),
            "checkpoint_bytes": int(statistics.median(sizes)) if sizes else None,
            "to_commit_seconds": statistics.median(timed) if timed else None,
            "timed_saves": len(timed),
            "newest_step": complete[-1].step if complete else None,
            "observed": observed_period((m.run_id, m.incarnation, m.step, m.created)
                                        for m in complete)}


# -- the command --------------------------------------------------------------------------------


def _save_cost(args: argparse.Namespace, run: dict[str, Any] | None) -> tuple[float, str]:
    """The save cost and where it came from; exit 2 naming what is missing."""
    if args.save_seconds is not None:
        return args.save_seconds, "given (--save-seconds)"
    if run is None:
        raise UsageError("no save cost: pass --save-seconds S (seconds one save stops "
                         "training), or a RUN whose size to estimate it from with --bandwidth")
    size = run["checkpoint_bytes"]
    if size is None:
        raise UsageError(f"{run['path']}: no complete generation to measure; pass "
                         "--save-seconds S")
    if args.bandwidth is None and run["to_commit_seconds"] is not None:
        return run["to_commit_seconds"], (
            f"measured: median of {run['timed_saves']} saves from their start to their commit "
            "(the manifests' timings; a sync save's read-back after the commit is not "
            "included)")
    if args.bandwidth is None:
        raise UsageError(
            f"{run['path']}: the run records no save duration (manifests written before "
            "unbroken recorded timings); pass --save-seconds S (the "
            "'unbroken' logger says it at INFO level: 'saved ... in S s', or for an async save "
            "'snapshot ... in S s'), or "
            f"--bandwidth MB_PER_S to estimate it from the checkpoint size ({human_size(size)})")
    return size / (args.bandwidth * 1e6), (
        f"estimated: {human_size(size)} (median checkpoint) at {_num(args.bandwidth)} MB/s "
        "(--bandwidth); not measured")


def _positive_type(unit: str) -> Any:
    """An argparse type: a finite number > 0 (``unit`` names it in the error)."""
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text}: expected a finite number of {unit} > 0")
        return value
    parse.__name__ = "number"
    return parse


@tool("plan",
      arg("run", metavar="RUN", nargs="?",
          help="a run folder or URL: take the checkpoint size and observed save period "
               "from its manifests"),
      arg("--save-seconds", type=_positive_type("seconds"), metavar="S",
          help="cost C of one save: seconds training stands still"),
      arg("--mtbf-hours", type=_positive_type("hours"), metavar="H",
          help="mean time between failures M"),
      arg("--restart-seconds", type=tolerance, default=0.0, metavar="R",
          help="time a restart takes (scheduling, start-up, restore); default 0"),
      arg("--interval-minutes", type=_positive_type("minutes"), metavar="T",
          help="evaluate this compute time between saves"),
      arg("--hours", type=_positive_type("hours"), metavar="D",
          help="run length: expected failures and work lost over it"),
      arg("--bandwidth", type=_positive_type("MB/s"), metavar="MB_PER_S",
          help="with RUN: estimate the save cost as checkpoint size / this throughput "
               "(10^6 bytes per second)"),
      arg("--plot", metavar="FILE.png", help="draw overhead against interval"))
def _plan(args: argparse.Namespace) -> int:
    """How often to save. With C the save cost, T the compute time between saves, M the MTBF
    and R the restart time (seconds): save overhead C/(T+C) (a 30 s save every 10 minutes:
    30/630 = 4.76%); Young's interval sqrt(2CM); Daly's, recommended, sqrt(2CM)(1 +
    sqrt(C/2M)/3 + C/18M) - C for C < 2M, else M; work lost per failure (T+C)/2 + R;
    expected failures over --hours D: D/M; total overhead with failures C/(T+C) + ((T+C)/2 +
    R)/M. Needs --save-seconds, or RUN with --bandwidth (a run records no save duration), and
    --mtbf-hours or --interval-minutes. With RUN and no --interval-minutes, the interval the
    run used (median time between its saves, from its manifests) is evaluated."""
    if args.bandwidth is not None and args.run is None:
        raise UsageError("--bandwidth estimates the save cost from a run's checkpoint size: "
                         "pass RUN too, or give --save-seconds instead")
    run = measure_run(args.run) if args.run is not None else None
    c, source = _save_cost(args, run)
    # a given cost needs no provenance line; a measured or estimated one does
    sources = [] if args.save_seconds is not None else [f"save cost: {source}"]
    interval, interval_source = args.interval_minutes, "given" if args.interval_minutes else None
    if run is not None:
        sources.insert(0, f"run {run['path']}: {run['generations']} complete generation"
                          f"{'s' * (run['generations'] != 1)}, median "
                          f"{human_size(run['checkpoint_bytes'])}")
        seen = run["observed"]
        if seen is not None and interval is None:
            if seen["period_seconds"] > c:  # the period holds one save and the compute
                interval, interval_source = (seen["period_seconds"] - c) / 60, "observed"
                sources.append(f"interval: observed, {duration(seen['period_seconds'])} "
                               f"between saves {seen['steps']} steps apart (median of "
                               f"{seen['pairs']}) minus the save cost")
            else:
                sources.append(f"interval: the observed {duration(seen['period_seconds'])} "
                               "between saves is not more than the save cost: not used")
        elif seen is None and interval is None:
            sources.append("interval: not observed (too few generations of one process, or "
                           "saves less than a second apart)")
    if args.mtbf_hours is None and interval is None:
        raise UsageError("nothing to compute: pass --mtbf-hours H (for the best interval) "
                         "and/or --interval-minutes T (for its overhead)")
    try:
        result = plan(c, args.mtbf_hours, args.restart_seconds, interval, args.hours)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for i in result["intervals"]:
        if i["label"] == "given" and interval_source == "observed":
            i["label"] = "observed"
    if args.plot:
        plot_plan(result, args.plot)
    payload = {**result, "ok": True, "save_source": source, "interval_source": interval_source,
               "run": run, "plot": args.plot}
    text = format_plan(result, sources)
    if args.plot:
        text += f"\nplot: {args.plot}"
    return emit(args, payload, text, True)
