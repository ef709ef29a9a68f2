"""Helper of the tests that fork the test process (``tests/integration/test_fork.py``,
``tests/unit/test_review_io_pool.py``): a forked child reaped within a deadline, and killed if
it hangs, so that a hang fails the test instead of the suite."""

from __future__ import annotations

import os
import signal
import time

import pytest


def reaped(pid: int, within: float, what: str = "the forked child") -> int:
    """The exit code of the forked child ``pid`` (minus the signal that ended it), once it
    ended within ``within`` seconds; else it is killed and the test fails."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"{what} still running after {within:g} s")
