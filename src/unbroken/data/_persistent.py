"""Persistent workers hold the copies of a map-style dataset, its ``collate_fn`` and its
``worker_init_fn`` made when they started: an attribute the loop sets between epochs (a
curriculum's ``dataset.level = epoch``, a masking rate kept on a collate object) never reaches
them, while a resumed run's new workers start from the objects as they are then, so the two
runs read different items. The loader starts its persistent workers again when those objects'
attributes changed since the workers started (`workers_key`), in every run alike (as it does
for an iterable dataset's state)."""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np

_PLAIN = (int, float, str, bytes, bool, type(None), np.generic)
_WIDE = 64  # a list, tuple or dict with more entries is known by its identity and length
_NODES = 4096  # values looked at per key at most; the rest are known by their identity
_DEPTH = 32  # (wrappers nest a few levels; a chain of objects this deep is known by identity)


def workers_key(*objects: Any) -> Any:
    """What changes when the loop sets an attribute of one of ``objects`` (a dataset and what
    its workers copy with it), of an object or a container it holds (``ds.aug.level``,
    ``ds.cfg["level"]``), of a dataset it wraps (``Subset``, ``ConcatDataset``'s list,
    `unbroken.seeded`), at any depth, or of the object a bound method belongs to: each plain
    value itself (a NaN as itself), an object or container by its type and contents (one
    replaced by an equal one changes nothing), anything else by its identity (an array
    replaced, or a long list; changed in place, it is not seen)."""
    return _Key().of(objects, 0)


class _Key:
    """One key's walk: the values looked at so far, and the objects on the path to the one
    looked at (an object holding itself is known by its identity the second time)."""

    def __init__(self) -> None:
        self.nodes = 0
        self.path: set[int] = set()

    def of(self, value: Any, depth: int) -> Any:
        if isinstance(value, _PLAIN):
            return ("nan",) if value != value else (type(value), value)
        self.nodes += 1
        if self.nodes > _NODES or depth > _DEPTH or id(value) in self.path:
            return id(value)
        kind = type(value)
        if isinstance(value, (list, tuple, dict)):  # (an OrderedDict, a named tuple too)
            if len(value) > _WIDE:
                return id(value), len(value)
            entries: Any = value
        elif kind is types.MethodType:
            entries = (value.__self__, value.__func__)
        elif kind is functools.partial:
            entries = (value.func, value.args, value.keywords)
        else:
            entries = getattr(value, "__dict__", None)
            if not isinstance(entries, dict):  # (a class with __slots__: its slots' values)
                entries = {n: getattr(value, n) for n in _slots(kind) if hasattr(value, n)}
            if not entries:
                return id(value)
        self.path.add(id(value))
        try:
            if isinstance(entries, dict):
                items = list(entries.items())  # (a copy: a worker thread may set one)
                return kind, tuple((k if isinstance(k, (str, int)) else id(k),
                                    self.of(v, depth + 1)) for k, v in items)
            return kind, tuple(self.of(v, depth + 1) for v in entries)
        except RuntimeError:  # (changed while read: known by its identity)
            return id(value)
        finally:
            self.path.discard(id(value))


def _slots(kind: type) -> list[str]:
    """The slot names a class and its bases declare (``__slots__``: a string or names)."""
    names: list[str] = []
    for k in kind.__mro__:
        declared = k.__dict__.get("__slots__", ())
        names += [declared] if isinstance(declared, str) else [n for n in declared
                                                                 if isinstance(n, str)]
    return [n for n in names if n not in ("__dict__", "__weakref__")]
