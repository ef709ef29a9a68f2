"""The Transformers Trainer adapter's callback (`unbroken.integrations.transformers`): the
`UnbrokenCallback` that replaces the Trainer's data loader and hooks its loop, with the hooks
it wraps and the RNG guard around evaluation. Kept apart from `attach` and its setup checks,
which build it."""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import nested_gather

from ..checkpointer import Checkpointer
from ..data import ResumableLoader, ResumableSampler, SeededDataset, seeded
from ..errors import CorruptCheckpoint, UnbrokenError, UnsupportedSetup
from ..state.identity import Identity
from ..state.parts import PerRank
from ._closing import close_after
from ._transformers_checks import _refuse_jit_checkpoint, _refuse_private_rng, _sampling
from ._transformers_state import TrainerProgress, restore_compatible, trainer_config

TESTED = "5.24"
PART = "trainer"  # the extras name of the Trainer's own state in a generation

# The Trainer internals this adapter wraps, with the parameters it reads.
_HOOKS = {"_init_training_state": ("max_steps", "num_train_epochs"),
          "_run_epoch": ("epoch", "steps_in_epoch", "num_update_steps_per_epoch"),
          "_maybe_log_save_evaluate": ("grad_norm",),
          "training_step": ("model", "inputs"),
          "train": ("resume_from_checkpoint",),
          "get_train_dataloader": (),
          "evaluate": ()}


class UnbrokenCallback(TrainerCallback):
    """Makes one Trainer resumable through unbroken (build it with `attach`).

    ``checkpointer`` is the `Checkpointer` of the current (or last) ``train()`` call, None
    before the first; ``loader`` the `ResumableLoader` the Trainer trains from; ``restored``
    the completed-update count the last ``train()`` continued from (0: a fresh run)."""

    def __init__(self, trainer: Trainer, root: str | os.PathLike[str], *, every: int | None,
                 identity: Identity | None, sampler: ResumableSampler | None,
                 options: Mapping[str, Any]) -> None:
        self.trainer = trainer
        self.root = root
        self.every = every
        self.identity = identity
        self.sampler = sampler
        self.options = dict(options)
        self.progress = TrainerProgress(trainer)
        self.checkpointer: Checkpointer | None = None
        self.loader: ResumableLoader | None = None
        self.restored = 0
        self._source: Any = None  # the train_dataset the loader was built from
        self._made_scheduler = False
        self._open = False  # the checkpointer holds the run folder
        # The epoch pass in progress: its epoch, its batches, those handed out so far.
        self._epoch = 0
        self._full = 0
        self._batches = 0
        self._losses: list[torch.Tensor] = []  # the update window's micro-batch losses
        self._window: list[Any] = []  # and its batches (their tensors, for the trace digest)
        self._grad_norm: Any = None
        self._pending = False  # an update ended (on_step_end); not yet marked
        self._deferred = False  # ... marked after the epoch-end logging and evaluation
        self._eval_on_start = False  # args.eval_on_start, turned off for a continuation
        self._epochs = 0  # the train() call's num_train_epochs: the loop ends after the last
        self._saved_at = -1  # the update whose generation this train() call wrote last
        self._orig: dict[str, Callable[..., Any]] = {n: getattr(trainer, n) for n in _HOOKS}
        self._sig = {n: inspect.signature(f) for n, f in self._orig.items()}
        for name in _HOOKS:  # instance attributes: a subclass's own overrides still run inside
            setattr(trainer, name, getattr(self, "_" + name.lstrip("_")))
        trainer.callback_handler.callbacks.insert(0, self)  # first: others see the fixed epoch

    def _bind(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> inspect.BoundArguments:
        bound = self._sig[name].bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    # -- train() and the data ----------------------------------------------------------------

    def _train(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._bind("train", args, kwargs)
        resume = bound.arguments["resume_from_checkpoint"]
        if resume is not None and resume is not True and resume is not False:
            raise UnsupportedSetup(
                f"train(resume_from_checkpoint={resume!r}): this Trainer continues from the "
                f"newest verified generation in {os.fspath(self.root)} (None, True or False, "
                "which the Trainer reads as None). A "
                "Trainer checkpoint-N folder is not read (`unbroken import` it into a new run "
                "folder and warm-start from it); to start over, use a new run folder")
        bound.arguments["resume_from_checkpoint"] = None  # no Trainer checkpoint is read
        _refuse_jit_checkpoint(self.trainer)  # (a callback may have been added since attach)
        try:
            result = self._orig["train"](*bound.args, **bound.kwargs)
        except BaseException as e:
            close_after(e, self._close)  # the run folder's lock is released all the same
            raise
        self._close()
        return result

    def _get_train_dataloader(self) -> ResumableLoader:
        t = self.trainer
        dataset: Any = t.train_dataset
        if self.loader is not None and dataset is self._source:
            return self.loader
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset,
                                                                                "__len__"):
            raise UnsupportedSetup(
                f"train_dataset is a {type(dataset).__name__} without a length: this adapter "
                "resumes map-style datasets (with __len__ and __getitem__), whose order "
                "ResumableSampler computes from (seed, epoch, position)")
        collate = t.data_collator
        _refuse_private_rng(collate)  # (it may have been replaced since attach)
        # The Trainer drops unused columns of a datasets.Dataset itself (one is only ever
        # given when that library was imported).
        datasets = sys.modules.get("datasets")
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = t._remove_unused_columns(dataset, description="Training")
        else:
            collate = t._get_collator_with_removed_columns(collate, description="Training")
        args = t.args
        # (the sampler's is the global batch: the processes' per-device batches, or, with
        # Accelerate's split_batches, the per-device batch split among them)
        split = bool(getattr(args.accelerator_config, "split_batches", False))
        batch = t._train_batch_size * (1 if split else args.world_size)
        sampler = self.sampler if self.sampler is not None else ResumableSampler(
            len(dataset), batch_size=batch,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=_sampling(args) != "sequential", drop_last=args.dataloader_drop_last,
            rank=args.process_index, world_size=args.world_size)
        if sampler.num_samples != len(dataset) or sampler.batch_size != batch:
            raise UnsupportedSetup(
                f"sampler orders {sampler.num_samples} samples in batches of "
                f"{sampler.batch_size}, but train_dataset has {len(dataset)} samples and the "
                f"Trainer's batch is {batch}"
                f"{f' ({args.world_size} processes)' if args.world_size > 1 else ''}; build "
                "it with those")
        if (sampler.rank, sampler.world_size) != (args.process_index, args.world_size):
            raise UnsupportedSetup(
                f"the sampler is rank {sampler.rank} of {sampler.world_size}, this process is "
                f"rank {args.process_index} of {args.world_size}: build it with "
                "ResumableSampler(..., rank=args.process_index, world_size=args.world_size)")
        self.loader = ResumableLoader(
            dataset if isinstance(dataset, SeededDataset) else seeded(dataset, sampler.seed),
            sampler, num_workers=args.dataloader_num_workers, collate_fn=collate,
            pin_memory=args.dataloader_pin_memory and args.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            accumulation=args.gradient_accumulation_steps)
        self._source = t.train_dataset
        return self.loader

    def _evaluate(self, *args: Any, **kwargs: Any) -> Any:
        # Evaluation leaves the training RNG streams as it found them: iter() of an eval
        # DataLoader draws its workers' base seed from the torch RNG, but a persistent one only
        # on its first pass, which a resumed process makes at another update than the
        # uninterrupted run (and a random eval transform draws from them too).
        try:
            with _rng_untouched():
                return self._orig["evaluate"](*args, **kwargs)
        finally:
            # Persistent eval workers would carry their RNG streams (a random collator's,
            # an augmentation's) from one evaluation to the next, and a resumed process
            # starts them afresh: each evaluation gets workers seeded at its own update.
            for loader in getattr(self.trainer, "_eval_dataloaders", {}).values():
                stop = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)
                if stop is not None:
                    stop()
            self.trainer.__dict__.pop("_eval_dataloaders", None)

    # -- restore ----------------------------------------------------------------------------

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        bound = self._bind("_init_training_state", args, kwargs)
        self._orig["_init_training_state"](*bound.args, **bound.kwargs)  # a fresh state
        t = self.trainer
        if self.loader is None:
            raise UnbrokenError("the Trainer initialized its state before building the train "
                                "dataloader; this adapter expects transformers' order "
                                f"(tested with {TESTED}, found {transformers.__version__})")
        # What _prepare_for_training does next, now: the restore needs both objects. The
        # scheduler is kept through it (the Trainer would otherwise build a fresh one).
        if t.optimizer is None:
            t.create_optimizer()
        if getattr(t, "_created_lr_scheduler", False):
            t.lr_scheduler = None  # the previous train()'s: the Trainer rebuilds its own too
        if t.lr_scheduler is None:
            t.create_scheduler(num_training_steps=bound.arguments["max_steps"])
            t._created_lr_scheduler = False
            self._made_scheduler = True
        optimizer = getattr(t.optimizer, "optimizer", t.optimizer)  # Accelerate's wrapper
        if t.model is None:
            raise ValueError("Trainer: training requires a model")
        self.checkpointer = Checkpointer(
            self.root, model=t.model, optimizer=optimizer, scheduler=t.lr_scheduler,
            scaler=t.accelerator.scaler, data=self.loader, extras={PART: PerRank(self.progress)},
            identity=(self.identity if self.identity is not None
                      else Identity(config=trainer_config(t.args))),
            every=self.every, **self.options)
        self._open = True
        self._epochs = int(bound.arguments["num_train_epochs"])
        self.progress.interrupted = False
        self.restored = restore_compatible(self.checkpointer, t.args, self.identity)
        self._saved_at = self.restored
        if self.restored != t.state.global_step:
            raise CorruptCheckpoint(f"{os.fspath(self.root)}: generation {self.restored} holds "
                                    f"Trainer global_step {t.state.global_step}")
        if t.state.global_step >= t.state.max_steps or self.progress.stopped:
            # A finished run (a callback such as early stopping may have ended it before
            # max_steps): nothing left to train, as for the uninterrupted run.
            return int(bound.arguments.get("num_train_epochs", self.loader.epoch)), 0
        return self.loader.epoch, 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        """Put back the logging accumulators the loop just reset (after a restore); skip
        ``eval_on_start`` on a continuation."""
        if args.eval_on_start and self.restored > 0:
            # The uninterrupted run evaluated before update 1 only: an evaluation here would
            # add a log entry and draw from the RNGs (eval augmentation, the loader's seed).
            args.eval_on_start = False
            self._eval_on_start = True  # put back when the loop starts (`_run_epoch`, `_close`)
        saved = self.progress.pending_logging
        if saved is None:
            return
        t = self.trainer
        t._tr_loss = saved["tr_loss"].to(t._tr_loss.device, t._tr_loss.dtype)
        t._globalstep_last_logged = saved["globalstep_last_logged"]
        # train_loss, the metric train() returns, averages this call's updates only: what the
        # next log adds holds the saved losses as it adds them, averaged over the ranks (a
        # collective in a job: every rank is here at once).
        t._total_loss_scalar = -nested_gather(t._tr_loss.detach().clone(),
                                              args.parallel_mode).mean().item()
        self.progress.pending_logging = None

    # -- the loop -----------------------------------------------------------------------------

    def _restore_eval_on_start(self) -> None:
        if self._eval_on_start:
            self._eval_on_start = False
            self.trainer.args.eval_on_start = True

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        self._restore_eval_on_start()
        bound = self._bind("_run_epoch", args, kwargs)
        a = bound.arguments
        loader = self.loader
        assert loader is not None and loader.sampler is not None
        if loader.epoch != a["epoch"]:
            raise UnbrokenError(f"the Trainer starts epoch {a['epoch']} while the data cursor "
                                f"is in epoch {loader.epoch}")
        if a["steps_in_epoch"] != len(loader):
            raise UnsupportedSetup(f"the Trainer counts {a['steps_in_epoch']} batches "
                                          f"per epoch, the loader {len(loader)}")
        done = loader.consumed // loader.sampler.batch_size  # batches of completed updates
        self._epoch, self._full, self._batches = a["epoch"], a["steps_in_epoch"], done
        self._losses, self._window = [], []  # (what an epoch stopped mid-window left)
        # The rest of the epoch: the loader starts at the cursor, and the epoch's last window
        # keeps its size, since a resume always starts at a window's first batch.
        a["steps_in_epoch"] -= done
        a["num_update_steps_per_epoch"] -= done // self.trainer.args.gradient_accumulation_steps
        result = self._orig["_run_epoch"](*bound.args, **bound.kwargs)
        control = self.trainer.control
        if loader.epoch == self._epoch and not control.should_training_stop:
            # A callback stopped the epoch inside an update window: the Trainer goes on with
            # the next epoch, and so does the cursor.
            loader.sampler.set_position(self._epoch + 1, 0)
        if (control.should_training_stop or a["epoch"] + 1 >= self._epochs) \
                and not self._window:
            self._save_the_end()
        return result

    def _save_the_end(self) -> None:
        """The Trainer's loop ends after this epoch: its last update is the run's final state,
        saved even where nothing asked for it (a callback's ``should_epoch_stop`` ended every
        epoch early, so ``num_train_epochs`` ran out before ``max_steps``), so a rerun of the
        finished script restores it and trains nothing. Not after a signal's stop: that
        generation is saved already, and the run goes on in the next process."""
        ckpt, t = self.checkpointer, self.trainer
        assert ckpt is not None
        if ckpt.should_stop or self._saved_at == t.state.global_step:
            return
        ckpt.save()
        self._saved_at = t.state.global_step

    def _training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = self._orig["training_step"](*args, **kwargs)
        inputs = self._bind("training_step", args, kwargs).arguments["inputs"]
        self._batches += 1
        self._losses.append(loss.detach())
        self._window.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
                            if isinstance(inputs, Mapping) else None)
        return loss

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """The optimizer step is done: report the epoch fraction over the whole epoch (the
        loop was given the rest of it), as an uninterrupted run does."""
        state.epoch = self._epoch + self._batches / self._full
        self._pending = True

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        grad_norm = self._bind("_maybe_log_save_evaluate", args, kwargs).arguments["grad_norm"]
        self._orig["_maybe_log_save_evaluate"](*args, **kwargs)
        control, loader = self.trainer.control, self.loader
        assert loader is not None
        if self._pending:
            self._pending, self._grad_norm = False, grad_norm
            if (loader.epoch != self._epoch or control.should_epoch_stop
                    or control.should_training_stop):
                self._deferred = True  # this call's epoch-end twin comes next
                return
        elif not self._deferred:
            return
        self._deferred = False
        if control.should_epoch_stop and not control.should_training_stop \
                and loader.epoch == self._epoch:
            # The Trainer leaves the rest of this epoch unseen; so does the cursor.
            assert loader.sampler is not None
            loader.sampler.set_position(self._epoch + 1, 0)
        self._boundary()

    def _boundary(self) -> None:
        t, ckpt = self.trainer, self.checkpointer
        assert ckpt is not None
        loss = torch.stack(self._losses).sum() if self._losses else None
        window, self._losses, self._window = self._window, [], []
        if ckpt.step_done(t.state.global_step, loss=loss, grad_norm=self._grad_norm,
                          batch=window):
            self._saved_at = t.state.global_step
        if ckpt.should_stop:  # a signal: the generation is saved, leave the loop
            # (not the run's end: a later save of this state must not mark it stopped)
            self.progress.interrupted = True
            t.control.should_training_stop = True
        elif t.control.should_training_stop:
            ckpt.save()  # the run ends here: its newest generation is its final state
            self._saved_at = t.state.global_step

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Release the run folder (waiting for a save in flight)."""
        self._close()

    def _close(self) -> None:
        self._restore_eval_on_start()
        if self.loader is not None:
            # The Trainer stops drawing batches without exhausting the pass, which would
            # keep the workers alive until the interpreter exits.
            self.loader.stop_workers()
            # Stopped persistent workers cannot be reused by the DataLoader: the next
            # train() builds a fresh loader (the restore positions it).
            self._source = None
        if self._made_scheduler:  # the next train() builds its own, as the Trainer would
            self.trainer._created_lr_scheduler = True
            self._made_scheduler = False
        if self.checkpointer is not None and self._open:
            self._open = False
            self.checkpointer.close()


@contextlib.contextmanager
def _rng_untouched() -> Iterator[None]:
    """Python's, NumPy's and torch's global RNG streams (CPU and each initialized CUDA
    device) put back as they were on leaving."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
