"""A tensor whose storage holds fewer bytes than the tensor reaches: freed (resized to 0 bytes,
as FSDP does with a parameter it sharded) or shrunk under it (``untyped_storage().resize_``).
A copy of it would read past the storage's end: from address 0 plus its offset (the process
crashed, SIGSEGV), or another allocation's bytes, saved silently as its values."""

from __future__ import annotations

import torch

_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError)


def shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """(the bytes ``t``'s storage holds, the bytes ``t`` reaches: its offset, shape and strides)
    when the storage holds fewer; None for any other tensor (an empty one, one without a
    storage of its own). ~0.5 us: read where a tensor's address is new to its reader (a
    resize moves a storage's memory, so a tensor met again at its address is as it was)."""
    try:
        n = t.numel()
        if n == 0:
            return None
        held = t.untyped_storage().nbytes()
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
                "(freed or resized to 0 bytes, as FSDP does with a parameter it sharded); save "
                "while it holds its values (FSDP: its state_dict), or keep it out of the "
                "saved state")
    return (f"{path}: a tensor of shape {list(t.shape)} reaches {reach} bytes of its storage, "
            f"which holds {held} (resized smaller under it: untyped_storage().resize_); its "
            "bytes past the storage's end are not its values. Save while its storage holds "
            "it, or keep it out of the saved state")
