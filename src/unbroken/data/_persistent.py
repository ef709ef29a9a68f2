"""Persistent workers hold the copy of a map-style dataset made when they started: an
attribute the loop sets between epochs (a curriculum's ``dataset.level = epoch``) never
reaches them, while a resumed run's new workers start from the dataset as it is then, so the
two runs read different items. The loader starts its persistent workers again when the
dataset's attributes changed since they started (`dataset_key`), in every run alike (as it
does for an iterable dataset's state)."""

from __future__ import annotations

from typing import Any

import torch.utils.data

_PLAIN = (int, float, str, bytes, bool, type(None))


def dataset_key(dataset: Any, depth: int = 3) -> Any:
    """What changes when the loop sets an attribute of ``dataset`` or of a dataset it wraps
    (``depth`` levels down): each plain value itself, any other object by its identity (a
    list or array replaced; changed in place, it is not seen)."""
    attributes = getattr(dataset, "__dict__", None)
    if not isinstance(attributes, dict) or depth == 0:
        return id(dataset)
    return tuple(
        (k, v if type(v) in _PLAIN else dataset_key(v, depth - 1)
         if isinstance(v, torch.utils.data.Dataset) else id(v))
        for k, v in attributes.items())
