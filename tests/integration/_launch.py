"""Launching a job of many ranks for a test: under torchrun, or rank by rank as plain
processes. Every process runs under a timeout and every script's collectives under a 30 s
process-group timeout: nothing can hang the suite."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "ddp_train.py")


def torchrun(n: int, folder: Path, trace: Path, *args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    """``ddp_train.py`` on ``n`` ranks, tracing each rank to ``<trace>.rank<r>``."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
         "--master-port", str(free_port()), SCRIPT, "--folder", str(folder), *args],
        env={**os.environ, "UNBROKEN_TRACE": str(trace), **(env or {})},
        capture_output=True, text=True, timeout=240)


def by_hand(n: int, folder: Path, env: dict[str, str], *args: str
            ) -> list[subprocess.CompletedProcess[str]]:
    """The ranks as plain processes (no torchrun agent to kill the survivors for us)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--folder", str(folder), *args],
                              env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(n),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gens(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("gen-"))


def assert_resumed_bitwise(reference: Path, lives: list[Path], resumed_from: int,
                           ranks: int = 2) -> None:
    """Every rank's trace, stitched from ``lives`` (each ``<life>.rank<r>``), equals that
    rank's ``<reference>.rank<r>`` at every update, resuming from ``resumed_from``."""
    from unbroken.proof.equivalence import compare
    from unbroken.trace import read_trace

    for rank in range(ranks):
        result = compare(read_trace(f"{reference}.rank{rank}"),
                         [read_trace(f"{life}.rank{rank}") for life in lives])
        assert result.verdict == "equivalent" and result.resumed_from == resumed_from, (
            rank, result.first_divergence)


def first_restores(trace: Path, ranks: int = 2) -> list[dict]:
    """Each rank's first restore record."""
    from unbroken.trace import read_trace

    return [next(x for x in read_trace(f"{trace}.rank{r}") if x["event"] == "restore")
            for r in range(ranks)]
