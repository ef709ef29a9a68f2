"""Review of `_procs.kill_job` under torchrun: a killer whose first try was interrupted by an
exception (what `kill_job`'s retry loop is for) must not wait on the job's killer name that
it holds itself; and a DataLoader worker (forked, inheriting the rank's launcher) that hits a
fault point takes the whole job down, launcher included."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

from _launch import _tagged, launcher_script

LAUNCHER = textwrap.dedent('''
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    time.sleep(60)
''')  # a rank in a session of its own, as torchrun starts it

RANK_INTERRUPTED = textwrap.dedent('''
    import os, time
    from unbroken import _procs
    if os.fork() == 0:  # a DataLoader worker of this rank
        time.sleep(60)
        os._exit(0)
    real, tries = _procs.kill_tree, []
    def kill_tree(root):
        tries.append(root)
        if len(tries) == 1:  # a signal handler's exception, before the launcher is killed
            raise KeyboardInterrupt
        real(root)
    _procs.kill_tree = kill_tree
    _procs.kill_job()
''')

RANK_WORKER_KILLS = textwrap.dedent('''
    import os, time
    from unbroken import _procs
    if os.fork() == 0:  # a DataLoader worker (forked: it inherits the rank's launcher)
        time.sleep(0.5)
        _procs.kill_job()
    time.sleep(60)  # the rank trains on
''')


def _job(tmp_path, rank: str, within: float) -> dict[int, str]:
    """Run a launcher with one rank; what of the job is left alive after ``within`` s."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "UNBROKEN_TEST_JOB": tag, "TORCHELASTIC_RUN_ID": tag}
    launcher = subprocess.Popen([sys.executable, launcher_script(tmp_path, LAUNCHER), rank],
                                env=env)
    try:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if launcher.poll() is not None and not _tagged(tag):
                return {}
        return _tagged(tag)
    finally:
        for pid in _tagged(tag):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        launcher.wait(timeout=10)


def test_a_killer_interrupted_once_still_kills_the_job(tmp_path):
    """`kill_job` starts over after an exception; the second try must not wait forever for
    the killer name this same process took in the first."""
    left = _job(tmp_path, RANK_INTERRUPTED, within=30)
    assert not left, f"left alive: {left}"


def test_a_forked_worker_that_kills_takes_the_whole_job(tmp_path):
    left = _job(tmp_path, RANK_WORKER_KILLS, within=30)
    assert not left, f"left alive: {left}"
