"""Review of job saves (2 ranks, gloo on CPU): a failure of one rank before the commit (the
leader alone cannot encode a part; a persisting process dies) fails the save on every rank
at once. Every process runs under a subprocess timeout, every
collective under a 20 s process-group timeout and every wait of the saves under 8 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _launch import JOB_TAG_ENV, _tagged, free_port
from conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "review_job_saves.py")


def run_job(tmp: Path, mode: str) -> list[dict]:
    out, folder, tag, port = tmp / "out", tmp / "run", uuid.uuid4().hex, str(free_port())
    out.mkdir()
    procs = [subprocess.Popen(
        [sys.executable, SCRIPT, "--folder", str(folder), "--out", str(out)],
        env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "MODE": mode, JOB_TAG_ENV: tag},
        stdout=subprocess.DEVNULL, stderr=open(out / f"err{r}", "w")) for r in range(2)]
    try:
        codes = [p.wait(timeout=60) for p in procs]
        deadline = time.monotonic() + 20
        while _tagged(tag) and time.monotonic() < deadline:  # persisting processes
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for pid in _tagged(tag):
            os.kill(pid, 9)
    errs = "".join((out / f"err{r}").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], errs
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def process_job(tmp_path_factory) -> list[dict]:
    return run_job(tmp_path_factory.mktemp("process-job"), "process")


@pytest.mark.parametrize("mode", ["process", "background"])
def test_a_save_the_leader_alone_cannot_encode_fails_on_every_rank_at_once(
        tmp_path, mode, request):
    results = (request.getfixturevalue("process_job") if mode == "process" else
               run_job(tmp_path, mode))
    for rank, r in enumerate(results):
        assert r["raised"] is not None, rank
        assert r["raised"]["type"] == "UnsupportedValue", r
        assert "nested deeper than 200 levels" in r["raised"]["message"], r
        assert r["seconds"] < 5, r  # at once, not after the 8 s wait for the other rank
    assert results[0]["raised"]["message"].startswith("rank 0: ")
    # save 3 went through; nothing of save 2 is left
    assert results[0]["folder"] == ["LOCK", "RUN.json", "gen-000000001", "gen-000000003"]


def test_a_persisting_process_that_died_mid_save_fails_it_on_every_rank_at_once(process_job):
    results = process_job  # (its save 4: see the script)
    for rank, r in enumerate(results):
        assert r["raised4"] is not None and r["raised4"]["type"] == "SaveFailed", r
        assert r["seconds4"] < 5, r  # at once, not after the 8 s wait for the other rank
    assert "ended with exit code -9" in results[1]["raised4"]["message"]
    assert "rank 1 gave up:" in results[0]["raised4"]["message"]
    assert "generation 4 was not committed" in results[0]["raised4"]["message"]
    assert results[0]["folder"] == ["LOCK", "RUN.json", "gen-000000001", "gen-000000003"]
