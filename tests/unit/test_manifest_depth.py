"""A manifest nested deeper than unbroken ever writes (a resealed, hand-made one) is refused as
corrupt by every reader alike; before, ``verify`` and ``restore()`` accepted it and
``inspect --json`` died in a RecursionError ("a bug in unbroken"). The deepest identity a user
can declare (`_identity_json.MAX_DEPTH` levels) still saves, restores and prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.cli import main
from unbroken.state._identity_json import MAX_DEPTH
from unbroken.store.manifest import MANIFEST, MAX_MANIFEST_DEPTH, seal


def _nested(depth: int) -> object:
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _run(run: Path, config: object = None) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 2)
    identity = unbroken.Identity(config=config) if config is not None else None
    with unbroken.Checkpointer(run, model=model, identity=identity) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.save(step)
    return model


@pytest.mark.parametrize("field", ["environment", "parent", "origin", "retention", "metrics"])
@pytest.mark.parametrize("depth", [MAX_MANIFEST_DEPTH, 700])
def test_a_manifest_nested_too_deeply_is_corrupt_everywhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, depth: int) -> None:
    run = tmp_path / "run"
    _run(run)
    path = run / "gen-000000002" / MANIFEST
    doc = json.loads(path.read_bytes())
    doc[field] = {"x": _nested(depth)}
    path.write_bytes(seal(doc))
    where = f"{path}: JSON nested deeper than {MAX_MANIFEST_DEPTH} levels"

    for command in (["inspect", str(run), "--json"], ["verify", str(run), "--json"]):
        capsys.readouterr()
        assert main(command) == 1
        out = json.loads(capsys.readouterr().out)
        status = {g["generation"]: (g["status"], g["reason"]) for g in out["generations"]}
        assert status[2][0] == "corrupt" and status[2][1].startswith(where), status
        assert status[1][0] in ("complete", "verified")
    assert main(["inspect", str(run)]) == 1
    assert f"nested deeper than {MAX_MANIFEST_DEPTH} levels" in capsys.readouterr().out

    with unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2)) as ckpt:
        assert ckpt.restore() == 1  # the generation before it


def test_the_deepest_identity_a_user_can_declare_saves_restores_and_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    config = {"model": _nested(MAX_DEPTH - 1)}
    model = _run(run, config)
    capsys.readouterr()
    assert main(["inspect", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["verify", str(run), "--json"]) == 0
    other = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(run, model=other,
                               identity=unbroken.Identity(config=config)) as ckpt:
        assert ckpt.restore() == 2
    assert torch.equal(other.weight, model.weight)
