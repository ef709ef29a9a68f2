"""Adversarial review of the data position in real processes: a training script with
DataLoader workers prefetching is SIGKILLed (its whole process group, workers included) at
random moments mid-epoch, resumed in a fresh process (with another worker count), killed
again, and resumed to the end; every update any life logged must equal the uninterrupted
run's update of that step -- sample ids and per-sample noise read from the batches themselves,
and the loss bit for bit -- and the lives together must cover every step. A resume with
another batch size or data revision must then fail loudly, naming the typed error."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import run_script

SCRIPT = "review_data_position.py"
N, BATCH, ACC, EPOCHS, EVERY = 50, 4, 2, 3, 2
PER_EPOCH = -(-(-(-N // BATCH)) // ACC)  # 13 batches in windows of 2: 7 updates
STEPS = PER_EPOCH * EPOCHS


def read(log: Path) -> tuple[int, list[dict[str, Any]]]:
    """(restored step, update records) of one life; a line torn by the kill is ignored."""
    restored, updates = None, []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "restored" in rec:
            restored = rec["restored"]
        else:
            updates.append(rec)
    assert restored is not None, f"{log}: the life never restored"
    return restored, updates


def children(pid: int) -> int:
    """Living processes whose parent is ``pid`` (the DataLoader workers)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != b"Z":
                count += 1
    return count


def life(tmp: Path, name: str, *args: str, kill_after: int | None = None,
         delay: float = 0.0) -> tuple[Any, Path, int]:
    """One process on the run folder. With ``kill_after``: once its log holds that many
    updates, wait ``delay`` and SIGKILL its group; returns the result, the log and how many
    workers were alive at the kill."""
    log = tmp / f"{name}.log"
    seen = [0]

    def killer(pid: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if log.exists() and log.read_text().count('"step"') >= kill_after:
                break
            time.sleep(0.005)
        time.sleep(delay)
        seen[0] = children(pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    r = run_script(SCRIPT, "--run", str(tmp / "run"), "--log", str(log), *args,
                   timeout=90, started=killer if kill_after is not None else None)
    return r, log, seen[0]


@pytest.mark.parametrize("mode", ["map", "iterable"])
def test_sigkill_mid_epoch_with_workers_then_resume_sees_the_uninterrupted_samples(
        tmp_path: Path, mode: str) -> None:
    extra = ["--iterable"] if mode == "iterable" else []
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    r, ref_log, _ = life(ref_dir, "ref", "--workers", "0", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    restored, ref = read(ref_log)
    assert restored == 0 and [u["step"] for u in ref] == list(range(1, STEPS + 1))
    for e in range(EPOCHS):  # the oracle: every sample once per epoch
        ids = [i for u in ref if u["epoch"] == e for i in u["ids"]]
        assert sorted(ids) == list(range(N)), e
    by_step = {u["step"]: u for u in ref}

    rng = random.Random(f"review-{mode}")
    sleep = ["--sleep", "0.02"]
    # life 1: 2 workers, killed mid-epoch 0 or 1 (never at an epoch's end, where workers
    # of non-persistent passes come and go); life 2: 2 persistent workers, killed later;
    # life 3: 1 worker, to the end.
    plans = [(["--workers", "2", *sleep], rng.choice([3, 4, 9, 10])),
             (["--workers", "2", "--persistent", *sleep], rng.randint(2, 6)),
             (["--workers", "1"], None)]
    lives = []
    workers_at_kill = []
    for k, (args, kill_after) in enumerate(plans):
        r, log, seen = life(tmp_path, f"life{k}", *args, *extra, kill_after=kill_after,
                            delay=rng.uniform(0.0, 0.05))
        if kill_after is not None:
            assert r.returncode == -signal.SIGKILL, (k, r.returncode, r.stderr[-3000:])
            workers_at_kill.append(seen)
        else:
            assert r.returncode == 0, r.stderr[-3000:]
        lives.append(read(log))

    covered: set[int] = set()
    last = 0
    for k, (restored, updates) in enumerate(lives):
        # each life continues from a generation the previous lives saved
        assert restored % EVERY == 0 and restored <= last, (k, restored, last)
        assert [u["step"] for u in updates] == list(range(restored + 1,
                                                          restored + 1 + len(updates))), k
        for u in updates:
            assert u == by_step[u["step"]], (k, u["step"], u, by_step[u["step"]])
        covered |= {u["step"] for u in updates}
        last = updates[-1]["step"] if updates else restored
    assert covered == set(range(1, STEPS + 1))
    assert last == STEPS
    assert lives[1][0] > 0 or lives[2][0] > 0, "no life resumed from a saved generation"
    assert workers_at_kill[0] >= 1 and workers_at_kill[1] >= 1, (
        f"a kill landed while no DataLoader worker ran: {workers_at_kill}")

    # other settings on the same run: refused loudly, with the typed error named
    for args, error in [(["--batch", "5"], "StateMismatch"),
                        (["--accumulation", "3"], "StateMismatch")]:
        r, _, _ = life(tmp_path, "refused", *args, *extra)
        assert r.returncode != 0 and error in r.stderr, (args, r.stderr[-2000:])
