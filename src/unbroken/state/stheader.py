"""A safetensors header, validated without torch: the length field, the JSON, and every
entry's dtype, shape and offsets against the file's size (offsets that tile its data
exactly), so that the parser behind it only ever sees a well-formed file. `tensorfile`
decodes what it validates; `unbroken audit`, which never imports torch, checks a file's
header alone."""

from __future__ import annotations

import struct
from typing import Any

from ..errors import CorruptCheckpoint
from .jsontext import loads_json

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies
# The bytes an element of each safetensors dtype takes (a test checks them against torch).
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4,
            "U64": 8}
# The bits an element of each dtype the format defines takes (the sub-byte ones packed, a
# tensor's bits a whole number of bytes): what `audit` accepts in a foreign file. unbroken
# itself writes and restores those of ITEMSIZE only.
BITS = {**{name: 8 * size for name, size in ITEMSIZE.items()}, "F8_E4M3FNUZ": 8,
        "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}


# A validated header entry: (key, safetensors dtype name, shape, begin, end), in the header's
# order (`read_header`).
_Entry = tuple[str, str, list[int], int, int]


def read_safetensors_header(data: bytes | memoryview, where: str,
                            limit: int = MAX_HEADER_BYTES, size: int | None = None
                            ) -> tuple[dict[str, Any], dict[str, str]]:
    """Validate a safetensors header against the buffer and return (entries, metadata).

    Checks everything the format promises (size limit, dtypes, shapes, offsets that tile the
    data exactly) so that the parser behind it only ever sees a well-formed file. ``size``:
    the whole file's, when ``data`` holds only its beginning (the length field and the
    header: `unbroken audit` reads no more)."""
    header, metadata, _ = read_header(data, where, limit, size)
    return header, metadata


def read_header(data: bytes | memoryview, where: str, limit: int, size: int | None = None
                 ) -> tuple[dict[str, Any], dict[str, str], list[_Entry]]:
    """`read_safetensors_header`, and each entry's fields as checked (`_Entry`): a reader
    of 10,000 small tensors looks each entry up once."""
    total = len(data) if size is None else size
    if total < 8 or len(data) < 8:
        raise CorruptCheckpoint(f"{where}: {total} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > limit:
        raise CorruptCheckpoint(f"{where}: header claims {n} bytes, over the {limit}-byte "
                                "limit readers apply")
    if n > total - 8 or n > len(data) - 8:
        raise CorruptCheckpoint(
            f"{where}: header claims {n} bytes; the file has {total - 8} after the length "
            "field")
    header = loads_json(bytes(data[8:8 + n]), where, limit, unique=False)
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CorruptCheckpoint(f"{where}: __metadata__ must map strings to strings")
    entries: list[_Entry] = []
    expected = 0  # (where the next tensor starts if they tile the data in the header's order)
    for key, entry in header.items():
        # (a plain loop, not all()/math.prod over generators: headers list 10,000 tensors)
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = bound = 1
            ok = (dtype in BITS and type(shape) is list and len(shape) <= 64
                  and type(begin) is int and type(end) is int)
            if ok:
                for d in shape:
                    if type(d) is not int or d < 0:
                        ok = False
                        break
                    count *= d
                    bound *= d or 1
                # strides must fit torch's int64 even when a zero makes the count 0
                ok = ok and bound < 1 << 62
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CorruptCheckpoint(f"{where}: malformed header entry for tensor {key!r}")
        bits = count * BITS[dtype]
        if bits % 8 or end - begin != bits // 8:
            raise CorruptCheckpoint(
                f"{where}: tensor {key!r} spans {end - begin} bytes but dtype {dtype} and shape "
                f"{shape} need {bits / 8:g}")
        entries.append((key, dtype, shape, begin, end))
        if expected >= 0:
            expected = end if begin == expected else -1
    if expected != total - 8 - n:
        # Not tiling in the header's order (as written): in the order of the data, which
        # names the first gap or overlap.
        expected = 0
        for key, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4], e[0])):
            if begin != expected:
                raise CorruptCheckpoint(f"{where}: tensor {key!r} starts at byte {begin}, "
                                        f"expected {expected} (overlapping or missing data)")
            expected = end
        if expected != total - 8 - n:
            raise CorruptCheckpoint(f"{where}: tensors cover {expected} data bytes, the file "
                                    f"holds {total - 8 - n}")
    return header, metadata, entries
