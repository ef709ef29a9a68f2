"""Setups the Lightning adapter (`unbroken.integrations.lightning`) cannot resume exactly,
refused by name with `UnsupportedSetup` before anything is trained."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    Callback,
    GradientAccumulationScheduler,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.core.hooks import CheckpointHooks

from ..errors import UnbrokenWarning, UnsupportedSetup

# Lightning's callbacks that change the model or the optimizer during fit, at an epoch's start
# or end (new parameter groups, SWA's learning rates, pruning masks in place of weights): a
# generation saved after the change no longer fits the objects a resumed process builds, and
# the change is not made again by a run resumed past it.
_RESHAPING = (StochasticWeightAveraging, BaseFinetuning, ModelPruning)


def _check_trainer(trainer: pl.Trainer) -> None:
    """Trainer settings under which Lightning's epoch is not the loader's epoch, or its update
    windows not the loader's."""
    connected: Any = trainer  # (the connectors set these attributes: untyped, read by name)
    schedulers = [cb for cb in connected.callbacks
                  if isinstance(cb, GradientAccumulationScheduler)]
    if schedulers:
        raise UnsupportedSetup(
            f"GradientAccumulationScheduler(scheduling={schedulers[0].scheduling!r}) changes "
            "accumulate_grad_batches from epoch to epoch, but the ResumableLoader's update "
            "windows (accumulation=) are fixed for the run, so updates and saves would no "
            "longer fall on the loader's window boundaries; drop the scheduler and give "
            "Trainer(accumulate_grad_batches=N) and ResumableLoader(accumulation=N) one value")
    for cb in connected.callbacks:
        if isinstance(cb, _RESHAPING):
            raise UnsupportedSetup(
                f"{type(cb).__name__} changes the model or the optimizer during fit (parameter "
                "groups, learning rates, pruning masks), which a resumed run neither finds in "
                "the objects it builds nor makes again: a generation saved after the change "
                "could not be restored; drop the callback, or make the change in the model "
                "and optimizer you build (then it is saved and restored as usual)")
        hooks = [name for name in ("on_save_checkpoint", "on_load_checkpoint")
                 if getattr(type(cb), name) is not getattr(Callback, name)]
        if hooks:
            raise UnsupportedSetup(
                f"{type(cb).__name__} defines {' and '.join(hooks)}: what it adds to "
                "Lightning's checkpoint dict (an averaged model, say) is not in the "
                "UnbrokenCallback's generations, and a resumed run would continue without "
                "it; keep that state in the callback's state_dict()/load_state_dict() "
                "(saved with each generation), or drop the callback")
    module = trainer.lightning_module
    hooks = [name for name in ("on_save_checkpoint", "on_load_checkpoint")
             if getattr(type(module), name) is not getattr(CheckpointHooks, name)]
    if hooks:  # (often for exports and metadata: warned, not refused)
        warnings.warn(
            f"{type(module).__name__} defines {' and '.join(hooks)}: the UnbrokenCallback "
            "calls neither, and what it adds to Lightning's checkpoint dict is not in its "
            "generations; training state belongs in the module's parameters and buffers, or "
            "in extras=", UnbrokenWarning, stacklevel=3)
    # Each must keep its default.
    problems = [f"{name}={getattr(trainer, name)!r}" for name, default in (
        ("limit_train_batches", 1.0), ("overfit_batches", 0),
        ("reload_dataloaders_every_n_epochs", 0), ("fast_dev_run", False))
        if getattr(trainer, name) != default]
    if problems:
        raise UnsupportedSetup(
            f"Trainer({', '.join(problems)}): Lightning's epochs would then differ from the "
            "ResumableLoader's (a shorter epoch, a new loader), so the saved position would "
            "not be the next batch; drop these settings (shorten an epoch with a smaller "
            "dataset or ResumableSampler instead)")


def _not_resumable(dataloader: Any) -> str:
    kind = type(dataloader).__name__
    if isinstance(dataloader, (list, tuple, Mapping)) or kind == "CombinedLoader":
        return (f"fit's train dataloaders are a {kind}: the UnbrokenCallback resumes exactly "
                "one unbroken.ResumableLoader; combine the datasets in one")
    return (f"fit's train dataloader is a {kind}, whose position inside an epoch cannot be "
            "saved (Lightning restarts or replays its epoch, and may rebuild it with a sampler "
            "of its own); use unbroken.ResumableLoader(dataset, unbroken.ResumableSampler("
            "len(dataset), batch_size, seed=...), num_workers=...)")
