"""A tensor whose storage holds no memory: its data would be read from address 0 (plus its
offset), and the process crashed (SIGSEGV) instead of refusing it."""

from __future__ import annotations

import torch

# Data addresses below this are looked at again (`freed`): a view of a freed storage has its
# offset's bytes as its address. Heap addresses are far above it where it matters (Linux:
# ~2**46); where they are not, every address is looked at again (correct, slower).
LOW_ADDRESS = 1 << 40


def freed(t: torch.Tensor, ptr: int) -> bool:
    """Whether ``t``, whose data address is ``ptr``, views a storage that holds no memory
    (freed: ``untyped_storage().resize_(0)``, as FSDP does with a parameter it sharded, or
    its flat parameter of which ``t`` is a view): its bytes would be read from its offset
    past address 0, and the process crashed (SIGSEGV)."""
    return (ptr < LOW_ADDRESS and t.numel() != 0 and not t.is_meta
            and ptr == t.storage_offset() * t.element_size())
