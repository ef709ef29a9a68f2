"""Settings for every test process (pytest's workers and every process they start).

OpenMP's idle threads wait passively. By default torch's OpenMP threads spin for a while
before they sleep; with two test workers on two cores, each training with two threads, the
spinning threads of one process take the cores the other's need, and the suite's small
training runs took up to four times as long as they do alone. A wait policy changes neither
the number of threads nor any result, only how an idle thread waits. Set here, before any
test imports torch (OpenMP reads it when it loads), and inherited by the xdist workers, the
zygote and every script the tests start."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HANG_LIMIT_S = 60  # a test that uses `hang_watchdog` and runs longer hangs


@pytest.fixture
def hang_watchdog():
    """Fail the test with TimeoutError after `HANG_LIMIT_S` seconds (SIGALRM in the main
    thread): for tests of processes that could wait on each other forever."""
    def boom(*_):
        raise TimeoutError(f"test ran past {HANG_LIMIT_S} s (a hang)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(HANG_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def fast_tmp(tmp_path):
    """A memory-backed folder where one exists: for tests that inject faults or race
    processes rather than measure the disk."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = tempfile.mkdtemp(prefix="unbroken-test-", dir="/dev/shm")
        yield Path(d)
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


@pytest.fixture
def sealed_export(tmp_path):
    """(folder, model): an inference export of a seeded Linear(4, 2), with identity, lineage
    and recorded outputs on fixed inputs (export.json sealed by its checksum)."""
    import torch

    from unbroken.tools.export import export_model

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    export_model(model, tmp_path / "exp", identity={"config": {"width": 4}},
                 lineage={"run_id": "r", "step": 1}, inputs=torch.randn(3, 4))
    return tmp_path / "exp", model
