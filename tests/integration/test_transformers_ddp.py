"""The Transformers Trainer adapter in a job of 2 processes (torchrun, gloo on CPU): the
README's example (`examples/transformers_train.py`: augmentation drawing from the Python,
NumPy and torch streams, a random collator, dropout, gradient accumulation, DataLoader workers,
warmup + cosine) SIGKILLed mid-epoch and resumed goes on bitwise on every rank. Each rank
keeps the Trainer's running loss of its own, so the adapter's part is held per rank
(`unbroken.PerRank`); the sampler takes the global batch, each rank its contiguous share."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import assert_job_killed, assert_resumed_bitwise, torchrun

pytest.importorskip("transformers")
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "transformers_train.py")


def _job(tmp: Path, folder: str, life: str, **env: str):
    # (a 60 s process-group timeout: a rank left alone fails instead of waiting 30 minutes)
    return torchrun(2, tmp / folder, tmp / f"{life}.trace", "--epochs", "3", "--ddp-timeout",
                    "60", env=env, script=EXAMPLE, folder_flag="--run")


def test_a_trainer_job_of_two_killed_mid_epoch_resumes_bitwise_on_every_rank(tmp_path):
    whole = _job(tmp_path, "whole", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert whole.stdout.count("finished: 12 updates") == 2, whole.stdout
    killed = _job(tmp_path, "run", "a", UNBROKEN_KILL_AT="update-end@7")
    assert_job_killed(killed)
    resumed = _job(tmp_path, "run", "b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_bitwise(tmp_path / "whole.trace", [tmp_path / "a.trace",
                                                       tmp_path / "b.trace"], 6)
    names = {p.name for p in (tmp_path / "run" / "gen-000000006").iterdir()}
    assert {"rank00000.extra.trainer.safetensors",
            "rank00001.extra.trainer.safetensors"} <= names, names
