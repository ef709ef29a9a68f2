"""The running epoch aggregates of training metrics for the Lightning adapter
(`unbroken.integrations.lightning`): what ``self.log(..., on_epoch=True)`` has accumulated so
far in the epoch, saved with the loop state (`._lightning_loops._LoopState`) and rebuilt in
the Trainer on restore.

Why: Lightning keeps each metric logged during training as a ``_ResultMetric`` in the
training epoch loop's ``_ResultCollection`` (a running sum or extreme and, for a mean, the
summed batch sizes) and reduces it only at the epoch's end. Neither Lightning's checkpoint
nor the model holds it, so a run resumed mid-epoch would report (and let a plateau scheduler
or ``EarlyStopping`` act on) an epoch value made of the batches after the resume only.

Each entry is saved as plain values: its key, the fields of its ``_Metadata`` that
``self.log`` sets (the reduction by name: mean, sum, max or min, torch's or the builtin, as
Lightning accepts them), its ``value`` and ``cumulated_batch_size`` tensors, the last step
value (``_forward_cache``), the update count and whether it was reset at an epoch's end and
not logged since; nothing is pickled. A restore rebuilds the entries with the same metadata,
so the next ``self.log`` of the metric accumulates into them as in the uninterrupted run
(Lightning refuses a ``log`` whose metadata differ from the entry's). A ``Metric`` logged per
step only is rebuilt around the module's own metric object (found by its attribute name)
with its last step value.

In a job of several processes each rank accumulates its own share (``sync_dist=True`` reduces
the shares when the value is computed, not as it accumulates): the part holding this state is
stored per rank (`unbroken.PerRank`), each rank saving and restoring its own.

Refused with `UnsupportedSetup`, naming the metric, at the first batch that logs it and at
any save: a ``torchmetrics.Metric`` logged with ``on_epoch=True`` (its running state lives in
the metric object, whose states are not saved with the module), and a ``sync_dist_group`` (a
process group cannot be stored)."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.connectors.logger_connector.result import (
    _Metadata,
    _ResultCollection,
    _ResultMetric,
    _Sync,
)
from torchmetrics import Metric

from ..errors import CorruptCheckpoint, StateMismatch, UnsupportedSetup

# The reductions ``self.log(reduce_fx=...)`` accepts, by name. The builtins are kept apart
# from torch's: Lightning compares the function itself when the metric is logged again.
_REDUCTIONS: dict[str, Callable[..., Any]] = {
    "mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min,
    "builtins.sum": builtins.sum, "builtins.max": builtins.max, "builtins.min": builtins.min}
_FLAGS = ("prog_bar", "logger", "on_step", "on_epoch", "enable_graph", "add_dataloader_idx",
          "rank_zero_only", "tensor", "reset")
_OPTIONAL = (("dataloader_idx", int), ("metric_attribute", str))


def training_results(trainer: pl.Trainer) -> _ResultCollection:
    """The collection ``self.log`` fills during training (the fit loop's training epoch loop's,
    whichever loop is active: a save may run while validation holds the Trainer)."""
    return trainer.fit_loop.epoch_loop._results


def save_results(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """The entries of the training results as stored values (tensors detached and copied: a
    later in-place update must not reach a save in flight), in logging order; or
    `UnsupportedSetup` naming the first entry that cannot be saved faithfully."""
    # (Entries reset at an epoch's end are kept too: a metric object's entry keeps its update
    # count and last step value across epochs, and the next ``log`` compares metadata.)
    return [_entry(key, metric) for key, metric in training_results(trainer).items()]


def check_results(trainer: pl.Trainer) -> None:
    """Refuse, as `save_results` would, an entry that cannot be saved (called as soon as
    training has logged, so that a run fails at its first batch, not at its first save)."""
    for key, metric in training_results(trainer).items():
        _refusal(key, metric)


def _refusal(key: str, metric: _ResultMetric) -> None:
    meta = metric.meta
    what = f"self.log({meta.name!r}, ...) in {meta.fx} (training results key {key!r})"
    if _name_of(meta.reduce_fx) is None:
        raise UnsupportedSetup(
            f"{what}: reduce_fx={meta.reduce_fx!r} cannot be saved by name; the callback saves "
            "the running epoch aggregates of mean, sum, max or min reductions only")
    sync = meta._sync
    if sync is not None and sync.group is not None:
        raise UnsupportedSetup(
            f"{what}: sync_dist_group={sync.group!r} is a process group, which cannot be "
            "saved without pickle; drop sync_dist_group")
    running = meta.on_epoch and not metric.has_reset
    # (A metric object's entry reset at the epoch's end holds nothing running: Lightning reset
    # the object too, so the module's new object in a resumed process is the same.)
    if not metric.is_tensor and running:
        raise UnsupportedSetup(
            f"{what} logs a torchmetrics {type(metric.value).__qualname__} with "
            "on_epoch=True: its running epoch state lives in the metric object, which the "
            "callback cannot save; log a tensor instead (e.g. self.log(name, "
            "self.metric(preds, target), on_epoch=True) averages its per-batch values) or "
            "log the metric on_epoch=False")
    cache = metric._forward_cache
    if cache is not None and not isinstance(cache, torch.Tensor):
        raise UnsupportedSetup(
            f"{what}: its step value is a {type(cache).__qualname__}, not a tensor; log a "
            "tensor")


def _entry(key: str, metric: _ResultMetric) -> dict[str, Any]:
    _refusal(key, metric)
    meta = metric.meta
    sync = meta._sync
    cache = metric._forward_cache
    entry: dict[str, Any] = {
        "key": key, "fx": meta.fx, "name": meta.name, "reduce_fx": _name_of(meta.reduce_fx),
        "prog_bar": meta.prog_bar, "logger": meta.logger, "on_step": meta.on_step,
        "on_epoch": meta.on_epoch, "enable_graph": meta.enable_graph,
        "add_dataloader_idx": meta.add_dataloader_idx, "dataloader_idx": meta.dataloader_idx,
        "metric_attribute": meta.metric_attribute,
        "rank_zero_only": bool(sync is not None and sync.rank_zero_only),
        "sync_dist": bool(sync is not None and sync.should),
        "tensor": metric.is_tensor, "reset": bool(metric.has_reset),
        "updates": int(metric._update_count),
        "forward_cache": cache.detach().clone() if cache is not None else None}
    if metric.is_tensor:
        entry["value"] = metric.value.detach().clone()
        if meta.is_mean_reduction:
            entry["cumulated_batch_size"] = metric.cumulated_batch_size.detach().clone()
    return entry


def _name_of(reduce_fx: Any) -> str | None:
    return next((name for name, fn in _REDUCTIONS.items() if fn is reduce_fx), None)


def check_saved(saved: Any, module: torch.nn.Module, where: str) -> None:
    """Refuse saved results before anything is loaded: an entry no save writes is corrupt
    (`CorruptCheckpoint`: the previous generation is used), one naming a metric object the
    module does not hold is a `StateMismatch`."""
    if not isinstance(saved, list):
        raise CorruptCheckpoint(f"{where}: the saved training results are not a list (found "
                                f"{saved!r:.80}); a save writes a list")
    for i, entry in enumerate(saved):
        problem = _problem(entry)
        key = entry.get("key") if isinstance(entry, Mapping) else None
        if problem:
            raise CorruptCheckpoint(
                f"{where}: saved training results entry {i} ({key!r:.80}): {problem}; no save "
                "writes that: the generation is damaged")
        attribute = entry.get("metric_attribute")
        if not entry["tensor"] and not isinstance(_submodule(module, attribute), Metric):
            raise StateMismatch(
                f"{where}: saved training results entry {i} ({key!r:.80}) logged the "
                f"torchmetrics Metric at {attribute!r}, which the module does not hold: "
                "resume with the run's module, or start a new run folder")


def _problem(entry: Any) -> str | None:
    """What no save writes in one saved entry, or None."""
    if not isinstance(entry, Mapping):
        return f"not a mapping (found {entry!r:.60})"
    for name in ("key", "fx", "name"):
        if not isinstance(entry.get(name), str):
            return f"{name} is {entry.get(name)!r:.60}, not a str"
    if entry.get("reduce_fx") not in _REDUCTIONS:
        return f"reduce_fx {entry.get('reduce_fx')!r:.60} is none of {sorted(_REDUCTIONS)}"
    flags = {name: entry.get(name) for name in _FLAGS}
    if any(type(v) is not bool for v in flags.values()):
        return f"{flags!r:.200}: each of {list(_FLAGS)} must be true or false"
    if not (entry["on_step"] or entry["on_epoch"]):
        return "neither on_step nor on_epoch"
    if type(entry.get("sync_dist", False)) is not bool:  # (absent before version 5: False)
        return f"sync_dist is {entry.get('sync_dist')!r:.60}, not true or false"
    for name, kind in _OPTIONAL:
        if entry.get(name) is not None and type(entry.get(name)) is not kind:
            return f"{name} is {entry.get(name)!r:.60}, neither None nor a {kind.__name__}"
    # (Lightning's key of a metric logged in training: its hook, then its name)
    if entry["key"] != f"{entry['fx']}.{entry['name']}" and entry.get("dataloader_idx") is None:
        return f"its key is not {entry['fx']!r}.{entry['name']!r}, as Lightning names it"
    if type(entry.get("updates")) is not int or entry["updates"] < 0:
        return f"updates is {entry.get('updates')!r:.60}, not a count"
    if entry.get("forward_cache") is not None and not isinstance(entry["forward_cache"],
                                                                 torch.Tensor):
        return "its step value is not a tensor"
    if entry["tensor"]:
        # (What ``self.log`` accumulates: one float element, and for a mean an integer count.)
        value, count = entry.get("value"), entry.get("cumulated_batch_size")
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or (
                not value.is_floating_point()):
            return f"its value is {value!r:.60}, not a one-element float tensor"
        if entry["reduce_fx"] == "mean" and (not isinstance(count, torch.Tensor) or (
                count.numel() != 1 or count.is_floating_point() or count.is_complex())):
            return "a mean without its cumulated batch size (a one-element integer tensor)"
        return None
    if entry["on_epoch"] and not entry["reset"]:
        return "a running torchmetrics Metric logged on_epoch (never saved)"
    if entry.get("metric_attribute") is None:
        return "a torchmetrics Metric without its attribute name"
    return None


def _submodule(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def load_results(trainer: pl.Trainer, saved: list[Mapping[str, Any]], own: bool = True
                 ) -> None:
    """Put the saved entries (checked by `check_saved`) back as the training results, in
    their order, on the module's device. ``own`` False: the entries another rank saved (this
    rank was not in the saving job, or it saved in one process): their running epoch
    aggregates start empty here, as a rank's own share of the epoch so far is nothing (taking
    the other rank's would count its batches twice in a synced epoch value)."""
    results = training_results(trainer)
    device = trainer.strategy.root_device
    module = trainer.lightning_module
    distributed = trainer._accelerator_connector.is_distributed
    # (Entries of an earlier ``fit`` of this process go: the saved ones replace them all.)
    results.clear()
    for entry in saved:
        meta = _Metadata(
            fx=entry["fx"], name=entry["name"], prog_bar=entry["prog_bar"],
            logger=entry["logger"], on_step=entry["on_step"], on_epoch=entry["on_epoch"],
            reduce_fx=_REDUCTIONS[entry["reduce_fx"]], enable_graph=entry["enable_graph"],
            add_dataloader_idx=entry["add_dataloader_idx"],
            dataloader_idx=entry["dataloader_idx"], metric_attribute=entry["metric_attribute"])
        # As ``LightningModule.log`` builds it (the Trainer's reduce, which it asks for only in
        # a job of several processes; no group: a metric that had one was refused), so the
        # next ``log`` finds equal metadata.
        meta.sync = _Sync(_should=bool(entry.get("sync_dist")) and distributed,
                          fn=trainer.strategy.reduce, _group=None,
                          rank_zero_only=entry["rank_zero_only"])
        metric = _ResultMetric(meta, entry["tensor"])
        if entry["tensor"] and not (entry["on_epoch"] and not own):
            metric.value = entry["value"].to(device)
            if meta.is_mean_reduction:
                metric.cumulated_batch_size = entry["cumulated_batch_size"].to(device)
        elif entry["tensor"]:  # (the reduction's empty aggregate, as `_ResultMetric` makes it)
            metric.to(device)
        else:
            metric.value = module.get_submodule(entry["metric_attribute"])
        cache = entry["forward_cache"]
        metric._forward_cache = cache.to(device) if cache is not None else None
        metric._update_count = entry["updates"]
        metric.has_reset = entry["reset"]
        results[entry["key"]] = metric
    _reconcile(results, {entry["key"] for entry in saved})


# What ``self.log`` may change from one process to the next without changing what is
# accumulated: how the metric is shown (progress bar, logger).
_SHOWN = ("prog_bar", "logger")


def _differences(entry: _ResultMetric, given: dict[str, Any]) -> str:
    """The arguments of a ``log`` that differ from a restored entry's, saved vs given."""
    meta = entry.meta
    saved: dict[str, Any] = {
        "on_step": meta.on_step, "on_epoch": meta.on_epoch,
        "reduce_fx": _name_of(meta.reduce_fx), "enable_graph": meta.enable_graph,
        "add_dataloader_idx": meta.add_dataloader_idx,
        "metric_attribute": meta.metric_attribute,
        "sync_dist": bool(meta._sync is not None and meta._sync.should),
        "rank_zero_only": bool(meta._sync is not None and meta._sync.rank_zero_only)}
    now = {k: (_name_of(v) or v) if k == "reduce_fx" else v for k, v in given.items()
           if k in saved}
    found = [f"{k}={saved[k]!r} saved, {now[k]!r} given" for k in saved
             if k in now and now[k] != saved[k]]
    return ", ".join(found) or "Lightning refused the change"


def _reconcile(results: _ResultCollection, restored: set[str]) -> None:
    """Until each restored entry is logged again: its first ``log`` takes the module's way of
    showing it (a resumed script may drop ``prog_bar``), and a ``log`` with other arguments
    that change what is accumulated is a `StateMismatch` naming the metric, not Lightning's
    "logged twice with different arguments" deep inside the training step."""
    plain = type(results).log

    def log(fx: str, name: str, value: Any, **kwargs: Any) -> None:
        key = f"{fx}.{name}"
        entry = results.get(key)
        if key not in restored or entry is None:
            plain(results, fx, name, value, **kwargs)
            return
        restored.discard(key)
        if not restored:
            del results.log  # (every restored entry met: Lightning's own method again)
        for field in _SHOWN:
            if field in kwargs:
                setattr(entry.meta, field, kwargs[field])
        # Whether the value is reduced across ranks when computed is not what was accumulated
        # (each rank's share is its own either way): Lightning asks for it only in a job of
        # several processes (``sync_dist and is_distributed``), so a run resumed on another
        # number of processes takes this call's.
        if "sync_dist" in kwargs and entry.meta._sync is not None:
            entry.meta.sync.should = bool(kwargs["sync_dist"])
        try:
            plain(results, fx, name, value, **kwargs)
        except MisconfigurationException as e:
            raise StateMismatch(
                f"self.log({name!r}, ...) in {fx} is called with other arguments than in the "
                f"run that saved its running epoch aggregate: {_differences(entry, kwargs)}; "
                "log it as that run did") from e

    results.log = log  # type: ignore[method-assign]
