"""Launching a job of many ranks for a test: under torchrun, or rank by rank as plain
processes. Every process runs under a timeout and every script's collectives under a 30 s
process-group timeout: nothing can hang the suite."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from conftest import SCRIPTS, zygote_job

SCRIPT = str(SCRIPTS / "ddp_train.py")


JOB_TAG_ENV = "UNBROKEN_TEST_JOB"  # every process of one launched job inherits it


def torchrun(n: int, folder: Path, trace: Path, *args: str, env: dict[str, str] | None = None,
             script: str = SCRIPT, folder_flag: str = "--folder"
             ) -> subprocess.CompletedProcess[str]:
    """``script`` (``ddp_train.py``) on ``n`` ranks, its run folder given as ``folder_flag``,
    tracing each rank to ``<trace>.rank<r>``.

    Output goes to files, not pipes, and the launcher's exit ends the wait: a straggler of the
    job (a DataLoader worker orphaned by a kill) cannot hold the test until its timeout. Any
    process of the job still alive 10 s after the launcher left is killed and named at the
    end of ``stderr``."""
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        with open(out, "w") as o, open(err, "w") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                 "--master-port", str(free_port()), "--", script, folder_flag, str(folder),
                 *args],
                env={**os.environ, "UNBROKEN_TRACE": str(trace), JOB_TAG_ENV: tag,
                     **(env or {})}, stdout=o, stderr=e, text=True)
            try:
                proc.wait(timeout=240)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"torchrun {' '.join(args)} ran past 240 s; left alive: "
                                     f"{_sweep(tag, grace=0)}; stderr:\n"
                                     f"{err.read_text()[-4000:]}") from None
            leftovers = _sweep(tag)
        stderr = err.read_text() + "".join(f"\nLEFT ALIVE, killed: {x}" for x in leftovers)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), stderr)


def forked(n: int, folder: Path, trace: Path, *args: str, env: dict[str, str] | None = None,
           script: str = SCRIPT, folder_flag: str = "--folder"
           ) -> subprocess.CompletedProcess[str]:
    """`torchrun`'s job, its ranks forked from the test zygote (real processes and a real gloo
    group, each ~0.1 s to start instead of ~2 s of imports): for the jobs no fault point
    kills, since only under torchrun a killed rank takes the whole job down
    (`unbroken._procs`). ``UNBROKEN_TEST_NO_ZYGOTE`` runs it under torchrun."""
    if os.environ.get("UNBROKEN_TEST_NO_ZYGOTE"):
        return torchrun(n, folder, trace, *args, env=env, script=script,
                        folder_flag=folder_flag)
    assert not any(k.startswith("UNBROKEN_KILL") for k in env or {}), "kills run under torchrun"
    return zygote_job(n, script, [folder_flag, str(folder), *args],
                      {"UNBROKEN_TRACE": str(trace), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), **(env or {})})


def assert_job_killed(r: subprocess.CompletedProcess[str]) -> None:
    """A fault point's kill took the whole job down: the launcher died by it and no process of
    the job (rank, DataLoader worker) was left alive."""
    assert r.returncode != 0, r.stderr[-3000:]
    assert "LEFT ALIVE" not in r.stderr, r.stderr[-3000:]


def _sweep(tag: str, grace: float = 10.0) -> list[str]:
    """Wait up to ``grace`` seconds for the processes carrying ``tag`` to leave, then SIGKILL
    those left; returns their command lines."""
    deadline = time.monotonic() + grace
    while True:
        alive = _tagged(tag)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return list(alive.values())


def launcher_script(folder: Path, code: str) -> str:
    """``code`` as a script named ``torchrun`` in ``folder``: a stand-in launcher that
    `unbroken._procs` takes for torchrun (it never takes another parent for the job's)."""
    path = folder / "torchrun"
    path.write_text(code)
    return str(path)


def _tagged(tag: str) -> dict[int, str]:
    """pid -> command line of the living (non-zombie) processes whose environment holds
    ``tag``."""
    found = {}
    needle = f"{JOB_TAG_ENV}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


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


def ddp_reference(tmp_path_factory: Any) -> Path:
    """The uninterrupted 2-rank DDP job every resume of the DDP tests is compared with: its
    traces (``ref.jsonl.rankN``) and the log of files each rank hashed. Run once per test
    session: the files that use it share it (read only), under a lock in the session's
    folder when pytest-xdist runs them in different workers."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _run_ddp_reference(tmp_path_factory.mktemp("ddp-ref"))
    shared = tmp_path_factory.getbasetemp().parent / "ddp-ref"  # (this session's, every worker's)
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not (shared / "done").exists():  # (a failed first run is run again, and fails again)
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir()
            _run_ddp_reference(shared)
            (shared / "done").touch()
    return shared


def _run_ddp_reference(tmp: Path) -> Path:
    r = forked(2, tmp / "run", tmp / "ref.jsonl", env={"HASH_LOG": str(tmp / "hashed")})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp
