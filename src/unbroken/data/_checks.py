"""Checks of saved data states (sampler, loader, packer), run once per restore.

Two kinds of refusal, following the rest of unbroken:

* a value **no run writes** (a bool or a float where an int belongs, an int past int64, a
  cursor off a batch boundary): `DamagedDataState`, a `CorruptCheckpoint` (the generation is
  refused by name and the previous verified one is used), which is also a `StateMismatch`,
  what these refusals raised before, so handlers written for that still catch them;
* a **valid setting that differs** from the live one (another batch size, seed,
  accumulation): `StateMismatch`, raised by the callers, naming both values.

Types are exact (``type(x) is int``): ``True == 1`` and ``50.0 == 50`` in Python, so an
equality test alone takes a bool or a float for the int a run writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

from ..errors import CorruptCheckpoint, StateMismatch, shown

INT64_MAX = (1 << 63) - 1  # what the counters part (and so a data epoch) can be saved as
_DAMAGED = "no run writes it: the generation is damaged (edited or corrupted)"


class DamagedDataState(CorruptCheckpoint, StateMismatch):
    """A data state holding a value no run writes (see the module doc)."""


def damaged(where: str, key: str, expected: str, found: Any) -> NoReturn:
    """Raise `DamagedDataState` naming the key, what was expected and what was found."""
    raise DamagedDataState(f"{where}: {key}={shown(found)} ({type(found).__name__}), expected "
                           f"{expected}; {_DAMAGED}")


def counted(value: Any) -> bool:
    """A count a constructor takes (a batch size, an accumulation window): an int, or a NumPy
    one, in [1, 2**63), never a bool (saved as ``true``, which `integer` never reads back)."""
    return bool(isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                and 1 <= value <= INT64_MAX)


def integer(state: Mapping[str, Any], key: str, where: str, lo: int = 0,
            hi: int = INT64_MAX) -> int:
    """``state[key]`` when it is an int (not a bool) in ``[lo, hi]``; else `DamagedDataState`."""
    value = state.get(key)
    # (bounded before any message shows it: shown() cuts an int of thousands of digits)
    if type(value) is not int or not lo <= value <= hi:
        damaged(where, key, f"an int in [{lo}, {hi}]", value)
    return value


def flag(state: Mapping[str, Any], key: str, where: str) -> bool:
    """``state[key]`` when it is a bool (not 0 or 1); else `DamagedDataState`."""
    value = state.get(key)
    if type(value) is not bool:
        damaged(where, key, "true or false", value)
    return value


def any_int(state: Mapping[str, Any], key: str, where: str, optional: bool = False
            ) -> int | None:
    """``state[key]`` when it is an int of any size (a seed; not a bool), or None when
    ``optional`` (an unset setting such as Packer's ``eos_id``); else `DamagedDataState`."""
    value = state.get(key)
    if type(value) is not int and not (optional and value is None):
        damaged(where, key, "an int" + (" or null" if optional else ""), value)
    return value


def located(error: StateMismatch, where: str) -> StateMismatch:
    """``error`` with ``where`` (the file and part) in front, of the same class."""
    return type(error)(f"{where}: {error}")
