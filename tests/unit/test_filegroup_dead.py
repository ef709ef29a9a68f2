"""A job's persisting processes wait for each other through files (`dist.filegroup`). One
found from outside (twenty-fourth session): the leader's persisting process killed at commit
left the other ranks' waiting until the timeout (the default 600 s, holding the snapshot's
memory) after the job had ended. A rank whose process posted before and is gone (or a
zombie its training process has not reaped) is now given up on at once, by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from unbroken.dist import filegroup
from unbroken.dist.filegroup import FileGroup, stage
from unbroken.dist.group import RankFailed
from unbroken.store.generations import GenerationStore


@pytest.fixture
def job(tmp_path):
    store = GenerationStore(tmp_path / "run")
    store.lock()
    yield store, stage(store, 7, False)
    store.unlock()


def _post_as(staging: str, name: str, pid: int) -> None:
    """Rank 1's post of collective ``name``, as its persisting process ``pid`` wrote it."""
    by = [filegroup._HOST, pid, filegroup._since(pid)]
    with open(os.path.join(staging + ".job", f"{name}.rank00001.json"), "w") as f:
        json.dump({"value": 1, "by": by}, f)


@pytest.mark.parametrize("reaped", [True, False], ids=["gone", "zombie"])
def test_a_rank_whose_process_died_after_posting_is_given_up_on_at_once(job, reaped) -> None:
    store, staging = job
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _post_as(staging, "0001", other.pid)
        group = FileGroup(store.fs, staging, 7, 0, 2, timeout=30)
        assert group.all_gather(0, "first") == [0, 1]  # (rank 1 posted it before it died)
        os.kill(other.pid, signal.SIGKILL)
        if reaped:
            other.wait()
        else:
            while filegroup._since(other.pid) is not None:  # (until it is a zombie)
                time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(RankFailed, match=f"rank 1's persisting process \\(pid "
                                             f"{other.pid}\\) died"):
            group.all_gather(0, "second")
        assert time.monotonic() - started < 5  # at once, not at the 30 s timeout
    finally:
        other.kill()
        other.wait()


def test_a_live_rank_is_waited_for(job) -> None:
    store, staging = job
    _post_as(staging, "0001", os.getpid())  # (alive: this process)
    group = FileGroup(store.fs, staging, 7, 0, 2, timeout=0.3)
    assert group.all_gather(0, "first") == [0, 1]
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] posted nothing within 0.3 s"):
        group.all_gather(0, "second")


def test_a_post_names_its_process(job) -> None:
    store, staging = job
    FileGroup(store.fs, staging, 7, 1, 2, timeout=1).close(None)  # (rank 1's: kept)
    with open(os.path.join(staging + ".job", "done.rank00001.json")) as f:
        assert json.load(f)["by"] == [filegroup._HOST, os.getpid(), filegroup._since(os.getpid())]
    assert filegroup._since(2 ** 22 + 12345) is None  # (no such process)
