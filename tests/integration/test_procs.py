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


KILLER = textwrap.dedent('''
    import os, sys, time
    from unbroken import _procs
    launcher = (int(sys.argv[1]), _procs._started(int(sys.argv[1])))
    assert _procs._be_the_killer(launcher)
    open(sys.argv[2] + f".{os.getpid()}", "w").close()  # this one holds the name
    time.sleep(float(sys.argv[3]))
''')


def test_ranks_killing_the_job_take_turns(tmp_path):
    """One killer at a time: a second rank waits while the first holds the job's name, and
    takes it when the first dies (two killers that killed each other once left the launcher
    alive)."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mark = str(tmp_path / "held")
    try:
        first = subprocess.Popen([sys.executable, "-c", KILLER, str(launcher.pid), mark, "60"])
        deadline = time.monotonic() + 30
        while not os.listdir(tmp_path):
            assert time.monotonic() < deadline, "the first killer never held the name"
            time.sleep(0.02)
        second = subprocess.Popen([sys.executable, "-c", KILLER, str(launcher.pid), mark, "0"])
        time.sleep(1)  # long enough to import and try; it must still be waiting
        assert second.poll() is None and os.listdir(tmp_path) == [f"held.{first.pid}"]
        first.kill()  # as a killer killed from outside halfway: the name passes on
        first.wait(timeout=10)
        assert second.wait(timeout=30) == 0
        assert sorted(os.listdir(tmp_path)) == sorted([f"held.{first.pid}", f"held.{second.pid}"])
    finally:
        for proc in (launcher, first, second):
            proc.kill()
            proc.wait(timeout=10)


REAPER = textwrap.dedent('''
    import ctypes, os, subprocess, sys, time
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans below come to this one
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
    go = sys.argv[3]
    deadline = time.monotonic() + 30
    while not os.path.exists(go + ".dead") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1)  # the orphaned rank's kill has run by now
    print(os.path.exists(go + ".dead"), bystander.poll() is None, flush=True)
    bystander.kill()
''')
LAUNCHER_DYING = textwrap.dedent('''
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    while not os.path.exists(sys.argv[2] + ".ready"):
        time.sleep(0.01)
''')  # and dies, before its rank kills the job
ORPHANED_RANK = textwrap.dedent('''
    import os, sys, time
    from unbroken import _procs  # imported under the launcher, as a rank imports it
    go = sys.argv[1]
    open(go + ".ready", "w").close()
    while os.getppid() == _procs._LAUNCHER[0]:
        time.sleep(0.01)  # until the launcher is gone
    open(go + ".dead", "w").close()
    _procs.kill_job()
''')


def test_a_rank_whose_launcher_died_kills_only_itself(tmp_path):
    """A rank's launcher died first, so the rank now belongs to a reaper and ``getppid()``
    names the reaper: its kill must not take the reaper and the reaper's other children."""
    go = str(tmp_path / "go")
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "orphan"}
    reaper = subprocess.run([sys.executable, "-c", REAPER, LAUNCHER_DYING, ORPHANED_RANK, go],
                            env=env, capture_output=True, text=True, timeout=60)
    assert reaper.returncode == 0, reaper.stderr
    assert reaper.stdout.split() == ["True", "True"], "the reaper's other child was killed"
