"""Lightning's loops for the Lightning adapter (`unbroken.integrations.lightning`): the training
state besides the model and optimizer, as a state part (`_LoopState`: the fit loop's progress
trackers, the callbacks' and datamodule's state, the callback metrics, the running epoch
aggregates of logged training metrics (`._lightning_results`) and a requested stop),
and validation inside ``fit`` that leaves training's random streams as it found them
(`_QuietValidation`).

Why the latter: iterating a validation ``DataLoader`` with workers draws their base seed from
the global torch RNG, and a ``persistent_workers=True`` loader does so only on its first pass,
which a resumed process makes at a later update than the uninterrupted run did (a random
transform of the validation data in the main process draws from the streams too). Run as it
is, validation would thus shift every later dropout mask of a resumed run. So each validation
of ``fit`` runs on a copy of the streams (Python, NumPy, torch CPU and initialized CUDA
devices) that is put back afterwards, and persistent validation workers are stopped after each
validation (the sanity check's before the first): each validation starts workers seeded at its
own update, as a resumed process does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.fit_loop import RestartStage
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress

from ..errors import StateMismatch, UnsupportedSetup
from ..state.rng import fork_rng
from ._lightning_results import check_saved, load_results, save_results

# 2: with the callbacks' and datamodule's state; 3: the callback metrics; 4: the running epoch
# aggregates of training metrics ("results"); 5: a results entry says sync_dist (in a job of
# several processes each rank holds this state of its own, `unbroken.PerRank`)
_STATE_VERSION = 5
# A version-2 generation resumes with no callback metrics, a version-2 or 3 one with no
# running aggregates (as before: the resumed epoch's values cover its later batches only).
_READS = (2, 3, 4, _STATE_VERSION)


class _LoopState:
    """Lightning's training state besides the model and optimizer, as a state part: every
    progress tracker of the fit loop and its children (epochs, batches, optimizer and
    scheduler steps, validation batches), the logger's stepped-batch count, the Trainer's
    ``should_stop``, what Lightning's own checkpoint holds of the callbacks (``state_dict()`` of
    each, e.g. ``EarlyStopping``'s patience count and best score) and of a
    ``LightningDataModule``, and ``trainer.callback_metrics`` as logged so far (tensors and
    numbers): a validation in the middle of an epoch (``val_check_interval``) logs what an
    epoch-end plateau scheduler or ``EarlyStopping(check_on_train_epoch_end=True)`` reads
    after a resume; and what ``self.log(..., on_epoch=True)`` has accumulated so far in the
    running training epoch (`._lightning_results`), so that its epoch value covers all the
    epoch's batches."""

    def __init__(self, trainer: pl.Trainer) -> None:
        # (Untyped: the Trainer's connectors set callbacks and datamodule, read by name.)
        self._trainer: Any = trainer
        self._fit: Any = trainer.fit_loop
        self._pending: dict[str, Any] | None = None  # re-applied after the epoch loop resets

    def state_dict(self) -> dict[str, Any]:
        # (the rank whose share of the running aggregates this is: a rank restoring another's
        # state, one the saving job did not have, starts its share afresh, `load_results`)
        return {**self._live(), "results": save_results(self._trainer),
                "rank": self._trainer.global_rank}

    def _live(self) -> dict[str, Any]:
        """The state without the running aggregates (which a restore replaces: a check of a
        saved state against the live one must not refuse what it is about to replace)."""
        datamodule = self._trainer.datamodule
        return {"version": _STATE_VERSION, "progress": _progress(self._fit),
                "batches_that_stepped": self._fit.epoch_loop._batches_that_stepped,
                "should_stop": self._trainer.should_stop,
                "callbacks": {key: cb.state_dict() for key, cb in self._callbacks().items()},
                "datamodule": datamodule.state_dict() if datamodule is not None else {},
                "metrics": self._metrics()}

    def _metrics(self) -> dict[str, Any]:
        """The callback metrics logged so far, as stored values (tensors detached and copied:
        a later in-place update must not reach a save still in flight)."""
        # The connector's own dict, not the ``callback_metrics`` property: reading that one
        # folds the running epoch's results in, which a save must not do to the run.
        return _plain(self._trainer._logger_connector._callback_metrics, "callback_metrics")

    def _callbacks(self) -> dict[str, pl.Callback]:
        """The callbacks with a state, by ``state_key`` (as Lightning's checkpoint keys them)."""
        return {str(cb.state_key): cb for cb in self._trainer.callbacks if cb.state_dict()}

    def validate_state_dict(self, state: Mapping[str, Any], where: str) -> None:
        """Refuse a state of another shape before anything is loaded."""
        live = self._live()
        if not isinstance(state, Mapping) or state.get("version") not in _READS:
            raise StateMismatch(f"{where}: not a version-{' or '.join(map(str, _READS))} "
                                f"state of Lightning's loops (found {state!r:.80})")
        metrics = state.get("metrics", {})
        if not isinstance(metrics, Mapping) or not _storable(metrics):
            raise StateMismatch(
                f"{where}: the saved callback metrics are not a mapping of names to tensors "
                f"or numbers (found {metrics!r:.80}); the generation was not written by this "
                "adapter: resume from another generation or start a new run folder")
        if type(state.get("rank", 0)) is not int:
            raise StateMismatch(f"{where}: the saved rank is {state.get('rank')!r:.40}, not an "
                                "int; the generation was not written by this adapter")
        if state.get("version") in (4, _STATE_VERSION):
            check_saved(state.get("results"), self._trainer.lightning_module, where)
        if _shape(state.get("progress")) != _shape(live["progress"]) or not isinstance(
                state.get("batches_that_stepped"), int) or not isinstance(
                state.get("should_stop"), bool):
            raise StateMismatch(
                f"{where}: Lightning's progress trackers differ from the saved ones (saved "
                f"{sorted(state.get('progress') or {})}, live {sorted(live['progress'])}): "
                "resume with the Lightning version that wrote the run")
        saved, now = sorted(state.get("callbacks") or {}), sorted(live["callbacks"])
        if saved != now:
            raise StateMismatch(
                f"{where}: the generation holds the state of the callbacks {saved}, the "
                f"Trainer's stateful callbacks are {now}: one would start afresh or its state "
                "be dropped; resume with the callbacks (and their monitor/mode) of the run")
        if bool(state.get("datamodule")) != bool(live["datamodule"]):
            raise StateMismatch(
                f"{where}: the generation {'holds' if state.get('datamodule') else 'lacks'} a "
                "LightningDataModule state_dict, the live datamodule "
                f"{'has one' if live['datamodule'] else 'has none'}; resume with the run's "
                "datamodule")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fit = self._fit
        self._apply(state)
        # A stop requested before the save (EarlyStopping, a callback) still ends the run.
        self._trainer.should_stop = state["should_stop"]
        callbacks = self._callbacks()
        for key, saved in state["callbacks"].items():
            callbacks[key].load_state_dict(dict(saved))
        if state["datamodule"]:
            self._trainer.datamodule.load_state_dict(dict(state["datamodule"]))
        # What the uninterrupted run's callback metrics hold here (the dict accumulates over
        # ``fit``): an epoch-end plateau step or EarlyStopping check reads the value of a
        # validation that ran before the save. Tensors go back to the module's device.
        device = self._trainer.strategy.root_device
        self._trainer._logger_connector._callback_metrics = {
            key: _on(value, device) for key, value in state.get("metrics", {}).items()}
        if "results" in state:  # (version 4 on; older generations resume without them)
            load_results(self._trainer, state["results"],
                         own=state.get("rank", 0) == self._trainer.global_rank)
        epoch = fit.epoch_progress.current
        if epoch.ready > epoch.processed:
            # Saved inside an epoch: re-enter it without its start hooks (they ran before the
            # save) and set the batch counters again once the epoch loop has reset them.
            fit._restart_stage = RestartStage.RESTARTED_MID_EPOCH
            self._pending = dict(state)
            self._first_batch_note()
        else:
            fit._restart_stage = RestartStage.NONE
            self._pending = None

    def _first_batch_note(self) -> None:
        """The logger connector's note of the epoch's first batch as the uninterrupted run has
        it at the next batch: a ``log`` in the epoch's first batch resets the entries of its
        hook, a later one accumulates (so after a restore past the first batch the note must
        say 'started', or the first ``log`` would wipe the restored running aggregates)."""
        started = self._fit.epoch_loop.batch_progress.current.ready > 0
        # (``on_batch_start`` turns None into True, the first batch, and True into False.)
        self._trainer._logger_connector._first_loop_iter = True if started else None

    def _apply(self, state: Mapping[str, Any]) -> None:
        _load_progress(self._fit, state["progress"])
        self._fit.epoch_loop._batches_that_stepped = state["batches_that_stepped"]

    def fix_epoch_loop(self) -> None:
        """At the first fetch after a restore: the counters as saved, and the fetcher's count
        of this epoch's batches (it decides the epoch's last batch) with them."""
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        self._apply(state)
        fetcher = self._fit._data_fetcher
        if fetcher is not None:
            fetcher.fetched = self._fit.epoch_loop.batch_progress.current.ready


def _progress(loop: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in vars(loop).items():
        if isinstance(value, _BaseProgress):
            out[prefix + name] = value.state_dict()
        elif isinstance(value, _Loop):
            out.update(_progress(value, f"{prefix}{name}."))
    return out


def _load_progress(loop: Any, saved: Mapping[str, Any], prefix: str = "") -> None:
    for name, value in vars(loop).items():
        if isinstance(value, _BaseProgress):
            value.load_state_dict(saved[prefix + name])
        elif isinstance(value, _Loop):
            _load_progress(value, saved, f"{prefix}{name}.")


def _plain(metrics: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``metrics`` as values the state codec stores without pickle (tensors detached and
    copied, numbers as they are, nested mappings of them), or `UnsupportedSetup` naming the
    first other value."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        where = f"{path}[{key!r}]"
        if not isinstance(key, str):
            raise UnsupportedSetup(
                f"trainer.{where}: a callback metric named by a {type(key).__name__}, not a "
                "str; the callback saves the callback metrics by name: log them with "
                "self.log(name, ...)")
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        elif type(value) in (int, float, bool):
            out[key] = value
        elif isinstance(value, Mapping):
            out[key] = _plain(value, where)
        else:
            raise UnsupportedSetup(
                f"trainer.{where} is a {type(value).__module__}.{type(value).__qualname__}: "
                "the callback saves the callback metrics (what epoch-end schedulers and "
                "EarlyStopping read after a resume) as tensors or numbers only, nothing "
                "pickled; log tensors or numbers (self.log) or drop that entry")
    return out


def _storable(metrics: Mapping[str, Any]) -> bool:
    """Whether a decoded metrics tree holds only what `_plain` stores."""
    return all(isinstance(k, str) and (
        isinstance(v, torch.Tensor) or type(v) in (int, float, bool)
        or isinstance(v, Mapping) and _storable(v)) for k, v in metrics.items())


def _on(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _on(v, device) for k, v in value.items()}
    return value


def _shape(tree: Any) -> Any:
    """Keys and value types of a progress tree (what must match to load it)."""
    if isinstance(tree, Mapping):
        return {k: _shape(v) for k, v in tree.items()}
    return type(tree).__name__


class _QuietValidation:
    """Stands in for the fit loop's ``val_loop.run`` (an instance attribute over the method)
    while the callback holds the Trainer; `remove` puts the method back."""

    def __init__(self, trainer: pl.Trainer) -> None:
        loop: Any = trainer.fit_loop.epoch_loop.val_loop  # (untyped: set over its method)
        self._loop = loop
        self._run = loop.run
        loop.run = self

    def __call__(self) -> Any:
        _stop_persistent_workers(self._loop)
        try:
            with fork_rng():
                return self._run()
        finally:
            _stop_persistent_workers(self._loop)

    def remove(self) -> None:
        """Let the validation loop run as Lightning's own again."""
        if vars(self._loop).get("run") is self:
            del self._loop.run


def _stop_persistent_workers(loop: Any) -> None:
    """Shut down the workers a ``persistent_workers=True`` validation loader keeps between
    passes, so that its next pass starts (and seeds) new ones."""
    combined = getattr(loop, "_combined_loader", None)
    for dataloader in getattr(combined, "flattened", None) or ():
        iterator = getattr(dataloader, "_iterator", None)  # kept only by a persistent loader
        if iterator is None:
            continue
        stop = getattr(iterator, "_shutdown_workers", None)
        if stop is not None:
            stop()
        dataloader._iterator = None  # (torch's DataLoader builds a new iterator from None)
