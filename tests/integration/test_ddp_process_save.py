"""``async_save="process"`` in a job of 2 ranks (gloo on CPU): every rank's persisting process
writes its own files and they commit together through files (`dist.filegroup`). One run
folder goes through three lives after an uninterrupted reference: one whose leader is
SIGKILLed right after a save returned, one whose rank 1 is, and one where rank 1's persisting
process cannot write its files; each restores the newest generation and must continue bit
for bit as the reference did.

The ranks are started by hand, not by torchrun: a rank SIGKILLed alone leaves its persisting
process alive, as a crash of the training process would (under torchrun the fault points
kill the job's whole process tree, persisting processes included). Every collective runs
under a 30 s process-group timeout, every wait of the persisting processes under 20 s and
every process under a subprocess timeout: nothing here can hang the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from _launch import JOB_TAG_ENV, _tagged, free_port, gens
from conftest import SCRIPTS
from safetensors.torch import load_file

from unbroken.dist.commit import commit_staged
from unbroken.dist.filegroup import FileGroup, stage
from unbroken.errors import SaveFailed
from unbroken.store.generations import GenerationStore

SCRIPT = str(SCRIPTS / "ddp_process_save.py")


class Life:
    """The 2 ranks of one life of the job, their output in ``out``."""

    def __init__(self, folder: Path, out: Path, env: dict[str, str] | None = None) -> None:
        out.mkdir()
        self.out, self.tag = out, uuid.uuid4().hex
        port = str(free_port())
        self.procs = []
        for r in range(2):
            with open(out / f"out.rank{r}", "w") as o, open(out / f"err.rank{r}", "w") as e:
                self.procs.append(subprocess.Popen(
                    [sys.executable, SCRIPT, "--folder", str(folder), "--out", str(out)],
                    env={**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": "2",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                         JOB_TAG_ENV: self.tag}, stdout=o, stderr=e))

    def stderr(self, rank: int) -> str:
        return (self.out / f"err.rank{rank}").read_text()[-3000:]

    def restored(self, rank: int) -> int:
        line = (self.out / f"out.rank{rank}").read_text().split("\n")[0]
        return int(line.rsplit(" ", 1)[1])

    def end(self, killed: int | None = None, at: int = 0) -> list[int]:
        """Wait for the ranks (with ``killed``: once it died by its SIGKILL, the other is
        SIGKILLed as soon as its own save of update ``at`` returned, so that the whole job
        dies after that save), then for every persisting process to finish; the ranks' exit
        codes."""
        deadline = time.monotonic() + 120
        try:
            if killed is not None:
                assert self.procs[killed].wait(timeout=120) == -9, self.stderr(killed)
                other = self.procs[1 - killed]
                while not (self.out / f"saved.{at}.rank{1 - killed}").exists():
                    assert other.poll() is None, self.stderr(1 - killed)
                    assert time.monotonic() < deadline, self.stderr(1 - killed)
                    time.sleep(0.01)
                other.kill()
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
            while _tagged(self.tag) and time.monotonic() < deadline:  # persisting processes
                time.sleep(0.05)
            assert not _tagged(self.tag), f"still alive: {_tagged(self.tag)}"
            return codes
        finally:
            for p in self.procs:
                p.kill()
                p.wait()
            for pid in _tagged(self.tag):
                os.kill(pid, 9)


def state(out: Path, step: int, rank: int) -> dict[str, torch.Tensor]:
    return load_file(out / f"state.{step}.rank{rank}.safetensors")


def assert_bitwise(reference: Path, life: Path, step: int) -> None:
    """Every rank's model and optimizer tensors after update ``step`` are those of the
    reference, bit for bit."""
    for rank in range(2):
        mine, theirs = state(life, step, rank), state(reference, step, rank)
        assert sorted(mine) == sorted(theirs) and any("optimizer" in k for k in mine)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), (step, rank)


def assert_committed(folder: Path, numbers: list[int]) -> None:
    """The run folder holds exactly generations ``numbers``, each verifying, and nothing
    else (no staging or job folder left by the persisting processes)."""
    assert sorted(os.listdir(folder)) == ["LOCK", "RUN.json", *(f"gen-{n:09d}" for n in
                                                                  numbers)]
    store = GenerationStore(folder)
    for n in numbers:
        info = store.scan_one(n)
        assert info.ok and info.manifest is not None and info.manifest.world_size == 2
        store.verify(info)
        assert {"rank00000.rng.safetensors", "rank00001.rng.safetensors"} <= {
            a.name for a in info.manifest.artifacts}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted job: 12 updates, a save every 3, keeping the last 2."""
    tmp = tmp_path_factory.mktemp("process-ref")
    life = Life(tmp / "run", tmp / "ref")
    assert life.end() == [0, 0], life.stderr(0) + life.stderr(1)
    assert_committed(tmp / "run", [9, 12])
    for rank in (0, 1):  # each rank's persisting process committed its share without torch
        libs = json.loads((tmp / "ref" / f"persister.rank{rank}.json").read_text())["libraries"]
        assert libs and not [lib for lib in libs if "torch" in lib], (rank, libs)
    return tmp / "ref"


@pytest.fixture(scope="module")
def killed(reference, tmp_path_factory) -> tuple[Path, list[Life]]:
    """Two lives on one folder: the leader SIGKILLed right after the save of update 3
    returned, then (resumed) rank 1 right after that of update 6."""
    tmp = tmp_path_factory.mktemp("process-killed")
    folder = tmp / "run"
    lives = []
    for rank, at in ((0, 3), (1, 6)):
        life = Life(folder, tmp / f"killed{rank}", {"KILL_RANK": str(rank),
                                                    "KILL_AT": str(at)})
        life.end(killed=rank, at=at)
        lives.append(life)
        assert_committed(folder, [3] if at == 3 else [3, 6])
    return folder, lives


def test_a_rank_killed_right_after_save_returned_still_commits_that_generation(
        reference, killed):
    folder, (first, second) = killed
    assert [first.restored(r) for r in range(2)] == [0, 0]
    assert_bitwise(reference, first.out, 3)
    assert [second.restored(r) for r in range(2)] == [3, 3]  # what the dead leader saved
    assert_bitwise(reference, second.out, 6)  # resumed from 3 as if never stopped


def test_a_failed_persisting_process_fails_the_save_on_every_rank(reference, killed):
    folder, _ = killed
    life = Life(folder, folder.parent / "failed", {"FAIL_RANK": "1", "FAIL_AT": "9"})
    assert life.end() == [0, 0], life.stderr(0) + life.stderr(1)
    assert [life.restored(r) for r in range(2)] == [6, 6]  # what the dead rank 1 saved
    failed = [json.loads((life.out / f"failed.rank{r}.json").read_text()) for r in range(2)]
    raised = failed[0]["raised"]
    assert raised is not None and raised["type"] == "SaveFailed"
    assert raised["message"].startswith("rank 1: File exists [EEXIST]")
    assert "/.staging-000000009-" in raised["message"]  # the file, in generation 9's staging
    assert failed[1]["raised"] == raised  # the same error on every rank
    assert all(f["seconds"] < 15 for f in failed)  # (told at once, not at the timeout)
    assert failed[0]["folder"] == ["LOCK", "RUN.json", "gen-000000003", "gen-000000006"]
    # the save of update 12 succeeded: the job went on, bit for bit
    assert_bitwise(reference, life.out, 12)
    assert_committed(folder, [6, 12])


def test_a_silent_persisting_process_fails_the_commit_within_the_timeout(tmp_path):
    """The file commit alone, rank 0's side: rank 1 stays silent (its persisting process
    died), or gives up (its ``done``, with its error)."""
    store = GenerationStore(tmp_path / "run")
    store.lock()
    for silent in (True, False):
        # (silent: the timeout is what ends the wait; gives up: it is said at once, which a
        # timeout far above the bound below tells from the timeout on a loaded machine)
        timeout = 0.5 if silent else 10.0
        staging = stage(store, 7, False)
        group = FileGroup(store.fs, staging, 7, 0, 2, timeout=timeout)
        if not silent:
            FileGroup(store.fs, staging, 7, 1, 2, timeout=timeout).close(
                SaveFailed("rank 1's disk is full"))
        started = time.monotonic()
        with pytest.raises(SaveFailed) as e:
            commit_staged(group, store, 7, staging, {"a": [b"x"]}, None, False)  # type: ignore
        group.close(e.value)
        took = time.monotonic() - started
        assert "writing the generation (generation 7) failed" in str(e.value)
        assert "generation 7 was not committed" in str(e.value)
        if silent:
            assert "rank(s) [1] posted nothing within 0.5 s" in str(e.value) and took < 3
        else:
            assert "rank 1 gave up: rank 1's disk is full" in str(e.value) and took < 3
        assert sorted(os.listdir(store.root)) == ["LOCK"]  # staging and job folder gone
    store.unlock()
    assert gens(tmp_path / "run") == []


def test_a_rank_killed_before_handing_its_share_over_frees_the_run_at_once(tmp_path):
    """Rank 1 dies inside the save of update 3 after the ranks agreed on its staging folder,
    before its share reached its persisting process (killed while encoding); the leader's
    persisting process, which has its own share, waited for rank 1's files until the 20 s
    timeout, holding the run's lock, so a restarted job waited too. Rank 1's persisting
    process now says that its writer ended: the leader's gives up at once."""
    folder = tmp_path / "run"
    life = Life(folder, tmp_path / "died", {"DIE_RANK": "1", "DIE_AT": "3"})
    try:
        assert life.procs[1].wait(timeout=120) == -9, life.stderr(1)
        deadline = time.monotonic() + 60
        while not (life.out / "saved.3.rank0").exists():  # the leader's share is handed over
            assert life.procs[0].poll() is None, life.stderr(0)
            assert time.monotonic() < deadline, life.stderr(0)
            time.sleep(0.01)
        life.procs[0].kill()  # (as torchrun tears a job down when one of its ranks dies)
        life.procs[0].wait()
        started = time.monotonic()
        while _tagged(life.tag) and time.monotonic() - started < 60:  # persisting processes
            time.sleep(0.05)
        took = time.monotonic() - started
        assert not _tagged(life.tag)
        assert took < 10, f"the persisting processes ended {took:.1f} s after the job"
    finally:
        life.end()
    assert_committed(folder, [])  # generation 3 was not committed; no staging is left
    store = GenerationStore(folder)
    store.lock()  # a restarted job takes the run at once
    store.unlock()


def test_a_first_save_whose_leader_persister_died_after_its_commit_is_the_jobs_own(
        reference, tmp_path):
    """The leader's persisting process is SIGKILLed right after it committed the job's first
    generation (3), before it replied: the save fails on every rank, naming the generation,
    and the job goes on. In a fresh run that never called ``restore()``, the generation in
    the folder is still the job's own: saving again must not refuse it as a history this
    Checkpointer never restored (it did, with `RunNotRestored`)."""
    life = Life(tmp_path / "run", tmp_path / "life", {
        "PERSISTER_KILL_RANK": "0", "PERSISTER_KILL_AT": "3", "NO_RESTORE": "1"})
    assert life.end() == [0, 0], life.stderr(0) + life.stderr(1)
    for rank in range(2):
        raised = json.loads((life.out / f"raised.6.rank{rank}.json").read_text())["message"]
        assert "generation 3" in raised, raised
    assert_bitwise(reference, life.out, 12)
    assert_committed(tmp_path / "run", [9, 12])
