"""Issue 3's resume matrix, each resume in a fresh process after a real SIGKILL.

examples/train_classifier.py (dropout, per-sample random augmentation from three RNGs, AdamW,
warmup + cosine, clipping) is interrupted mid-epoch, at the last batch of an epoch and at the
first batch of the next one, with 0 and 2 workers and accumulation 1 and 4. Every cell's
per-step sample ids, learning rate, exact loss, gradient norm, parameter and state digests
must equal the uninterrupted run's, and every sample of each epoch is seen exactly once."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_script

from unbroken.proof.equivalence import compare, stitch
from unbroken.trace import read_trace

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "train_classifier.py")
N, BATCH, EPOCHS = 512, 16, 2


def run(tmp: Path, name: str, workers: int, accumulation: int, *, save_at: int | None = None,
        kill_after: int | None = None) -> Path:
    trace = tmp / f"{name}.jsonl"
    env = {"UNBROKEN_TRACE": str(trace)}
    if save_at is not None:
        env["UNBROKEN_SAVE_AT"] = str(save_at)
    if kill_after is not None:
        env["UNBROKEN_KILL_AT"] = f"step-done@{kill_after}"
    r = run_script(EXAMPLE, "--run", str(tmp / "run"), "--workers", str(workers),
                   "--accumulation", str(accumulation), "--epochs", str(EPOCHS),
                   "--every", "1000", env=env)
    expected = -signal.SIGKILL if kill_after is not None else 0
    assert r.returncode == expected, r.stderr
    return trace


_refs: dict[tuple[int, int], list[dict]] = {}


def reference(tmp_path_factory, workers: int, accumulation: int) -> list[dict]:
    key = (workers, accumulation)
    if key not in _refs:
        tmp = tmp_path_factory.mktemp(f"ref-w{workers}-a{accumulation}")
        _refs[key] = read_trace(run(tmp, "ref", workers, accumulation))
    return _refs[key]


def points(accumulation: int) -> dict[str, int]:
    per_epoch = N // BATCH // accumulation
    return {"mid-epoch": per_epoch // 2 + 1, "last-batch-of-epoch": per_epoch,
            "first-batch-of-epoch": per_epoch + 1}


def check_cell(tmp: Path, ref: list[dict], workers: int, accumulation: int, at: int,
               resume_workers: int | None = None) -> None:
    # Save exactly at the interesting boundary, die one update later: the resumed process
    # restores that boundary and replays the lost update.
    killed = read_trace(run(tmp, "killed", workers, accumulation, save_at=at,
                            kill_after=at + 1))
    resumed = read_trace(run(tmp, "resumed", resume_workers if resume_workers is not None
                             else workers, accumulation))
    result = compare(ref, [killed, resumed])
    assert result.resumed_from == at
    assert result.restore_differs == []
    assert result.verdict == "equivalent", result.first_divergence
    updates, _ = stitch([killed, resumed])
    per_update = N // BATCH // accumulation
    for epoch in range(EPOCHS):
        seen = Counter(i for s in range(epoch * per_update + 1, (epoch + 1) * per_update + 1)
                       for i in updates[s]["ids"])
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, epoch


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["mid-epoch", "last-batch-of-epoch", "first-batch-of-epoch"])
def test_resume_matrix(tmp_path, tmp_path_factory, where, workers, accumulation):
    ref = reference(tmp_path_factory, workers, accumulation)
    check_cell(tmp_path, ref, workers, accumulation, points(accumulation)[where])


@pytest.mark.parametrize("before,after", [(2, 0), (0, 4)])
def test_resume_with_another_worker_count(tmp_path, tmp_path_factory, before, after):
    ref = reference(tmp_path_factory, 0, 4)
    check_cell(tmp_path, ref, before, 4, points(4)["mid-epoch"], resume_workers=after)


def test_worker_count_does_not_change_the_run(tmp_path_factory):
    """The batches, losses and states of the run are the same with 0 and 2 workers."""
    a, b = reference(tmp_path_factory, 0, 4), reference(tmp_path_factory, 2, 4)
    assert compare(a, [b]).first_divergence is None
