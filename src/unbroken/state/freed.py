"""A tensor whose storage holds fewer bytes than the tensor reaches: freed (resized to 0 bytes,
as FSDP does with a parameter it sharded), shrunk under it (``untyped_storage().resize_``), or
without memory of its own (a wrapper subclass made by ``_make_wrapper_subclass``, whose data
is another tensor's). A copy of its bytes would read past the storage's end: from address 0
plus its offset (the process crashed, SIGSEGV), or another allocation's bytes, saved silently
as its values.

Looked at where a tensor's address is new to its reader (a save's plans, kept from one save to
the next, read each tensor's address anyway): a resize moves a storage's memory, unless it
frees it and a later one gets the same address back (``resize_(0)``, then ``resize_(n)``
smaller than before), which is then read as every torch operation on that tensor reads it."""

from __future__ import annotations

import torch

# Data addresses below this may be a storage's without memory (address 0) plus an offset (heap
# addresses are far above it: Linux ~2**46).
LOW_ADDRESS = 1 << 40
_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError)


def shortfall(t: torch.Tensor, ptr: int) -> tuple[int, int] | None:
    """(the bytes ``t``'s storage holds, the bytes ``t`` reaches: its offset, shape and strides)
    when the storage holds fewer, or holds no memory of its own (0: ``ptr``, ``t``'s data
    address, is its offset's bytes past address 0); None for any other tensor (an empty one,
    a meta one, one without a storage: a DTensor). ~0.5 us (see module doc)."""
    try:
        n = t.numel()
        if n == 0 or t.is_meta:
            return None
        held = t.untyped_storage().nbytes()
        if ptr < LOW_ADDRESS and ptr == t.storage_offset() * t.element_size():
            held = 0  # (its bytes would be read from address 0 on: a wrapper's, a freed one)
        if t.is_contiguous():
            reach = t.storage_offset() + n
        else:  # (strides are never negative in torch)
            reach = t.storage_offset() + 1 + sum((s - 1) * st
                                                 for s, st in zip(t.shape, t.stride()))
        reach = int(reach) * t.element_size()
    except _ERRORS:  # (a tensor without a storage of its own: its own kind reads it)
        return None
    return (held, reach) if held < reach else None


def unheld(path: str, t: torch.Tensor, short: tuple[int, int]) -> str:
    """The refusal of ``t`` at ``path``, whose storage holds ``short``'s bytes of those it
    reaches (`shortfall`)."""
    held, reach = short
    if held == 0:
        return (f"{path}: a tensor of shape {list(t.shape)} whose storage holds no memory "
                "(freed or resized to 0 bytes, as FSDP does with a parameter it sharded; or a "
                f"{type(t).__name__} whose data is another tensor's); save while it holds its "
                "values (FSDP: its state_dict), return its data as a plain tensor from "
                "state_dict(), or keep it out of the saved state")
    return (f"{path}: a tensor of shape {list(t.shape)} reaches {reach} bytes of its storage, "
            f"which holds {held} (resized smaller under it: untyped_storage().resize_); its "
            "bytes past the storage's end are not its values. Save while its storage holds "
            "it, or keep it out of the saved state")
