"""`_procs.kill_job`, the kill behind every fault point of a job: ranks that hit a fault
point at the same moment take turns (one killer at a time), and nothing of the job (launcher,
ranks, the workers they forked) survives. (A version that stopped every process before killing
it once left two such ranks stopped by each other; one that let both kill at once left the
launcher alive in CI, each rank killed by the other before either reached it. Those races are
too narrow to provoke on demand: the outcome is checked, and the turn-taking itself.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from _launch import _tagged, launcher_script

RANK = textwrap.dedent('''
    import os, sys, time
    from unbroken import _procs
    if os.fork() == 0:  # a DataLoader worker of this rank, in its group
        time.sleep(120)
        os._exit(0)
    go, kills = sys.argv[1], sys.argv[2] == "kill"
    open(go + f".ready{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    if kills:
        _procs.kill_job()  # the job: the launcher, every rank and its workers
    time.sleep(120)  # (a rank that reached no fault point goes on training)
''')
LAUNCHER = textwrap.dedent('''
    import subprocess, sys, time
    for kills in sys.argv[3:]:  # ranks in sessions of their own, as torchrun starts them
        subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], kills],
                         start_new_session=True)
    time.sleep(120)
''')


@pytest.mark.parametrize("ranks", [("kill", "kill"), ("kill", "kill", "train")],
                         ids=["2-of-2", "2-of-3"])
def test_ranks_killing_the_job_at_once_leave_nothing_alive(tmp_path, ranks):
    """Two ranks reach a fault point at the same moment and kill the job: nothing of it
    survives, a rank that reached none included."""
    for trial in range(3 if len(ranks) == 2 else 2):
        tag = uuid.uuid4().hex
        go = str(tmp_path / f"go{trial}")
        env = {**os.environ, "UNBROKEN_TEST_JOB": tag, "TORCHELASTIC_RUN_ID": tag}
        launcher = subprocess.Popen([sys.executable, launcher_script(tmp_path, LAUNCHER), RANK,
                                     go, *ranks], env=env)
        deadline = time.monotonic() + 60
        while (len([p for p in os.listdir(tmp_path) if p.startswith(f"go{trial}.ready")])
               < len(ranks)):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        open(go, "w").close()  # the killers kill the job now
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
    subprocess.run([sys.executable, sys.argv[1], sys.argv[2], sys.argv[3]])
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
    launcher = launcher_script(tmp_path, LAUNCHER_DYING)
    reaper = subprocess.run([sys.executable, "-c", REAPER, launcher, ORPHANED_RANK, go],
                            env=env, capture_output=True, text=True, timeout=60)
    assert reaper.returncode == 0, reaper.stderr
    assert reaper.stdout.split() == ["True", "True"], "the reaper's other child was killed"


PARENT = textwrap.dedent('''
    import subprocess, sys
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = subprocess.run([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    print(rank.returncode, bystander.poll() is None, flush=True)
    bystander.kill()
''')
KILLER_UNDER_ANOTHER_PARENT = textwrap.dedent('''
    from unbroken import _procs
    _procs.kill_job()
''')


def test_under_torchrun_a_process_whose_parent_is_not_torchrun_kills_only_itself():
    """``$TORCHELASTIC_RUN_ID`` is inherited by everything a rank starts (a test runner under
    torchrun starting a script): a fault point in such a process must not take its parent,
    which is no launcher, nor the parent's other children."""
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "inherited"}
    parent = subprocess.run([sys.executable, "-c", PARENT, KILLER_UNDER_ANOTHER_PARENT],
                            env=env, capture_output=True, text=True, timeout=60)
    assert parent.returncode == 0, parent.stderr
    assert parent.stdout.split() == ["-9", "True"], parent.stdout
