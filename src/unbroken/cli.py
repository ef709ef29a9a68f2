"""The ``unbroken`` command line (see DESIGN.md, "CLI contract").

Every command takes ``--json`` (one JSON document on stdout). Exit status: 0 good, 1 the check
found a problem (torn or corrupt generation, hash mismatch), 2 usage or environment error.
Bad input never prints a traceback: errors become ``unbroken: error: <message>`` on stderr.

Commands only read the run folder: they take no lock, never unpickle and never execute
anything from it. To add a command, write one function and register it with ``@command``::

    @command("name", "one-line help", arg("RUN", help="..."), arg("--flag", action="store_true"))
    def _name(args: argparse.Namespace) -> int:
        ...
        return emit(args, payload, text, ok)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import NoReturn

from . import tools
from ._commands import (
    COMMANDS,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    TOOLS,
    Command,
    arg,
    command,
    count,
    emit,
    error,
    fail,
    os_message,
    seconds,
    tolerance,
)
from ._runview import (
    GONE,
    UsageError,
    aside_entries,
    aside_lines,
    folder_run_record,
    holds_a_run,
    list_debris,
    mark_best,
    named_generation,
    newest_summary,
    newest_summary_lines,
    open_run,
    recheck_torn,
    record,
    rows,
    verify_one,
)
from .errors import CorruptCheckpoint, IdentityMismatch, MissingState, StateMismatch, UnbrokenError
from .proof.checkplan import PHASES
from .store.verifying import UNREADABLE

# Errors that mean "the check found a problem" (exit 1) rather than "could not check" (exit 2).
_PROBLEMS = (CorruptCheckpoint, MissingState, IdentityMismatch, StateMismatch)


class _UsageExit(Exception):
    """A usage error argparse found, already printed on stderr as argparse prints it."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose usage errors `main` also reports as
    one JSON document when ``--json`` was given: every command's errors are."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise _UsageExit(f"{self.prog}: {message}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of the command line. Every command is listed, but only ``command``'s
    arguments are known when it is a tool's (`_commands.TOOLS`): the parser imports that
    tool's module alone, and none for this module's own commands (``inspect``, ``verify``,
    ``check``, ``demo``) or for ``unbroken --help``: a tool that imports torch costs its
    import only when it runs."""
    from . import __version__

    if command in TOOLS:
        importlib.import_module(f"{tools.__name__}.{TOOLS[command][0]}")
    parser = _Parser(
        prog="unbroken", description="Resume PyTorch training runs exactly, and prove it.",
        epilog="exit status: 0 good, 1 a problem was found, 2 usage or environment error")
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    for name in [*(n for n in COMMANDS if n not in TOOLS), *TOOLS]:
        cmd = COMMANDS.get(name) if name not in TOOLS or name == command else None
        if cmd is None:  # (a tool not run now: listed, its arguments unknown)
            sub.add_parser(name, help=TOOLS[name][1], add_help=False)
            continue
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.run.__doc__ or cmd.help)
        for flags, kwargs in cmd.arguments:
            p.add_argument(*flags, **kwargs)
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        p.set_defaults(command=cmd)
    return parser


def _named_path(args: argparse.Namespace) -> str | None:
    """The run the command was given, to name in an error that names no file (a refused
    object-store credential)."""
    run = getattr(args, "run", None)
    return run if isinstance(run, str) else None


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    # (the command is the first word that is not an option: the top level takes no values)
    parser = build_parser(next((a for a in given if not a.startswith("-")), None))
    try:
        args = parser.parse_args(argv)
    except _UsageExit as e:
        if "--json" in given:
            print(json.dumps({"ok": False, "error": str(e), "exit_status": EXIT_USAGE},
                             indent=2))
        return EXIT_USAGE
    except SystemExit as e:  # argparse: usage errors exit 2, --help/--version exit 0
        code: object = e.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_USAGE)
    cmd: Command | None = getattr(args, "command", None)
    if cmd is None:
        parser.print_usage(sys.stderr)
        error("a command is required (see unbroken --help)")
        return EXIT_USAGE
    try:
        return cmd.run(args)
    except UsageError as e:
        return fail(args, str(e), EXIT_USAGE)
    except BrokenPipeError:  # the reader went away (`unbroken inspect RUN | head`)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_USAGE
    except _PROBLEMS as e:
        return fail(args, str(e), EXIT_PROBLEM)
    except UnbrokenError as e:
        return fail(args, str(e), EXIT_USAGE)
    except OSError as e:
        return fail(args, os_message(e, _named_path(args)), EXIT_USAGE)
    except KeyboardInterrupt:
        return fail(args, "interrupted", 130)
    except Exception as e:  # noqa: BLE001 -- the contract: exit 0, 1 or 2, never a traceback
        return fail(args, f"unexpected {type(e).__name__}: {e} (a bug in unbroken: please "
                           "report it with this message)", EXIT_USAGE)


@command("inspect", "list generations, their status and the newest one's identity",
         arg("run", metavar="RUN", help="the run folder"))
def _inspect(args: argparse.Namespace) -> int:
    """List every generation of RUN (step, size, status: complete / torn / corrupt, and why),
    the identity, lineage and environment of the newest complete one, uncommitted debris and
    moved-aside generations. Cheap: checks manifests and sizes, never re-hashes file contents
    (use `unbroken verify` for that). Exit 1 when any generation is torn or corrupt."""
    store = open_run(args.run)
    for _ in range(3):
        scanned = store.scan()
        run, run_problem = folder_run_record(store, scanned)
        records = [record(store, g, run) for g in scanned]
        recheck_torn(store, scanned, records)  # (a live writer's retention deleting one)
        if not records or any(r["status"] != GONE for r in records):
            break  # (else every one listed went while it was read: a live writer moved on)
    complete = [g for g, r in zip(scanned, records) if r["status"] == "complete"]
    gone = sum(r["status"] == GONE for r in records)
    newest = newest_summary(complete[-1]) if complete else None
    best = mark_best(records, newest["retention"]) if newest else None
    debris, aside = list_debris(store), aside_entries(store)
    ok = len(complete) + gone == len(scanned) and (not records or gone < len(records))
    payload = {"run": store.root, "run_id": run.run_id if run else None,
               "lineage": run.lineage if run else [], "generations": records,
               "newest_complete": newest, "best": best, "debris": debris, "aside": aside,
               "run_record_problem": run_problem, "ok": ok}
    lines = [f"run {store.root}" + (f" (run {run.run_id})" if run else "")]
    if run_problem:
        lines.append(f"warning: {run_problem}")
    if not scanned:
        lines.append("no generations")
        if os.path.basename(store.root).startswith("gen-"):
            lines.append("(this looks like a generation folder; pass the run folder above it)")
        elif not holds_a_run(store):
            lines.append("(nothing a Checkpointer writes is there: check the path)")
    else:
        bad = len(scanned) - len(complete) - gone
        lines += [f"{len(scanned)} generation{'s' * (len(scanned) != 1)}: "
                  f"{len(complete)} complete"
                  + (f", {bad} torn, corrupt or foreign" if bad else "")
                  + (f", {gone} {GONE} (a writer's retention)" if gone else ""),
                  "",
                  rows(store.root, records), ""]
        if best is not None:
            lines += [f"best by {best['metric']} ({best['mode']}): " + (
                f"generation {best['generation']}" if best["generation"] is not None
                else "none (no complete generation has a value of it)"), ""]
        lines += newest_summary_lines(newest) if newest else ["no complete generation"]
    for d in debris:
        lines.append(f"debris: {d['name']} ({d['note']})")
    lines += aside_lines(aside)
    return emit(args, payload, "\n".join(lines), ok)


# -- verify -------------------------------------------------------------------------------------


@command("verify", "re-hash and fully decode generations",
         arg("run", metavar="RUN", help="the run folder"),
         arg("--generation", type=int, metavar="N", help="verify only generation N"),
         arg("--deep", action="store_true",
             help="also check that every weight and optimizer tensor is finite and that the "
                  "optimizer, scheduler and scaler state could load and train"),
         arg("--factory", metavar="MODULE:FUNCTION",
             help="with --deep: build the training objects with this function, restore each "
                  "generation with a next-step fixture into them and replay that update"))
def _verify(args: argparse.Namespace) -> int:
    """Re-hash every artifact of every generation of RUN (or only --generation N) against its
    manifest, then decode it fully (safetensors headers, skeleton references, per-file stamps)
    without loading it into any model. Reports each generation: ok, or which file failed and
    what was expected and found. Exit 1 when any checked generation fails."""
    # (RUN/gen-000000400, as diff takes it)
    root, args.generation = named_generation(args.run, args.generation, "verify")
    store = open_run(root)
    scanned = store.scan()
    if not scanned and not holds_a_run(store):
        raise UsageError(f"{root}: not a run folder (nothing a Checkpointer writes is there); "
                         "verify takes the folder (or object-store URL) a Checkpointer saved "
                         "into")
    if args.generation is not None:
        scanned = [g for g in scanned if g.generation == args.generation]
        if not scanned:
            found = [g.generation for g in store.scan()]
            raise UsageError(f"{store.root}: no generation {args.generation} (found "
                             f"{found or 'none'})")
    run, run_problem = folder_run_record(store, store.scan())
    from .tools.deep import deep_problems

    deep = deep_problems if args.deep else None
    records = [verify_one(store, g, run, deep) for g in scanned]
    recheck_torn(store, scanned, records)
    for _ in range(3):  # a live writer's retention deleted every one of them: the newer ones
        if not records or any(r["status"] != GONE for r in records):
            break
        scanned = [g for g in store.scan() if args.generation in (None, g.generation)]
        records += [verify_one(store, g, run, deep) for g in scanned]
        recheck_torn(store, scanned, records[-len(scanned):] if scanned else [])
    if args.factory:
        from .tools.nextstep import replay_fixtures

        replay_fixtures(args, store, scanned, records)
    # (nothing verified, every generation gone while checked, is no verdict of success)
    ok = all(r["status"] in ("verified", GONE) for r in records) and (
        not records or any(r["status"] != GONE for r in records))
    payload = {"run": store.root, "generations": records, "run_record_problem": run_problem,
               "ok": ok}
    # (a generation this machine may not read was not judged: an environment error, exit 2,
    # unless a problem was found besides: exit 1 says that)
    statuses = {r["status"] for r in records}
    code = 2 if UNREADABLE in statuses and statuses <= {"verified", GONE, UNREADABLE} else None
    head = [f"run {store.root}", *([f"warning: {run_problem}"] if run_problem else [])]
    if not records:
        text = "\n".join([*head, "no generations to verify"])
    else:
        good = sum(r["status"] == "verified" for r in records)
        gone = sum(r["status"] == GONE for r in records)
        text = "\n".join([*head, rows(store.root, records), "",
                          f"{len(records)} checked: {good} verified, "
                          f"{len(records) - good - gone} failed"
                          + (f", {gone} {GONE} (a writer's retention)" if gone else "")])
    status = emit(args, payload, text, ok)
    return code or status


_DROPPABLE = ("optimizer", "scheduler", "scaler", "data", "rng", "weights_only")


@command("check", "prove that a training script resumes exactly: kill it, resume, compare",
         arg("--at", type=count(1), action="append", default=[], metavar="K",
             help="interrupt at update K only (repeatable; each its own case)"),
         arg("--random", type=count(0), default=0, metavar="N",
             help="add N random interruption points to the default plan"),
         arg("--seed", type=int, default=0, metavar="S", help="seed of the random points"),
         arg("--phase", action="append", default=[], choices=PHASES,
             help="how to interrupt (repeatable): after-update, mid-save, after-commit, "
                  "mid-update (SIGKILL) or sigterm (the script must stop cleanly); default: "
                  "each place's own"),
         arg("--rtol", type=tolerance, default=0.0,
             help="relative tolerance (default: exact)"),
         arg("--atol", type=tolerance, default=0.0,
             help="absolute tolerance (default: exact)"),
         arg("--exact-steps", type=count(0), default=None, metavar="N",
             help="with a tolerance: still exact for the first N updates after each resume"),
         arg("--plot", metavar="FILE.png", help="draw losses and their differences"),
         arg("--workdir", metavar="DIR", help="keep runs, traces and logs in DIR"),
         arg("--keep", action="store_true",
             help="keep the temporary working folder (removed by default)"),
         arg("--drop", metavar="PART", help="fault injection: do not restore PART on resume "
             "(optimizer, scheduler, scaler, data, rng, rng.<stream>, weights_only; PART@R: on "
             "rank R of a job only)"),
         arg("--reference", metavar="TRACE", help="reuse the trace of an earlier uninterrupted "
             "run of the same command (its workdir's reference/trace.jsonl)"),
         arg("--timeout", type=seconds, default=600.0, help="seconds allowed per process"),
         arg("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
             help="the training command"))
def _check(args: argparse.Namespace) -> int:
    """Run CMD uninterrupted, then run it again interrupted at the structurally risky places
    (first and last update of each epoch, the update after a save, inside a save, inside an
    update, the first update after a resume, the final update; --random N adds random
    points; --at K chooses points instead), resume it in a fresh process after each, and
    compare every update's trace with the uninterrupted run: sample ids, the learning rate
    the optimizer applied, optimizer steps taken, exact loss, gradient norm, the metrics given
    to step_done, and digests of parameters, optimizer, scheduler, scaler, data cursor and
    each RNG stream. Exit 0 when every case is equivalent, 1 when one diverges (naming the
    first step, field and the part to fix) or a process failed, 2 on a usage error."""
    import shutil
    import tempfile

    from .proof.harness import format_report, run_check

    for entry in (args.drop or "").split(","):
        part, at, rank = entry.partition("@")
        if (part and part not in _DROPPABLE and not part.startswith(("rng.", "extra."))
                or at and not rank.isdigit()):
            raise UsageError(f"--drop {entry!r}: one of {', '.join(_DROPPABLE)}, rng.<stream> "
                             "or extra.<name>, optionally @RANK (one rank of a job)")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("no command: unbroken check [options] -- python train.py ...")
    if args.exact_steps is not None and not (args.rtol or args.atol):
        raise UsageError("--exact-steps N: only with --rtol or --atol (without a tolerance "
                         "every update is compared exactly)")
    _check_inputs_first(args)
    temporary = args.workdir is None and not args.keep
    workdir = args.workdir or tempfile.mkdtemp(prefix="unbroken-check-")
    say = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        report = run_check(cmd, workdir, at=args.at, random_n=args.random, seed=args.seed,
                           phases=args.phase, rtol=args.rtol, atol=args.atol,
                           exact_steps=args.exact_steps, drop=args.drop,
                           reference_trace=args.reference, timeout=args.timeout,
                           progress=say)
        if args.plot:
            from .proof.plot import plot_check

            plot_check(report, args.plot)
    except UnbrokenError as e:
        if temporary:  # the message may name logs in the folder about to go
            raise type(e)(f"{e}\n(the working folder was removed; rerun with --keep or "
                          "--workdir DIR to keep its runs and logs)") from None
        raise
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
    kept = None if temporary else workdir
    payload = {**report.to_json(), "workdir": kept, "plot": args.plot}
    return emit(args, payload, format_report(report, kept), report.verdict == "equivalent")


def _check_inputs_first(args: argparse.Namespace) -> None:
    """What can be refused before minutes of training: a plot without matplotlib or without a
    writable path, a reference trace that is not there."""
    from .proof.harness import rank_traces

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'unbroken[plot]'") from None
        existed = os.path.lexists(args.plot)
        try:
            with open(args.plot, "ab"):
                pass
        except OSError as e:
            raise UsageError(f"--plot {args.plot}: cannot be written ({e.strerror or e})"
                             ) from None
        if not existed:
            os.unlink(args.plot)
    if args.reference and not rank_traces(args.reference):
        raise UsageError(f"--reference {args.reference}: no such trace file (nor one per "
                         "rank: .rank0, .rank1, ...)")


@command("demo", "kill a training run, resume it, prove equivalence, show defective resumes",
         arg("--dir", metavar="DIR", help="keep the runs and traces in DIR"))
def _demo(args: argparse.Namespace) -> int:
    """The main job: train uninterrupted; kill a copy with SIGKILL mid-run; resume it in a fresh
    process and compare every update bit for bit; resume copies deliberately wrongly and show
    each one caught. Exit 0 when the resume is equivalent and every defect is caught."""
    from .proof.demo import run_demo

    return run_demo(args.dir, as_json=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
