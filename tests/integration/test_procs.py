"""`_procs.kill_job`, the kill behind every fault point of a job: two ranks that hit a fault
point at the same moment both kill the job, and nothing of it (launcher, ranks, the workers
they forked) survives. (A version that stopped every process before killing it once left two
such ranks stopped by each other, an FSDP test's job alive until its timeout; that race is too
narrow to provoke here on demand, so this checks the outcome, not the interleaving.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

from _launch import _tagged

RANK = textwrap.dedent('''
    import os, sys, time
    from unbroken import _procs
    if os.fork() == 0:  # a DataLoader worker of this rank, in its group
        time.sleep(120)
        os._exit(0)
    go = sys.argv[1]
    open(go + f".ready{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    _procs.kill_job()  # the job: the launcher, every rank and its workers
    time.sleep(120)
''')
LAUNCHER = textwrap.dedent('''
    import subprocess, sys, time
    for _ in range(2):  # ranks in sessions of their own, as torchrun starts them
        subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                         start_new_session=True)
    time.sleep(120)
''')


def test_two_ranks_killing_the_job_at_once_leave_nothing_alive(tmp_path):
    for trial in range(3):
        tag = uuid.uuid4().hex
        go = str(tmp_path / f"go{trial}")
        env = {**os.environ, "UNBROKEN_TEST_JOB": tag, "TORCHELASTIC_RUN_ID": tag}
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, go], env=env)
        deadline = time.monotonic() + 60
        while len([p for p in os.listdir(tmp_path) if p.startswith(f"go{trial}.ready")]) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        open(go, "w").close()  # both ranks kill the job now
        deadline = time.monotonic() + 20
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _tagged(tag)
        for pid in left:
            os.kill(pid, 9)
        launcher.wait(timeout=10)
        assert not left, f"trial {trial}: left alive {left}"
