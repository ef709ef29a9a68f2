"""`unbroken check` over a job of many ranks: ``unbroken check -- torchrun ...`` kills the whole
job (the launcher, every rank, every DataLoader worker) with SIGKILL, resumes it, and compares
every rank's trace with that rank's uninterrupted one. The correct DDP script is equivalent;
the RNG streams of one rank left unrestored (``--drop rng@1``) are caught and attributed to
that rank's stream."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _launch import SCRIPT, free_port

from unbroken.cli import main


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], *options: str,
          script_args: tuple[str, ...] = ()) -> tuple[int, dict]:
    job = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), SCRIPT, "--epochs", "1", *script_args]
    code = main(["check", "--json", "--timeout", "240", *options, "--", *job])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("check-torchrun")


def test_a_correct_ddp_job_is_equivalent_on_every_rank(workdir, capsys):
    """Saving through persisting processes: the kill inside the save fires in rank 0's
    persisting process, which kills the whole job too (it killed its own rank only, and
    torchrun stopped the other and exited 1, which check took for a failed run)."""
    code, report = check(workdir, capsys, "--workdir", str(workdir / "ok"), "--at", "11",
                         "--phase", "mid-save", script_args=("--process-save",))
    assert code == 0 and report["verdict"] == "equivalent", report
    [case] = report["cases"]
    assert case["kills"][0]["exit_code"] == -9  # the whole job, killed inside the save
    assert case["resumed_from"] == 10
    names = {p.name for p in (workdir / "ok" / "case-01").iterdir()}
    assert {"life-01.jsonl.rank0", "life-01.jsonl.rank1", "life-02.jsonl.rank0",
            "life-02.jsonl.rank1"} <= names  # every rank traced every life
    assert not _running(str(workdir / "ok"))  # no rank, no worker of a killed job outlives it


def test_rng_streams_dropped_on_one_rank_are_attributed_to_that_rank(workdir, capsys):
    code, report = check(workdir, capsys, "--workdir", str(workdir / "drop"), "--at", "11",
                         "--phase", "after-update", "--drop", "rng@1",
                         "--reference", str(workdir / "ok" / "reference" / "trace.jsonl"))
    assert code == 1 and report["verdict"] == "diverged", report
    case = report["cases"][0]
    assert case["rank"] == 1
    assert case["first_divergence"]["state_part"].startswith("rng")
    assert case["first_divergence"]["kind"] == "jump"


def _running(workdir: str) -> list[int]:
    """Living processes of the job ``unbroken check`` ran in ``workdir`` (their environment
    names it: the trace and run folder live there); other tests' jobs do not count."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if SCRIPT.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if workdir.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found
