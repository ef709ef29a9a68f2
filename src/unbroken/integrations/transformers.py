"""Resumable training with the Hugging Face Transformers `Trainer` (``unbroken[transformers]``).

``attach(trainer, "runs/exp1", every=100)`` makes ``trainer.train()`` continue a killed run
at the first sample no completed update consumed, bit for bit: no batch is replayed through
the loader, and the model, optimizer, LR scheduler, GradScaler, every RNG stream, the data
cursor and the Trainer's own state (global step, epoch, logging accumulators, log history,
stateful callbacks) come back from the newest verified unbroken generation.

How it plugs into the Trainer's loop (transformers 5.x; each hook is checked at attach time,
and a configuration that cannot be resumed exactly is refused with `UnsupportedSetup`):

* ``get_train_dataloader``: a `ResumableLoader` over ``seeded(train_dataset)`` ordered by a
  `ResumableSampler` (seed ``data_seed`` or ``seed``), with ``gradient_accumulation_steps``
  as its update windows and the Trainer's collator (its randomness seeded per batch).
* ``_init_training_state``: after the Trainer built its fresh state, the optimizer and
  scheduler are created (what ``_prepare_for_training`` would do next, and keeps), the
  Checkpointer restores everything, and the epoch loop starts at the cursor's epoch.
* ``_run_epoch``: told the batches and updates left in the cursor's epoch, so its counters
  line up with the loader; the callback puts back the epoch fraction the Trainer reports.
* ``training_step``: counts micro-batches and sums the update's loss for the trace.
* ``_maybe_log_save_evaluate``: the update boundary, after the update's logging and
  evaluation: ``step_done`` traces it and saves when due (``every``, ``$UNBROKEN_SAVE_AT``, a
  signal). An update that ends its epoch (or the run) is marked after the epoch-end logging
  and evaluation instead, so its generation holds what the next epoch starts from.
* ``evaluate``: runs with the training RNG streams put back afterwards, so evaluation (a
  persistent eval loader's first pass, which a resumed process makes at another update,
  draws its workers' seed from the torch RNG) never shifts training's random draws; eval
  workers are not kept from one evaluation to the next (``dataloader_persistent_workers``
  applies to training), so a random eval collator or transform draws the same after a
  resume.
* ``train``: ``resume_from_checkpoint`` None, True or False (the Trainer's None) continues
  from the run folder's newest generation (a fresh folder starts at 0); a Trainer
  ``checkpoint-N`` path is refused. A generation saved where the run stopped
  (``max_steps``, or a callback's ``should_training_stop``, e.g. early stopping) is the
  run's end: running it again trains nothing more; so is the last update of a run whose
  ``num_train_epochs`` ran out first (a callback's ``should_epoch_stop`` ended its epochs
  early), saved when the loop ends. A continuation skips ``eval_on_start``
  (the run evaluated before update 1).

Under ``torchrun`` (DDP, one process per device) every rank attaches alike: the sampler's batch
is the global one (per-device batch x processes; with Accelerate's ``split_batches``, the
per-device batch), each rank taking its contiguous share, and the Trainer's state is held per
rank (`unbroken.PerRank`: each rank's running loss is its own); a job continues on the same
number of processes (another changes the global batch, which the data cursor refuses, or the
per-device batch, which the run's identity holds).

``train_sampling_strategy`` "random" (a seeded shuffle) or "sequential" (dataset order); a
collator with a random generator of its own (``DataCollatorForLanguageModeling(seed=...)``)
is refused: its stream is neither saved nor positioned by the data cursor. So is one that
reaches such a generator through what it holds (a wrapped collator, a closure, a global its
code names, a ``functools.partial`` argument). ``enable_jit_checkpoint=True`` is refused:
the Trainer's SIGTERM handling stops the loop as if the run had ended (pass
``signals=[signal.SIGTERM]`` to `attach` instead).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import transformers
from transformers import Trainer

from ..data import ResumableSampler
from ..errors import UnsupportedSetup
from ..state.identity import Identity
from ._transformers_callback import _HOOKS, TESTED, UnbrokenCallback
from ._transformers_callback import PART as PART
from ._transformers_checks import _refuse_jit_checkpoint, _refuse_private_rng, _sampling
from ._transformers_state import TrainerProgress, trainer_config

__all__ = ["TrainerProgress", "UnbrokenCallback", "UnsupportedSetup", "attach",
           "trainer_config"]


def _refuse_unsupported(trainer: Trainer) -> None:
    args = trainer.args
    if any(isinstance(cb, UnbrokenCallback) for cb in trainer.callback_handler.callbacks):
        raise UnsupportedSetup("this Trainer is attached already")
    version = f"(tested with transformers {TESTED}, found {transformers.__version__})"
    for name, params in _HOOKS.items():
        method = getattr(trainer, name, None)
        if method is None or not set(params) <= set(inspect.signature(method).parameters):
            raise UnsupportedSetup(f"Trainer.{name} with parameters {list(params)} is "
                                          f"what this adapter hooks into {version}")
    for name in ("get_train_dataloader", "_get_train_sampler"):
        if getattr(type(trainer), name) is not getattr(Trainer, name):
            raise UnsupportedSetup(
                f"{type(trainer).__name__} overrides {name}: its own loader or sampler "
                "cannot resume at the exact next sample, and this adapter would replace it; "
                "drop the override (pass sampler=ResumableSampler(...) to attach to choose "
                "the order)")
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    refusals = [
        (args.n_gpu > 1,
         f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): run one process per "
         "device (torchrun)"),
        (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled,
         "DeepSpeed or FSDP: their sharded state is not captured here; train without them"),
        (getattr(args, "parallelism_config", None) is not None,
         "parallelism_config (tensor, context or sequence parallelism): processes that share "
         "a batch are not data-parallel ranks, which this adapter's sampler takes them for; "
         "train without it"),
        (args.auto_find_batch_size,
         "auto_find_batch_size=True changes the batch (and the sample order) on a retry; "
         "set per_device_train_batch_size"),
        (strategy != "no",
         f"save_strategy={strategy!r} also writes the Trainer's own pickled checkpoint-N "
         "folders, which this run never resumes from; set save_strategy='no' (attach's "
         "every=N saves)"),
        (_sampling(args) not in ("random", "sequential"),
         f"train_sampling_strategy={_sampling(args)!r}: the order comes from "
         "ResumableSampler (a seeded shuffle, or dataset order); use 'random' or "
         "'sequential'"),
    ]
    for refused, why in refusals:
        if refused:
            raise UnsupportedSetup(why)
    _refuse_jit_checkpoint(trainer)
    _refuse_private_rng(trainer.data_collator)


def attach(trainer: Trainer, root: str | os.PathLike[str], *, every: int | None = None,
           identity: Identity | None = None, sampler: ResumableSampler | None = None,
           **options: Any) -> UnbrokenCallback:
    """Make ``trainer.train()`` resume exactly from unbroken generations in ``root``.

    ``every``: save each N completed updates (plus ``$UNBROKEN_SAVE_AT``, a signal's stop and
    the final update). ``identity``: what a continuation must match; by default
    `trainer_config` of the arguments. ``sampler``: the sample order (default:
    ``ResumableSampler(len(train_dataset), per-device batch x processes, seed=data_seed or
    seed, drop_last=dataloader_drop_last, rank=process_index, world_size=world_size)``).
    Other keywords go to the `Checkpointer` (``keep``,
    ``trace``, ``signals``, ``async_save``, ...). Set ``save_strategy="no"``: the Trainer's
    own checkpoints are not used. Returns the callback (already added to the Trainer)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"attach() takes a transformers.Trainer, got {type(trainer).__name__}")
    _refuse_unsupported(trainer)
    return UnbrokenCallback(trainer, root, every=every, identity=identity, sampler=sampler,
                            options=options)
