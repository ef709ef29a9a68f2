"""Canonical JSON text for everything unbroken writes (manifests, state skeletons, records),
and a parser for JSON read from untrusted files that raises only `CorruptCheckpoint`."""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CorruptCheckpoint


def dumps_json(obj: Any, sort_keys: bool = True, texts: dict[str, str] | None = None
               ) -> bytes:
    """Compact JSON bytes, canonical by default (sorted keys; no NaN: the skeleton tags them).
    State documents pass ``sort_keys=False`` so that dicts keep their insertion order.
    ``texts``: JSON text by the string ``obj`` holds in its place (a planned skeleton's, see
    `codec.Encoded`), each put in place of that string: the same bytes as ``obj`` with the
    texts' values in their places.

    UTF-8 text; a string that UTF-8 cannot encode (a lone surrogate, which ``os.fsdecode``
    makes of an undecodable file name) switches the whole document to ASCII with ``\\u``
    escapes, which JSON readers turn back into the same string: nothing is lost."""
    text = json.dumps(obj, sort_keys=sort_keys, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=False)
    for holder, value in (texts or {}).items():
        text = text.replace(f'"{holder}"', value, 1)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        if texts:  # (the texts in their places, as values again)
            obj = json.loads(text)
        return json.dumps(obj, sort_keys=sort_keys, separators=(",", ":"), allow_nan=False,
                          ensure_ascii=True).encode("ascii")


def json_pieces(obj: Any, texts: dict[str, str]) -> list[bytes]:
    """``dumps_json(obj, sort_keys=False, texts=texts)`` in pieces, which joined are the same
    bytes: each text is a piece of its own, not copied into one document (a state document's
    planned texts are most of its ~0.6 MB for 10,000 tensors)."""
    text = json.dumps(obj, sort_keys=False, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=False)
    places = sorted((text.find(f'"{holder}"'), holder) for holder in texts)
    pieces: list[str] = []
    at = 0
    for where, holder in places:
        if where < at:  # (not found: what `dumps_json` leaves as it is)
            continue
        pieces += (text[at:where], texts[holder])
        at = where + len(holder) + 2
    pieces.append(text[at:])
    try:
        return [piece.encode("utf-8") for piece in pieces]
    except UnicodeEncodeError:  # (ASCII with escapes, as `dumps_json` writes it)
        return [dumps_json(obj, sort_keys=False, texts=texts)]


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf: never written, so never read
        raise ValueError(f"number {text[:40]} is out of the float range")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # (which key: only once one is known to be there twice)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r:.80} appears twice in one object")
            seen.add(key)
    return out


def loads_json(data: bytes | memoryview, where: str, limit: int, unique: bool = True) -> Any:
    """Parse JSON from an untrusted file, turning every failure into ``CorruptCheckpoint``.
    Callers check a file's size against ``limit`` before reading it; this checks again.

    ``unique``: a key twice in one object is refused. Python keeps the last one, another
    reader may keep the first: a manifest whose checksum covers what Python parsed would
    read otherwise elsewhere. (False for the large documents a restore parses, state
    skeletons and tensor headers, whose every byte a content hash covers, and whose
    thousands of objects a hook per object would slow.)"""
    if len(data) > limit:
        raise CorruptCheckpoint(f"{where}: {len(data)} bytes, over the {limit}-byte limit")
    try:
        return json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant,
                          parse_float=_finite_float,
                          object_pairs_hook=_unique if unique else None)
    except RecursionError:
        raise CorruptCheckpoint(f"{where}: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise CorruptCheckpoint(f"{where}: not valid UTF-8 ({e!s:.200})") from None
    except ValueError as e:  # (an integer over 4,300 digits too: Python's conversion limit)
        raise CorruptCheckpoint(f"{where}: not valid JSON ({e!s:.200})") from None
