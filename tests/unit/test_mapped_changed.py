"""A restore of large files reads each twice: streamed and hashed, then copied from the file
into the live tensors (`store.backends._mapped`). A file written in place or truncated between
the two reads must never be loaded as verified: the restore raises `CorruptCheckpoint` naming
the file and saying what is partly restored, and the next restore refuses the file by its hash
and falls back to the previous verified generation, bitwise."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken import picking
from unbroken.errors import CorruptCheckpoint
from unbroken.store.backends import _mapped


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _saved(run: Path, last: int) -> torch.nn.Module:
    """Generations up to ``last`` in ``run``, one per step, continued from those there; the
    model."""
    model, opt = _state(0)
    with unbroken.Checkpointer(run, model=model, optimizer=opt) as ckpt:
        for step in range(ckpt.restore() + 1, last + 1):
            _train(model, opt)
            ckpt.step_done(step)
            ckpt.save()
    return model


def _bits(model: torch.nn.Module) -> list[bytes]:
    return [t.detach().numpy().tobytes() for t in model.state_dict().values()]


def _changing(how: str, victim: str):
    """`MappedFiles.add` that damages ``victim`` (a file name) of generation 2 right after
    its identity was checked, before anything is copied from it."""
    add = _mapped.MappedFiles.add

    def damaging(self, view, path, hashed):
        got = add(self, view, path, hashed)
        if "gen-000000002" in path and os.path.basename(path) == victim:
            with open(path, "r+b") as f:
                if how == "written":  # same size, other bytes in the data section
                    f.seek(os.path.getsize(path) - 4096)
                    f.write(b"\0" * 4096)
                else:
                    f.truncate(os.path.getsize(path) // 2)
        return got
    return damaging


@pytest.mark.parametrize("pieces", ["one read", "pool"])
@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.safetensors"])
@pytest.mark.parametrize("how", ["written", "truncated"])
def test_a_file_changed_between_its_hash_and_its_copy_is_never_loaded_as_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        how: str, victim: str, pieces: str) -> None:
    monkeypatch.setattr(picking, "_MAP_MIN", 0)  # every model and optimizer file mapped
    if pieces == "pool":  # the background readers' pieces, as for tensors of 8 MiB and more
        monkeypatch.setattr(_mapped, "_PIECE", 4096)
        monkeypatch.setattr(_mapped, "_READERS", 2)
    run = tmp_path / "run"
    first = _bits(_saved(run, 1))
    _saved(run, 2)
    assert (run / "gen-000000002" / victim).stat().st_size > 64 << 10

    other, other_opt = _state(1)
    _train(other, other_opt)  # (live optimizer state: the saved one is copied into it)
    monkeypatch.setattr(_mapped.MappedFiles, "add", _changing(how, victim))
    with pytest.raises(CorruptCheckpoint) as caught:
        with unbroken.Checkpointer(run, model=other, optimizer=other_opt) as ckpt:
            ckpt.restore()
    said = str(caught.value)
    assert str(run / "gen-000000002" / victim) in said
    if how == "written":
        assert "written while being restored" in said
    else:  # (found by a read that came back short, or by the file's size after the reads)
        assert ("shrank while being restored" in said
                or "bytes while being restored" in said), said
    assert "partly restored now" in said
    # (named under the part copied from it: the model's file is checked after its copies)
    assert said.startswith(f"part '{victim.split('.')[0]}': "), said

    # The next restore (a process built anew) refuses the damaged file by its hash and
    # continues from the generation before it, bitwise.
    monkeypatch.undo()
    again, again_opt = _state(2)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        with unbroken.Checkpointer(run, model=again, optimizer=again_opt) as ckpt:
            assert ckpt.restore() == 1
    assert f"rejected {run / 'gen-000000002'}: {run / 'gen-000000002' / victim}" in caplog.text
    assert _bits(again) == first


@pytest.mark.parametrize("how", ["link", "link and unlink", "chmod"])
def test_a_link_or_chmod_while_restoring_changes_no_byte_and_is_no_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A hard link (an incremental save links a stable file at every save; retention unlinks
    them) or a chmod changes a file's ctime, not a byte: a restore beside them restores."""
    monkeypatch.setattr(picking, "_MAP_MIN", 0)
    run = tmp_path / "run"
    model = _saved(run, 1)
    add = _mapped.MappedFiles.add

    def touching(self, view, path, hashed):  # type: ignore[no-untyped-def]
        got = add(self, view, path, hashed)
        if how == "chmod":
            os.chmod(path, 0o444)
        else:
            os.link(path, tmp_path / os.path.basename(path))
            if how == "link and unlink":
                os.unlink(tmp_path / os.path.basename(path))
        return got

    monkeypatch.setattr(_mapped.MappedFiles, "add", touching)
    other, other_opt = _state(1)
    _train(other, other_opt)
    with unbroken.Checkpointer(run, model=other, optimizer=other_opt) as ckpt:
        assert ckpt.restore() == 1
    assert _bits(other) == _bits(model)
