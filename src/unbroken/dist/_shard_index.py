"""The sharded-state index, ``shards.json``: its name and schema, the shard files it names,
how every rank's chunks are merged into it on saving and how it is validated on restoring.
Kept apart from `sharded` (the DCP side: planning, writing and loading the chunks) so that
each module stays short; it needs no torch."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CorruptCheckpoint, StateMismatch
from ..state.jsontext import loads_json
from ..state.tensorfile import ST_DTYPES

SHARDS_FILE = "shards.json"
SHARDS_SCHEMA = "unbroken.shards/1"
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_DTYPE_BY_NAME = {v: k for k, v in ST_DTYPES.items()}
_SHARD_FILE = re.compile(r"rank([0-9]{5})\.shards\.safetensors", re.ASCII)


def shard_file(rank: int) -> str:
    """One rank's chunks of every sharded tensor."""
    return f"rank{rank:05d}.shards.safetensors"


def _merge(everyone: list[list[dict[str, Any]]], meta: Mapping[str, str]) -> dict[str, Any]:
    """``shards.json``: per DCP key, the global size, dtype and every rank's chunks."""
    tensors: dict[str, Any] = {}
    for rank, index in enumerate(everyone):
        for c in index:
            entry = tensors.setdefault(c["key_path"], {"dtype": c["dtype"], "size": c["size"],
                                                       "chunks": []})
            if (entry["dtype"], entry["size"]) != (c["dtype"], c["size"]):
                raise StateMismatch(f"sharded tensor {_name(c['key_path'])}: rank {rank} holds "
                                    f"{c['dtype']} {c['size']}, another rank "
                                    f"{entry['dtype']} {entry['size']}")
            if any(x["offsets"] == c["offsets"] for x in entry["chunks"]):
                continue  # a replica of a chunk (HSDP): the lowest rank's copy is read
            entry["chunks"].append({"offsets": c["offsets"], "sizes": c["sizes"],
                                    "file": shard_file(rank), "key": c["key"]})
    return {"schema": SHARDS_SCHEMA, "meta": dict(meta), "tensors": tensors}


def read_index(data: bytes | memoryview, where: str) -> dict[str, Any]:
    """``shards.json``, validated: every chunk inside its tensor, every dtype known."""
    doc = loads_json(data, where, _MAX_INDEX_BYTES)
    try:
        if doc["schema"] != SHARDS_SCHEMA:
            raise CorruptCheckpoint(f"{where}: schema {doc['schema']!r}, expected "
                                    f"{SHARDS_SCHEMA!r}")
        for key, entry in doc["tensors"].items():
            path = json.loads(key)
            size, chunks = entry["size"], entry["chunks"]
            ok = (isinstance(path, list) and len(path) >= 2 and isinstance(path[0], str)
                  and all(type(k) in (str, int) for k in path)
                  and entry["dtype"] in _DTYPE_BY_NAME and _ints(size) and chunks
                  and all(_ints(c["offsets"]) and _ints(c["sizes"])
                          and len(c["offsets"]) == len(c["sizes"]) == len(size)
                          and all(o + s <= n for o, s, n in zip(c["offsets"], c["sizes"], size))
                          and _SHARD_FILE.fullmatch(c["file"]) is not None
                          and isinstance(c["key"], str)
                          for c in chunks))
            # Each element is saved in exactly one chunk: chunks that do not add up to the
            # tensor would leave part of it unread (and an edited size would allocate it).
            if ok and sum(math.prod(c["sizes"]) for c in chunks) != math.prod(size):
                raise CorruptCheckpoint(f"{where}: tensor {key}: its chunks hold "
                                        f"{sum(math.prod(c['sizes']) for c in chunks)} "
                                        f"elements, its size {list(size)} needs "
                                        f"{math.prod(size)}")
            if ok and (pair := _overlap(chunks)) is not None:
                # (sizes that add up, but two chunks share elements: the rest stays unread)
                raise CorruptCheckpoint(
                    f"{where}: tensor {key}: chunks at offsets {pair[0]['offsets']} "
                    f"({pair[0]['file']}) and {pair[1]['offsets']} ({pair[1]['file']}) "
                    "overlap, so part of the tensor is in no chunk")
            if not ok:
                raise ValueError(key)
    except CorruptCheckpoint:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpoint(f"{where}: not an unbroken shard index ({e!s:.100})") from None
    return doc


def _overlap(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Two chunks (boxes of ``offsets`` and ``sizes``) sharing an element, or None. A sweep
    along the first dimension: a tensor sharded along it (FSDP) compares each chunk with one
    other, not all of them."""
    boxes = sorted((c for c in chunks if all(c["sizes"])), key=lambda c: c["offsets"])
    active: list[dict[str, Any]] = []
    for c in boxes:
        start = c["offsets"][0] if c["offsets"] else 0
        active = [a for a in active if not a["offsets"] or a["offsets"][0] + a["sizes"][0] > start]
        for a in active:
            if all(ao < co + cs and co < ao + as_ for ao, as_, co, cs
                   in zip(a["offsets"], a["sizes"], c["offsets"], c["sizes"])):
                return a, c
        active.append(c)
    return None


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def _name(key: str) -> str:
    try:
        return ".".join(str(k) for k in json.loads(key))
    except ValueError:
        return key
