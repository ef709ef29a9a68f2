"""Lightning adapter: ``Trainer.fit`` saved as unbroken generations and resumed mid-epoch at
the exact next batch, bit for bit.

Add `UnbrokenCallback` to the Trainer's callbacks and give ``fit`` an `unbroken.ResumableLoader`
as its train dataloader (passed to ``fit`` or returned by ``train_dataloader()``). Each run of
the script continues from the newest verified generation of the run folder; Lightning's own
``ckpt_path`` resume (``torch.save`` pickles) is not used.

What stands between ``Trainer.fit`` and an exact mid-epoch resume, and how it is handled here:

* **The data position.** Lightning restarts an epoch's iterator from the top (or replays it),
  calls ``set_epoch`` on any ``sampler`` it finds at each epoch start (which would rewind a
  `ResumableSampler` to sample 0), and may rebuild a ``DataLoader`` to inject its own sampler.
  The callback hands Lightning a thin view of the `ResumableLoader` instead (no ``sampler``,
  no ``state_dict``, a length, so Lightning never reads ahead): Lightning cannot rebuild,
  rewind or snapshot it, and a pass of the view starts the loader at its cursor only when
  the first batch is fetched.
* **The update boundary.** Lightning finishes an update only after ``on_train_batch_end``:
  the module's own hook, validation, plateau schedulers and, at an epoch's end, the epoch-end
  hooks and schedulers still run. So an update is marked done (``step_done``: traced, saved
  when due) when the *next* batch is fetched, or when training ends: the generation holds
  the state that the next batch starts from, whatever ran in between.
* **The loop counters.** Lightning's progress trackers (epochs, batches, optimizer and
  scheduler steps, validation batches) are saved as an extras part (``lightning``) of the
  generation and put back without Lightning's restart logic: a restored run that stopped
  mid-epoch re-enters that epoch without calling ``on_train_epoch_start`` again (it ran
  before the save), and the batch counters are set once the epoch loop has reset them, so
  ``global_step``, ``current_epoch``, ``batch_idx``, accumulation windows and
  ``max_epochs``/``max_steps`` continue exactly as in the uninterrupted run. The same part
  holds what Lightning's checkpoint keeps of the callbacks (each ``state_dict()``, e.g.
  ``EarlyStopping``'s patience count and best score; a resume needs the same stateful
  callbacks), of a ``LightningDataModule``, ``trainer.should_stop`` (an early-stopped run
  stays stopped), ``trainer.callback_metrics`` (a validation before the save, e.g. by
  ``val_check_interval``, logged what an epoch-end plateau scheduler or EarlyStopping reads)
  and the running epoch aggregates of training metrics logged with ``on_epoch=True`` (the
  sum or extreme so far and, for a mean, the summed batch sizes; `._lightning_results`), so
  that an epoch value such as ``train_loss_epoch``, and a plateau scheduler or EarlyStopping
  that monitors it, covers all the epoch's batches after a resume. In a job of several
  processes each rank logs its own values, so each rank stores this part in its own files
  (`unbroken.PerRank`) and restores its own.
* **RNG and state.** Model (the LightningModule), optimizer, LR scheduler, the precision
  plugin's ``GradScaler`` (16-bit mixed precision), the Python, NumPy and torch RNG streams
  (and any ``generators=`` registered) go through `unbroken.Checkpointer` as usual; seeding
  by ``seed_everything`` is harmless (the loader seeds its workers from seed, epoch and
  position, never from the global streams).
* **Validation.** Each validation inside ``fit`` runs on a copy of the global RNG streams
  that is put back afterwards, and stops persistent validation workers when it ends: their
  base seed is drawn from the torch stream on a pass that starts them, which a resumed process
  makes at another update than the uninterrupted run (`._lightning_loops`).

Configurations that cannot continue exactly are refused with `UnsupportedSetup` (a typed
`unbroken.errors.UnbrokenError`): a train dataloader that is not a `ResumableLoader`, several
train dataloaders, several optimizers or LR schedulers, manual optimization, a loader
``accumulation`` different from ``accumulate_grad_batches``, a
``GradientAccumulationScheduler``, ``limit_train_batches``, ``overfit_batches``,
``reload_dataloaders_every_n_epochs``, or ``fit(ckpt_path=...)``; and, at the first batch that
logs it, a training metric whose running epoch aggregate cannot be saved: a
``torchmetrics.Metric`` logged with ``on_epoch=True`` or a ``sync_dist_group``. Callbacks that
change the model or the optimizer during fit
(SWA, fine-tuning that adds parameter groups, pruning) and callbacks with checkpoint hooks
(``on_save_checkpoint``: what they add to Lightning's checkpoint dict, such as
``EMAWeightAveraging``'s averaged model, is not in the generations) are refused too; a
LightningModule's own checkpoint hooks are warned about (`._lightning_checks`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.utilities.exceptions import _TunerExitException

from ..checkpointer import Checkpointer
from ..data.loader import ResumableLoader
from ..errors import StateMismatch, UnbrokenError, UnsupportedSetup, UpdateBoundaryError
from ..state.parts import PerRank
from ..trace import TRACE_ENV
from ._closing import close_after
from ._lightning_checks import _check_trainer, _not_resumable
from ._lightning_loops import _LoopState, _QuietValidation
from ._lightning_results import check_results

__all__ = ["LOOPS", "UnbrokenCallback", "UnsupportedSetup"]

LOOPS = "lightning"  # the extras part that holds Lightning's loop counters
_OWN = ("model", "optimizer", "scheduler", "scaler", "data")  # Checkpointer arguments we fill


class UnbrokenCallback(pl.Callback):
    """Save ``Trainer.fit``'s continuation state as unbroken generations in ``root`` and resume
    from the newest verified one at the start of every ``fit``.

    ``options`` go to `unbroken.Checkpointer` (``identity``, ``every``, ``keep``, ``extras``,
    ``generators``, ``trace``, ``signals``, ``async_save``, ...); the model, optimizer,
    scheduler, scaler and data parts come from the Trainer. The run folder, trace and extra
    saves follow ``$UNBROKEN_ROOT`` / ``$UNBROKEN_TRACE`` / ``$UNBROKEN_SAVE_AT`` as for any
    Checkpointer, so ``unbroken check -- python train.py`` works unchanged.

    ``fit`` ends with a generation of its final state, so running a finished script again
    trains nothing. After a ``fit``, ``restored_step`` is the completed-update count it
    resumed from (0: a new run) and ``step`` the count it reached; ``checkpointer`` is the
    live `Checkpointer` while ``fit`` runs (None otherwise). With ``signals=[signal.SIGTERM]``
    a signal saves at the next update boundary and stops ``fit`` (``trainer.should_stop``)."""

    def __init__(self, root: str | os.PathLike[str], **options: Any) -> None:
        taken = sorted(set(options) & set(_OWN))
        if taken:
            raise UnsupportedSetup(
                f"UnbrokenCallback({', '.join(k + '=...' for k in taken)}): the callback takes "
                "the model, optimizer, scheduler, scaler and data from the Trainer; pass only "
                "Checkpointer options such as identity=, every=, keep=, extras=")
        if LOOPS in (options.get("extras") or {}):
            raise UnsupportedSetup(f"extras name {LOOPS!r} is the callback's own part (Lightning's "
                                   "loop counters); name yours differently")
        self.root = root
        self.options = options
        self.checkpointer: Checkpointer | None = None
        self.restored_step = 0
        self.step = 0
        self._tracing = False  # whether the Checkpointer keeps a trace (then the gradient norm)
        self._loader: ResumableLoader | None = None
        self._trainer: pl.Trainer | None = None
        self._loops: _LoopState | None = None
        self._validation: _QuietValidation | None = None
        self._done: dict[str, Any] | None = None  # the update awaiting its boundary
        self._grad_norm: torch.Tensor | None = None
        self._unchecked = False  # restored, no batch fetched yet (`_check_position` pending)

    # -- the data ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Route ``fit``'s train dataloader through `_FitData` (before Lightning requests it)."""
        if stage != "fit":
            return
        _check_trainer(trainer)
        loop = trainer.fit_loop
        if not isinstance(loop._data_source, _Source):
            loop._data_source = _Source(loop._data_source, self)

    def _view(self, dataloader: Any) -> _FitData:
        if isinstance(dataloader, _FitData):
            return dataloader
        if not isinstance(dataloader, ResumableLoader):
            raise UnsupportedSetup(_not_resumable(dataloader))
        try:
            len(dataloader)
        except TypeError:
            raise UnsupportedSetup(
                "the train ResumableLoader has no length (an iterable dataset without "
                "__len__): Lightning then reads a batch ahead, which a saved position cannot "
                "tell from a consumed one; give the dataset a __len__") from None
        self._loader = dataloader
        return _FitData(dataloader, self)

    # -- restore -------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse Lightning's own resume (it has loaded its checkpoint by now)."""
        if trainer.ckpt_path is not None:
            raise UnsupportedSetup(
                f"fit(ckpt_path={trainer.ckpt_path!r}): the UnbrokenCallback resumes from its "
                "own generations in the run folder; drop ckpt_path (Lightning's checkpoint "
                "would be loaded, then overwritten or, if it ended training, obeyed)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the Checkpointer from the Trainer's objects and restore the newest verified
        generation (model, optimizer, scheduler, scaler, RNG, data position, loop counters)."""
        loader, optimizer, scheduler = self._parts(trainer, pl_module)
        self._trainer = trainer
        self._loops = _LoopState(trainer)
        # (From here: the sanity check before training runs as Lightning's own, whose draws a
        # restore replaces anyway.)
        self._validation = _QuietValidation(trainer)
        self._tracing = bool(os.environ.get(TRACE_ENV) or self.options.get("trace"))
        # (held per rank: in a job each rank logs its own values, `._lightning_results`)
        extras = {**(self.options.get("extras") or {}), LOOPS: PerRank(self._loops)}
        options = {k: v for k, v in self.options.items() if k != "extras"}
        self.checkpointer = Checkpointer(
            self.root, model=pl_module, optimizer=optimizer, scheduler=scheduler,
            scaler=getattr(trainer.precision_plugin, "scaler", None), data=loader,
            extras=extras, **options)
        try:
            step = self.checkpointer.restore()
            if step != trainer.global_step:
                raise StateMismatch(
                    f"{self.checkpointer.store.root}: generation {step} restored Lightning's "
                    f"global_step as {trainer.global_step}; the loop counters do not belong to "
                    "this generation")
        except BaseException:
            self._close()
            raise
        self.restored_step = self.step = step
        self._done = None
        self._unchecked = True

    def _parts(self, trainer: pl.Trainer, pl_module: pl.LightningModule
               ) -> tuple[ResumableLoader, torch.optim.Optimizer, Any]:
        if not pl_module.automatic_optimization:
            raise UnsupportedSetup(
                "manual optimization: the callback marks an update where Lightning's automatic "
                "optimization steps the optimizer; use automatic optimization")
        if len(trainer.optimizers) != 1:
            raise UnsupportedSetup(
                f"configure_optimizers returned {len(trainer.optimizers)} optimizers; the "
                "callback saves exactly one (combine parameter groups in one optimizer)")
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1:
            raise UnsupportedSetup(
                f"configure_optimizers returned {len(configs)} LR schedulers; the callback "
                "saves at most one (chain them with torch.optim.lr_scheduler.SequentialLR)")
        loader = self._loader
        if loader is None:
            raise UnsupportedSetup("fit's train dataloader never reached the callback: add "
                                   "the UnbrokenCallback to Trainer(callbacks=[...]) before fit")
        if loader.accumulation != trainer.accumulate_grad_batches:
            raise UnsupportedSetup(
                f"ResumableLoader(accumulation={loader.accumulation}) but Trainer("
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}): the loader's "
                "update windows must be the Trainer's; give both the same value")
        sampler = loader.sampler
        if sampler is not None and (sampler.world_size, sampler.rank) != (
                trainer.world_size, trainer.global_rank):
            raise UnsupportedSetup(
                f"the ResumableSampler is rank {sampler.rank} of {sampler.world_size}, the "
                f"Trainer's process is rank {trainer.global_rank} of {trainer.world_size}: "
                "build the sampler with the Trainer's rank and world size")
        return loader, trainer.optimizers[0], configs[0].scheduler if configs else None

    # -- updates -------------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Record the gradient norm for the trace (before any clipping)."""
        if self._tracing:
            grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
            self._grad_norm = (torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads])) if grads else None)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """Note an update that this batch completed; it is marked done at its boundary.
        Refuse a logged metric whose running epoch aggregate no save could hold now, not at
        the first save inside an epoch (hours later, or at a SIGTERM)."""
        assert self._loader is not None
        check_results(trainer)
        stepped = trainer.global_step - self.step
        if stepped not in (0, 1) or bool(stepped) != self._loader.at_boundary:
            raise UpdateBoundaryError(
                f"batch {batch_idx}: Lightning's global_step went from {self.step} to "
                f"{trainer.global_step} while the ResumableLoader's update window is "
                f"{'closed' if self._loader.at_boundary else 'open'}; one optimizer step must "
                "end each window of the loader's accumulation")
        if stepped:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            self._done = {"loss": loss if isinstance(loss, torch.Tensor) else None,
                          "batch": batch, "grad_norm": self._grad_norm}
            self._grad_norm = None

    def _boundary(self, first: bool = False) -> bool:
        """The next batch is about to be fetched (or training ended): mark the pending update
        done; after a restore, set the counters the epoch loop reset. Returns whether to stop."""
        ckpt, trainer, loops = self.checkpointer, self._trainer, self._loops
        if ckpt is None or trainer is None or loops is None:
            raise UnbrokenError("the UnbrokenCallback's data was iterated outside Trainer.fit")
        if self._done is not None:
            done, self._done = self._done, None
            self.step += 1
            ckpt.step_done(self.step, **{k: v for k, v in done.items() if v is not None})
            if ckpt.should_stop:
                trainer.should_stop = True
                return True
        loops.fix_epoch_loop()
        if first:
            self._unchecked = False
            self._check_position(trainer)
        return False

    def _check_position(self, trainer: pl.Trainer) -> None:
        """The loader's cursor must be where Lightning's loops are (a pass starts here), or,
        for loops that ended their last epoch in full, at the start of the next epoch."""
        assert self._loader is not None
        loader, fit = self._loader, trainer.fit_loop
        epochs: Any = fit.epoch_progress.current  # (a processed tracker, typed as its base)
        batches = fit.epoch_loop.batch_progress.current.ready
        where = (loader.epoch, loader.consumed // loader.sampler.batch_size
                 if loader.sampler is not None else batches)
        # A finished epoch keeps its batch count until the next epoch starts, while the
        # loader's cursor rolled over to that next epoch's first batch: a run that reached
        # max_epochs (or max_steps at an epoch's end), restored with nothing left to train.
        finished = (epochs.ready == epochs.processed and batches == len(loader)
                    and where == (trainer.current_epoch, 0))
        if where != (trainer.current_epoch, batches) and not finished:
            raise StateMismatch(
                f"the ResumableLoader is at epoch {where[0]}, batch {where[1]}, Lightning's loops "
                f"at epoch {trainer.current_epoch}, batch {batches}: the epoch ended early (a "
                "stop, max_steps) and training was continued; continue with the settings that "
                "ended it, or start a new run folder")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last update's boundary (no batch follows), a generation of the final state (a
        no-op when that step is saved), then release the run folder."""
        try:
            if self.checkpointer is not None:
                self._boundary()
                if (self._unchecked and not trainer.should_stop
                        and not 0 <= trainer.max_steps <= trainer.global_step):
                    # Restored loops that were done before a batch was fetched: fine when
                    # they hold a requested stop (EarlyStopping's), max_steps is reached or
                    # their last epoch ended in full (max_epochs: a finished run run again);
                    # else they ended an epoch early (max_steps raised in the last epoch),
                    # which a fetch would have refused.
                    self._check_position(trainer)
                if self.step:
                    self.checkpointer.save()
        finally:
            self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Release the run folder (the newest generation stays the last one committed). The
        training's exception is the one that goes on: an error of the save still in flight
        (its read-back), raised here, would replace it and skip the rest of Lightning's
        handling (``strategy.on_exception``, the loggers' finalize, ``trainer._teardown()``);
        it is logged instead (`Checkpointer.close` has released the folder either way)."""
        close_after(exception, self._close)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Release the run folder if ``fit`` ended without ``on_train_end``."""
        self._close()

    def _close(self) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        self._done, self._trainer, self._loops = None, None, None
        validation, self._validation = self._validation, None
        if validation is not None:
            validation.remove()
        if ckpt is not None:
            ckpt.close()


class _Source(_DataLoaderSource):
    """Lightning's train-dataloader source, handing out the callback's view of the loader."""

    def __init__(self, source: _DataLoaderSource, callback: UnbrokenCallback) -> None:
        super().__init__(source.instance, source.name)
        self._callback = callback

    def dataloader(self) -> Any:
        return self._callback._view(super().dataloader())


class _FitData:
    """What Lightning iterates instead of the `ResumableLoader` (see the module doc): its
    length, and passes that start the loader at its cursor on their first fetch and mark the
    previous update's boundary before every fetch."""

    def __init__(self, loader: ResumableLoader, callback: UnbrokenCallback) -> None:
        self.loader = loader
        self._callback = callback

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return _FitPass(self.loader, self._callback)


class _FitPass:
    def __init__(self, loader: ResumableLoader, callback: UnbrokenCallback) -> None:
        self._loader = loader
        self._callback = callback
        self._it: Iterator[Any] | None = None
        self._epoch = -1

    def __iter__(self) -> _FitPass:
        return self

    def __next__(self) -> Any:
        if self._callback._boundary(first=self._it is None):
            # A signal asked to stop, and that update is saved: leave ``fit`` now. Ending the
            # pass instead would run the epoch-end hooks on a cut epoch (EarlyStopping then
            # fails on a metric no validation produced yet); Lightning's tuner exit returns
            # from ``fit`` through its teardown, which releases the run folder.
            raise _TunerExitException()
        if self._it is None:
            self._epoch = self._loader.epoch
            self._it = iter(self._loader)
        batch = next(self._it)
        if self._loader.epoch != self._epoch:
            # The epoch's last batch (the cursor rolled over). Lightning asks no further, so
            # end the pass here: its workers stop now, not when the process exits.
            next(self._it, None)
        return batch
