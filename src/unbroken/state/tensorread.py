"""Reading side of the safetensors bytes codec (`tensorfile` writes): a validated buffer into
CPU tensors, each a view of the buffer where its alignment allows. Nothing here touches
files."""

from __future__ import annotations

import struct

import numpy as np
import torch

from ..errors import CorruptCheckpoint
from .stheader import ITEMSIZE, MAX_HEADER_BYTES, _Entry, read_header
from .tensorfile import _ST_BY_NAME

# The NumPy dtype a tensor of each safetensors dtype is read through (same item size; torch
# views it as its own dtype where NumPy has none).
_AS_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.int16,
             "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
             "BOOL": np.bool_, "C64": np.complex64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
             "U16": np.int16, "U32": np.int32, "U64": np.int64}
# Read through another NumPy dtype of the same size, then viewed as their own.
_VIEWED = frozenset(name for name, dt in _ST_BY_NAME.items()
                    if torch.from_numpy(np.empty(0, dtype=_AS_NUMPY[name])).dtype != dt)
# How `_views` reads each dtype: (its item size, the NumPy dtype read, the torch dtype to view
# that as, or None), one lookup a tensor.
_READ_AS = {name: (ITEMSIZE[name], np.dtype(kind), dt if name in _VIEWED else None)
            for name, kind in _AS_NUMPY.items() for dt in (_ST_BY_NAME[name],)}


def decode_safetensors(data: bytes | memoryview, where: str
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a safetensors buffer (validated first) into CPU tensors and its metadata.

    From a writable memoryview (``LocalFS.read_file(..., aligned=True)``) each tensor is a
    view into it, without a copy, when it sits 64-byte aligned, and an aligned copy
    otherwise: vectorized reductions (``dot``) round differently at other alignments, and a
    restored run must compute exactly as the uninterrupted one did."""
    from safetensors.torch import load

    header, metadata, entries = read_header(data, where, MAX_HEADER_BYTES)
    if not header:
        return {}, metadata
    if isinstance(data, memoryview) and not data.readonly:
        # The header check proved every span in bounds, tiling the data exactly, and sized
        # for its dtype and shape.
        base = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
        address = np.frombuffer(data, dtype=np.uint8).ctypes.data + base
        try:
            return _views(data, entries, base, address), metadata
        except KeyError:  # (its lookup of a dtype unbroken never writes: no check a tensor)
            _refuse_foreign_dtypes(entries, where)
            raise
    _refuse_foreign_dtypes(entries, where)
    try:
        return load(bytes(data)), metadata
    except Exception as e:  # the parser's own error type; we already validated the header
        raise CorruptCheckpoint(f"{where}: safetensors could not parse it ({e})") from None


def _refuse_foreign_dtypes(entries: list[_Entry], where: str) -> None:
    """A dtype the format defines but unbroken never writes (F4, F8_E8M0, ...): corrupt."""
    for key, name, *_ in entries:
        if name not in _ST_BY_NAME:
            raise CorruptCheckpoint(f"{where}: tensor {key!r} has dtype {name}, which unbroken "
                                    f"does not restore (it writes {', '.join(_ST_BY_NAME)})")


def _views(data: memoryview, entries: list[_Entry], base: int, address: int
           ) -> dict[str, torch.Tensor]:
    """Every tensor of a validated header (its `_Entry`s) as a view into ``data`` (whose data
    section starts at byte ``base``, at ``address`` in memory), without a copy where it sits
    64-byte aligned.

    Each tensor gets a storage of exactly its own bytes: a view of a larger storage would be
    copied whole by ``copy.deepcopy`` (torch deep-copies param_groups, extras may deep-copy
    what they load) and by anything else that copies storages, and RNG-state APIs read a
    uint8 state from its storage's first byte. (Per-tensor costs matter: 10,000 small tensors
    are common. A slice of one NumPy array per dtype and ``torch.from_numpy`` cost what one
    ``as_strided`` costs.)"""
    out: dict[str, torch.Tensor] = {}
    from_numpy, array = torch.from_numpy, np.ndarray
    for key, name, shape, begin, end in entries:
        at = address + begin
        size, np_dtype, viewed = _READ_AS[name]
        if not at % size and end != begin:
            # (one NumPy array of exactly its bytes and shape: the cheapest way to a tensor
            # with a storage of its own, ~0.8 us)
            t = from_numpy(array(shape, np_dtype, data, base + begin))
            if viewed is not None:  # no NumPy dtype of its own (bfloat16, float8, uint16-64)
                t = t.view(viewed)
        elif end == begin:
            out[key] = torch.empty(shape, dtype=_ST_BY_NAME[name])
            continue
        else:
            t = torch.frombuffer(data, dtype=_ST_BY_NAME[name], count=(end - begin) // size,
                                 offset=base + begin)
            if len(shape) != 1:
                t = t.reshape(shape)
        if at % 64 and end - begin > size:
            # a fresh allocation (64-byte aligned), copied as bytes: vectorized reductions
            # (``dot``) round differently at other alignments, and a restored run must compute
            # exactly as the uninterrupted one did (one element has nothing to vectorize); a
            # bool's clone would make any nonzero byte 1
            t = t.view(torch.uint8).clone().view(t.dtype) if size == 1 else t.clone()
        out[key] = t
    return out


