"""Reading a generation's sharded tensors outside a restore, for the tools (``unbroken diff``,
``unbroken verify --deep``): one process, whatever the number of ranks that saved them, with
neither torch.distributed nor DCP.

``shards.json`` (`_shard_index.read_index`, validated: every chunk inside its tensor, the
chunks adding up to it without overlap) lists each chunk of every sharded tensor: its offsets
and sizes in the global tensor, and the shard file and key that hold it. `ShardReader` takes
the hash-verified bytes of each shard file from ``read(name)``, checks that the file is
stamped for this generation and its rank, and that each chunk is in it with the index's dtype
and shape, then hands out chunks (file by file: `files`, `decode`, `chunk`) or whole
tensors reassembled from them (`tensor`). With ``keep=False`` it holds no decoded file (a
caller walking the files one at a time holds one), so memory stays bounded by one file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint
from ..state.tensorread import decode_safetensors
from ..store.manifest import Manifest
from ._shard_index import _DTYPE_BY_NAME, _SHARD_FILE, SHARDS_FILE, _name

__all__ = ["Read", "ShardReader", "generation_stamps", "key_path"]

Read = Callable[[str], "bytes | memoryview"]  # a shard file's hash-verified bytes, by name
Chunk = Mapping[str, Any]  # one entry of a tensor's "chunks" in shards.json


def generation_stamps(manifest: Manifest) -> dict[str, str]:
    """The stamps every file of the generation ``manifest`` describes carries (as
    `unbroken.saving.stamps` writes them): a shard file copied from another generation or run
    is told apart by them."""
    return {"unbroken.run_id": manifest.run_id,
            "unbroken.generation": str(manifest.generation),
            "unbroken.incarnation": str(manifest.incarnation)}


class ShardReader:
    """The sharded tensors a validated ``shards.json`` (``index``) lists, read from the shard
    files ``read(name)`` returns (hash-verified by the caller's store). ``where`` (the
    generation's folder) begins every message; ``stamps``: `generation_stamps`. ``keep``:
    hold each decoded file for later calls (the bytes are in memory anyway: ``unbroken
    diff``), or decode a file again for each call that needs it (``verify --deep``, which
    walks the files once)."""

    def __init__(self, index: Mapping[str, Any], read: Read, where: str,
                 stamps: Mapping[str, str], keep: bool = True) -> None:
        self.entries: Mapping[str, Any] = index["tensors"]
        self.where = where
        self._read = read
        self._stamps = dict(stamps)
        self._keep = keep
        self._files: dict[str, dict[str, torch.Tensor]] = {}

    # -- what the index says ----------------------------------------------------------------

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPE_BY_NAME[self.entries[key]["dtype"]]

    def size(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["size"])

    def layout(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The (offsets, sizes) of the chunks of ``key``, sorted: two generations chunk a
        tensor alike when their layouts are equal (whichever files hold the chunks)."""
        return sorted((tuple(c["offsets"]), tuple(c["sizes"]))
                      for c in self.entries[key]["chunks"])

    def files(self) -> Iterator[tuple[str, list[tuple[str, Chunk]]]]:
        """Each shard file the index names (by name: rank order), with the chunks it holds as
        (tensor key, chunk), in the index's order."""
        held: dict[str, list[tuple[str, Chunk]]] = {}
        for key, entry in self.entries.items():
            for c in entry["chunks"]:
                held.setdefault(c["file"], []).append((key, c))
        yield from sorted(held.items())

    # -- reading ------------------------------------------------------------------------------

    def decode(self, file: str) -> dict[str, torch.Tensor]:
        """Shard file ``file``'s tensors (views into its bytes), once its stamps are checked:
        `CorruptCheckpoint` names the file, the stamps expected and those found."""
        known = self._files.get(file)
        if known is not None:
            return known
        where = f"{self.where}/{file}"
        tensors, stamped = decode_safetensors(self._read(file), where)
        match = _SHARD_FILE.fullmatch(file)
        if match is None:  # (read_index refuses such a name; an index made by hand may not)
            raise CorruptCheckpoint(f"{self.where}/{SHARDS_FILE}: names shard file {file!r}; "
                                    "expected rankNNNNN.shards.safetensors")
        expected = {**self._stamps, "unbroken.part": "shards",
                    "unbroken.rank": str(int(match.group(1)))}
        if stamped != expected:
            raise CorruptCheckpoint(f"{where}: stamped {stamped}, expected {expected}: the "
                                    "file belongs to another generation or rank")
        if self._keep:
            self._files[file] = tensors
        return tensors

    def chunk(self, key: str, c: Chunk, tensors: Mapping[str, torch.Tensor] | None = None
              ) -> torch.Tensor:
        """Chunk ``c`` of tensor ``key`` (a view into its file; from ``tensors``, that file
        decoded, when given). `CorruptCheckpoint` when the file lacks it or holds it with
        another dtype or shape than the index gives it (the writer saves each chunk as it
        is, and a restore reads it so)."""
        held = self.decode(c["file"]) if tensors is None else tensors
        where = f"{self.where}/{c['file']}"
        found = held.get(c["key"])
        what = f"{_name(key)} at offsets {list(c['offsets'])}"
        if found is None:
            raise CorruptCheckpoint(f"{where}: no tensor {c['key']!r}, which {SHARDS_FILE} "
                                    f"names for the chunk of {what}")
        dtype = self.dtype(key)
        if found.dtype != dtype or list(found.shape) != list(c["sizes"]):
            raise CorruptCheckpoint(
                f"{where}: tensor {c['key']!r} (the chunk of {what}) is {_dtype(found.dtype)} "
                f"{list(found.shape)}; {SHARDS_FILE} expects {_dtype(dtype)} "
                f"{list(c['sizes'])}")
        return found

    def chunks(self, key: str) -> list[tuple[Chunk, torch.Tensor]]:
        """Every chunk of ``key`` with its tensor (`chunk`), in the index's order."""
        return [(c, self.chunk(key, c)) for c in self.entries[key]["chunks"]]

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, reassembled from its chunks (one new tensor of its size:
        every chunk is found and checked first, so an index whose sizes the files do not
        hold never has its size allocated)."""
        pieces = self.chunks(key)
        out = torch.empty(self.size(key), dtype=self.dtype(key))
        for c, t in pieces:  # (read_index: the chunks cover the tensor, none overlapping)
            view = out
            for dim, (offset, length) in enumerate(zip(c["offsets"], c["sizes"])):
                view = view.narrow(dim, offset, length)
            view.copy_(t)
        return out


def key_path(key: str) -> list[Any]:
    """The path in the state tree a DCP key stands for (``["model", "0.weight"]``)."""
    path = json.loads(key)
    assert isinstance(path, list)  # (read_index checked every key)
    return path


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
