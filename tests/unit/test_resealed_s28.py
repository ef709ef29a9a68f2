"""Resealed generations holding a state no torch class or generator ever holds (session 28's
outside review): some stopped the restore with an error blaming the run's settings
(`StateMismatch` "build the optimizer as in the saved run", `MissingState` "written by a
different LambdaLR configuration") although an older verified generation was there, and
`verify --deep` passed others that the restore refused. Each is now corrupt for both: the
restore falls back to the generation before it, and ``verify --deep`` names the problem."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _resealing import reseal
from safetensors.torch import load_file, save

import unbroken
from unbroken.cli import main
from unbroken.store.manifest import seal

NEWEST = "gen-000000003"


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched, torch.amp.GradScaler("cpu")


def _checkpointer(run: Path) -> unbroken.Checkpointer:
    model, opt, sched, scaler = _objects()
    return unbroken.Checkpointer(run, model=model, optimizer=opt, scheduler=sched,
                                 scaler=scaler, read_back="sync")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("resealed") / "run"
    ckpt = _checkpointer(run)
    ckpt.restore()
    model, opt = ckpt.model, ckpt.optimizer
    assert opt is not None
    for step in (1, 2, 3):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step)
        ckpt.save()
    ckpt.close()
    return run


def _state(p: dict[str, Any]) -> dict[str, Any]:
    return p["parts"]


def _group(p: dict[str, Any]) -> dict[str, Any]:
    return p["parts"]["optimizer"]["param_groups"][0]


STATE_EDITS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "amsgrad an int": lambda p: _group(p).update(amsgrad=1),
    "param group without lr": lambda p: _group(p).pop("lr"),
    "scheduler without last_epoch": lambda p: _state(p)["scheduler"].pop("last_epoch"),
    "scaler without growth_factor": lambda p: _state(p)["scaler"].pop("growth_factor"),
}


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


def _both_refuse(run: Path, capsys: pytest.CaptureFixture[str], needle: str) -> None:
    capsys.readouterr()
    assert main(["verify", "--deep", "--json", str(run)]) == 1
    doc = json.loads(capsys.readouterr().out)
    newest = [g for g in doc["generations"] if g["generation"] == 3][0]
    assert newest["status"] == "corrupt" and needle in newest["reason"], newest
    ckpt = _checkpointer(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore() == 2
    ckpt.close()
    assert [r.rsplit("/", 1)[-1] for r, _ in ckpt.rejected] == [NEWEST]


@pytest.mark.parametrize("edit", sorted(STATE_EDITS))
def test_a_resealed_state_torch_never_holds_falls_back(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str) -> None:
    run = _copy(saved, tmp_path)
    doc = json.loads((run / NEWEST / "state.json").read_text())
    STATE_EDITS[edit](doc)
    reseal(run / NEWEST, "state.json", json.dumps(doc).encode())
    needle = {"amsgrad an int": "'amsgrad' is 1", "param group without lr": "has no 'lr'",
              "scheduler without last_epoch": "last_epoch",
              "scaler without growth_factor": "growth_factor"}[edit]
    _both_refuse(run, capsys, needle)


def test_a_retyped_rng_state_falls_back(saved: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(saved, tmp_path)
    rng = load_file(run / NEWEST / "rng.safetensors")
    raw = (run / NEWEST / "rng.safetensors").read_bytes()
    meta = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]).get("__metadata__")
    rng["torch_cpu"] = rng["torch_cpu"].view(torch.float8_e5m2)  # the same bytes, retyped
    reseal(run / NEWEST, "rng.safetensors", save(rng, meta))
    _both_refuse(run, capsys, "rng.torch_cpu is a torch.float8_e5m2 tensor")


def test_an_identity_entry_without_its_hash_falls_back(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(saved, tmp_path)
    manifest = json.loads((run / NEWEST / "MANIFEST.json").read_text())
    manifest["identity"]["config"] = {"kind": "json", "summary": "x"}
    (run / NEWEST / "MANIFEST.json").write_bytes(seal(manifest))
    _both_refuse(run, capsys, "identity 'config' should be an entry with its 'hash'")
