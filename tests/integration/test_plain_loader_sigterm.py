"""A SIGTERM to the whole process group (what torchrun and SLURM send) with a plain torch
DataLoader over a `ResumableSampler` and ``signals=[SIGTERM]``: torch's workers ended on it,
and the loop failed on its next batch (DataLoader worker killed by signal) before the stop
save. The sampler now starts such a DataLoader's workers to drop a SIGTERM that is not their
parent's (`data._signals`), so the loop stops cleanly, saved; and a process leaving with a
DataLoader iterator alive still exits (its workers end on their parent's SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "plain_loader_sigterm.py"


def _start(run: Path, how: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run), how], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_a_group_sigterm_stops_a_plain_dataloader_loop_cleanly_with_its_save(tmp_path):
    proc = _start(tmp_path / "run", "wait")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # (a few updates first: its workers are running)
            if line.startswith("step 5"):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    stopped = int(out.split("stopped at ")[1].split()[0])
    assert (tmp_path / "run" / f"gen-{stopped:09d}").is_dir()


def test_leaving_with_an_iterator_alive_exits(tmp_path):
    proc = _start(tmp_path / "run", "exit")
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and "leaving" in out, out
    assert time.monotonic() - started < 60
