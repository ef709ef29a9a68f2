"""The command line as session 28's outside review found it: ``unbroken verify s3://`` (no
bucket) checked a local folder named ``s3:`` and said ``ok`` with exit 0; a verify beside a
live writer whose retention deleted every generation it listed said ``ok`` having verified
nothing."""

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


@pytest.mark.parametrize("url", ["s3://", "s3:///", "gs://", "memory://"])
@pytest.mark.parametrize("command", ["verify", "inspect", "diff"])
def test_a_url_without_bucket_or_path_is_a_usage_error(
        url: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = [command, url, *([url] if command == "diff" else []), "--json"]
    assert main(args) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "names no bucket or path" in doc["error"]


def _run(run: Path, steps: list[int]) -> None:
    model = torch.nn.Linear(2, 2)
    ckpt = unbroken.Checkpointer(run, model=model, keep=unbroken.Keep(last=2),
                                 read_back="sync")
    ckpt.restore()
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1)
        ckpt.save(step)
    ckpt.close()


def test_verify_beside_a_writer_that_deleted_all_it_listed_checks_the_newer_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _run(run, [1, 2])
    real = cli.verify_one
    calls: list[int] = []

    def racing(store: Any, info: Any, *a: Any) -> dict[str, Any]:
        calls.append(info.generation)
        if len(calls) == 1:  # the writer saves 3 and 4, its retention deletes 1 and 2
            ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2),
                                         keep=unbroken.Keep(last=2), read_back="sync")
            ckpt.restore()
            ckpt.save(3)
            ckpt.save(4)
            ckpt.close()
        return real(store, info, *a)

    monkeypatch.setattr(cli, "verify_one", racing)
    capsys.readouterr()
    assert main(["verify", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    statuses = {g["generation"]: g["status"] for g in doc["generations"]}
    assert statuses == {1: "deleted while checked", 2: "deleted while checked",
                        3: "verified", 4: "verified"}, statuses
    assert doc["ok"] is True


def test_verify_that_saw_every_generation_go_is_not_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _run(run, [1, 2])
    real = cli.verify_one

    def emptied(store: Any, info: Any, *a: Any) -> dict[str, Any]:
        shutil.rmtree(info.path, ignore_errors=True)  # gone, and nothing newer comes
        return real(store, info, *a)

    monkeypatch.setattr(cli, "verify_one", emptied)
    capsys.readouterr()
    assert main(["verify", str(run), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert {g["status"] for g in doc["generations"]} == {"deleted while checked"}
