"""What the private-generator search reaches (found by an outside attack, 2026-12-05): a
collate_fn's generator held by its class (``class Aug: rng = ...``) or by a module its code
names (``helpers.RNG``) was accepted, and a map-style dataset holding a generator of its own
was neither refused nor warned about; a resumed run then read other values."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch

import unbroken
from unbroken.errors import UnsupportedSetup

N = 8


def _loader(collate=None, dataset=None, **kw):
    ds = dataset if dataset is not None else torch.utils.data.TensorDataset(torch.arange(8.0))
    return unbroken.ResumableLoader(ds, unbroken.ResumableSampler(N, batch_size=2, seed=0),
                                    collate_fn=collate, **kw)


class _Aug:
    rng = np.random.default_rng(0)

    def __call__(self, batch):  # noqa: ANN001
        return torch.stack([x[0] for x in batch]) + float(self.rng.random())


def test_a_generator_held_by_the_collate_object_s_class_is_refused():
    with pytest.raises(UnsupportedSetup, match=r"_Aug\.rng"):
        _loader(_Aug())


def test_a_generator_held_by_a_module_the_collate_code_names_is_refused():
    helpers = types.ModuleType("helpers")
    helpers.RNG = torch.Generator().manual_seed(0)
    space = {"helpers": helpers, "torch": torch}
    exec("def collate(batch):\n"
         "    return torch.stack([x[0] for x in batch]) + torch.rand(1, generator=helpers.RNG)\n",
         space)
    with pytest.raises(UnsupportedSetup, match=r"global helpers\)\.RNG"):
        _loader(space["collate"])
    exec("import random\ndef fine(batch):\n    return random.random()\n", space)
    _loader(space["fine"])  # (the module's global stream: saved, seeded per batch)


class _OwnRng(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> float:
        return float(self.rng.random())


class _Plain(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> float:
        return float(i)


@pytest.mark.parametrize("wrap", ["none", "seeded", "subset"])
def test_a_dataset_holding_a_generator_of_its_own_is_warned_about(wrap):
    ds = {"none": _OwnRng, "seeded": lambda: unbroken.seeded(_OwnRng(), seed=1),
          "subset": lambda: torch.utils.data.Subset(_OwnRng(), range(N))}[wrap]()
    with pytest.warns(unbroken.UnbrokenWarning, match=r"dataset(\.dataset)?\.rng: a numpy"):
        _loader(dataset=ds)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loader(dataset=unbroken.seeded(_Plain(), seed=1))


def test_the_os_entropy_a_module_holds_is_not_taken_for_a_stream():
    import secrets
    space = {"secrets": secrets, "torch": torch}
    exec("def collate(batch):\n    secrets.token_hex(2)\n"
         "    return torch.stack([x[0] for x in batch])\n", space)
    _loader(space["collate"])
