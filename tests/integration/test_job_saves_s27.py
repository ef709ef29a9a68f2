"""Job saves attacked (session 27), 2 ranks, gloo on CPU: a rank that hangs fails the other's
save within the process group's timeout with the default read-back (its collectives ran on
the save group's 600 s ``async_timeout``); a rank that failed or died fails the others'
save with a `SaveFailed` (it was a bare `RankFailed`); a save of a step already saved with
nothing changed is a no-op though each rank passes its own loss (it rewrote the generation).
Every process runs under a subprocess timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import free_port
from conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "job_saves_s27.py")


def run_job(tmp: Path, case: str) -> list[dict | None]:
    out, folder, port = tmp / "out", tmp / "run", str(free_port())
    out.mkdir()
    procs = [subprocess.Popen(
        [sys.executable, SCRIPT, "--folder", str(folder), "--out", str(out)],
        env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "CASE": case},
        stdout=subprocess.DEVNULL, stderr=open(out / f"err{r}", "w")) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not (out / "result.rank0.json").exists() and time.monotonic() < deadline:
            if procs[0].poll() is not None:
                break
            time.sleep(0.05)
        if case == "noop":
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    errs = "".join((out / f"err{r}").read_text()[-3000:] for r in range(2))
    results = [json.loads(f.read_text()) if (f := out / f"result.rank{r}.json").exists()
               else None for r in range(2)]
    assert results[0] is not None, errs
    return results


def test_an_unchanged_save_of_a_saved_step_is_a_no_op_though_losses_differ(tmp_path):
    results = run_job(tmp_path, "noop")
    for r in results:
        assert r is not None and r["raised"] is None, r
    assert results[0]["before"] == results[0]["after"], results[0]  # (nothing moved aside)
    assert "aside" not in results[0]["after"]


@pytest.mark.parametrize("case", ["hang", "dies"])
def test_a_rank_that_hangs_or_dies_fails_the_save_as_a_save_failed(tmp_path, case):
    raised = run_job(tmp_path, case)[0]
    assert raised is not None
    assert raised["raised"] is not None, raised
    assert raised["raised"]["type"] == "SaveFailed" and raised["raised"]["is_save_failed"], raised
    assert "the save failed" in raised["raised"]["message"], raised
    assert raised["seconds"] < 20, raised  # (the process group's 3 s timeout, not 600 s)
