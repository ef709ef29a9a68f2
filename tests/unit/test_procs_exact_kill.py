"""`_procs.kill` and `kill_tree` signal a process only while it is still the one that was
listed (its pid pinned by a pidfd, its start time checked): a pid reused since the listing,
here simulated by a listing whose start time is another process's, is left alone."""

from __future__ import annotations

import subprocess
import sys
import time

from unbroken import _procs


def _sleeper(session: bool = False) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=session)


def _gone(proc: subprocess.Popen[bytes]) -> bool:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return True


def _alive(pid: int) -> bool:
    row = _procs._table().get(pid)
    return row is not None and row[2] != "Z"


def test_a_listed_pair_whose_start_time_no_longer_matches_is_not_killed():
    proc = _sleeper()
    try:
        start = _procs._started(proc.pid)
        assert start is not None
        assert _procs.kill({(proc.pid, start + 1)}) == set()  # "another process" with its pid
        _procs._sigkill((proc.pid, start + 1))
        _procs._sigkill((proc.pid, start + 1), group=True)
        time.sleep(0.2)
        assert proc.poll() is None
        assert _procs.kill({(proc.pid, start)}) == {(proc.pid, start)}
        assert _gone(proc) and proc.returncode == -9
    finally:
        proc.kill()
        proc.wait()


def test_a_group_leader_is_killed_with_its_group_only_while_it_is_the_listed_one():
    leader = _sleeper(session=True)
    try:
        start = _procs._started(leader.pid)
        assert start is not None
        _procs._sigkill((leader.pid, start - 1), group=True)
        time.sleep(0.2)
        assert leader.poll() is None
        _procs._sigkill((leader.pid, start), group=True)
        assert _gone(leader) and leader.returncode == -9
    finally:
        leader.kill()
        leader.wait()


def test_a_process_that_ended_is_not_an_error():
    proc = _sleeper()
    start = _procs._started(proc.pid)
    proc.kill()
    proc.wait()
    assert start is not None
    _procs._sigkill((proc.pid, start))  # (reaped: its pid is free)
    assert _procs.kill({(proc.pid, start)}) == set()


def test_kill_tree_takes_the_whole_tree_down():
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while len(_procs.tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        listed = _procs.tree(parent.pid)
        assert len(listed) == 2
        _procs.kill_tree(parent.pid)
        assert _gone(parent) and parent.returncode == -9
        [child] = [pid for pid, _ in listed if pid != parent.pid]
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)  # (dead; a zombie until its new parent reaps it)
    finally:
        parent.kill()
        parent.wait()
