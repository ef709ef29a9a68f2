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
    # save 3 went through; nothing of save 2 is left (process mode: saves 4 and 5 follow)
    assert results[0]["folder"][:4] == ["LOCK", "RUN.json", "gen-000000001", "gen-000000003"]


def test_a_save_a_persisting_process_died_before_taking_goes_to_a_new_one(process_job):
    results = process_job  # (its save 4: see the script)
    for rank, r in enumerate(results):
        assert r["raised4"] is None, r
    warned = results[1]["warned4"]
    assert len(warned) == 1 and "had ended (exit code -9" in warned[0], warned
    assert "before it took the save of generation 4; a new one takes it" in warned[0]
    assert results[0]["warned4"] == []


def test_a_persisting_process_that_died_mid_save_fails_it_on_every_rank_at_once(process_job):
    results = process_job  # (its save 5: see the script)
    for rank, r in enumerate(results):
        assert r["raised5"] is not None and r["raised5"]["type"] == "SaveFailed", r
        assert r["seconds5"] < 5, r  # at once, not after the 8 s wait for the other rank
    assert "ended with exit code -9" in results[1]["raised5"]["message"]
    said = results[0]["raised5"]["message"]
    assert "rank 1 gave up:" in said, said
    # killed before it posted its files written: nothing committed; after: the leader's
    # committed the generation, but not every rank read it back (a restore verifies it)
    committed = "gen-000000005" in results[0]["folder"]
    assert ("generation 5 is not known to be committed and read back by every rank" in said
            if committed else "generation 5 was not committed" in said), said
    assert results[0]["folder"] == ["LOCK", "RUN.json", "gen-000000001", "gen-000000003",
                                    "gen-000000004", *(["gen-000000005"] if committed else [])]
