"""What a user hands the Checkpointer, checked before anything is written: metrics (real
numbers, NaN and inf kept), every small part's state (a dict the format can store, checked
once when the Checkpointer is built, not hours in at the first save), extras' names, and the
steps the harness asks to save at."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import UnbrokenError, UnsupportedValue
from .state import generation as G
from .state import parts as S
from .state.codec import encode_tree

EXTRA_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}", re.ASCII)  # used with fullmatch


def steps_from_env(name: str) -> frozenset[int]:
    """Comma-separated step numbers from the environment variable ``name``."""
    value = os.environ.get(name, "")
    try:
        return frozenset(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UnbrokenError(f"${name}={value!r}: expected comma-separated step numbers") from None


def dry_encode(parts: Mapping[str, Any]) -> None:
    """Encode every part but the model and optimizer (tensors only, checked at save) once, so
    that a value the format cannot store (a deque, a set) is named with its part and key when
    the Checkpointer is built."""
    small = {name: obj for name, obj in parts.items() if name not in (S.MODEL, S.OPTIMIZER)}
    for name, tree in S.capture(small, torch.nn.Module()).items():
        try:
            G.check_part_tree(name, tree)
            encode_tree(tree, "")
        except UnsupportedValue as e:
            raise UnsupportedValue(f"part {name!r}: {e}; make its state_dict() return "
                                   "tensors, arrays, numbers, strings, bytes, lists, tuples or "
                                   "dicts") from None


def same_number(a: float | None, b: float) -> bool:
    """Equal floats, NaN equal to NaN (a stored NaN metric against a new one)."""
    return a == b or (a is not None and math.isnan(a) and math.isnan(b))


def metric(name: str, value: object) -> float:
    """A metric as a float (NaN and inf are kept: an AMP overflow step has a NaN loss), or
    ``UnsupportedValue`` naming it: checked before anything is written."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedValue(f"metric {name!r}: a tensor of {value.numel()} elements; "
                                   "pass one number")
        value = value.detach().item()
    if (isinstance(value, (bool, complex, np.complexfloating))
            or not isinstance(value, (int, float, np.number))):
        raise UnsupportedValue(f"metric {name!r}: {type(value).__name__} {value!r:.40}; "
                               "metrics are real numbers")
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        shown = f"an int of {len(str(value))} digits" if isinstance(value, int) else \
            f"{value!r:.40}"
        raise UnsupportedValue(f"metric {name!r}: {shown} does not fit a float") from None
