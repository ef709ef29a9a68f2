"""`ResumableLoader`: a DataLoader whose saved position counts what completed updates consumed.

Rules (documented contract):

* One ``iter(loader)`` is the rest of the cursor's epoch, like a DataLoader pass; when a pass
  is exhausted the epoch has ended and the next ``iter()`` starts the next epoch. ``len`` is
  the batches of a whole epoch. Drive epochs with ``while loader.epoch < epochs:`` — the
  loader is the one owner of the epoch counter, so keep no other.
* **Consumed, not prefetched.** The loader counts the batches it hands to the training loop,
  whatever the workers and ``prefetch_factor`` read ahead; `state_dict` returns the position
  after the last **completed update window**.
* **Accumulation.** With ``accumulation=N``, micro-batches form update windows of N counted
  from the start of the pass. A window never spans epochs: the epoch's last window is
  shorter when the epoch's batch count is not a multiple of N (the last update uses fewer
  micro-batches; no sample is dropped beyond the sampler's own ``drop_last``). After each
  batch, `at_boundary` says whether it closed its window (step the optimizer then) and
  `window_size` gives the window's micro-batch count (scale the loss by it), right from its
  first micro-batch (an iterable pass reads up to a window ahead for it). A save between
  boundaries raises `UpdateBoundaryError`. An update the GradScaler skipped still consumed
  its samples: the window is complete once its micro-batches were handed out.
* Starting a new ``iter()`` (or `load_state_dict`) drops the micro-batches of an unfinished
  window: they are handed out again, exactly as a resumed process would see them.
* The DataLoader gets a private ``torch.Generator`` (seeded from seed, epoch and cursor), so
  ``iter()`` never draws from the global torch RNG; with a ``collate_fn``, each batch's
  collate runs under RNGs seeded from (seed, epoch, position of its first sample); one that
  reaches a random generator of its own (neither saved nor seeded per batch: a resumed run
  would collate differently) is refused at construction (`UnsupportedSetup`). A draw in
  a map-style dataset's ``__getitem__`` inside workers survives a resume only under `seeded`
  (workers' own streams cannot be saved): an unwrapped one with workers is warned about.
* **Iterable datasets** must implement the resumable-iterable contract of
  `unbroken.data.iterable` (``state_dict()``/``load_state_dict()``; before each pass the loader
  sets ``state["epoch"]`` and ``state["consumed"]``, and ``__iter__`` yields that epoch's items
  from item ``consumed`` on). Batch ``j`` of a pass is made by worker ``j % num_workers`` and the
  batches come back in order, so any number of workers (persistent or not) gives the same
  batches; trace ids are sample ids (the item's id or a content digest), not positions. A
  dataset without the contract is refused with `MissingState`.
"""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ..errors import StateMismatch, UnbrokenError, UpdateBoundaryError
from ._checks import counted, located
from ._keyed import TAG_WORKERS, mix
from ._loader_pass import _LoaderIterator, _Pass
from ._loader_state import _length, check_iterable, check_settings, settings
from ._persistent import workers_key
from ._private_rng import refuse_private_collate, warn_private_dataset
from ._signals import _sigterm_held, _worker_start
from .iterable import IterableSource, require_contract
from .sampler import STATE_VERSION, ResumableSampler
from .seeding import _RecordKeys, _SeededCollate, warn_unless_seeded


class ResumableLoader:
    """A `torch.utils.data.DataLoader` wrapper that saves and restores its exact position.

    Args:
        dataset: map-style dataset (wrap it in `seeded` for reproducible augmentation), or an
            IterableDataset implementing the resumable-iterable contract (module doc).
        sampler: the `ResumableSampler` giving the order (map-style datasets; required).
        batch_size: batch size for iterable datasets only (map-style: the sampler's).
        num_workers, collate_fn, pin_memory, prefetch_factor, persistent_workers, timeout,
        worker_init_fn, multiprocessing_context: as for DataLoader.
        accumulation: micro-batches per optimizer update (N >= 1).
        seed: seed of the private DataLoader generator and of collate_fn randomness
            (default: the sampler's seed, or 0). Saved with the position, like
            ``accumulation`` and the seed of a `seeded` dataset: a resume with another one is
            refused (`StateMismatch`).

    Attributes read by the Checkpointer: ``epoch``, ``state_dict()``, ``load_state_dict()``.
    """

    def __init__(
        self,
        dataset: Any,
        sampler: ResumableSampler | None = None,
        *,
        batch_size: int | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        timeout: float = 0.0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        accumulation: int = 1,
        seed: int | None = None,
    ) -> None:
        # (not a bool: saved as true, no restore would read it back; NumPy ints as ints)
        if not counted(accumulation):
            raise ValueError("ResumableLoader: accumulation must be an int in [1, 2**63), got "
                             f"{accumulation!r}")
        accumulation = int(accumulation)
        if seed is not None and (isinstance(seed, bool)
                                 or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"ResumableLoader: seed must be an int, got {seed!r}")
        if collate_fn is not None:  # (before anything is built: a refused loader holds nothing)
            refuse_private_collate(collate_fn)
        self._dataset = dataset
        self._collate_fn, self._worker_init_fn = collate_fn, worker_init_fn
        self.sampler = sampler
        self.accumulation = accumulation
        self._iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        self._seed = int(seed) if seed is not None else (sampler.seed if sampler is not None else 0)
        self._seed_given = seed is not None
        self._generator = torch.Generator()
        self._pass: _Pass | None = None
        self._it_epoch = 0  # the cursor of an iterable dataset (a sampler keeps its own)
        self._it_consumed = 0
        self._handed = 0  # batches handed out since the loader was built (never saved)
        self._workers_key: Any = None  # what persistent workers copied (`_persistent`)
        self._asked = False  # state_dict() called (a Checkpointer holds it: `unsaved_loaders`)
        common: dict[str, Any] = dict(
            num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, timeout=timeout,
            worker_init_fn=functools.partial(_worker_start, worker_init_fn),
            multiprocessing_context=multiprocessing_context,
            generator=self._generator)
        self._source: IterableSource | None = None
        if self._iterable:
            require_contract(dataset)
            if sampler is not None:
                raise ValueError("ResumableLoader: an IterableDataset orders its own items; "
                                 "pass batch_size=, not a sampler")
            self._source = IterableSource(dataset, batch_size, collate_fn, self._seed, common)
            self._batch_size = self._source.batch_size
        else:
            if not isinstance(sampler, ResumableSampler):
                raise TypeError("ResumableLoader: a map-style dataset needs "
                                "sampler=ResumableSampler(...)")
            if batch_size is not None and batch_size != sampler.batch_size // sampler.world_size:
                raise ValueError(f"ResumableLoader: batch_size={batch_size} contradicts the "
                                 "sampler's per-rank batch "
                                 f"{sampler.batch_size // sampler.world_size}")
            # (a wrapper's len() of a dataset without one raises: unsized, as torch takes it)
            size = _length(dataset)
            if size is not None and size != sampler.num_samples:
                raise ValueError(f"ResumableLoader: len(dataset)={size} but the sampler "
                                 f"orders num_samples={sampler.num_samples}")
            self._batch_size = sampler.batch_size
            warn_unless_seeded(dataset, num_workers)
            warn_private_dataset(dataset)
            # Only a user collate_fn can draw random numbers; the default collate needs no
            # seeding, and skipping it saves an RNG save/restore per batch.
            wrapped = collate_fn is not None
            self._dl = torch.utils.data.DataLoader(
                _RecordKeys(dataset) if wrapped else dataset, batch_sampler=sampler,
                collate_fn=(_SeededCollate(collate_fn, self._seed)
                            if collate_fn is not None else None),
                **common)
        _LIVE.add(self)  # (built: its workers are stopped at exit)

    # -- cursor ----------------------------------------------------------------------------

    @property
    def dataset(self) -> Any:
        """The dataset as passed in."""
        return self._dataset

    def _cursor(self) -> tuple[int, int]:
        if self.sampler is not None:
            return self.sampler.epoch, self.sampler.consumed
        return self._it_epoch, self._it_consumed

    @property
    def epoch(self) -> int:
        """Completed epochs = the epoch the next update's data comes from."""
        return self._cursor()[0]

    @property
    def consumed(self) -> int:
        """Samples (items) of `epoch` consumed by completed updates, summed over ranks."""
        return self._cursor()[1]

    @property
    def at_boundary(self) -> bool:
        """True when every batch handed out belongs to a completed update window."""
        p = self._pass
        return p is None or p.yielded == p.completed()

    @property
    def handed_out(self) -> int:
        """Batches this loader handed to the training loop since it was built (not saved):
        a save checks it to know that none was handed out since the last update boundary."""
        return self._handed

    @property
    def window_size(self) -> int:
        """Micro-batches in the update window of the last batch handed out (N, or fewer for
        an epoch's final window)."""
        return self._pass.window()[1] if self._pass is not None else self.accumulation

    @property
    def last_batch_ids(self) -> list[int]:
        """Dataset indices of the last batch handed out (this rank's share); for an iterable
        dataset, its items' sample ids (`unbroken.data.iterable`). Empty before the first
        batch."""
        p = self._pass
        if p is None or p.yielded == 0:
            return []
        if self.sampler is None:
            return list(p.batch_ids)
        number = p.start // self.sampler.batch_size + p.yielded - 1
        return [int(k) for k in self.sampler.batch(p.epoch, number)]

    @property
    def last_update_ids(self) -> list[int]:
        """Dataset indices of every micro-batch of the last completed update window of the
        current pass (this rank's share); what the trace records per update."""
        p = self._pass
        if p is None or p.completed() == 0:
            return []
        if self.sampler is None:
            return list(p.update_ids)
        done = p.completed()
        first = (done - 1) // p.n * p.n
        base = p.start // self.sampler.batch_size
        return [int(k) for number in range(base + first, base + done)
                for k in self.sampler.batch(p.epoch, number)]

    def _position_after(self, p: _Pass, batches: int) -> tuple[int, int]:
        if self.sampler is not None:
            return self.sampler.position_after(p.epoch, p.start, batches)
        if p.total is not None and batches == p.total:
            return p.epoch + 1, 0
        return p.epoch, p.start + batches * self._batch_size

    def _set_cursor(self, epoch: int, consumed: int) -> None:
        if self.sampler is not None:
            self.sampler.set_position(epoch, consumed)
        else:
            self._it_epoch, self._it_consumed = epoch, consumed

    # -- iteration -------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch (a whole epoch, wherever the cursor is)."""
        return len(self.sampler) if self.sampler is not None else len(self._iterable_source())

    def _iterable_source(self) -> IterableSource:
        assert self._source is not None
        return self._source

    def __iter__(self) -> Iterator[Any]:
        """The rest of the cursor's epoch, from the first sample no completed update consumed."""
        self._detach()
        epoch, consumed = self._cursor()
        total = (None if self.sampler is None
                 else self.sampler.batches_per_epoch - consumed // self.sampler.batch_size)
        p = _Pass(epoch, consumed, total, self.accumulation)
        # A private generator: iter(DataLoader) draws the workers' base seed from it instead of
        # from the global torch RNG, which would shift the training loop's dropout stream.
        self._generator.manual_seed(mix(TAG_WORKERS, self._seed, epoch, consumed))
        with _sigterm_held():
            if self.sampler is not None:
                if self._dl.persistent_workers and self._dl.num_workers:
                    key = workers_key(self._dataset, self._collate_fn, self._worker_init_fn)
                    if key != self._workers_key:  # (started with other objects: `_persistent`)
                        self.stop_workers()
                        self._workers_key = key
                p.iterator = iter(self._dl)
            else:  # positions the dataset (and persistent workers' copies) at the cursor
                p.iterator = self._iterable_source().start(epoch, consumed)
        self._pass = p
        return _LoaderIterator(self, p)

    def _detach(self) -> None:
        # Drop the previous pass: its completed windows are already in the cursor, an
        # unfinished window is replayed. Releasing the DataLoader iterator shuts its
        # (non-persistent) workers down now rather than at garbage collection.
        if self._pass is not None:
            self._pass.iterator = None
            self._pass = None

    def stop_workers(self) -> None:
        """Shut this loader's workers down now (told to stop, and joined): for a loop that
        ends before its pass does (a step limit) and would otherwise leave them running until
        the interpreter exits."""
        for it in self._iterators():
            stop = getattr(it, "_shutdown_workers", None)
            if stop is not None:
                stop()
        dl = self._dl if self._source is None else self._source._dl
        if getattr(dl, "_iterator", None) is not None:
            dl._iterator = None  # persistent workers: the next pass starts new ones

    def _iterators(self) -> tuple[Any, Any]:
        """The torch iterators that may hold this loader's workers (the pass's; a persistent
        one's, kept by the DataLoader)."""
        dl = self._dl if self._source is None else self._source._dl
        return self._pass.iterator if self._pass else None, getattr(dl, "_iterator", None)

    def _next(self, p: _Pass) -> Any:
        if self._pass is not p:
            raise UnbrokenError("this iterator of the ResumableLoader was superseded by a newer "
                                "iter(loader) or load_state_dict(); iterate the loader again")
        if self.sampler is not None:
            if p.iterator is None:
                raise StopIteration
            try:
                batch = next(p.iterator)
            except StopIteration:
                p.iterator = None
                raise
        else:
            # The stream's length is unknown: fetch ahead until this batch's window size is
            # known, so that window_size (the loss scale) is right on its first micro-batch
            # and the last batch of the stream closes its window and rolls the epoch over.
            p.look_ahead()
            if not p.ahead:
                if p.yielded == 0:  # an empty epoch still ends
                    self._set_cursor(p.epoch + 1, 0)
                raise StopIteration
            p.batch_ids, batch = p.ahead.popleft()  # the workers send (sample ids, batch)
            p.window_ids += p.batch_ids
        p.yielded += 1
        self._handed += 1
        if p.yielded == p.completed():
            self._set_cursor(*self._position_after(p, p.yielded))
            p.update_ids, p.window_ids = p.window_ids, []
        return batch

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last completed update (plain ints/bools/dicts).

        Raises `UpdateBoundaryError` between the micro-batches of an update window.
        """
        self._asked = True
        p = self._pass
        if p is not None and p.yielded != p.completed():
            taken, size = p.window()
            raise UpdateBoundaryError(
                f"save requested after {taken} of {size} micro-batches of the update window; "
                f"save at an update boundary (after the optimizer step that ends the window)")
        epoch, consumed = self._cursor()
        fields = settings(self.accumulation, self._seed, self._dataset, self._iterable)
        if self.sampler is not None:
            return {**self.sampler._state(epoch, consumed), **fields}
        dataset_state = self._iterable_source().state(epoch, consumed)
        return {"version": STATE_VERSION, "kind": "iterable", "epoch": epoch,
                "consumed": consumed, "batch_size": self._batch_size, "dataset": dataset_state,
                **fields}

    def validate_state_dict(self, state: Mapping[str, Any], where: str = "data") -> None:
        """Check a saved state against this loader without changing anything (the
        Checkpointer validates every part before it loads any)."""
        try:
            self._check(state)
        except StateMismatch as e:
            raise located(e, where) from None

    def _check(self, state: Mapping[str, Any]) -> tuple[int, int]:
        if self.sampler is not None and self._seed_given is False and isinstance(state, Mapping):
            # (the loader's seed is the sampler's: a changed sampler seed is named as that,
            # not as a loader seed= the script never passed)
            position = self.sampler.check_state(state)
            check_settings(state, self.accumulation, self._seed, self._dataset, self._iterable)
            return position
        check_settings(state, self.accumulation, self._seed, self._dataset, self._iterable)
        if self.sampler is not None:
            return self.sampler.check_state(state)
        return check_iterable(state, self._batch_size, self._dataset)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position (validated first; raises `StateMismatch` on a misfit). The
        next ``iter()`` continues at the first sample no completed update consumed."""
        position = self._check(state)
        if self.sampler is None:
            self._dataset.load_state_dict(dict(state["dataset"]))
        self._detach()
        self._set_cursor(*position)


# -- workers and the preemption signal ---------------------------------------------------------
# A launcher that stops a job (torchrun, SLURM, ``kill -TERM -PGID``) sends SIGTERM to every
# process of a rank's group, DataLoader workers included: a worker killed by it makes the loader
# raise before the training loop reaches the update boundary where the Checkpointer saves and
# stops. So workers ignore SIGTERM (they still end with their parent: PyTorch's worker loop
# watches it), and SIGTERM is held while they are started, so that none is born before it
# ignores the signal; a SIGTERM held meanwhile reaches the training process afterwards. At
# interpreter exit multiprocessing ends daemonic workers with SIGTERM and then joins them:
# before that (atexit runs handlers last-registered first), every loader's workers are told
# to stop and joined. A process forked from the one that made them (``os.fork()``, then
# ``sys.exit``) has them in its copy of this set, and stopping them there stopped the parent's
# workers (they share the event that tells them to stop), and so did torch's own iterators,
# collected at the fork's exit: in a fork they are marked shut down and the set is emptied.

_LIVE: weakref.WeakSet[ResumableLoader] = weakref.WeakSet()


def unsaved_loaders() -> int:
    """How many ResumableLoaders this process holds whose state nothing has asked for (a
    Checkpointer given one as ``data=`` reads its state when it is built)."""
    return sum(not loader._asked for loader in list(_LIVE))


def _forget_in_fork() -> None:
    for loader in list(_LIVE):
        for it in loader._iterators():
            if hasattr(it, "_shutdown"):
                it._shutdown = True  # (torch's _shutdown_workers then does nothing here)
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_in_fork)


@atexit.register
def _stop_all_workers() -> None:
    for loader in list(_LIVE):
        loader.stop_workers()
