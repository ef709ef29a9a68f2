"""Per-sample and per-batch randomness that does not depend on DataLoader workers.

A sample's augmentation draws come from python `random`, NumPy's global RNG and torch's
default CPU generator, seeded from (seed, epoch, global position) for the duration of its
``__getitem__`` only. The caller's RNG states are restored afterwards, so with 0 workers the
training loop's streams (dropout) are untouched, and with any number of workers every sample
draws the same numbers.
"""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ..errors import UnbrokenWarning
from ._keyed import TAG_COLLATE, TAG_SAMPLE, mix
from .sampler import SampleKey


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    # Not torch.manual_seed: that also reseeds every CUDA/MPS/XPU generator, which would
    # clobber the training loop's GPU dropout stream in the main process.
    torch.default_generator.manual_seed(seed)


@contextmanager
def _isolated_rng(seed: int) -> Iterator[None]:
    """Seed python, NumPy-global and torch-CPU RNGs from a 64-bit ``seed`` for the body, then
    put the caller's states back (even when the body raises).

    Inside a DataLoader worker nothing is put back: no training stream lives there, and
    saving/restoring NumPy's state costs ~100 us per sample, ten times the seeding itself.
    """
    if torch.utils.data.get_worker_info() is not None:
        _seed_all(seed)
        yield
        return
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.default_generator.get_state()
    try:
        _seed_all(seed)
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.default_generator.set_state(torch_state)


class SeededDataset(torch.utils.data.Dataset[Any]):
    """Map-style dataset wrapper; see `seeded`."""

    def __init__(self, dataset: Any, seed: int = 0) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("seeded() wraps map-style datasets (with __getitem__); an "
                            "IterableDataset must seed its own randomness from its position")
        self.dataset = dataset
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Epoch used for plain-int indices (keys from ResumableSampler carry their own)."""
        self.epoch = int(epoch)

    def sample_seed(self, index: int) -> int:
        """The 64-bit seed ``__getitem__(index)`` runs under."""
        if isinstance(index, SampleKey):
            return mix(TAG_SAMPLE, self.seed, index.epoch, index.position)
        return mix(TAG_SAMPLE, self.seed, self.epoch, int(index))

    def __getitem__(self, index: int) -> Any:
        with _isolated_rng(self.sample_seed(index)):
            return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # Pass attribute reads through to the user's dataset (its vocab, transforms, ...).
        # Dunder and own names fail normally so pickling into workers stays well-defined.
        if name.startswith("__") or name in ("dataset", "seed", "epoch"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def seeded(dataset: Any, seed: int = 0) -> SeededDataset:
    """Wrap a map-style dataset so randomness inside its ``__getitem__`` is reproducible.

    Each ``dataset[key]`` runs with python ``random``, ``np.random`` (global) and torch's
    default CPU generator seeded from ``(seed, epoch, position)`` — taken from the
    `SampleKey` that `ResumableSampler` yields (global position in the epoch, so the same on
    every rank split and every worker count: under `ResumableLoader` nothing else is needed).
    A plain int index (a plain DataLoader, direct indexing) is keyed ``(seed, self.epoch,
    index)``: call ``set_epoch(e)`` every epoch there, or every epoch draws the same
    augmentation. The previous RNG states are restored afterwards. `ResumableLoader` saves
    ``seed`` with its position and refuses a resume with another one.

    Not covered: CUDA generators and RNG objects the dataset creates itself without a seed
    (``np.random.default_rng()``); derive those from ``torch.randint`` / ``random`` instead.
    """
    return SeededDataset(dataset, seed)


def warn_unless_seeded(dataset: Any, num_workers: int) -> None:
    """Warn when a map-style dataset not wrapped in `seeded` runs in DataLoader workers.

    A worker's random streams cannot be saved: its base seed is drawn per pass (from the
    loader's position) and its place in the stream depends on which samples it fetched. So a
    draw in ``__getitem__`` comes back the same after a resume only when it is keyed by the
    sample (`seeded`); with no workers it comes from the checkpointed global streams."""
    if num_workers > 0 and not isinstance(dataset, SeededDataset):
        warnings.warn(
            f"ResumableLoader: {type(dataset).__name__} is not wrapped in unbroken.seeded() "
            f"and runs in {num_workers} DataLoader workers, whose random streams a resume "
            f"cannot restore: any random draw in its __getitem__ (augmentation) differs after "
            f"a resume. Pass unbroken.seeded(dataset, seed=...) (draws keyed by sample), or "
            f"num_workers=0", UnbrokenWarning, stacklevel=3)


# -- per-batch seeding of collate_fn -------------------------------------------------------

# The keys of the batch being fetched in this thread. The DataLoader fetcher calls the
# dataset's __getitems__ and then collate_fn back to back in the same thread (a worker's, or
# the main one with 0 workers), which is how the collate wrapper learns which batch it sees.
_fetching = threading.local()


class _RecordKeys(torch.utils.data.Dataset[Any]):
    """Private proxy handed to the DataLoader: fetches like the user's dataset and records
    the batch's keys for `_SeededCollate`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitems__(self, keys: Sequence[int]) -> list[Any]:
        _fetching.keys = keys
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(keys))
        return [self.dataset[k] for k in keys]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


class _SeededCollate:
    """Runs the user's collate_fn under RNGs seeded from (seed, epoch, position of the batch's
    first sample): masking or mixing in collate is then independent of workers."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], seed: int) -> None:
        self.collate_fn = collate_fn
        self.seed = seed

    def __call__(self, samples: list[Any]) -> Any:
        keys = getattr(_fetching, "keys", None)
        _fetching.keys = None
        if not keys or not isinstance(keys[0], SampleKey):
            raise RuntimeError("unbroken internal error: collate_fn called without the keys of "
                               "its batch (was the DataLoader's dataset replaced?)")
        first = keys[0]
        with _isolated_rng(mix(TAG_COLLATE, self.seed, first.epoch, first.position)):
            return self.collate_fn(samples)
