"""Persistent workers hold the copy of a map-style dataset made when they started: an
attribute the loop sets between epochs (a curriculum's ``dataset.level = epoch``) never
reaches them, while a resumed run's new workers start from the dataset as it is then, so the
two runs read different items. The loader starts its persistent workers again when the
dataset's attributes changed since they started (`dataset_key`), in every run alike (as it
does for an iterable dataset's state)."""

from __future__ import annotations

from typing import Any

import numpy as np

_PLAIN = (int, float, str, bytes, bool, type(None), np.generic)
_WIDE = 64  # a container or object with more entries is known by its identity alone
_DEPTH = 3


def dataset_key(dataset: Any, depth: int = _DEPTH) -> Any:
    """What changes when the loop sets an attribute of ``dataset``, of an object or a small
    dict it holds (``ds.aug.level``, ``ds.cfg["level"]``), or of a dataset it wraps, down to
    ``depth`` levels: each plain value itself (a NaN as itself), any other object by its
    identity (a list or array replaced; changed in place, it is not seen)."""
    if isinstance(dataset, _PLAIN):
        return ("nan",) if dataset != dataset else (type(dataset), dataset)
    entries = (dataset if type(dataset) is dict else getattr(dataset, "__dict__", None))
    if (not isinstance(entries, dict) or not entries or depth == 0
            or len(entries) > _WIDE and depth < _DEPTH):  # (the dataset's own: all of them)
        return id(dataset)
    try:
        items = list(entries.items())
    except RuntimeError:  # (changed while read: known by its identity)
        return id(dataset)
    return tuple((k if isinstance(k, (str, int)) else id(k), dataset_key(v, depth - 1))
                 for k, v in items)
