"""JSON trees for identity entries: conversion with typed errors that name the key path, and
a bounded digest per key path, so that a mismatch of a tree too large to keep whole (a big
config, a tokenizer's serialization) can still name the keys that changed."""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import xxhash

from ..errors import UnsupportedValue
from .jsontext import dumps_json

# Deeper trees are refused, not recursed into: Python's recursion limit would end in a raw
# RecursionError (a self-referencing dict nests forever), and real configs are shallow.
MAX_DEPTH = 100
# Python refuses to turn an int of more than 4300 digits into text by default, so a manifest
# holding one could not be read back (14,000 bits are about 4,214 digits).
_MAX_INT_BITS = 14_000
# Bounds of the per-key digest map: at most this many key paths, this many bytes in all,
# and values shown beside their digest only when this short.
_MAX_KEYS = 4096
_MAX_MAP_BYTES = 256 * 1024
_SHOWN_BYTES = 64


def xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def short_path(path: str) -> str:
    """A key path cut to a readable length for a message (a 3000-level one is 6000 chars)."""
    return path if len(path) <= 160 else f"{path[:100]}...{path[-50:]}"


def jsonable(obj: Any, path: str, depth: int = 0) -> Any:
    """A plain JSON tree equal to ``obj``, or ``UnsupportedValue`` naming the first bad key."""
    if depth > MAX_DEPTH:
        raise UnsupportedValue(
            f"{short_path(path)}: nested deeper than {MAX_DEPTH} levels (a dict that contains "
            "itself nests forever); an identity value must be a plain tree: flatten it, or "
            "pass a digest or revision string of it instead")
    if isinstance(obj, float) and not math.isfinite(obj):
        raise UnsupportedValue(f"{short_path(path)}: {obj} cannot be fingerprinted (JSON has "
                               "no NaN/inf); store it as a str")
    if isinstance(obj, int) and not isinstance(obj, bool) and obj.bit_length() > _MAX_INT_BITS:
        raise UnsupportedValue(
            f"{short_path(path)}: an int of {obj.bit_length()} bits (over 4,200 digits) cannot "
            "be fingerprinted: JSON readers refuse ints past Python's 4,300-digit limit; "
            "store it as a str or a hash")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Mapping):
        for key in obj:
            if not isinstance(key, str):
                raise UnsupportedValue(f"{short_path(path)}: key {key!r:.60} is a "
                                       f"{type(key).__name__}; identity mappings need string "
                                       "keys")
        return {k: jsonable(v, f"{path}.{k}", depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
    raise UnsupportedValue(f"{short_path(path)}: a {type(obj).__name__} value cannot be "
                           "fingerprinted; convert it to str, int, float, bool, None, list or "
                           "dict")


def key_digests(tree: Mapping[str, Any], field: str) -> dict[str, list[Any]] | None:
    """``{key path: [digest]}``, or ``[digest, value]`` for a short value, of a plain JSON
    tree: dicts longer than a shown value are opened breadth first while the paths stay under
    ``_MAX_KEYS`` (a 50,000 token vocab stays one path); lists are leaves. None when even
    the top level does not fit the bounds: then only the whole tree's hash is kept."""
    leaves: list[tuple[str, Any]] = []
    queue: deque[tuple[str, Mapping[str, Any]]] = deque([(field, tree)])
    count = 1  # leaves found plus dicts still queued
    while queue:
        path, node = queue.popleft()
        if count - 1 + len(node) > _MAX_KEYS:
            if path == field:
                return None
            leaves.append((path, node))
            continue
        count += len(node) - 1
        for key, value in node.items():
            # A short dict stays one path, shown whole: "normalizer: saved null, now {...}".
            if isinstance(value, dict) and _longer(value, _SHOWN_BYTES):
                queue.append((f"{path}.{key}", value))
            else:
                leaves.append((f"{path}.{key}", value))
    found: dict[str, list[Any]] = {}
    shown = 0  # bytes of the values kept beside their digests
    for path, value in leaves:
        blob = dumps_json(value)
        digest = xxh(blob)[:16]
        if path in found:  # {"a.b": 1} and {"a": {"b": 1}} read alike: fold both in
            found[path] = [xxh((found[path][0] + digest).encode("ascii"))[:16]]
        elif len(blob) <= _SHOWN_BYTES:
            found[path] = [digest, value]
            shown += len(blob)
        else:
            found[path] = [digest]
    # Each path costs its text and a quoted 16-hex digest in the manifest, about 24 bytes more.
    paths = sum(len(path.encode("utf-8", "surrogatepass")) + 24 for path in found)
    if paths > _MAX_MAP_BYTES:
        return None
    if paths + shown > _MAX_MAP_BYTES:  # digests alone still name the changed keys
        found = {path: kept[:1] for path, kept in found.items()}
    return found


_MEASURE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _longer(value: dict[str, Any], limit: int) -> bool:
    """Whether ``value``'s compact JSON takes more than ``limit`` characters, encoding only as
    much as that takes: a short dict may hold a 50,000-token vocabulary one level down."""
    size = 0
    for chunk in _MEASURE.iterencode(value):  # (lazily, a piece at a time)
        size += len(chunk)
        if size > limit:
            return True
    return False


def json_entry(kind: str, obj: Mapping[str, Any], path: str, summary: str,
               keep_bytes: int) -> dict[str, Any]:
    """``{"kind", "hash", "summary"}`` of a tree, plus its ``value`` when its JSON is under
    ``keep_bytes``, else its per-key ``keys`` digests. The hash is of the canonical JSON."""
    blob = dumps_json(jsonable(obj, path))
    entry: dict[str, Any] = {"kind": kind, "hash": xxh(blob), "summary": summary}
    plain = json.loads(blob)  # plain JSON (tuples, enums normalised), as hashed
    if len(blob) < keep_bytes:
        entry["value"] = plain
    elif (keys := key_digests(plain, path)) is not None:
        entry["keys"] = keys
    return entry


def key_changes(old: Mapping[str, Any], new: Mapping[str, Any]
                ) -> list[tuple[str, list[Any] | None, list[Any] | None]]:
    """The key paths whose digests differ, in sorted order, with both sides' records (None:
    absent, or not a ``[digest, ...]`` record, as an edited manifest may hold)."""
    changed = []
    for path in sorted(old.keys() | new.keys()):
        a, b = (r if isinstance(r, list) and r and isinstance(r[0], str) else None
                for r in (old.get(path), new.get(path)))
        if (a and a[0]) != (b and b[0]):
            changed.append((path, a, b))
    return changed
