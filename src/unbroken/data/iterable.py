"""Resumable iterable datasets under `ResumableLoader`, with any number of DataLoader workers.

The resumable-iterable contract (an IterableDataset without it is refused with `MissingState`):

* ``state_dict()`` returns a dict of plain (codec-friendly) values and ``load_state_dict(state)``
  accepts it back. Before each pass the loader sets ``state["epoch"]`` and ``state["consumed"]``
  (items of that epoch consumed by completed updates) and calls ``load_state_dict``.
* ``__iter__`` then yields that epoch's items from item ``consumed`` on; the items and their
  order depend on the state only (no global RNG, no worker count). That is all a dataset needs,
  with any ``num_workers``.
* **Worker split.** Item ``consumed + k`` of a pass belongs to batch ``j = k // batch_size``, and
  batch ``j`` is made by worker ``j % num_workers``; the DataLoader takes batches from its
  workers in that round-robin order, so the batches are the same with 0, 1, 2 or 4 workers.
  Each worker iterates its own copy of the dataset, positioned by the same state, and keeps its
  batches, reading past the others'. A dataset that can skip items cheaply sets the class
  attribute ``splits_by_worker = True``: the loader then also sets ``state["batch_size"]``, and
  inside worker ``id`` of ``num_workers`` (``torch.utils.data.get_worker_info()``, the only
  thing it needs; ``None`` outside workers means all items) ``__iter__`` yields only the items
  ``consumed + k`` with ``k // batch_size % num_workers == id``, in order.
* **Persistent workers** are supported: at each pass the loader writes (epoch, consumed) to
  shared memory, and each worker repositions its copy with ``load_state_dict`` of the state
  the workers started from plus that position. When the rest of the dataset's state changed
  (``loader.load_state_dict``, or your own change), the workers are restarted.
* **Sample ids** (``last_batch_ids``, ``last_update_ids``, the trace) identify samples, not
  stream positions: ``dataset.sample_id(item)`` when the dataset defines it; else ``item["id"]``
  when the item is a mapping whose ``"id"`` is an integer (int, NumPy integer, one-element
  integer tensor); else a 63-bit xxh3 digest of the item's content (tensors, arrays, numbers,
  strings, bytes, lists, tuples, dicts), computed in the worker that reads the item.
* A ``collate_fn`` runs in the worker that makes the batch, under RNGs seeded from (seed, epoch,
  position of the batch's first item), so its randomness does not depend on workers either.
* ``get_worker_info().dataset`` inside a worker is the loader's wrapper; your copy is its
  ``.dataset`` (attribute reads pass through).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data
import xxhash

from ..errors import MissingState, UnbrokenWarning
from ..state._digest import _feed, digest_tree
from ._checks import counted
from ._keyed import TAG_COLLATE, mix
from ._persistent import workers_key
from .seeding import _isolated_rng

# Keys the loader sets in the dataset's state; the rest is what persistent workers must share.
_POSITION = ("epoch", "consumed", "batch_size")
_OWN = frozenset(("dataset", "batch_size", "collate_fn", "seed", "splits", "shared",
                  "base_state", "epoch", "consumed"))


def require_contract(dataset: Any) -> None:
    """Raise `MissingState` unless ``dataset`` has ``state_dict()`` and ``load_state_dict()``."""
    if not (callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None))):
        raise MissingState(
            f"{type(dataset).__name__} is an IterableDataset without state_dict()/"
            f"load_state_dict(), so its position cannot be saved and a `continue` "
            f"would repeat or skip data. Implement the resumable-iterable contract "
            f"(see unbroken.data.iterable: start each epoch at state['consumed']) or "
            f"use a map-style dataset with ResumableSampler")


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool
            and not value.is_floating_point() and not value.is_complex()):
        return int(value.item())
    return None


def sample_id(item: Any, custom: Callable[[Any], Any] | None = None) -> int:
    """The id of one item (rule in the module doc); ``custom`` is the dataset's ``sample_id``."""
    if custom is not None:
        return int(custom(item))
    if isinstance(item, Mapping) and "id" in item:
        found = _integer(item["id"])
        if found is not None:
            return found
    h = xxhash.xxh3_64()
    try:
        _feed(h, item)
    except TypeError as e:
        raise TypeError(f"cannot derive a sample id from an item of type "
                        f"{type(item).__qualname__} ({e}); give the dataset a "
                        f"sample_id(item) -> int method") from None
    return h.intdigest() >> 1


def _as_is(batch: Any) -> Any:
    return batch


class _Batches(torch.utils.data.IterableDataset[Any]):
    """Private wrapper handed to the DataLoader: yields this worker's ``(ids, batch)`` pairs."""

    def __init__(self, dataset: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None,
                 seed: int, splits: bool, shared: torch.Tensor | None,
                 base_state: dict[str, Any] | None) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.seed = seed
        self.splits = splits
        self.shared = shared  # persistent workers: [epoch, consumed] in shared memory
        self.base_state = base_state  # persistent workers: the dataset state they started from
        self.epoch = 0  # the pass position (non-persistent workers get it with their copy)
        self.consumed = 0

    def __iter__(self) -> Iterator[tuple[list[int], Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, consumed = self.epoch, self.consumed
        if self.shared is not None and info is not None:
            # A persistent worker: its long-lived copy is repositioned for this pass. Read
            # eagerly: the main process writes the next position before it resumes us.
            epoch, consumed = (int(v) for v in self.shared.tolist())
            state = dict(self.base_state or {})
            state["epoch"], state["consumed"] = epoch, consumed
            if self.splits:
                state["batch_size"] = self.batch_size
            self.dataset.load_state_dict(state)
        return self._batches(iter(self.dataset), epoch, consumed, worker, workers)

    def _batches(self, items: Iterator[Any], epoch: int, consumed: int, worker: int,
                 workers: int) -> Iterator[tuple[list[int], Any]]:
        size = self.batch_size
        if workers > 1 and not self.splits:
            items = (x for k, x in enumerate(items) if k // size % workers == worker)
        custom = getattr(self.dataset, "sample_id", None)
        custom = custom if callable(custom) else None
        number = worker  # the pass's batch number of this worker's next batch
        while True:
            chunk = list(itertools.islice(items, size))
            if not chunk:
                return
            ids = [sample_id(x, custom) for x in chunk]
            if self.collate_fn is None:
                batch = torch.utils.data.default_collate(chunk)
            else:
                with _isolated_rng(mix(TAG_COLLATE, self.seed, epoch, consumed + number * size)):
                    batch = self.collate_fn(chunk)
            yield ids, batch
            if len(chunk) < size:
                return
            number += workers

    def __getattr__(self, name: str) -> Any:
        # Reads in worker_init_fn pass through to the user's copy; own names and dunders fail
        # normally so that pickling into workers stays well-defined.
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _fingerprint(state: Mapping[str, Any]) -> Any:
    try:
        return digest_tree({k: v for k, v in state.items() if k not in _POSITION})
    except TypeError:
        return object()  # not digestible: never equal, so persistent workers restart


class IterableSource:
    """What `ResumableLoader` runs for an IterableDataset: positions the dataset before each
    pass and returns an iterator of ``(ids, batch)`` in stream order."""

    def __init__(self, dataset: Any, batch_size: Any, collate_fn: Callable[[list[Any]], Any] | None,
                 seed: int, loader_kwargs: dict[str, Any]) -> None:
        require_contract(dataset)
        if not counted(batch_size):
            raise ValueError("ResumableLoader: an IterableDataset needs batch_size= (an int in "
                             f"[1, 2**63)), got {batch_size!r}")
        batch_size = int(batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self._collate_fn = collate_fn
        self._seed = seed
        self._kwargs = loader_kwargs
        self._splits = bool(getattr(dataset, "splits_by_worker", False))
        workers = loader_kwargs.get("num_workers") or 0
        if workers > 1 and not self._splits:
            warnings.warn(f"ResumableLoader: {type(dataset).__name__} does not set "
                          f"splits_by_worker, so each of the {workers} workers reads the whole "
                          f"stream and keeps its own batches: correct, but no faster than one "
                          f"worker (see unbroken.data.iterable)", UnbrokenWarning, stacklevel=3)
        persistent = loader_kwargs.get("persistent_workers") and workers
        self._shared = torch.zeros(2, dtype=torch.int64).share_memory_() if persistent else None
        self._key: Any = None  # fingerprint of the state persistent workers started from
        self._build(None)  # now, so that DataLoader argument errors surface here

    def _build(self, base_state: dict[str, Any] | None) -> None:
        self._wrapper = _Batches(self.dataset, self.batch_size, self._collate_fn, self._seed,
                                 self._splits, self._shared, base_state)
        self._dl = torch.utils.data.DataLoader(self._wrapper, batch_size=None,
                                               collate_fn=_as_is, **self._kwargs)

    def __len__(self) -> int:
        """Batches of a whole epoch (needs ``len(dataset)``, in items)."""
        return -(-len(self.dataset) // self.batch_size)

    def state(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The dataset's state with the cursor set (what a pass starts from)."""
        state = dict(self.dataset.state_dict())
        state["epoch"], state["consumed"] = epoch, consumed
        if self._splits:
            state["batch_size"] = self.batch_size
        return state

    def start(self, epoch: int, consumed: int) -> Iterator[tuple[list[int], Any]]:
        """Position the dataset at (epoch, consumed) and start a pass."""
        state = self.state(epoch, consumed)
        self.dataset.load_state_dict(state)
        if self._shared is not None:
            # (the collate_fn and worker_init_fn the workers copied, as a map-style dataset's)
            key = (_fingerprint(state),
                   workers_key(self._collate_fn, self._kwargs.get("worker_init_fn")))
            if self._key is None or key != self._key:
                # Fresh workers (the old ones shut down with their DataLoader) start from
                # this state; later passes only move the position.
                self._build(dict(state))
                self._key = key
            self._shared[0], self._shared[1] = epoch, consumed
        else:
            self._wrapper.epoch, self._wrapper.consumed = epoch, consumed
        return iter(self._dl)
