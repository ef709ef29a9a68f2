"""Who holds an object-store run (`store.lease`): a lease names its holder's pid and start
time, host name, boot and pid namespace, so a writer restarted on this machine takes over at
once from a holder that is gone (no such process, a zombie not reaped yet, or its pid given to
another process), and never from a live writer in another container that shares this host's
name (host networking) but not its pid namespace, where its pid means nothing here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import fsspec
import pytest

from unbroken.errors import StoreLocked
from unbroken.store.lease import LEASE, _dead_here, _machine
from unbroken.store.opening import open_store


def holder(pid: int, **fields) -> dict:
    """A lease of this machine naming ``pid`` (its real start time unless given)."""
    from unbroken._procs import _started

    return {"lease": "x", "pid": pid, "host": socket.gethostname(), **_machine(),
            "started": _started(pid), "expires": time.time() + 3600, **fields}


@pytest.fixture
def zombie():
    """A child process that has ended and is not reaped (its pid still taken)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended; not reaped
    with open(f"/proc/{proc.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    yield proc.pid
    proc.wait()


def gone_pid() -> int:
    """A pid no process has now (one that ended and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_writer_of_this_machine_holds_its_lease():
    assert not _dead_here(holder(os.getpid()))


def test_a_holder_that_is_gone_is_dead():
    assert _dead_here(holder(gone_pid(), started=1))


def test_a_holder_that_died_and_is_not_reaped_yet_is_dead(zombie):
    assert _dead_here(holder(zombie))


def test_a_holder_whose_pid_another_process_took_since_is_dead():
    me = holder(os.getpid())
    assert _dead_here({**me, "started": me["started"] + 1})


@pytest.mark.parametrize("field", ["pidns", "boot"])
def test_a_holder_of_another_pid_namespace_or_boot_under_this_name_is_never_taken_for_dead(
        field):
    """The pid of a writer in another container sharing this host name (host networking) is
    no process here: the lease is not taken over before it expires."""
    assert not _dead_here(holder(gone_pid(), started=1, **{field: "other"}))
    assert not _dead_here(holder(os.getpid(), started=1, **{field: "other"}))


def test_an_older_lease_without_boot_and_namespace_counts_only_a_missing_process(zombie):
    def old(pid: int) -> dict:
        return {k: v for k, v in holder(pid).items() if k not in ("boot", "pidns", "started")}

    assert _dead_here(old(gone_pid()))
    assert not _dead_here(old(zombie))  # (it might be another machine's live pid)
    assert not _dead_here(old(os.getpid()))


def test_a_writer_takes_over_at_once_from_a_zombie_holder_and_not_from_a_live_one(zombie):
    url = f"memory://unbroken-lease/{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{url}/{LEASE}", json.dumps(holder(zombie)).encode())
    store = open_store(url)
    store.lock()  # at once: the lease names a process that has ended
    store.unlock()
    fs.pipe_file(f"{url}/{LEASE}", json.dumps(holder(os.getppid())).encode())
    with pytest.raises(StoreLocked, match=f"leased by pid {os.getppid()} on"):
        open_store(url).lock()


def test_a_lease_this_writer_writes_names_its_machine_and_start_time():
    url = f"memory://unbroken-lease/{uuid.uuid4().hex}"
    store = open_store(url)
    store.lock()
    try:
        written = json.loads(fsspec.filesystem("memory").cat_file(f"{url}/{LEASE}"))
    finally:
        store.unlock()
    assert {k: written[k] for k in ("pid", "host", "boot", "pidns", "started")} == {
        "pid": os.getpid(), "host": socket.gethostname(), **_machine(),
        "started": holder(os.getpid())["started"]}
    assert written["boot"] and written["pidns"].startswith("pid:[")
