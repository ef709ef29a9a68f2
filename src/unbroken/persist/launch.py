"""Starting a persisting process (`persist.process`): the interpreter running
`persist._worker` in a session of its own, connected by a Unix socket pair. A start the
operating system refuses (no interpreter at ``sys.executable``, no file descriptors or
processes left) is a `SaveFailed` that names the command and the reason, never a raw
``OSError`` from ``subprocess``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from .._procs import PERSISTER_OF_ENV
from ..errors import SaveFailed
from ..store.lock import errno_text


def launch(root: str, member: bool) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start the persisting process of the run folder ``root`` (``member``: a rank of a job
    other than the leader, which takes no lock); it and this process's end of the socket."""
    command = [sys.executable, "-m", "unbroken.persist._worker", root]
    try:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:
        raise _not_started(root, command, e) from None
    try:
        env = {**os.environ, PERSISTER_OF_ENV: str(os.getpid()), "UNBROKEN_PROGRESS": "0"}
        proc = subprocess.Popen(
            [*command, str(theirs.fileno()), *(["--member"] if member else [])],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            env=env, start_new_session=True)
    except BaseException as e:
        mine.close()
        if isinstance(e, OSError):  # (no interpreter there, no descriptors or processes)
            raise _not_started(root, command, e) from None
        raise
    finally:
        theirs.close()  # (the child has its copy)
    return proc, mine


def _not_started(root: str, command: list[str], e: OSError) -> SaveFailed:
    return SaveFailed(
        f"{root}: the persisting process of async_save='process' could not be started "
        f"({' '.join(command)}): {errno_text(e)}; nothing was written. The interpreter must "
        "exist and import unbroken, and this process must be able to open file descriptors "
        "and start a process (see ulimit -n and ulimit -u); or save with async_save=True "
        "(a thread of this process)")
