"""``unbroken inspect`` beside a live writer: its retention deletes a generation (manifest
first, then the folder) while inspect lists the run. Such a generation is "deleted while
checked", as ``verify`` says, never "torn" with exit 1 (a false alarm for anything that gates
on inspect). A real writer beside a loop of inspects:
tests/integration/test_inspect_live_writer.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken import cli
from unbroken.cli import main


def _run(run: Path, steps: list[int]) -> None:
    model = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(run, model=model, keep=unbroken.Keep(last=3)) as ckpt:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.save(step)


@pytest.mark.parametrize("reached", ["manifest", "folder"])
def test_a_generation_deleted_while_listed_is_not_torn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], reached: str) -> None:
    run = tmp_path / "run"
    _run(run, [1, 2, 3])
    real = cli.record
    # retention at work: the manifest first (before inspect listed the run), then the folder
    # (while inspect looks at the generations it listed), or not yet
    (run / "gen-000000001" / "MANIFEST.json").unlink()

    def retained(store: Any, info: Any, *a: Any) -> dict[str, Any]:
        if info.generation == 1 and reached == "folder":
            shutil.rmtree(info.path)
        return real(store, info, *a)

    monkeypatch.setattr(cli, "record", retained)
    capsys.readouterr()
    code = main(["inspect", str(run), "--json"])
    doc = json.loads(capsys.readouterr().out)
    statuses = {g["generation"]: g["status"] for g in doc["generations"]}
    if reached == "folder":
        assert statuses == {1: "deleted while checked", 2: "complete", 3: "complete"}
    else:  # (the folder outlived the pause: torn as far as anyone can tell)
        assert statuses[1] == "torn" and doc["ok"] is False and code == 1
        return
    assert doc["ok"] is True and code == 0
    assert main(["inspect", str(run)]) == 0
    assert "deleted while checked" not in capsys.readouterr().out  # (gone by now: unlisted)
