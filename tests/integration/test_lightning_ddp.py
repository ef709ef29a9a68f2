"""The Lightning adapter in a 2-rank DDP job (torchrun, gloo on CPU) whose ranks log training
metrics of their own: the loss per step (Lightning's default ``self.log``), a running epoch
mean without ``sync_dist`` and one with ``sync_dist=True`` that a plateau scheduler monitors.

Before, the adapter's part was held once for all ranks, so the first save of such a job was
refused (the ranks' logged values differ), and ``on_epoch=True`` and ``sync_dist=True`` were
refused outright. Now each rank stores that part in its own files (`unbroken.PerRank`): a job
SIGKILLed mid-epoch and resumed goes on bitwise on every rank, at every update (traces),
in its final state and in every value it logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import assert_job_killed, assert_resumed_bitwise, torchrun
from conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "lightning_ddp.py")
pytest.importorskip("lightning")


def _job(tmp: Path, folder: str, life: str, *args: str, **env: str):
    return torchrun(2, tmp / folder, tmp / f"{life}.trace", "--out", str(tmp / life), *args,
                    env=env, script=SCRIPT)


def _records(tmp: Path, lives: list[str], rank: int) -> dict[tuple, dict[str, str]]:
    """A rank's logged records by (step, names), a later life's replacing an earlier one's
    (the killed life logged steps the resumed one logged again)."""
    out: dict[tuple, dict[str, str]] = {}
    for life in lives:
        path = tmp / f"{life}.rank{rank}.log"
        for line in path.read_text().splitlines() if path.exists() else []:
            rec = json.loads(line)
            out[rec["step"], tuple(sorted(rec["metrics"]))] = rec["metrics"]
    return out


def test_each_ranks_logged_metrics_survive_a_mid_epoch_kill_bitwise(tmp_path):
    """Saved at update 17 (5 batches into epoch 1 of 12) through persisting processes, the
    whole job SIGKILLed as soon as generation 17 is committed (a kill of the whole machine
    before that loses the save in flight), resumed: every rank's updates, final state and
    logged values are the uninterrupted job's (which saved in the training process: how a
    job saves changes none of its updates); the generation holds each rank's loop state in
    its own file. (Saves in the training process: test_per_rank_extra.py,
    test_transformers_ddp.py.)"""
    reference = tmp_path / "whole"
    reference.mkdir()
    whole = _job(reference, "whole", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _job(tmp_path, "run", "a", "--async-save", "process", UNBROKEN_SAVE_AT="17",
                  UNBROKEN_KILL_AT="after-rename@17")
    assert_job_killed(killed)
    resumed = _job(tmp_path, "run", "b", "--async-save", "process")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed from 17, reached 48" in resumed.stdout, resumed.stdout

    gen = tmp_path / "run" / "gen-000000017"
    names = {p.name for p in gen.iterdir()}
    assert {"rank00000.extra.lightning.safetensors",
            "rank00001.extra.lightning.safetensors"} <= names, names
    shared = json.loads((gen / "state.json").read_text())["parts"]
    assert "extra.lightning" not in shared and "model" in shared, sorted(shared)
    own = json.loads((gen / "rank00001.state.json").read_text())["parts"]
    assert sorted(own) == ["extra.lightning", "rng"], sorted(own)

    assert_resumed_bitwise(reference / "whole.trace", [tmp_path / "a.trace",
                                                       tmp_path / "b.trace"], 17)
    for rank in (0, 1):
        final = reference / f"whole.rank{rank}.final"
        assert final.read_text() == (tmp_path / f"b.rank{rank}.final").read_text(), rank
        logged = _records(reference, ["whole"], rank)
        assert _records(tmp_path, ["a", "b"], rank) == logged, rank
        epochs = [m for m in logged.values() if "synced" in m]
        assert len(epochs) == 4, logged
    # (what makes the part each rank's own: the ranks' unsynced values differ, the synced
    # ones agree)
    ends = [[m for m in _records(reference, ["whole"], r).values() if "synced" in m]
            for r in (0, 1)]
    assert [m["synced"] for m in ends[0]] == [m["synced"] for m in ends[1]]
    assert all(a["rank_mean"] != b["rank_mean"] for a, b in zip(*ends))
