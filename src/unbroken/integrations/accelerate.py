"""Accelerate adapter: an ``Accelerator`` loop saved as unbroken generations and resumed at
the exact next sample, gradient accumulation included.

Two things stand between an Accelerate loop and an exact resume, and this module handles both:

* **The data position.** ``accelerator.prepare(DataLoader)`` rebuilds the loader as a
  ``DataLoaderShard`` that iterates one batch ahead, so nothing outside it knows which batches
  completed updates consumed (``accelerator.save_state`` records a batch count and replays the
  loader to skip). Here the data comes from an `unbroken.ResumableLoader` (its order is a
  function of seed, epoch and position; it counts what completed update windows consumed)
  wrapped by `prepare_loader` in a `PreparedLoader`. That wrapper never reads ahead; it moves
  batches to the accelerator's device and registers itself with Accelerate's
  ``GradientState`` as the active dataloader, raising ``end_of_dataloader`` on the epoch's
  last batch, exactly as ``DataLoaderShard`` would: Accelerate closes the epoch's last
  (shorter) accumulation window where unbroken's loader closes it, so
  ``accelerator.sync_gradients`` and ``loader.at_boundary`` agree at every batch, the
  scheduler steps the same number of times, and a save lands on a real update boundary.
  Each batch makes it the active dataloader again, so an evaluation loader's pass left
  unfinished (a loop that broke out after a few batches) cannot hide the epoch's end.
  ``accelerator.skip_first_batches`` on it is refused (the resume is exact already), and
  ``set_epoch`` accepts only the cursor's epoch.
* **Unwrapping.** `checkpointer` builds an `unbroken.Checkpointer` from the objects
  ``accelerator.prepare`` returned: the model unwrapped (DDP, ``torch.compile``; the
  mixed-precision forward wrapper is left in place), the optimizer and scheduler taken out of
  ``AcceleratedOptimizer`` / ``AcceleratedScheduler``, the accelerator's ``GradScaler`` (fp16
  mixed precision) added, and the data part being the `ResumableLoader` itself. A further
  prepared model, or an object given to ``register_for_checkpointing``, must be passed in
  ``extras``; a second prepared optimizer or scheduler (a generation holds one of each) is
  refused with `UnsupportedSetup`, as is anything else the generation would not hold.

``AcceleratedScheduler`` steps the wrapped scheduler only when gradients are synced and
advances its ``_step_count`` otherwise; both are in the scheduler's ``state_dict``, saved at
update boundaries. It would step ``num_processes`` times per update in a job without
``split_batches``; unbroken's sampler splits one global batch among the ranks, which is
``split_batches=True``, so `prepare_loader` requires it in a job (the schedule then does not
depend on the process count, and a run may resume on another one). ``accelerator.step``
(the micro-batch counter of ``accumulate``) is a multiple of the accumulation at every update
boundary, and a fresh Accelerator starts it at 0, so nothing of Accelerate's own needs saving.
Generations never pickle: ``accelerator.save_state`` is not used.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils.data
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from accelerate.scheduler import AcceleratedScheduler  # type: ignore[import-untyped]
from accelerate.utils import DistributedType, send_to_device  # type: ignore[import-untyped]

from ..checkpointer import Checkpointer
from ..data.loader import ResumableLoader
from ..data.sampler import ResumableSampler
from ..errors import UnsupportedSetup

__all__ = ["PreparedLoader", "UnsupportedSetup", "checkpointer", "prepare", "prepare_loader"]


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


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)``, except that each `ResumableLoader` goes through
    `prepare_loader`; returns the prepared objects in the same order (one object alone, as
    Accelerate does). A DataLoader built around a `ResumableSampler` is refused: Accelerate
    would rebuild it and read ahead, and the sampler could not tell what updates consumed."""
    others = []
    for obj in objects:
        if isinstance(obj, torch.utils.data.DataLoader) and isinstance(
                getattr(obj, "batch_sampler", None), ResumableSampler):
            raise UnsupportedSetup(
                "prepare: a torch DataLoader around a ResumableSampler cannot resume exactly "
                "(Accelerate rebuilds it and reads batches ahead, so no one knows what "
                "completed updates consumed); build unbroken.ResumableLoader(dataset, sampler, "
                "num_workers=..., accumulation=N) and pass that instead")
        if isinstance(obj, ResumableLoader):
            _check_loader(accelerator, obj)  # before Accelerate changes anything
        else:
            others.append(obj)
    prepared = accelerator.prepare(*others) if others else ()
    if len(others) == 1:
        prepared = (prepared,)
    rest = iter(prepared)
    result = tuple(prepare_loader(accelerator, obj) if isinstance(obj, ResumableLoader)
                   else next(rest) for obj in objects)
    return result[0] if len(result) == 1 else result


def checkpointer(accelerator: Accelerator, root: str | os.PathLike[str], *,
                 model: torch.nn.Module, optimizer: Any, data: PreparedLoader | None,
                 scheduler: Any = None, extras: Mapping[str, Any] | None = None,
                 **options: Any) -> Checkpointer:
    """An `unbroken.Checkpointer` for an Accelerate loop, from what ``accelerator.prepare``
    returned: ``model``, ``optimizer`` and ``scheduler`` are unwrapped, the accelerator's
    GradScaler (fp16) is captured as ``scaler``, and ``data`` (a `PreparedLoader`; ``None``
    only for a loop without a data position) gives the data part. ``extras`` and ``options``
    (``identity``, ``every``, ``keep``, ``signals``, ``trace``, ...) are the Checkpointer's.

    Call ``step_done`` when ``accelerator.sync_gradients`` is True after the optimizer and
    scheduler steps. Raises `UnsupportedSetup` for a setup it cannot resume exactly: data that
    is not a `PreparedLoader` of this accelerator, a prepared optimizer, scheduler or model,
    or an object registered for checkpointing, that the generation would not hold (pass
    further models and registered objects in ``extras``), or DeepSpeed, Megatron-LM, XLA or
    FSDP1, which keep state their own way."""
    if "scaler" in options:
        raise UnsupportedSetup("checkpointer: scaler= is taken from accelerator.scaler (the "
                               "GradScaler Accelerate steps); do not pass one")
    _check_engine(accelerator)
    module = _unwrap_model(accelerator, model)
    inner_optimizer = _unwrap_optimizer(accelerator, optimizer)
    inner_scheduler = _unwrap_scheduler(accelerator, scheduler)
    loader = _unwrap_data(accelerator, data)
    # What the generation holds as a part of its own: an object also registered with
    # register_for_checkpointing (a scheduler kept out of prepare, say) is held already.
    parts = [module, optimizer, inner_optimizer, scheduler, inner_scheduler, data, loader,
             accelerator.scaler]
    return Checkpointer(
        root, model=module, optimizer=inner_optimizer, scheduler=inner_scheduler,
        scaler=accelerator.scaler, data=loader,
        extras=_check_captured(accelerator, parts, dict(extras or {})), **options)


# -- checks ------------------------------------------------------------------------------------

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


def _check_engine(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA) \
            or (kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False)):
        raise UnsupportedSetup(
            f"checkpointer: {kind} keeps model and optimizer state in its own engine, which "
            "unbroken's generations do not capture; use DDP (MULTI_CPU/MULTI_GPU), FSDP2 "
            "(fsdp_version=2) or one process")


def _unwrap_model(accelerator: Accelerator, model: Any) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedSetup(f"checkpointer: model must be the torch.nn.Module "
                               f"accelerator.prepare returned, found {type(model).__name__}")
    # keep_fp32_wrapper=True: unwrapping must not change the live model's forward.
    module: torch.nn.Module = accelerator.unwrap_model(model, keep_fp32_wrapper=True,
                                                       keep_torch_compile=False)
    return module


def _unwrap_optimizer(accelerator: Accelerator, optimizer: Any) -> torch.optim.Optimizer | None:
    prepared = [o.optimizer for o in accelerator._optimizers]
    if len(prepared) > 1:
        raise UnsupportedSetup(
            f"checkpointer: {len(prepared)} optimizers were prepared; an unbroken generation "
            "holds one optimizer, so the others would restart from scratch on resume; use one "
            "optimizer with several parameter groups")
    inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    if prepared and inner is not prepared[0]:
        raise UnsupportedSetup(
            "checkpointer: optimizer is not the one accelerator.prepare returned; pass that "
            "one (its state is what the updates change)")
    if inner is not None and not isinstance(inner, torch.optim.Optimizer):
        raise UnsupportedSetup(f"checkpointer: optimizer must be a torch optimizer, found "
                               f"{type(inner).__name__}")
    return inner


def _unwrap_scheduler(accelerator: Accelerator, scheduler: Any) -> Any:
    prepared = [s.scheduler for s in accelerator._schedulers]
    if len(prepared) > 1:
        raise UnsupportedSetup(
            f"checkpointer: {len(prepared)} schedulers were prepared; an unbroken generation "
            "holds one; chain them (torch.optim.lr_scheduler.SequentialLR) into one")
    inner = scheduler.scheduler if isinstance(scheduler, AcceleratedScheduler) else scheduler
    if prepared and inner is not prepared[0]:
        raise UnsupportedSetup(
            "checkpointer: the scheduler accelerator.prepare returned is not the one passed "
            "as scheduler=; pass that one, or its learning rate would restart on resume")
    return inner


def _unwrap_data(accelerator: Accelerator, data: Any) -> ResumableLoader | None:
    if data is None:
        return None
    if isinstance(data, PreparedLoader):
        if data.accelerator is not accelerator:
            raise UnsupportedSetup("checkpointer: data was prepared for another Accelerator")
        return data.loader
    if isinstance(data, ResumableLoader):
        raise UnsupportedSetup(
            "checkpointer: data is a ResumableLoader that was not prepared; iterate "
            "prepare_loader(accelerator, loader) (or prepare(accelerator, ...)) instead, so "
            "that Accelerate's accumulation windows end with the epoch where unbroken's do")
    raise UnsupportedSetup(
        f"checkpointer: data must be a PreparedLoader (prepare_loader(accelerator, "
        f"unbroken.ResumableLoader(...))), found {type(data).__name__}: a DataLoader that "
        "Accelerate prepared reads ahead and replays batches to skip on resume, so its exact "
        "position cannot be saved")


def _check_captured(accelerator: Accelerator, parts: list[Any],
                    extras: dict[str, Any]) -> dict[str, Any]:
    """Refuse prepared models and registered objects the generation would not hold (neither
    one of its ``parts`` nor in ``extras``); returns ``extras`` with prepared models among
    them unwrapped (saved under their own names)."""
    unwrapped = {name: _unwrap_model(accelerator, obj) if isinstance(obj, torch.nn.Module)
                 else obj for name, obj in extras.items()}
    held = [p for p in (*parts, *unwrapped.values()) if p is not None]
    for i, prepared in enumerate(accelerator._models):
        inner = accelerator.unwrap_model(prepared, keep_fp32_wrapper=True,
                                         keep_torch_compile=False)
        if not any(inner is h for h in held):
            raise UnsupportedSetup(
                f"checkpointer: prepared model #{i} ({type(inner).__name__}) is neither model= "
                "nor in extras: its weights would not be saved; pass it as "
                "extras={'name': model}")
    for i, obj in enumerate(accelerator._custom_objects):
        inner = accelerator.unwrap_model(obj, keep_fp32_wrapper=True, keep_torch_compile=False) \
            if isinstance(obj, torch.nn.Module) else obj
        if not any(obj is h or inner is h for h in held):
            raise UnsupportedSetup(
                f"checkpointer: object #{i} ({type(obj).__name__}) was registered with "
                "accelerator.register_for_checkpointing but is not in extras: pass it as "
                "extras={'name': obj} so the generation holds it")
    return unwrapped
