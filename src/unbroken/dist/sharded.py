"""Sharded state (FSDP2's ``fully_shard``, any DTensor) inside unbroken's generation, through
torch.distributed.checkpoint (DCP).

DCP's planners decide what each rank writes (its local chunk of every DTensor, with the
chunk's offsets in the global tensor) and, on restore, which saved chunks overlap each
rank's new local shard: that is resharding, from any world size to any other. DCP's storage
layer is replaced by ours (`_Writer`, `_Reader`): each rank's chunks go into its own
``rankNNNNN.shards.safetensors``, written, fsynced and hashed by the two-phase commit like every
other file of the generation, and the index DCP keeps as a pickled ``.metadata`` is written by
us as ``shards.json`` (JSON, covered by the manifest). Nothing is pickled, and every shard file
is hash-verified before a byte of it is decoded.

DCP runs with ``no_dist=True`` on both sides: its own object collectives (which pickle) are
not used; the index is gathered with unbroken's JSON collectives, and a restore is agreed by
the same vote as every other file (`picking`), so a rank that refuses a generation can never
leave another waiting inside DCP.

In the state tree a DTensor leaf at path ``[part, key, ...]`` is taken out (`split`) and put
back on restore (`load_shards`) under the DCP key ``json.dumps(path)``."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any

import torch
from torch.futures import Future

from ..errors import CorruptCheckpoint, UnbrokenError, UnsupportedValue
from ..state.jsontext import dumps_json
from ..state.tensorfile import ST_DTYPES, encode_safetensors
from ._shard_index import _DTYPE_BY_NAME, SHARDS_FILE, _merge, _name, shard_file
from ._shard_index import SHARDS_SCHEMA as SHARDS_SCHEMA
from ._shard_index import read_index as read_index
from ._shard_read import ShardReader
from .group import Group

# (No DTensor is of these types: a Parameter made of a DTensor is of the DTensor's type.)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_DICT = frozenset({dict})


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor (saved through DCP, by every rank its own chunk).
    There is none before ``torch.distributed.tensor`` was imported (by FSDP2, or by the
    user): not importing it here keeps ``import unbroken`` (and the CLI) 0.6 s faster."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def split(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tree without its DTensor leaves, {DCP key: DTensor}); the tree is not changed.
    Leaves are found in nested dicts (the model, the optimizer's per-parameter state, a
    part's own dicts)."""
    shards: dict[str, Any] = {}
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return dict(tree), shards  # no DTensor can exist (see is_sharded)

    def walk(node: Mapping[Any, Any], path: tuple[Any, ...]) -> Any:
        """``node`` itself when it holds no DTensor; else a shallow copy of it (of its own
        type: an OrderedDict keeps its ``_metadata``, a Counter stays a Counter) without
        them."""
        values = list(node.values())
        if _PLAIN.issuperset(map(type, values)) or _DICT.issuperset(map(type, values)) and (
                _PLAIN.issuperset(map(type, chain.from_iterable(map(dict.values, values))))):
            return node  # (a state_dict, an optimizer's per-parameter state: at C speed)
        out: Any = None
        for k, v in node.items():
            kind = type(v)
            if kind in _PLAIN or kind is dict and _PLAIN.issuperset(map(type, v.values())):
                continue  # (a tensor, or a dict of them: an optimizer's per-parameter state)
            if isinstance(v, dtensor):
                inner = None
            elif isinstance(v, Mapping):
                inner = walk(v, (*path, k))
                if inner is v:
                    continue
            else:
                continue
            if out is None:
                out = copy.copy(node)
            if inner is None:
                shards[json.dumps([*path, k])] = v
                del out[k]
            else:
                out[k] = inner
        return node if out is None else out

    rest = {part: walk(value, (part,)) if isinstance(value, Mapping) else value
            for part, value in tree.items()}
    return rest, shards


# -- saving ------------------------------------------------------------------------------------


def encode_shards(group: Group, shards: Mapping[str, Any], meta: Mapping[str, str]
                  ) -> dict[str, list[memoryview]]:
    """This rank's shard file and, on the leader, ``shards.json`` (every rank's chunks, gathered
    as JSON). Collective: every rank of the job calls it, with or without shards of its own."""
    import torch.distributed.checkpoint as dcp

    writer = _Writer()
    if shards:
        try:
            with _quiet():
                dcp.save(dict(shards), storage_writer=writer, no_dist=True,
                         planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
        except BaseException as e:  # noqa: BLE001 -- DCP wraps failures in a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise UnsupportedValue(f"sharded state could not be planned by DCP: "
                                   f"{_first_line(e)}") from None
    stamped = {**meta, "unbroken.rank": str(group.rank), "unbroken.part": "shards"}
    out: dict[str, list[memoryview]] = {}
    if writer.tensors:
        out[shard_file(group.rank)] = encode_safetensors(writer.tensors, stamped)
    everyone = group.all_gather(writer.index, "gathering the sharded-state index")
    if any(everyone):
        index = _merge(everyone, meta)  # on every rank: ranks that disagree all raise
        if group.leader:
            out[SHARDS_FILE] = [memoryview(dumps_json(index))]
    return out


class _Writer:
    """A DCP StorageWriter that keeps this rank's chunks in memory (as safetensors keys) for
    the generation's commit to write; `index` lists each chunk for ``shards.json``."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.index: list[dict[str, Any]] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def write_data(self, plan: Any, planner: Any) -> Future[list[Any]]:
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:  # only DTensors are handed to DCP
                raise UnsupportedValue(f"{item.index.fqn}: not a tensor")
            t = planner.resolve_data(item).detach()
            if t.device.type != "cpu":
                t = t.cpu()
            key = str(len(self.tensors))
            self.tensors[key] = t.contiguous()
            chunk = item.tensor_data.chunk
            self.index.append({"key_path": item.index.fqn, "key": key,
                               "dtype": ST_DTYPES[t.dtype], "size": list(item.tensor_data.size),
                               "offsets": list(chunk.offsets), "sizes": list(chunk.sizes)})
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() *
                                       t.element_size(), storage_data=key))
        done: Future[list[Any]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: Any) -> None:
        pass

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


# -- restoring ---------------------------------------------------------------------------------


def load_shards(tree: dict[str, Any], index: Mapping[str, Any], live_tree: Mapping[str, Any],
                model: torch.nn.Module, read: Callable[[str], bytes | memoryview], where: str,
                meta: Mapping[str, str]) -> None:
    """Put the sharded tensors of ``index`` back into ``tree``, each as the live run holds
    it (`_like`): a DTensor with this job's mesh and placements, whatever the saving job's
    were, or a plain tensor. ``read(name)`` returns a shard file's hash-verified bytes.
    Nothing live is changed."""
    import torch.distributed.checkpoint as dcp

    _, live = split(live_tree)
    params = dict(model.named_parameters())
    reader = _Reader(index, read, where, meta)
    wanted = {}
    for key, entry in index["tensors"].items():
        like = _like(key, entry, live, params)
        # Only the shard files holding chunks this rank loads (that overlap the DTensor's
        # own chunks, from which DCP plans its reads) are read, each whole, in memory: with
        # the saving job's mesh, its own. A tensor read whole is checked against its files
        # before the size the index gives it is allocated.
        region = like.__create_chunk_list__() if is_sharded(like) else None  # type: ignore[union-attr]
        for c in entry["chunks"]:
            if region is not None and not any(_overlap(c, r) for r in region):
                continue
            stored = reader.tensors(c["file"]).get(c["key"])
            if stored is None:
                raise CorruptCheckpoint(f"{where}/{c['file']}: no tensor {c['key']!r}, which "
                                        f"{SHARDS_FILE} names for {_name(key)}")
            if stored.numel() != math.prod(c["sizes"]):
                raise CorruptCheckpoint(
                    f"{where}/{SHARDS_FILE}: {_name(key)}: chunk {c['key']!r} of {c['file']} "
                    f"should hold {math.prod(c['sizes'])} elements, the file holds "
                    f"{stored.numel()}")
        dtype = _DTYPE_BY_NAME[entry["dtype"]]
        wanted[key] = (torch.empty_like(like, dtype=dtype) if like is not None
                       else torch.empty(torch.Size(entry["size"]), dtype=dtype))
    try:
        with _quiet():
            dcp.load(wanted, storage_reader=reader, no_dist=True,
                     planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
    except BaseException as e:  # noqa: BLE001 -- DCP wraps every failure in a BaseException
        if reader.error is not None:
            raise reader.error from None
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CorruptCheckpoint(f"{where}/{SHARDS_FILE}: the sharded state does not load "
                                f"({_first_line(e)})") from None
    for key, tensor in wanted.items():
        path = json.loads(key)
        node = tree.get(path[0])
        for k in path[1:-1]:  # `split` keeps every dict on the way, emptied or not
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] in node:
            raise CorruptCheckpoint(f"{where}/{SHARDS_FILE}: {_name(key)} has no place in the "
                                    "saved state")
        node[path[-1]] = tensor


def _like(key: str, entry: Mapping[str, Any], live: Mapping[str, Any],
          params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The live tensor a saved sharded tensor loads like: the live run's tensor at the same
    path, of the same shape (for the state of a parameter a fresh optimizer has not created
    yet: that parameter), so that a DTensor keeps this job's mesh and placements; None for
    a tensor the live run does not hold so (read whole)."""
    path = json.loads(key)
    like = live.get(key)
    if like is None and len(path) == 4 and path[:2] == ["optimizer", "state"]:
        like = params.get(path[2])
    if isinstance(like, torch.Tensor) and like.shape == torch.Size(entry["size"]):
        return like
    return None


def _overlap(chunk: Mapping[str, Any], region: Any) -> bool:
    """Whether a saved chunk (its ``offsets`` and ``sizes``) and a live one (DCP's
    ``ChunkStorageMetadata``) share an element."""
    return all(a < b + m and b < a + n for a, n, b, m in zip(
        chunk["offsets"], chunk["sizes"], region.offsets, region.sizes, strict=True)) and all(
        chunk["sizes"]) and all(region.sizes)


class _Reader:
    """A DCP StorageReader over ``shards.json`` and hash-verified shard files."""

    def __init__(self, index: Mapping[str, Any], read: Callable[[str], bytes | memoryview],
                 where: str, meta: Mapping[str, str]) -> None:
        self.index, self.where = index, where
        self.error: UnbrokenError | None = None
        self._shards = ShardReader(index, read, where, meta)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        md: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for key, entry in self.index["tensors"].items():
            md[key] = TensorStorageMetadata(
                TensorProperties(dtype=_DTYPE_BY_NAME[entry["dtype"]]),
                torch.Size(entry["size"]),
                [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                 for c in entry["chunks"]])
            for c in entry["chunks"]:
                storage[MetadataIndex(key, c["offsets"])] = (c["file"], c["key"])
        return Metadata(state_dict_metadata=md, storage_data=storage)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        try:
            for item in plan.items:
                file, key = self.storage[item.storage_index]
                src = self.tensors(file).get(key)
                if src is None:
                    raise CorruptCheckpoint(f"{self.where}/{file}: no tensor {key!r}, which "
                                            f"{SHARDS_FILE} lists for "
                                            f"{_name(item.storage_index.fqn)}")
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    src = src.narrow(dim, start, length)
                dest = planner.resolve_tensor(item).detach()
                if dest.shape != src.shape or dest.dtype != src.dtype:
                    raise CorruptCheckpoint(
                        f"{self.where}/{file}: {_name(item.storage_index.fqn)} chunk {key!r} is "
                        f"{src.dtype} {tuple(src.shape)}, expected {dest.dtype} "
                        f"{tuple(dest.shape)}")
                dest.copy_(src)
                planner.commit_tensor(item, dest)
        except UnbrokenError as e:
            self.error = e
            raise
        except (IndexError, RuntimeError, ValueError) as e:
            self.error = CorruptCheckpoint(f"{self.where}: a shard does not fit its index "
                                           f"({e!s:.200})")
            raise self.error from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def tensors(self, file: str) -> dict[str, torch.Tensor]:
        """Shard file ``file``'s tensors, its stamps checked (`ShardReader.decode`)."""
        return self._shards.decode(file)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs without torch.distributed: deliberately so (module doc)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]
