"""The command line's entry point (``unbroken``, ``python -m unbroken``): a Ctrl-C while the
command line is still being imported, or once the command has finished, is no traceback.
`cli.main` answers a Ctrl-C while a command runs; this covers the moments around it. It
imports nothing heavy itself (not even json): the command line's own imports are what it
guards, and the sooner its handler is in place the smaller the window left to Python's
own start (the interpreter's ``site``, the console script's ``import re``), which no code of
a package can reach."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # (typing.TYPE_CHECKING: see the package's __init__)
if TYPE_CHECKING:
    import signal
    from types import FrameType
else:  # the module behind `signal`, without the enums it builds (~4 ms at start)
    import _signal as signal

INTERRUPTED = 130  # as a shell reports a process ended by SIGINT

# The document `cli.main` prints for an interrupt with --json (json.dumps(..., indent=2)).
_JSON = '{\n  "ok": false,\n  "error": "interrupted",\n  "exit_status": 130\n}\n'


def _say_interrupted(json_too: bool) -> None:
    print("unbroken: error: interrupted", file=sys.stderr, flush=True)
    if json_too:
        print(_JSON, end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; its exit status, or 130 when interrupted before it could run."""
    given = sys.argv[1:] if argv is None else argv
    json_too = "--json" in given
    before = signal.getsignal(signal.SIGINT)
    guard = before != signal.SIG_IGN  # (started ignoring Ctrl-C, as nohup does: keep it)

    def while_importing(signum: int, frame: FrameType | None) -> None:
        # Exit here rather than raise KeyboardInterrupt: raised inside the import machinery
        # (a module lock's weakref callback), it is printed as "Exception ignored ...
        # Traceback" and lost, and the command runs on. Nothing has been done yet to undo.
        try:
            _say_interrupted(json_too)
        finally:
            os._exit(INTERRUPTED)

    if guard:
        signal.signal(signal.SIGINT, while_importing)
    hook = sys.unraisablehook
    try:
        from .cli import main as run

        if guard:  # (cli.main answers an interrupt itself: as KeyboardInterrupt)
            signal.signal(signal.SIGINT, before)
        sys.unraisablehook = _unraisable
        code = run(argv)
    except KeyboardInterrupt:
        _say_interrupted(json_too)
        code = INTERRUPTED
    finally:
        sys.unraisablehook = hook
        # The command is done and has said so: a Ctrl-C now (the interpreter joining
        # threads, flushing files) must not turn a reported success into a failure.
        if guard:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a reader that went away: cli.main said what it could)
            pass
    return code


def _unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """A Ctrl-C that Python could not raise where it landed (in a weakref callback or a
    ``__del__``, as while a command imports torch) would be printed as "Exception ignored"
    with a traceback, and lost: deliver it again, to be raised in the command itself."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        return
    sys.__unraisablehook__(unraisable)
