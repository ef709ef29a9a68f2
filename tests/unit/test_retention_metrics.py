"""The metrics ``step_done`` is given reach the manifest of a ``save()`` of that step, as they
do when ``every`` saves inside ``step_done`` (found from outside, twenty-third session:
``Keep(best=...)`` deleted the best generation, whose manifest held no metric)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import unbroken


def _metrics(run: str) -> dict[int, dict[str, float]]:
    out = {}
    for name in sorted(os.listdir(run)):
        if name.startswith("gen-"):
            with open(os.path.join(run, name, "MANIFEST.json")) as f:
                out[int(name[4:])] = json.load(f)["metrics"]
    return out


@pytest.mark.parametrize("every", [None, 3])
def test_an_explicit_save_stores_the_metrics_step_done_was_given(tmp_path, every):
    run = str(tmp_path / "run")
    vals = [3.0, 0.5, 2.0, 4.0, 1.0]
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2), every=every,
                                 keep=unbroken.Keep(last=1, best=("val", "min")),
                                 read_back="sync")
    ckpt.restore()
    for step, v in enumerate(vals, 1):
        ckpt.step_done(step, loss=torch.tensor(v * 2), val=v)
        if step != 3:  # (every=3 saved step 3 inside step_done)
            ckpt.save()
    ckpt.close()
    found = _metrics(run)
    assert sorted(found) == [2, 5]  # the best (0.5) and the newest
    assert found[2] == {"val": 0.5, "loss": 1.0} and found[5] == {"val": 1.0, "loss": 2.0}


def test_metrics_given_to_save_win_and_another_steps_are_not_taken(tmp_path):
    run = str(tmp_path / "run")
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2), read_back="sync",
                                 keep=unbroken.Keep(last=5))
    ckpt.restore()
    ckpt.step_done(1, val=1.0, acc=0.25)
    ckpt.save(metrics={"val": 0.75})
    ckpt.save(3)  # a declared step: step_done's metrics were step 1's
    ckpt.close()
    found = _metrics(run)
    assert found[1] == {"val": 0.75, "acc": 0.25} and found[3] == {}
