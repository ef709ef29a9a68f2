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
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils.data
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from accelerate.scheduler import AcceleratedScheduler  # type: ignore[import-untyped]
from accelerate.utils import DistributedType  # type: ignore[import-untyped]

from ..checkpointer import Checkpointer
from ..data.loader import ResumableLoader
from ..data.sampler import ResumableSampler
from ..errors import UnsupportedSetup
from ..state.parts import PerRank
from ._accelerate_loader import PreparedLoader, _check_loader, prepare_loader

__all__ = ["PreparedLoader", "UnsupportedSetup", "checkpointer", "prepare", "prepare_loader"]


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
                 evaluation: Iterable[Any] = (), **options: Any) -> Checkpointer:
    """An `unbroken.Checkpointer` for an Accelerate loop, from what ``accelerator.prepare``
    returned: ``model``, ``optimizer`` and ``scheduler`` are unwrapped, the accelerator's
    GradScaler (fp16) is captured as ``scaler``, and ``data`` (a `PreparedLoader`; ``None``
    only for a loop without a data position: refused when the accelerator prepared a
    DataLoader, which such a loop would iterate from its start again) gives the data part.
    ``evaluation``: DataLoaders ``accelerator.prepare`` returned before this call that only
    evaluate (any other one prepared by then is refused: its position would not be saved).
    ``extras`` and ``options`` (``identity``, ``every``, ``keep``, ``signals``, ``trace``,
    ...) are the Checkpointer's.

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
    held = _check_captured(accelerator, parts, dict(extras or {}))
    _check_no_prepared_loader(accelerator, data is None, evaluation)
    return Checkpointer(
        root, model=module, optimizer=inner_optimizer, scheduler=inner_scheduler,
        scaler=accelerator.scaler, data=loader, extras=held, **options)


# -- checks ------------------------------------------------------------------------------------

def _check_no_prepared_loader(accelerator: Accelerator, without_data: bool,
                              evaluation: Iterable[Any]) -> None:
    """A DataLoader that ``accelerator.prepare`` returned before the checkpointer is built is
    one the loop trains on (``without_data``: the loop declared no data position, and this is
    what it iterates; else a second stream of batches beside ``data``, an auxiliary loss's
    say): its position is not in the generation, so a resume would start its epoch over and
    train on other batches than the uninterrupted run. Evaluation-only loaders are declared
    (``evaluation``) or prepared after the checkpointer is built, which this never sees."""
    declared = {id(dl) for dl in evaluation}
    for i, dl in enumerate(getattr(accelerator, "_dataloaders", [])):
        if id(dl) in declared:
            continue
        said = ("data=None, but" if without_data else
                "data= is the loop's ResumableLoader, and besides it")
        raise UnsupportedSetup(
            f"checkpointer: {said} accelerator.prepare returned a DataLoader (#{i}, "
            f"{type(dl).__name__}): its position is not saved, so a resumed run would start "
            "its epoch over and train on other batches than the uninterrupted run; build "
            "an unbroken.ResumableLoader(dataset, sampler, accumulation=N), prepare it with "
            "ua.prepare(accelerator, ...) and pass it as data= (one stream of batches: "
            "combine the datasets in it; an evaluation-only loader: pass it in "
            "evaluation=[...], or prepare it after the checkpointer is built)")

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
    def unwrapped_model(obj: Any) -> Any:
        if isinstance(obj, PerRank):  # (held per rank: the object it wraps, unwrapped)
            return PerRank(unwrapped_model(obj.state))
        return _unwrap_model(accelerator, obj) if isinstance(obj, torch.nn.Module) else obj

    unwrapped = {name: unwrapped_model(obj) for name, obj in extras.items()}
    held = [p.state if isinstance(p, PerRank) else p
            for p in (*parts, *unwrapped.values()) if p is not None]
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
