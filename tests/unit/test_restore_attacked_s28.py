"""The restore as session 28's outside review found it: a run folder whose generations were
all set aside restored from step 0 without a word; ``restore(generation="23")`` said "no
generation 23; found [15, 20, 23]"."""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import UnbrokenWarning


@pytest.fixture(autouse=True)
def _no_loader_of_earlier_tests():
    """Loaders an earlier test in this process gave to no Checkpointer are collected first:
    the restores here turn warnings into errors, and one about them is not this file's."""
    gc.collect()


def _saved(run: Path, steps: list[int]) -> None:
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2), read_back="sync")
    ckpt.restore()
    for step in steps:
        ckpt.save(step)
    ckpt.close()


def test_a_start_from_zero_beside_generations_set_aside_is_said(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _saved(run, [1, 2])
    (run / "aside").mkdir()
    for name in ("gen-000000001", "gen-000000002"):
        os.rename(run / name, run / "aside" / f"{name}-corrupt-20261204T000000Z")
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2))
    with pytest.warns(UnbrokenWarning, match=r"no generation in place, but 2 set aside"):
        assert ckpt.restore() == 0
    ckpt.close()
    fresh = unbroken.Checkpointer(tmp_path / "new", model=torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new run: nothing to say
        assert fresh.restore() == 0
    fresh.close()


@pytest.mark.parametrize("generation", ["2", True, 2.0, -1])
def test_a_generation_that_is_no_number_is_a_type_error(tmp_path: Path, generation) -> None:
    _saved(tmp_path / "run", [1, 2])
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="a generation number"):
        ckpt.restore(generation=generation)
    assert ckpt.restore(generation=1) == 1
    ckpt.close()


@pytest.mark.parametrize("litter", [".DS_Store", "._model.safetensors", "Thumbs.db",
                                    "desktop.ini", ".nfs0000000001234567"])
def test_what_a_file_browser_leaves_in_a_generation_refuses_nothing(
        tmp_path: Path, litter: str) -> None:
    """Session 28: opening a run in macOS's Finder (its .DS_Store) got the newest generation
    refused as corrupt and moved aside, the restore falling back past it. Such litter is
    ignored; any other stray entry, or litter that is no plain file, still refuses it."""
    run = tmp_path / "run"
    _saved(run, [1, 2])
    (run / "gen-000000002" / litter).write_bytes(b"\0Bud1")
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore() == 2
    ckpt.close()
    for n, (stray, folder) in enumerate((("notes.txt", False), (litter, True))):
        run = tmp_path / f"run{n}"
        _saved(run, [1, 2])
        made = run / "gen-000000002" / stray
        made.mkdir() if folder else made.write_bytes(b"x")
        ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(2, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ckpt.restore() == 1, stray  # refused, the one before it restored
        ckpt.close()


def test_a_param_group_the_saved_run_added_is_named_as_such(tmp_path: Path) -> None:
    """Session 28: the refusal said "renamed, reordered or regrouped" only."""
    from unbroken.errors import StateMismatch

    def build(unfrozen: bool) -> unbroken.Checkpointer:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
        if unfrozen:
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.01})
        return unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt)

    ckpt = build(True)
    ckpt.restore()
    ckpt.save(5)
    ckpt.close()
    ckpt = build(False)
    with pytest.raises(StateMismatch, match=r"had 2 param groups, the live optimizer 1: a "
                                            r"group the saved run added \(add_param_group"):
        ckpt.restore()
    ckpt.close()
