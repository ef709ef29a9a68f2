"""Reliability suites anyone can rerun: ``python -m unbroken.torture crash|corrupt``.

``crash --kills N --seed S``: a small real training run (saves every 2 or 3 updates, retention
``Keep(last=2)``) is killed with SIGKILL N times — at numbered I/O operations, at named points
of the commit protocol and by random timers — and restarted each time until it completes.
After every kill: a verified generation is found (or none when none was ever committed), no
torn or corrupt generation is loaded, no committed generation that retention had to keep is
lost, and each finished run's final state equals the uninterrupted run's, bit for bit. Between
some lives the newest generation rots (one byte of tensor data flipped): the next life must
refuse it and restore the previous verified generation (when it was the only one, refuse the
run, which then starts over from 0); or a script starts without ``restore()`` in the used
folder: it must get ``RunNotRestored`` with the folder unchanged.

``corrupt --cases N --seed S``: committed generations are mutated (bit flips, truncations,
deleted, extra and swapped files, edited manifests, escaping names, symlinks, FIFOs and
devices, oversized and deeply nested JSON, bad encodings, pickle payloads, hostile run-folder
layouts, resealed out-of-range numbers and lone surrogates, generations copied from another
run, oversized parts); every restore must end in a typed error naming the file, or load a
generation whose state equals what it saved; no exception outside ``UnbrokenError`` escapes;
``unbroken verify``/``inspect`` exit 0 or 1 without a traceback.

Both print their figures as a table (``--json``: one JSON document) and exit 0 only when every
check held; 1 when one failed; 2 on a usage error. Op-numbered and named-point kills and all
corruption cases are reproducible from the seed (``corrupt --case K`` reruns one case);
timer kills depend on timing."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from .._table import table


def _crash_text(f: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in f["kills_by_kind"].items())
    rows = [
        ["kills (SIGKILL of the whole process group)", f["kills"], kinds],
        ["recoveries (restart restored and verified)", f["recoveries"],
         f"{f['lives']} lives in {f['episodes']} runs"],
        ["restored from nothing (none committed yet)", f["restored_from_nothing"], ""],
        ["torn generations seen / refused", f"{f['torn_seen']} / {f['torn_refused']}", ""],
        ["corrupt generations seen / refused",
         f"{f['corrupt_seen']} / {f['corrupt_refused']}", ""],
        ["staging / trash debris seen (then removed)",
         f"{f['staging_debris_seen']} / {f['trash_debris_seen']}", ""],
        ["generations reported committed", f["generations_reported"], ""],
        ["newer generation rotted between lives / refused",
         f"{f['rots']} / {f['rots_refused']}",
         f"{f['rots_only_generation']} the only verified one: run refused, started over"],
        ["started without restore() in a used folder / refused",
         f"{f['no_restore_starts']} / {f['no_restore_refused']}", "RunNotRestored"],
        ["folder changed by a refused start (must be 0)", f["no_restore_changed"], ""],
        ["aside/ entries explained / unexplained (must be 0)",
         f"{f['aside_explained']} / {f['aside_unexplained']}", "by a rot or a refusal"],
        ["generations lost (must be 0)", f["generations_lost"], "rotten ones: lost by the disk"],
        ["torn, corrupt or rotten generations loaded (must be 0)", f["torn_or_corrupt_loaded"],
         ""],
        ["restored state differs (must be 0)", f["wrong_state_restored"], ""],
        *([["kills right after save() returned / generation committed",
            f"{f['kills_after_save_returned']} / {f['committed_after_save_returned']}",
            "save on failure: the persisting process commits it" if f["async_save"] ==
            "process" else "a thread dies with its process: the restore falls back"],
           ["kills with a save in flight / committed",
            f"{f['kills_in_flight']} / {f['committed_in_flight']}", "any kind of kill"]]
          if f["async_save"] != "off" else []),
        ["final state bitwise equal to uninterrupted",
         f"{f['episodes_equal']}/{f['episodes']}", "yes" if f["final_equal"] else "NO"],
    ]
    mode = "" if f["async_save"] == "off" else f", async_save={f['async_save']!r}"
    if f.get("persist_share") is not None:
        mode += f", persist_share={f['persist_share']}"
    head = (f"crash torture{mode}: seed {f['seed']}, {f['kills']} kills in {f['seconds']} s "
            f"(reference run: {f['reference_ops']} I/O operations, {f['reference_seconds']} s)")
    lines = [head, "",
             table(["figure", "value", "note"], rows, right=(1,), indent="  "), "",
             "  where the kills landed:"]
    for phase, n in sorted(f["kills_by_phase"].items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"    {n:5d}  {phase}")
    lines += _failures(f["failures"])
    lines.append(f"result: {'PASS' if f['ok'] else 'FAIL'}")
    return "\n".join(lines)


def _corrupt_text(r: dict[str, Any]) -> str:
    rows = [[k, v["cases"], v["refused"], v["fell_back"], v["loaded"],
             v["loaded_older_mutated"], v["failures"]] for k, v in r["by_kind"].items()]
    rows.append(["total", r["cases"], r["refused"], r["fell_back"], r["loaded"],
                 r["loaded_older_mutated"], r["failed"]])
    lines = [f"corruption fuzz: seed {r['seed']}, {r['cases']} cases in {r['seconds']} s", "",
             table(["mutation", "cases", "refused", "fell back", "loaded", "(older hit)",
                    "failures"], rows, right=(1, 2, 3, 4, 5, 6), indent="  "), "",
             "  refused: a typed UnbrokenError naming the file and the reason",
             "  fell back: an older generation loaded; its restored state equals what it saved",
             "  loaded: the newest loaded; its restored state equals what it saved",
             "  (older hit): of those, cases whose mutation hit an older generation",
             "", "  typed errors: " + (", ".join(f"{k} {v}" for k, v in
                                                 r["errors_by_type"].items()) or "none"),
             "  exceptions seen (escaped restore or a command, or refused a candidate): "
             + (", ".join(f"{k} {v}" for k, v in r["exception_types"].items()) or "none"),
             "  outside UnbrokenError (must be none): "
             + (", ".join(r["exceptions_outside_unbroken_error"]) or "none")]
    lines += _failures([f"case {x['case']} ({x['kind']}: {x['mutation']}): "
                        + "; ".join(x["failures"]) for x in r["failures"]])
    lines.append(f"result: {'PASS' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def _failures(items: list[str]) -> list[str]:
    if not items:
        return []
    out = ["", f"  FAILURES ({len(items)}):"]
    out += [f"    - {x}" for x in items[:50]]
    if len(items) > 50:
        out.append(f"    ... and {len(items) - 50} more (see --json)")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m unbroken.torture", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("crash", help="kill a training run again and again; check recovery")
    c.add_argument("--kills", type=int, default=30, help="SIGKILLs to deliver (default 30)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--kinds", default="op,timer,point",
                   help="kill kinds to draw from: op (numbered I/O operation), timer, point "
                        "(named fault point); comma-separated")
    c.add_argument("--points", help="the named fault points point kills rotate through "
                                    "(comma-separated; default: every one)")
    c.add_argument("--events", default="rot,no-restore",
                   help="events between lives: rot (the newest generation rots on disk), "
                        "no-restore (a script starts without restore()); comma-separated, "
                        "or none")
    c.add_argument("--async-save", choices=["off", "thread", "process"], default="off",
                   help="the run saves asynchronously: in a thread, or through a persisting "
                        "process that commits a save handed over even when the training "
                        "process is killed (named kills after a save then land right after "
                        "save() returned; figures: how many of those generations committed)")
    c.add_argument("--persist-share", type=float, default=None,
                   help="with --async-save: pace the background saves at this share of one "
                        "core (Checkpointer(persist_share=...))")
    c.add_argument("--dir", help="work in DIR (kept) instead of a temporary folder")
    c.add_argument("--sabotage", choices=["retention-first", "skip-hash",
                                          "first-save-unchecked"],
                   help="test the test: break the Checkpointer on purpose (delete old "
                        "generations before writing the new one; load without re-hashing; "
                        "let a first save without restore() go ahead); the torture must FAIL")
    c.add_argument("--json", action="store_true", help="one JSON document on stdout")
    z = sub.add_parser("corrupt", help="mutate committed generations; check every restore")
    z.add_argument("--cases", type=int, default=300, help="cases to run (default 300)")
    z.add_argument("--seed", type=int, default=0)
    z.add_argument("--case", type=int, help="run only case number K (reproduce a failure)")
    z.add_argument("--dir", help="work in DIR (kept) instead of a temporary folder; by "
                                 "default a temporary folder in /dev/shm where available")
    z.add_argument("--sabotage", choices=["skip-hash", "accept-foreign", "no-size-limits"],
                   help="test the test: load without re-hashing content, continue from another "
                        "run's generations, or read state.json whatever its listed size; the "
                        "fuzz must FAIL")
    z.add_argument("--map-all", action="store_true",
                   help="restore every model and optimizer file through the one pass that "
                        "reads it into the live tensors and hashes it (as files of 32 MiB and "
                        "more are), not only large ones")
    z.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    text: Callable[[dict[str, Any]], str]
    if args.mode == "crash":
        from ._events import EVENTS
        from .crash import KINDS, POINTS, crash

        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        points = tuple(k.strip() for k in (args.points or ",".join(POINTS)).split(",")
                       if k.strip())
        events = tuple(k.strip() for k in args.events.split(",")
                       if k.strip() and k.strip() != "none")
        if (args.kills < 1 or not kinds or any(k not in KINDS for k in kinds)
                or any(e not in EVENTS for e in events)
                or not points or any(p not in POINTS for p in points)):
            print(f"torture: --kills must be >= 1, --kinds a subset of {','.join(KINDS)}, "
                  f"--points of {','.join(POINTS)} and --events of {','.join(EVENTS)} (or "
                  "none)", file=sys.stderr)
            return 2
        if args.persist_share is not None and (args.async_save == "off"
                                               or not 0 < args.persist_share <= 1):
            print("torture: --persist-share is a share of one core in (0, 1], with "
                  "--async-save thread or process", file=sys.stderr)
            return 2
        result = crash(args.kills, args.seed, args.dir, kinds, sabotage=args.sabotage,
                       events=events, async_save=args.async_save, points=points,
                       persist_share=args.persist_share).to_json()
        text = _crash_text
    else:
        from .corrupt import corrupt

        if args.cases < 1:
            print("torture: --cases must be >= 1", file=sys.stderr)
            return 2
        result = corrupt(args.cases, args.seed, args.dir, args.case, sabotage=args.sabotage,
                         map_all=args.map_all)
        text = _corrupt_text
    try:
        out = json.dumps(result, indent=2) if args.json else text(result)
        # (a failure's text may quote a lone surrogate from a mutated file)
        print(out.encode("utf-8", "backslashreplace").decode("utf-8"), flush=True)
    except BrokenPipeError:  # the reader went away (`... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if result["ok"] else 1
