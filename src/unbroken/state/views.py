"""A tensor's data address and what makes two tensor objects one view of the same data (the
encoder stores such views once), with the refusals of a tensor whose data cannot be read."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedValue
from .freed import shortfall, unheld


def uninitialized(path: str, t: torch.Tensor) -> Exception:
    """The refusal of a lazy module's parameter or buffer before its first forward (it has no
    shape or data yet; torch raises a ValueError when asked for its address)."""
    if not isinstance(t, UNINITIALIZED):
        return UnsupportedValue(f"{path}: a {type(t).__name__} whose data cannot be read "
                                "cannot be stored")
    return UnsupportedValue(f"{path}: an uninitialized parameter of a lazy module (e.g. "
                            "LazyLinear) that has not run yet holds no data to store; run one "
                            "forward pass, or otherwise materialize the lazy modules, before "
                            "saving")


def address(t: torch.Tensor, path: str) -> int:
    """``t``'s data address (its storage's plus its offset), or 0 for a tensor without storage
    of its own (a DTensor, an empty or meta tensor). Refuses a lazy module's uninitialized
    parameter, and a tensor whose storage holds fewer bytes than it reaches (`shortfall`:
    freed, or resized smaller under it)."""
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):  # a DTensor has no storage of its own
        return 0
    except ValueError:  # (what torch raises for a lazy module's parameter)
        raise uninitialized(path, t) from None
    short = shortfall(t, ptr)
    if short is not None:
        raise UnsupportedValue(unheld(path, t, short))
    return ptr


# A lazy module's parameter or buffer before its first forward (torch does not export the
# class's name to type checkers).
UNINITIALIZED: type = getattr(torch.nn.parameter, "UninitializedTensorMixin")  # noqa: B009


def view_ident(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensor objects one view of the same data (tied weights: two state_dict
    entries of one parameter); None for a tensor without memory of its own (empty, or a
    DTensor)."""
    try:
        ptr = t.data_ptr()  # (the storage's address plus the offset: one call for both)
    except (RuntimeError, NotImplementedError):  # a DTensor has no storage of its own
        return None
    if ptr == 0:
        return None
    # A conjugate or negated view shares its base's memory, not its values (``z.conj().imag``
    # is a real tensor with the negative bit).
    return (ptr, t.shape, t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg())
