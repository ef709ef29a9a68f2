"""The data position as session 28's outside review found it: ``accumulation=True`` (and an
iterable dataset's ``batch_size=True``, a Packer's) was taken, saved as ``true``, and then
every restore refused every generation as damaged, so the run could never continue; a changed
``ResumableSampler(seed=)`` was blamed on a ``ResumableLoader(seed=)`` the script never
passed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken
from unbroken.errors import StateMismatch


class Items(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.state = {"epoch": 0, "consumed": 0}

    def __iter__(self):  # type: ignore[no-untyped-def]
        start = self.state["consumed"]
        return iter(range(start, 10))

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


@pytest.mark.parametrize("bad", [True, False, 0, 1.0, 2**63, "2", None])
def test_counts_that_no_restore_reads_back_are_refused_when_built(bad: object) -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = unbroken.ResumableSampler(8, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="accumulation"):
        unbroken.ResumableLoader(ds, sampler, accumulation=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        unbroken.ResumableLoader(Items(), batch_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accumulation"):
        unbroken.Packer([[1, 2, 3]], seq_len=2, accumulation=bad)  # type: ignore[arg-type]


def test_numpy_counts_are_taken_as_ints(tmp_path: Path) -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = unbroken.ResumableSampler(8, batch_size=2, seed=0)
    loader = unbroken.ResumableLoader(ds, sampler, accumulation=np.int64(2))
    assert type(loader.accumulation) is int and loader.accumulation == 2
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1), data=loader)
    ckpt.restore()
    for step, _ in enumerate(loader, 1):
        if loader.at_boundary:
            ckpt.step_done(step // 2)
            break
    ckpt.save()
    ckpt.close()
    again = unbroken.ResumableLoader(ds, unbroken.ResumableSampler(8, batch_size=2, seed=0),
                                     accumulation=2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1), data=again)
    assert ckpt.restore() == 1
    ckpt.close()


def test_a_changed_sampler_seed_is_named_as_the_samplers(tmp_path: Path) -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))

    def build(seed: int, loader_seed: int | None = None) -> unbroken.Checkpointer:
        loader = unbroken.ResumableLoader(ds, unbroken.ResumableSampler(8, batch_size=2,
                                                                        seed=seed),
                                          seed=loader_seed)
        return unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1),
                                     data=loader)

    ckpt = build(0)
    ckpt.restore()
    ckpt.save(0)
    ckpt.close()
    ckpt = build(1)
    with pytest.raises(StateMismatch) as e:
        ckpt.restore()
    ckpt.close()
    assert "saved seed=0, live seed=1" in str(e.value) and "loader_seed" not in str(e.value)
    ckpt = build(0, loader_seed=1)  # a loader seed given: that one is named
    with pytest.raises(StateMismatch, match="loader_seed=1"):
        ckpt.restore()
    ckpt.close()


class Sized(Items):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.state["consumed"], self.n))


def test_an_iterable_dataset_of_another_length_is_refused(tmp_path: Path) -> None:
    """Session 28: 101 items then 102 (or 100 then 60) was taken silently, each epoch then
    holding other items than the interrupted run's. A map-style dataset was refused already."""
    def build(n: int) -> unbroken.Checkpointer:
        loader = unbroken.ResumableLoader(Sized(n), batch_size=2)
        return unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1),
                                     data=loader)

    ckpt = build(100)
    ckpt.restore()
    loader = ckpt.data
    assert loader is not None
    for step, _ in enumerate(loader, 1):
        ckpt.step_done(step)
        if step == 3:
            break
    ckpt.save()
    ckpt.close()
    for n in (60, 102):
        ckpt = build(n)
        with pytest.raises(StateMismatch, match=f"had 100 items, this one {n}"):
            ckpt.restore()
        ckpt.close()
    ckpt = build(100)
    assert ckpt.restore() == 3
    ckpt.close()
