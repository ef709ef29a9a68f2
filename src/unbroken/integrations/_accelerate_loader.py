"""The Accelerate adapter's data side (`unbroken.integrations.accelerate`): `PreparedLoader`,
the wrapper that lets a `ResumableLoader` stand in for an Accelerate-prepared DataLoader
without reading ahead, with `prepare_loader` and its checks. Kept apart from the unwrapping
of prepared objects into a `Checkpointer`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.utils import send_to_device  # type: ignore[import-untyped]

from ..data.loader import ResumableLoader
from ..errors import UnsupportedSetup


class PreparedLoader:
    """A `ResumableLoader` prepared for an ``Accelerator`` (made by `prepare_loader`).

    Iterate it as the prepared DataLoader: each batch comes from the wrapped loader (never
    read ahead, so its consumed-sample count stays exact), moved to the accelerator's device,
    and Accelerate's ``GradientState`` sees this loader as the active one, with
    ``end_of_dataloader`` raised on the epoch's last batch. The wrapped loader's cursor and
    window properties are passed through; ``loader`` is the `ResumableLoader` itself."""

    def __init__(self, accelerator: Accelerator, loader: ResumableLoader, *,
                 device_placement: bool | None = None) -> None:
        _check_loader(accelerator, loader)
        self.loader = loader
        self.accelerator = accelerator
        place = accelerator.device_placement if device_placement is None else device_placement
        self.device: torch.device | None = accelerator.device if place else None
        # The attributes Accelerate's GradientState reads from its active dataloader.
        self.end_of_dataloader = False
        self.remainder = -1  # the sampler pads nothing: gather_for_metrics keeps every sample

    def __iter__(self) -> Iterator[Any]:
        """The rest of the cursor's epoch, as `ResumableLoader.__iter__`."""
        state = self.accelerator.gradient_state
        # A pass left unfinished (a loop that broke out) is still registered: drop it first.
        state._remove_dataloader(self)
        epoch = self.loader.epoch
        batches = iter(self.loader)
        self.end_of_dataloader = False
        state._add_dataloader(self)
        return _PreparedPass(self, batches, epoch)

    def __len__(self) -> int:
        """Batches per epoch (a whole epoch, wherever the cursor is)."""
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        """The wrapped loader's dataset (`ResumableLoader.dataset`)."""
        return self.loader.dataset

    def set_epoch(self, epoch: int) -> None:
        """Accepted for a loop written for Accelerate's prepared DataLoader, but the loader
        owns the epoch counter (restored on resume): ``epoch`` must be `epoch`, the epoch
        the next pass continues. Raises `UnsupportedSetup` otherwise (a loop counting
        epochs from 0 after a resume would train the epochs it already trained again)."""
        if epoch != self.loader.epoch:
            raise UnsupportedSetup(
                f"set_epoch({epoch!r}): the unbroken loader's cursor is at epoch "
                f"{self.loader.epoch} (restored on resume, it owns the epoch counter); "
                "drive the loop with `while loader.epoch < epochs:` or start your epoch "
                "counter at loader.epoch")

    @property
    def epoch(self) -> int:
        """The epoch the next update's data comes from (`ResumableLoader.epoch`)."""
        return self.loader.epoch

    @property
    def consumed(self) -> int:
        """Samples of `epoch` consumed by completed updates (`ResumableLoader.consumed`)."""
        return self.loader.consumed

    @property
    def at_boundary(self) -> bool:
        """Every batch handed out belongs to a completed update window; equals
        ``accelerator.sync_gradients`` after ``accumulate`` ran for the last batch."""
        return self.loader.at_boundary

    @property
    def handed_out(self) -> int:
        """Batches handed to the training loop (`ResumableLoader.handed_out`): an empty
        epoch's rollover is then told apart from batches handed out since a boundary."""
        return self.loader.handed_out

    @property
    def window_size(self) -> int:
        """Micro-batches in the current update window (`ResumableLoader.window_size`)."""
        return self.loader.window_size

    @property
    def last_update_ids(self) -> list[int]:
        """Sample ids of the last completed update (`ResumableLoader.last_update_ids`)."""
        return self.loader.last_update_ids

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's position (`ResumableLoader.state_dict`)."""
        return self.loader.state_dict()

    def validate_state_dict(self, state: Mapping[str, Any], where: str = "data") -> None:
        """`ResumableLoader.validate_state_dict` of the wrapped loader."""
        self.loader.validate_state_dict(state, where)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """`ResumableLoader.load_state_dict` of the wrapped loader."""
        self.loader.load_state_dict(state)


class _PreparedPass:
    """One pass of a `PreparedLoader`."""

    def __init__(self, owner: PreparedLoader, batches: Iterator[Any], epoch: int) -> None:
        self._owner = owner
        self._batches = batches
        self._epoch = epoch

    def __iter__(self) -> _PreparedPass:
        return self

    def __next__(self) -> Any:
        owner = self._owner
        try:
            batch = next(self._batches)
        except StopIteration:
            owner.accelerator.gradient_state._remove_dataloader(owner)
            raise
        # The wrapped loader rolls its cursor over to the next epoch exactly when it hands
        # out the epoch's last batch (that batch closes the last window): that is Accelerate's
        # end of the dataloader, known without reading a batch ahead.
        owner.end_of_dataloader = owner.loader.epoch != self._epoch
        # The batch is this loader's, so Accelerate must read end_of_dataloader from it: a
        # pass of another prepared loader left unfinished (an evaluation loop that broke out
        # early never deregisters; one garbage-collected leaves a dead reference) would sit on
        # top of GradientState's stack, hide the epoch's end, and let Accelerate's window run
        # into the next epoch while unbroken's closes at the epoch's end.
        state = owner.accelerator.gradient_state
        if state.active_dataloader is not owner:
            state._remove_dataloader(owner)
            state._add_dataloader(owner)
        if owner.device is not None:
            batch = send_to_device(batch, owner.device)
        return batch


def prepare_loader(accelerator: Accelerator, loader: ResumableLoader, *,
                   device_placement: bool | None = None) -> PreparedLoader:
    """Prepare an `unbroken.ResumableLoader` for ``accelerator`` (what
    ``accelerator.prepare`` does to a DataLoader, keeping unbroken's exact data position).
    Its ``accumulation`` must equal ``Accelerator(gradient_accumulation_steps=...)``; in a job,
    its sampler's world size must be the accelerator's process count (each rank takes its
    share of the global batch, which is Accelerate's ``split_batches=True``: required then).
    Raises `UnsupportedSetup` otherwise.

    ``accelerator.skip_first_batches(prepared, n)`` (Accelerate's resume recipe) then raises
    `UnsupportedSetup` for ``n > 0`` and returns the loader itself for ``n == 0``: it already
    continues at the first sample no completed update consumed, and skipping would lose
    ``n`` batches."""
    prepared = PreparedLoader(accelerator, loader, device_placement=device_placement)
    _guard_skip_first_batches(accelerator)
    return prepared


def _guard_skip_first_batches(accelerator: Accelerator) -> None:
    original = accelerator.skip_first_batches
    if getattr(original, "_unbroken_guard", False):
        return

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, PreparedLoader):
            if num_batches == 0:
                return dataloader
            raise UnsupportedSetup(
                f"accelerator.skip_first_batches(loader, num_batches={num_batches!r}) on an "
                "unbroken PreparedLoader: ckpt.restore() already put it at the first sample no "
                "completed update consumed (epoch "
                f"{dataloader.epoch}, sample {dataloader.consumed}); skipping would lose "
                f"{num_batches} batches; iterate the loader itself")
        return original(dataloader, num_batches=num_batches)

    skip_first_batches._unbroken_guard = True  # type: ignore[attr-defined]
    skip_first_batches.__doc__ = original.__doc__
    accelerator.skip_first_batches = skip_first_batches



def _check_loader(accelerator: Accelerator, loader: Any) -> None:
    if not isinstance(loader, ResumableLoader):
        raise UnsupportedSetup(
            f"prepare_loader: expected an unbroken.ResumableLoader, found "
            f"{type(loader).__name__}; build ResumableLoader(unbroken.seeded(dataset), "
            "ResumableSampler(len(dataset), batch_size=..., seed=...), num_workers=..., "
            "accumulation=N)")
    steps = accelerator.gradient_accumulation_steps
    if loader.accumulation != steps:
        raise UnsupportedSetup(
            f"prepare_loader: Accelerator(gradient_accumulation_steps={steps}) but "
            f"ResumableLoader(accumulation={loader.accumulation}): the update windows (and "
            "where saves may land) would differ; build both with the same N")
    if steps > 1 and not accelerator.gradient_state.sync_with_dataloader:
        raise UnsupportedSetup(
            "prepare_loader: GradientAccumulationPlugin(sync_with_dataloader=False) lets an "
            "update window span two epochs, but unbroken's loader closes the last window at "
            "the epoch's end; keep sync_with_dataloader=True")
    if accelerator.num_processes > 1 and not accelerator.split_batches:
        raise UnsupportedSetup(
            f"prepare_loader: {accelerator.num_processes} processes without "
            "Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True)): "
            "unbroken's sampler splits one global batch among the ranks, and without "
            "split_batches AcceleratedScheduler steps the scheduler once per process at every "
            "update, so the schedule would depend on the process count; set split_batches=True")
    sampler = loader.sampler
    if sampler is not None and sampler.world_size != accelerator.num_processes:
        raise UnsupportedSetup(
            f"prepare_loader: the ResumableSampler was built for world size "
            f"{sampler.world_size}, the accelerator runs {accelerator.num_processes} "
            "processes; build the sampler after the Accelerator (it reads rank and world "
            "size from torch.distributed)")
