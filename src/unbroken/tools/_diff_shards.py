"""The sharded tensors of a generation in ``unbroken diff``'s decoded tree: a `Sharded` leaf
where each DTensor was taken out (`place_shards`), whose chunks are read only when it is
compared."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..dist._shard_index import SHARDS_FILE, read_index
from ..dist._shard_read import ShardReader, generation_stamps, key_path
from ..errors import CorruptCheckpoint
from ..store.manifest import Manifest


@dataclass(frozen=True)
class Sharded:
    """A sharded tensor in a decoded tree, where `split` took its DTensor from: its chunks
    are read (`ShardReader`) only when it is compared."""

    reader: ShardReader
    key: str  # its DCP key: the JSON of its path in the tree

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.dtype(self.key)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.reader.size(self.key)

    def whole(self) -> torch.Tensor:
        return self.reader.tensor(self.key)


def place_shards(tree: dict[str, Any], files: Mapping[str, Any], where: str,
                  m: Manifest) -> None:
    """Put a `Sharded` leaf into ``tree`` for every tensor of the generation's
    ``shards.json``, each where the saving rank's DTensor was (`split` keeps every mapping on
    the way). Every shard file is decoded and every chunk checked against the index here (its
    stamps, key, dtype and shape: headers only), so that a generation whose shards do not
    match their index does not verify, as for a restore."""

    def read(name: str) -> Any:
        if name not in files:  # (read_verified read every artifact the manifest lists)
            raise CorruptCheckpoint(f"{where}/{name}: named in {SHARDS_FILE}, missing from "
                                    "the manifest")
        return files[name]

    reader = ShardReader(read_index(files[SHARDS_FILE], f"{where}/{SHARDS_FILE}"), read,
                         where, generation_stamps(m))
    for key in reader.entries:
        reader.chunks(key)
        path = key_path(key)
        node: Any = tree.get(path[0])
        for k in path[1:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] in node:
            raise CorruptCheckpoint(f"{where}/{SHARDS_FILE}: sharded tensor "
                                    f"{'.'.join(map(str, path))} has no place in the saved "
                                    "state")
        node[path[-1]] = Sharded(reader, key)
