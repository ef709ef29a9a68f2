"""The command line's entry point (``unbroken``, ``python -m unbroken``): a Ctrl-C while the
command line is still being imported, or once the command has finished, is no traceback.
`cli.main` answers a Ctrl-C while a command runs; this covers the moments around it. It
imports nothing heavy itself: the command line's own imports are what it guards."""

from __future__ import annotations

import json
import signal
import sys

INTERRUPTED = 130  # as a shell reports a process ended by SIGINT


def main(argv: list[str] | None = None) -> int:
    """Run the command line; its exit status, or 130 when interrupted before it could run."""
    given = sys.argv[1:] if argv is None else argv
    try:
        from .cli import main as run

        code = run(argv)
    except KeyboardInterrupt:
        print("unbroken: error: interrupted", file=sys.stderr)
        if "--json" in given:
            print(json.dumps({"ok": False, "error": "interrupted", "exit_status": INTERRUPTED},
                             indent=2))
        code = INTERRUPTED
    # The command is done and has said so: a Ctrl-C now (the interpreter joining threads,
    # flushing files) must not turn a reported success into a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # (a reader that went away: cli.main said what it could)
        pass
    return code
