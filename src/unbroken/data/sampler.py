"""`ResumableSampler`: the sample order as a pure function of (seed, epoch, position).

Layout of an epoch (the rules other parts rely on):

* ``num_samples`` positions ``0 .. N-1`` are mapped to dataset indices by a keyed bijection
  of ``[0, N)`` whose key is ``(seed, epoch)`` (identity when ``shuffle=False``). Nothing of
  size N is ever built: computing any position costs O(1) time and memory, so resuming at
  sample 10**9 of 3*10**9 costs the same as resuming at sample 0.
* Consecutive positions form **global batches** of ``batch_size`` samples. The last one is
  shorter (``N % batch_size``) unless ``drop_last=True``, which drops it; an epoch therefore
  covers ``samples_per_epoch`` positions in ``batches_per_epoch`` global batches.
* **Rank split (contiguous):** rank ``r`` of ``W`` takes the contiguous slice
  ``[r*b//W, (r+1)*b//W)`` of each global batch of ``b`` samples; for full batches that is
  ``[r*B/W, (r+1)*B/W)``, so concatenating the ranks' batches in rank order (what
  ``all_gather`` does) gives the global batch. ``batch_size`` must divide by ``world_size``.
  A final partial batch is split the same way (shares differ by at most one sample); a final
  partial batch smaller than ``world_size`` would leave a rank empty and is refused.
* The **cursor** ``(epoch, consumed)`` counts global samples of the epoch consumed by
  completed updates. It is global, so a run saved with W ranks resumes with any other W of the
  same global batch size. ``consumed`` reaching ``samples_per_epoch`` rolls over to
  ``(epoch + 1, 0)``: a save after the last batch of an epoch resumes at the next epoch's
  first sample, never with an empty epoch.

The sampler does not see what the training loop consumed; `ResumableLoader` tells it (or the
user does, through `advance` / `set_position`, when using the sampler with a plain DataLoader).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch.utils.data

from ..errors import StateMismatch, UnsupportedSetup, shown
from ._checks import INT64_MAX, any_int, damaged, flag, integer, located
from ._keyed import MAX_SAMPLES, TAG_ORDER, KeyedPermutation, mix
from ._signals import quiet_dataloader_workers

STATE_VERSION = 1

# Keys of the saved state that must equal the live sampler's for the cursor to mean the same
# samples; world_size is saved for diagnostics only (the cursor is global).
_CONSTANTS = ("num_samples", "batch_size", "seed", "shuffle", "drop_last")

# What a run can write for the sizes (a value outside is damage, not another setting).
_RANGES = {"num_samples": (1, MAX_SAMPLES), "batch_size": (1, INT64_MAX)}

_WHY = {
    "num_samples": "the dataset changed size since the checkpoint; resume with the same "
    "dataset, or start a new run (warm_start) to train on a different one",
    "batch_size": "the global batch size (per-rank batch x world size) changed; the cursor "
    "counts global batches of the saved size, so keep it (changing the world size is fine)",
    "seed": "a different seed gives a different sample order than the interrupted run",
    "shuffle": "shuffling on/off changes the sample order of the interrupted run",
    "drop_last": "drop_last changes which samples an epoch holds",
}


class SampleKey(int):
    """A dataset index that also carries where it sits in the run: ``epoch`` and global
    ``position`` in that epoch.

    It *is* an ``int`` (indexing lists, arrays, tensors and any map-style dataset works
    unchanged); `seeded` datasets read ``epoch`` and ``position`` from it to seed per-sample
    randomness independently of the worker that fetches the sample.
    """

    epoch: int
    position: int

    def __new__(cls, index: int, epoch: int, position: int) -> SampleKey:
        self = super().__new__(cls, index)
        self.epoch = epoch
        self.position = position
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Compact and explicit pickling: keys travel to DataLoader workers in every batch.
        return (SampleKey, (int(self), self.epoch, self.position))

    def __repr__(self) -> str:
        return f"SampleKey({int(self)}, epoch={self.epoch}, position={self.position})"


class ResumableSampler(torch.utils.data.Sampler[list[SampleKey]]):
    """Batch sampler whose order is a pure function of (seed, epoch, position).

    Use as ``batch_sampler=`` of a DataLoader (or, better, through `ResumableLoader`, which
    keeps the cursor for you). Iterating yields this rank's batches (lists of `SampleKey`,
    i.e. dataset indices) from the cursor to the end of the cursor's epoch. A plain
    DataLoader needs ``generator=torch.Generator()`` then: without one, every ``iter()`` of
    it draws its workers' base seed from the global torch stream, and the resumed process's
    one extra ``iter()`` (mid-epoch) shifts every later draw of that stream (dropout).

    Args:
        num_samples: dataset size N (up to 2**62).
        batch_size: **global** batch size B (all ranks together, one micro-batch).
        seed: order seed; the order of epoch e is a keyed bijection with key (seed, e).
        shuffle: False keeps positions in dataset order.
        drop_last: drop each epoch's final partial global batch.
        rank, world_size: this rank's share of each global batch (contiguous slice,
            see the module doc); B must divide by world_size. Default: the rank and world
            size of the initialized ``torch.distributed`` job, else 0 and 1.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if rank is None or world_size is None:  # this rank's share of a torch.distributed job
            import torch.distributed as dist

            joined = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if joined else 0) if rank is None else rank
            world_size = (dist.get_world_size() if joined else 1) if world_size is None \
                else world_size
        for name, value in (("num_samples", num_samples), ("batch_size", batch_size),
                            ("seed", seed), ("rank", rank), ("world_size", world_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"ResumableSampler: {name} must be an int, got {value!r}")
        num_samples, batch_size, seed = int(num_samples), int(batch_size), int(seed)
        rank, world_size = int(rank), int(world_size)
        if not 0 < num_samples <= MAX_SAMPLES:
            raise ValueError("ResumableSampler: num_samples must be in [1, 2**62], got "
                             f"{num_samples}")
        if batch_size < 1:
            raise ValueError(f"ResumableSampler: batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ResumableSampler: need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        if batch_size % world_size:
            raise ValueError(
                f"ResumableSampler: batch_size={batch_size} is the global batch size and must "
                f"divide by world_size={world_size} (each rank takes batch_size/world_size "
                f"samples of every global batch)")
        tail = num_samples % batch_size
        if drop_last and num_samples < batch_size:
            raise ValueError(f"ResumableSampler: num_samples={num_samples} < batch_size="
                             f"{batch_size} with drop_last=True leaves no batch in an epoch")
        if not drop_last and 0 < tail < world_size:
            raise ValueError(
                f"ResumableSampler: the final partial batch of each epoch holds {tail} samples "
                f"(num_samples % batch_size), fewer than world_size={world_size}, so some "
                f"ranks would get no sample for the last update; use drop_last=True")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.rank = rank
        self.world_size = world_size
        self.batches_per_epoch = (num_samples // batch_size if drop_last
                                  else -(-num_samples // batch_size))
        self.samples_per_epoch = self.batches_per_epoch * batch_size if drop_last else num_samples
        self._epoch = 0
        self._consumed = 0
        self._perms: dict[int, KeyedPermutation] = {}
        self._recent: dict[tuple[int, int, int | None], list[SampleKey]] = {}

    # -- the order -------------------------------------------------------------------------

    def _perm(self, epoch: int) -> KeyedPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 4:  # a few epochs are alive at once at most (prefetch)
                self._perms.clear()
            perm = self._perms[epoch] = KeyedPermutation(
                self.num_samples, mix(TAG_ORDER, self.seed, epoch))
        return perm

    def indices(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Dataset indices (int64 array) at global positions ``[start, stop)`` of ``epoch``."""
        if not 0 <= start <= stop <= self.samples_per_epoch:
            raise IndexError(f"positions [{start}, {stop}) outside the epoch's "
                             f"[0, {self.samples_per_epoch})")
        positions = np.arange(start, stop, dtype=np.int64)
        return self._perm(epoch)(positions) if self.shuffle else positions

    def index(self, epoch: int, position: int) -> int:
        """Dataset index at global ``position`` of ``epoch`` (O(1))."""
        return int(self.indices(epoch, position, position + 1)[0])

    def _share(self, size: int, rank: int) -> tuple[int, int]:
        return rank * size // self.world_size, (rank + 1) * size // self.world_size

    def batch(self, epoch: int, number: int, *, rank: int | None = None) -> list[SampleKey]:
        """Batch ``number`` of ``epoch`` for ``rank`` (default: this sampler's rank), as keys.

        ``rank=-1`` returns the whole global batch.
        """
        key = (epoch, number, rank)
        cached = self._recent.get(key)
        if cached is not None:  # the trace asks again for batches the DataLoader just took
            return cached
        if not 0 <= number < self.batches_per_epoch:
            raise IndexError(f"batch {number} outside the epoch's [0, {self.batches_per_epoch})")
        start = number * self.batch_size
        stop = min(start + self.batch_size, self.samples_per_epoch)
        if rank != -1:
            lo, hi = self._share(stop - start, self.rank if rank is None else rank)
            start, stop = start + lo, start + hi
        idx = self.indices(epoch, start, stop).tolist()
        keys = [SampleKey(i, epoch, start + k) for k, i in enumerate(idx)]
        if len(self._recent) >= 256:  # more than any prefetch depth
            self._recent.clear()
        self._recent[key] = keys
        return keys

    def __len__(self) -> int:
        """Batches per epoch (the whole epoch, wherever the cursor is)."""
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[list[SampleKey]]:
        """This rank's batches from the cursor to the end of the cursor's epoch."""
        # Read the cursor now, not lazily at the first next(): the loader moves the cursor
        # while a DataLoader still iterates an earlier pass.
        epoch, first = self._epoch, self._consumed // self.batch_size
        quiet_dataloader_workers()  # (a plain DataLoader's workers: a SIGTERM to the group)
        return (self.batch(epoch, b) for b in range(first, self.batches_per_epoch))

    # -- the cursor ------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epoch of the cursor: the epoch the next update's samples come from."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Global samples of the cursor's epoch consumed by completed updates."""
        return self._consumed

    def set_position(self, epoch: int, consumed: int) -> None:
        """Move the cursor. ``consumed`` must end a global batch (a multiple of batch_size, or
        the epoch's size, which rolls over to ``(epoch + 1, 0)``)."""
        if epoch < 0 or not 0 <= consumed <= self.samples_per_epoch:
            raise ValueError(f"position (epoch={epoch}, consumed={consumed}) outside "
                             f"epoch >= 0, consumed in [0, {self.samples_per_epoch}]")
        if consumed % self.batch_size and consumed != self.samples_per_epoch:
            raise ValueError(f"consumed={consumed} is not at a global batch boundary "
                             f"(batch_size={self.batch_size})")
        if consumed == self.samples_per_epoch:
            epoch, consumed = epoch + 1, 0
        self._epoch, self._consumed = int(epoch), int(consumed)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample (DistributedSampler-compatible), except that
        the epoch the cursor is in keeps its position: a run resumed mid-epoch calls
        ``set_epoch`` for the epoch it resumes (``for epoch in range(start, epochs):
        sampler.set_epoch(epoch)``), and starting it over would train its first samples
        twice. An epoch before the cursor's raises `UnsupportedSetup` (a loop counting
        epochs from 0 after a resume would train them all again); `set_position` moves the
        cursor anywhere on purpose."""
        if epoch == self._epoch:
            return
        if epoch < self._epoch:
            raise UnsupportedSetup(
                f"set_epoch({epoch}): the sampler's cursor is at epoch {self._epoch} "
                f"({self._consumed} samples consumed; restored on resume, it owns the epoch "
                "counter); start your epoch counter at sampler.epoch, or call "
                "set_position() to go back on purpose")
        self.set_position(epoch, 0)

    def advance(self, batches: int = 1) -> None:
        """Record that ``batches`` more global batches were consumed by completed updates
        (for use without `ResumableLoader`). Stops at the end of the epoch, then rolls over."""
        consumed = min(self._consumed + batches * self.batch_size, self.samples_per_epoch)
        self.set_position(self._epoch, consumed)

    def position_after(self, epoch: int, consumed: int, batches: int) -> tuple[int, int]:
        """The (rolled-over) cursor after ``batches`` more global batches from a position."""
        consumed = min(consumed + batches * self.batch_size, self.samples_per_epoch)
        if consumed == self.samples_per_epoch:
            return epoch + 1, 0
        return epoch, consumed

    # -- state -----------------------------------------------------------------------------

    def _state(self, epoch: int, consumed: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "kind": "sampler",
            "epoch": epoch,
            "consumed": consumed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict[str, Any]:
        """The cursor plus the constants it is only valid with (plain ints/bools)."""
        return self._state(self._epoch, self._consumed)

    def check_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """Validate a saved state against this sampler; return its ``(epoch, consumed)``.

        Raises `StateMismatch` naming the key, the saved and live values and what to do;
        `DamagedDataState` (also a `CorruptCheckpoint`) for a value no run writes.
        """
        if not isinstance(state, Mapping):
            raise StateMismatch(f"data state: expected a dict, found {type(state).__name__}")
        missing = [k for k in ("epoch", "consumed", *_CONSTANTS) if k not in state]
        if missing:
            raise StateMismatch(f"data state lacks {missing}; it was not written by "
                                f"ResumableSampler/ResumableLoader (found keys {sorted(state)})")
        if state.get("kind", "sampler") != "sampler":
            raise StateMismatch(f"data state is of kind {shown(state['kind'])}, but the live "
                                f"data part is a map-style ResumableSampler")
        where = "data state"
        version = state.get("version", STATE_VERSION)
        if type(version) is not int:
            damaged(where, "version", f"the int {STATE_VERSION}", version)
        if version != STATE_VERSION:
            raise StateMismatch(f"data state version {shown(version)} is not supported "
                                f"(this unbroken reads version {STATE_VERSION})")
        for key in _CONSTANTS:
            live = getattr(self, key)
            # exact types first: 50.0 == 50 and True == 1 would pass the comparison below
            if type(live) is bool:
                saved: Any = flag(state, key, where)
            elif key in _RANGES:
                saved = integer(state, key, where, *_RANGES[key])
            else:  # the seed: any int
                saved = any_int(state, key, where)
            if saved != live:
                raise StateMismatch(f"data state: saved {key}={shown(saved)}, live {key}="
                                    f"{live!r}: {_WHY[key]}")
        if "world_size" in state:  # for diagnostics only, but still a value a run wrote
            integer(state, "world_size", where, 1)
        # The epoch is bounded so that the epoch after a rollover still fits the counters.
        epoch = integer(state, "epoch", where, 0, INT64_MAX - 1)
        consumed = state["consumed"]
        if not (type(consumed) is int and 0 <= consumed <= self.samples_per_epoch
                and (consumed % self.batch_size == 0 or consumed == self.samples_per_epoch)):
            damaged(where, "consumed", f"a global batch boundary (a multiple of batch_size="
                    f"{self.batch_size}, or the epoch's size) in [0, {self.samples_per_epoch}]",
                    consumed)
        return self.position_after(epoch, consumed, 0)

    def validate_state_dict(self, state: Mapping[str, Any], where: str = "data") -> None:
        """`check_state` without a result, for the Checkpointer's validate-before-load pass."""
        try:
            self.check_state(state)
        except StateMismatch as e:
            raise located(e, where) from None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor (validated with `check_state`). A different world_size is fine."""
        self.set_position(*self.check_state(state))
