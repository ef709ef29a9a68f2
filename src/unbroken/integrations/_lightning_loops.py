"""Lightning's training state besides the model and optimizer, as a state part of the
Lightning adapter (`unbroken.integrations.lightning`): the fit loop's progress trackers, the
callbacks' and datamodule's state, and a requested stop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.fit_loop import RestartStage
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress

from ..errors import StateMismatch

_STATE_VERSION = 2  # 2: with the callbacks' and datamodule's state


class _LoopState:
    """Lightning's training state besides the model and optimizer, as a state part: every
    progress tracker of the fit loop and its children (epochs, batches, optimizer and
    scheduler steps, validation batches), the logger's stepped-batch count, the Trainer's
    ``should_stop``, and what
    Lightning's own checkpoint holds of the callbacks (``state_dict()`` of each, e.g.
    ``EarlyStopping``'s patience count and best score) and of a ``LightningDataModule``."""

    def __init__(self, trainer: pl.Trainer) -> None:
        # (Untyped: the Trainer's connectors set callbacks and datamodule, read by name.)
        self._trainer: Any = trainer
        self._fit: Any = trainer.fit_loop
        self._pending: dict[str, Any] | None = None  # re-applied after the epoch loop resets

    def state_dict(self) -> dict[str, Any]:
        datamodule = self._trainer.datamodule
        return {"version": _STATE_VERSION, "progress": _progress(self._fit),
                "batches_that_stepped": self._fit.epoch_loop._batches_that_stepped,
                "should_stop": self._trainer.should_stop,
                "callbacks": {key: cb.state_dict() for key, cb in self._callbacks().items()},
                "datamodule": datamodule.state_dict() if datamodule is not None else {}}

    def _callbacks(self) -> dict[str, pl.Callback]:
        """The callbacks with a state, by ``state_key`` (as Lightning's checkpoint keys them)."""
        return {str(cb.state_key): cb for cb in self._trainer.callbacks if cb.state_dict()}

    def validate_state_dict(self, state: Mapping[str, Any], where: str) -> None:
        """Refuse a state of another shape before anything is loaded."""
        live = self.state_dict()
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise StateMismatch(f"{where}: not a version-{_STATE_VERSION} state of Lightning's "
                                f"loops (found {state!r:.80})")
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
        epoch = fit.epoch_progress.current
        if epoch.ready > epoch.processed:
            # Saved inside an epoch: re-enter it without its start hooks (they ran before the
            # save) and set the batch counters again once the epoch loop has reset them.
            fit._restart_stage = RestartStage.RESTARTED_MID_EPOCH
            self._pending = dict(state)
        else:
            fit._restart_stage = RestartStage.NONE
            self._pending = None

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


def _shape(tree: Any) -> Any:
    """Keys and value types of a progress tree (what must match to load it)."""
    if isinstance(tree, Mapping):
        return {k: _shape(v) for k, v in tree.items()}
    return type(tree).__name__
