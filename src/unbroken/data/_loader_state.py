"""What `ResumableLoader` saves beyond the sampler's cursor, and the checks of it on restore
(kept apart from `loader` so that module stays small). They run once per restore.

Besides the cursor, a loader saves the settings its batches depend on, so a resume with
another one is refused (`StateMismatch`, naming both values) instead of silently training on
other data: ``accumulation`` (the update windows), ``loader_seed`` (``ResumableLoader(seed=)``:
a ``collate_fn``'s draws and the workers' base seeds are keyed by it) and, for a map-style
dataset, ``dataset_seed`` (``seeded(dataset, seed=)``, or None when the dataset is not
wrapped: every augmentation draw is keyed by it). A generation saved before a field existed
lacks it and is not checked for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import StateMismatch, shown
from ._checks import INT64_MAX, any_int, damaged, integer
from .sampler import STATE_VERSION
from .seeding import SeededDataset

_WHERE = "data state"


def dataset_seed(dataset: Any) -> int | None:
    """The seed of `seeded` when ``dataset`` is wrapped in it, else None."""
    return dataset.seed if isinstance(dataset, SeededDataset) else None


def settings(accumulation: int, seed: int, dataset: Any, iterable: bool) -> dict[str, Any]:
    """The settings a loader saves beside its cursor (module doc)."""
    fields: dict[str, Any] = {"accumulation": accumulation, "loader_seed": seed}
    if not iterable:  # (seeded() wraps map-style datasets only)
        fields["dataset_seed"] = dataset_seed(dataset)
    else:  # (a map-style dataset's length is its sampler's num_samples)
        fields["length"] = _length(dataset)
    return fields


def _length(dataset: Any) -> int | None:
    """A dataset's ``len()``, when it has one (None for a stream, or a map-style dataset
    read through a batch sampler, without one)."""
    try:
        length = len(dataset)
    except (TypeError, NotImplementedError):
        return None
    return length if type(length) is int and length >= 0 else None


def check_settings(state: Mapping[str, Any], accumulation: int, seed: int, dataset: Any,
                   iterable: bool) -> None:
    """Refuse saved settings that differ from the live loader's (`StateMismatch`) or that no
    run writes (`DamagedDataState`); a field the generation lacks is not checked."""
    if not isinstance(state, Mapping):
        raise StateMismatch(f"{_WHERE}: expected a dict, found {type(state).__name__}")
    if iterable and state.get("kind") != "iterable":  # (what it is before what it holds)
        raise StateMismatch(f"{_WHERE} was not written by a ResumableLoader over an "
                            f"IterableDataset (kind={shown(state.get('kind'))}, not 'iterable')")
    if "accumulation" in state:
        saved = integer(state, "accumulation", _WHERE, 1)
        if saved != accumulation:
            raise StateMismatch(f"{_WHERE}: saved accumulation={saved}, live accumulation="
                                f"{accumulation}: update windows (and so the learning-rate "
                                "schedule per sample) would shift; keep it")
    if "loader_seed" in state:
        saved_seed = any_int(state, "loader_seed", _WHERE)
        if saved_seed != seed:
            raise StateMismatch(
                f"{_WHERE}: saved loader_seed={shown(saved_seed)}, live loader_seed="
                f"{shown(seed)} (ResumableLoader(seed=)): the collate_fn's random draws (and the "
                "workers' base seeds) are keyed by it and would differ from the interrupted "
                f"run's; pass seed={shown(saved_seed)}")
    if "dataset_seed" in state and not iterable:
        saved_seed = any_int(state, "dataset_seed", _WHERE, optional=True)
        live = dataset_seed(dataset)
        if saved_seed != live:
            def how(s: int | None) -> str:
                return "no seeded() wrapper" if s is None else f"seeded(dataset, seed={shown(s)})"
            raise StateMismatch(
                f"{_WHERE}: saved dataset_seed={shown(saved_seed)} ({how(saved_seed)}), live "
                f"dataset_seed={shown(live)} ({how(live)}): every random draw in the dataset's "
                "__getitem__ (augmentation) would differ from the interrupted run's; wrap it "
                f"as {how(saved_seed)}")


def check_iterable(state: Mapping[str, Any], batch_size: int, dataset: Any) -> tuple[int, int]:
    """The cursor ``(epoch, consumed)`` of a saved iterable loader state, checked against the
    live batch size and, when the dataset has one, its length (after `check_settings`)."""
    if "version" in state:
        version = integer(state, "version", _WHERE, 1)
        if version != STATE_VERSION:
            raise StateMismatch(f"{_WHERE} version {version} is not supported (this unbroken "
                                f"reads version {STATE_VERSION})")
    saved = integer(state, "batch_size", _WHERE, 1)
    if saved != batch_size:
        raise StateMismatch(f"{_WHERE}: saved batch_size={saved}, live batch_size={batch_size}: "
                            "the cursor counts items of the saved batches; keep the batch size")
    # An epoch one below int64's top: the rollover after it must still fit the counters.
    epoch = integer(state, "epoch", _WHERE, 0, INT64_MAX - 1)
    consumed = integer(state, "consumed", _WHERE, 0)
    if consumed % batch_size:  # every update consumes whole batches, except at an epoch's end
        damaged(_WHERE, "consumed", f"a multiple of batch_size={batch_size} (updates consume "
                "whole batches; a pass that ends rolls over to the next epoch's 0)", consumed)
    length = _length(dataset)  # (a stream without a length: nothing to compare)
    if "length" in state:  # (states since session 28)
        saved_length = any_int(state, "length", _WHERE, optional=True)
        if None not in (saved_length, length) and saved_length != length:
            raise StateMismatch(
                f"{_WHERE}: the saved run's dataset had {shown(saved_length)} items, this one "
                f"{shown(length)} (len(dataset)): an epoch would hold other items than the "
                "interrupted run's; resume with the dataset it was saved with")
    if length is not None and consumed > length:
        raise StateMismatch(
            f"{_WHERE}: consumed={consumed} items of epoch {epoch}, but len(dataset)={length}: "
            "the resumed pass would skip the rest of the epoch. The dataset is not the one the "
            "checkpoint was saved with (or its __len__ is wrong); resume with that dataset")
    if not isinstance(state.get("dataset"), Mapping):
        damaged(_WHERE, "dataset", "a dict (the dataset's state_dict())", state.get("dataset"))
    return epoch, consumed
