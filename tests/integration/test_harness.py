"""The harness's process handling: a hung run is killed with its whole group and reported."""

from __future__ import annotations

import sys
import time

import pytest

from unbroken._procs import group_alive
from unbroken.proof.harness import Timeout, run_process


def test_a_hung_process_group_is_killed_and_reported(tmp_path):
    script = tmp_path / "hang.py"
    # A parent that forks a child (like a DataLoader worker), then both hang.
    script.write_text("import os, time\nos.fork()\ntime.sleep(300)\n")
    started = time.monotonic()
    with pytest.raises(Timeout, match="ran past 1 s"):
        run_process([sys.executable, str(script)], {}, str(tmp_path / "log"), timeout=1)
    assert time.monotonic() - started < 20
    assert "killed after 1 s" in (tmp_path / "log").read_text()


def test_workers_left_behind_by_a_finished_parent_are_reaped(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text("import os, sys, time\nif os.fork() == 0:\n    time.sleep(300)\n"
                      "print(os.getpgid(0))\nsys.exit(0)\n")
    log = tmp_path / "log"
    assert run_process([sys.executable, str(script)], {}, str(log), timeout=30) == 0
    pgid = int(log.read_text().split()[0])
    assert not group_alive(pgid)


def test_the_leader_is_reaped_only_after_its_group_is_gone(tmp_path, monkeypatch):
    """Every SIGKILL of the group by its number lands while the leader is still a zombie
    (its pid, the group's id, then cannot belong to another process group); the leader's
    exit status comes back as it exited."""
    import os

    from unbroken.proof import harness

    script = tmp_path / "orphan.py"
    script.write_text("import os, sys, time\nif os.fork() == 0:\n    time.sleep(300)\n"
                      "sys.exit(3)\n")
    states: list[str] = []
    real = os.killpg

    def watched(pgid: int, sig: int) -> None:
        with open(f"/proc/{pgid}/stat") as f:  # (raises if the leader was reaped)
            states.append(f.read().rsplit(")", 1)[1].split()[0])
        real(pgid, sig)

    monkeypatch.setattr(harness.os, "killpg", watched)
    assert run_process([sys.executable, str(script)], {}, str(tmp_path / "log"),
                       timeout=30) == 3
    assert states and set(states) == {"Z"}, states
