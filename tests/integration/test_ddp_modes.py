"""Many ranks (torch.distributed, gloo on CPU), the ways a job saves and stops: a preemption
notice to one rank, an async job killed while persisting, a job reading back later, a job on
an S3 server (test_ddp.py has the rest; two files so that the test runner can run them side by
side). The jobs killed or signalled run under torchrun, the resumed ones fork their ranks from
the test zygote (`_launch.forked`). Every collective runs under a 30 s process-group timeout
and every process under a subprocess timeout: nothing here can hang the suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import (
    assert_job_killed,
    assert_resumed_bitwise,
    ddp_reference,
    forked,
    gens,
    torchrun,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return ddp_reference(tmp_path_factory)


def test_a_preemption_notice_to_one_rank_stops_every_rank_at_the_same_update(reference,
                                                                             tmp_path):
    folder = tmp_path / "run"
    # the notice lands inside update 13, between two exchanges (every 5 updates): every
    # rank stops at the next exchange, none alone
    stopped = torchrun(2, folder, tmp_path / "s.jsonl", "--stop-check-every", "5",
                       env={"SIGNAL_RANK": "1", "SIGNAL_AT": "13"})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "rank 0 stopped after update 15" in stopped.stdout
    assert "rank 1 stopped after update 15" in stopped.stdout
    assert "SIGTERM received by another rank" in stopped.stderr
    assert gens(folder)[-1] == "gen-000000015"
    resumed = forked(2, folder, tmp_path / "r.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_bitwise(reference / "ref.jsonl", [tmp_path / "s.jsonl",
                           tmp_path / "r.jsonl"], 15)


def test_an_async_job_killed_while_persisting_resumes_bitwise(reference, tmp_path):
    folder = tmp_path / "run"
    killed = torchrun(2, folder, tmp_path / "k.jsonl", "--async-save",
                      env={"UNBROKEN_KILL_AT": "artifact-1-written@15"})
    assert_job_killed(killed)
    assert gens(folder) == ["gen-000000005", "gen-000000010"]  # 15 never committed
    resumed = forked(2, folder, tmp_path / "r.jsonl", "--async-save")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_bitwise(reference / "ref.jsonl", [tmp_path / "k.jsonl",
                           tmp_path / "r.jsonl"], 10)


def test_a_job_reading_back_in_save_killed_after_a_commit_resumes_from_it(reference, tmp_path):
    """read_back="sync" in a job (the other job tests use the default, the read-back beside
    the loop over a gloo group of the saves' own): save() returns after every rank read its
    own files back. Killed after generation 15 was committed (its read-back not yet done),
    the job resumes from 15, bitwise."""
    folder = tmp_path / "run"
    killed = torchrun(2, folder, tmp_path / "k.jsonl", "--read-back-sync",
                      env={"UNBROKEN_KILL_AT": "after-rename@15"})
    assert_job_killed(killed)
    assert gens(folder)[-1] == "gen-000000015"
    resumed = forked(2, folder, tmp_path / "r.jsonl", "--read-back-sync")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_bitwise(reference / "ref.jsonl", [tmp_path / "k.jsonl",
                           tmp_path / "r.jsonl"], 15)
    assert gens(folder) == ["gen-000000020", "gen-000000025", "gen-000000030"]  # retention ran


def test_a_job_on_an_s3_server_killed_mid_epoch_resumes_bitwise(reference, tmp_path, s3):
    """Every rank uploads its own files into the generation's upload folder; rank 0 uploads
    the manifest after every rank confirmed. Killed after update 17, resumed from 15."""
    import uuid

    from conftest import BUCKET

    from unbroken.store.opening import open_store

    url = f"s3://{BUCKET}/ddp/{uuid.uuid4().hex[:12]}"
    killed = torchrun(2, url, tmp_path / "k.jsonl",
                      env={**s3["env"], "UNBROKEN_KILL_AT": "step-done@17"})
    assert_job_killed(killed)
    store = open_store(url, s3["options"])
    (newest, *_) = reversed(store.scan())
    assert newest.generation == 15 and newest.manifest and newest.manifest.world_size == 2
    store.verify(newest)
    resumed = forked(2, url, tmp_path / "r.jsonl", env=s3["env"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_bitwise(reference / "ref.jsonl", [tmp_path / "k.jsonl",
                           tmp_path / "r.jsonl"], 15)
