"""Pure codec, the decoding half: a JSON skeleton and its named tensors -> the state tree
(`codec` makes them). Everything read here comes from a file: every malformed entry is a
`CorruptCheckpoint` naming it, never an exception from deep inside NumPy or torch, and a
dtype name is only ever looked up in `codec`'s fixed table."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpoint, UnbrokenError
from .codec import _DTYPES, _MAPPING_TYPES, MAX_DEPTH, TAG


def _dtype_from_name(name: object, where: str) -> torch.dtype:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"{where}: unknown torch dtype {name!r:.60}")  # (decode_tree's)
    return dtype


def _shape(value: object, count: int, what: str) -> list[int]:
    """A stored shape: a list of non-negative ints whose product is ``count`` (and whose
    strides fit an int64 even when a zero dimension makes the product 0). A ValueError
    otherwise, which `decode_tree` reports naming the file."""
    if (not isinstance(value, list) or len(value) > 64
            or not all(type(d) is int and 0 <= d < 1 << 62 for d in value)
            or math.prod(value) != count or math.prod(max(d, 1) for d in value) >= 1 << 62):
        raise ValueError(f"{what}: shape {value!r:.80} does not hold {count} elements")
    return value



def decode_tree(skeleton: Any, tensors: Mapping[str, torch.Tensor], where: str = "state") -> Any:
    """Rebuild the tree from its skeleton; ``where`` names the file in error messages."""
    views: dict[str, torch.Tensor] = {}  # a raw tensor's view, by key (`_decode_tagged`)
    get = tensors.get

    def dec(obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptCheckpoint(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(obj, list):
            return [dec(v, depth + 1) for v in obj]
        if not isinstance(obj, dict):
            return obj
        tag = obj.get(TAG)
        if tag is None:
            if depth >= MAX_DEPTH:  # (its children fail the depth check)
                return {k: dec(v, depth + 1) for k, v in obj.items()}
            out = {}
            for k, v in obj.items():
                # (the common leaf, a tensor's reference, without a call: state dicts hold
                # thousands; once a raw tensor's view was made, `_decode_tagged` says)
                if type(v) is dict and len(v) == 2 and v.get(TAG) == "tensor" and not views:
                    key = v.get("key")
                    if type(key) is str:
                        t = get(key)
                        if t is not None:
                            out[k] = t
                            continue
                out[k] = dec(v, depth + 1)
            return out
        if tag == "tensor" and len(obj) == 2 and not views:  # (the common leaf, as above)
            key = obj.get("key")
            if type(key) is str:
                t = get(key)
                if t is not None:
                    return t
        try:
            return _decode_tagged(tag, obj, dec, depth, tensors, views)
        except _NotStored as e:
            raise CorruptCheckpoint(
                f"{where}: {e.args[0]} {e.args[1]!r:.60} is referenced but no tensor file of "
                "the part holds it (the skeleton or the list of the part's files was edited, "
                "or a file is missing from it)") from None
        except UnbrokenError:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure on untrusted input is corruption
            raise CorruptCheckpoint(f"{where}: malformed {tag!r:.40} entry "
                                    f"({type(e).__name__}: {e!s:.200})") from None

    return dec(skeleton, 0)


class _NotStored(Exception):
    """(what, key): a reference to a tensor the part's files do not hold (`decode_tree`
    names the file)."""


# The keys each tagged entry may have: anything else means the skeleton was edited.
_TAG_KEYS: dict[str, tuple[frozenset[str], ...]] = {
    "tensor": (frozenset({TAG, "key"}), frozenset({TAG, "key", "dtype", "shape"})),
    # "v": base64 inline (as written before 0.2); "key": raw bytes in the part's tensor file
    "ndarray": (frozenset({TAG, "dtype", "shape", "v"}), frozenset({TAG, "dtype", "shape",
                                                                     "key"})),
    "bytes": (frozenset({TAG, "v"}), frozenset({TAG, "key"})),
    "npscalar": (frozenset({TAG, "dtype", "v"}),),
    "float": (frozenset({TAG, "v"}), frozenset({TAG, "v", "bits"})),  # bits: a NaN's payload
}


def _numpy_dtype(name: object) -> np.dtype[Any]:
    if not isinstance(name, str) or len(name) > 256:
        raise ValueError(f"NumPy dtype {name!r:.60}")
    dtype = np.dtype(name)
    if dtype.hasobject:
        raise ValueError("object arrays are never loaded")
    return dtype


def _raw_bytes(obj: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> memoryview:
    """The bytes of a ``raw`` entry: a 1-D uint8 tensor in the tensor file, or base64."""
    if "v" in obj:
        return memoryview(base64.b64decode(obj["v"], validate=True))
    key = obj["key"]
    t = tensors.get(key) if isinstance(key, str) else None
    if t is None:
        raise _NotStored("raw bytes", key)
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"raw bytes stored as {t.dtype} {tuple(t.shape)}, expected 1-D uint8")
    return t.numpy().data


def _decode_tagged(tag: str, obj: dict[str, Any], dec: Any, depth: int,
                   tensors: Mapping[str, torch.Tensor], views: dict[str, torch.Tensor]) -> Any:
    if frozenset(obj) not in _TAG_KEYS.get(tag, (frozenset({TAG, "v"}),)):
        raise ValueError(f"unexpected keys {sorted(obj)}")
    if tag == "tensor":
        key = obj["key"]
        if not isinstance(key, str):
            raise ValueError(f"tensor key {key!r:.60}")
        if key not in tensors:
            raise _NotStored("tensor", key)
        t = tensors[key]
        if "dtype" not in obj:  # (every reference to a key: the one tensor, or view, made of it)
            return views.get(key, t)
        if key in views:  # (and every raw reference to it: one view)
            return views[key]
        dtype = _dtype_from_name(obj["dtype"], key)
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError(f"raw tensor stored as {t.dtype} {tuple(t.shape)}")
        size = torch.empty(0, dtype=dtype).element_size()
        if t.numel() % size:
            raise ValueError(f"{t.numel()} bytes do not hold whole {dtype} elements")
        views[key] = t = t.view(dtype).reshape(_shape(obj["shape"], t.numel() // size, repr(key)))
        return t
    if tag == "int":
        return int(obj["v"], 16)
    if tag == "float":
        value = float(obj["v"])
        if math.isfinite(value):
            raise ValueError("finite float stored as special value")
        if "bits" in obj:  # a NaN's payload, kept (see `codec`)
            bits = obj["bits"]
            if type(bits) is not str or len(bits) != 16 or not math.isnan(value):
                raise ValueError(f"NaN bits {bits!r:.40}")
            value = struct.unpack("<d", int(bits, 16).to_bytes(8, "little"))[0]
            if not math.isnan(value) or math.copysign(1, value) != math.copysign(1, float(
                    obj["v"])):
                raise ValueError(f"NaN bits {bits!r:.40} are not those of {obj['v']!r:.10}")
        return value
    if tag == "tuple":
        return tuple(dec(v, depth + 1) for v in obj["v"])
    if tag == "size":
        dims = obj["v"]
        if not isinstance(dims, list) or not all(type(d) is int and 0 <= d < 1 << 62
                                                 for d in dims):
            raise ValueError(f"torch.Size dimensions {dims!r:.60}")
        return torch.Size(dims)
    if tag in _MAPPING_TYPES:
        # (keys stored plain, str and int, are returned as they are without a call)
        items = {k if type(k) is int or type(k) is str else dec(k, depth + 1):
                 dec(v, depth + 1) for k, v in obj["v"]}
        return items if tag == "dict" else _MAPPING_TYPES[tag](items)
    if tag == "bytes":
        return bytes(_raw_bytes(obj, tensors))
    if tag == "ndarray":
        np_dtype = _numpy_dtype(obj["dtype"])
        raw = _raw_bytes(obj, tensors)
        if np_dtype.itemsize == 0 or raw.nbytes % np_dtype.itemsize:
            raise ValueError(f"{raw.nbytes} bytes do not hold whole {np_dtype} elements")
        shape = _shape(obj["shape"], raw.nbytes // np_dtype.itemsize, "ndarray")
        array = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
        if np_dtype.kind == "U" and array.size and int(
                array.view(np_dtype.byteorder.replace("|", "=") + "u4").max()) > 0x10FFFF:
            raise ValueError("a string array holds code points beyond U+10FFFF")
        # A view into the tensor file's buffer, which the restored tree owns; base64 bytes
        # are immutable and an unaligned view is slow: those are copied.
        return array.copy() if "v" in obj or not array.flags.aligned else array
    if tag == "npscalar":
        np_dtype = _numpy_dtype(obj["dtype"])
        scalar = base64.b64decode(obj["v"], validate=True)
        if len(scalar) != np_dtype.itemsize:
            raise ValueError(f"{len(scalar)} bytes for a {np_dtype} scalar")
        return np.frombuffer(scalar, dtype=np_dtype)[0]
    if tag == "dtype":
        return _dtype_from_name(obj["v"], "skeleton")
    if tag == "device":
        return torch.device(obj["v"])
    raise ValueError(f"unknown tag {tag!r}")
