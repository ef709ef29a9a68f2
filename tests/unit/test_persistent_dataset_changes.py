"""Persistent workers and a map-style dataset the loop changes between epochs (a curriculum's
``dataset.level = epoch``): torch's persistent workers keep the copy they started with, while a
resumed run's new workers start from the dataset as it is, so the two runs read different
items (found by an outside attack). The loader starts its persistent workers again when the
dataset's attributes changed since they started, in every run alike."""

from __future__ import annotations

import torch

import unbroken
from unbroken.data._persistent import dataset_key


class _Levels(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.level = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i + 100 * self.level)])


def _batches(run: str, until: int, stop: int | None) -> list[list[float]]:
    """Train (nothing: record each batch) from the run's newest generation to update
    ``until``, saving and leaving after update ``stop``."""
    ds = _Levels()
    loader = unbroken.ResumableLoader(unbroken.seeded(ds, seed=1),  # (its level, wrapped)
                                      unbroken.ResumableSampler(8, batch_size=2, seed=3),
                                      num_workers=2, persistent_workers=True)
    ck = unbroken.Checkpointer(run, model=torch.nn.Linear(1, 1), data=loader)
    step = ck.restore()
    seen = []
    while step < until:
        ds.level = loader.epoch  # (the curriculum: set before each pass)
        for x in loader:
            seen.append(x.flatten().tolist())
            step += 1
            ck.step_done(step)
            if step in (stop, until):
                break
        if step == stop:
            ck.save()
            break
    ck.close()
    loader.stop_workers()
    return seen


def test_a_resumed_run_reads_what_the_uninterrupted_one_read(tmp_path):
    whole = _batches(str(tmp_path / "whole"), 10, None)
    first = _batches(str(tmp_path / "cut"), 10, 6)
    rest = _batches(str(tmp_path / "cut"), 10, None)
    assert first + rest == whole
    assert whole[4][0] >= 100  # (the second epoch reads level 1: workers started again)


def test_the_key_sees_attributes_set_not_contents_changed():
    ds = _Levels()
    wrapped = torch.utils.data.Subset(ds, [0, 1])
    before = dataset_key(wrapped)
    ds.level = 1
    assert dataset_key(wrapped) != before
    items = [1, 2]
    ds.items = items
    key = dataset_key(wrapped)
    items.append(3)  # (in place: not seen, as documented)
    assert dataset_key(wrapped) == key


class _Aug:
    def __init__(self) -> None:
        self.level = 0


class _Held(torch.utils.data.Dataset):
    """The level in an object the dataset holds, or in a small dict; the worker's pid too."""

    def __init__(self) -> None:
        self.aug, self.cfg = _Aug(), {"level": 0}

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        import os
        return torch.tensor([float(i + 100 * self.aug.level + 1000 * self.cfg["level"]),
                             float(os.getpid())])


def test_levels_held_in_objects_and_dicts_restart_the_workers_and_nothing_else_does():
    ds = _Held()
    loader = unbroken.ResumableLoader(unbroken.seeded(ds, seed=1),
                                      unbroken.ResumableSampler(8, batch_size=2, seed=3),
                                      num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(4):
        if epoch == 1:
            ds.aug.level = 1
        if epoch == 3:
            ds.cfg["level"] = 1
        items = torch.cat(list(loader))
        seen.append((items[:, 0].min().item(), set(items[:, 1].tolist())))
        loader.sampler.set_position(epoch + 1, 0)
    loader.stop_workers()
    assert [low for low, _ in seen] == [0.0, 100.0, 100.0, 1100.0]
    pids = [p for _, p in seen]
    assert pids[1] != pids[0] and pids[2] == pids[1] and pids[3] != pids[2]  # (no restart at 2)
    assert dataset_key(float("nan")) == dataset_key(float("nan"))
