"""Replacing one artifact of a generation and resealing its manifest (size, hash, checksum):
a well-formed generation whose contents an adversary with write access changed."""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from unbroken.store.manifest import seal


def reseal(gen: Path, name: str, data: bytes) -> None:
    """Write ``data`` as artifact ``name`` of generation folder ``gen`` and update the
    manifest consistently, checksum included."""
    (gen / name).write_bytes(data)
    manifest = json.loads((gen / "MANIFEST.json").read_text())
    for a in manifest["artifacts"]:
        if a["name"] == name:
            a["size"], a["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    (gen / "MANIFEST.json").write_bytes(seal(manifest))
