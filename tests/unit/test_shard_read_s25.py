"""`unbroken.dist._shard_read`, the one reader of sharded tensors that ``unbroken diff`` and
``unbroken verify --deep`` share, on shard files made by hand (in memory): chunks of any
layout reassembled, every chunk checked against ``shards.json`` and the file's stamps, and
what the two tools make of them (values compared across chunkings; NaN found in any chunk
and reported by its index in the whole tensor)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from unbroken.dist._shard_index import read_index
from unbroken.dist._shard_read import ShardReader, generation_stamps
from unbroken.errors import CorruptCheckpoint
from unbroken.state.tensorfile import encode_safetensors
from unbroken.state.tensorread import decode_safetensors
from unbroken.store.manifest import Artifact, Manifest
from unbroken.tools.deep import deep_problems
from unbroken.tools.diff import Sharded, tensor_diff

WHERE = "/runs/x/gen-000000003"
MANIFEST = Manifest(generation=3, step=3, run_id="r" * 32, incarnation=0,
                    artifacts=[Artifact("shards.json", 1, "0" * 32)], parts=["model"])
STAMPS = generation_stamps(MANIFEST)
Box = tuple[list[int], list[int]]  # (offsets, sizes)


def shard(tensors: dict[str, torch.Tensor], boxes: dict[str, list[tuple[int, Box]]]
          ) -> tuple[dict[str, Any], dict[str, bytes]]:
    """shards.json (validated) and the shard files of ``tensors`` (by DCP key), each cut in
    the boxes given with the rank whose file holds it."""
    files: dict[int, dict[str, torch.Tensor]] = {}
    index: dict[str, Any] = {"schema": "unbroken.shards/1", "meta": STAMPS, "tensors": {}}
    for key, t in tensors.items():
        chunks = []
        for rank, (offsets, sizes) in boxes[key]:
            piece = t
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                piece = piece.narrow(dim, o, s)
            held = files.setdefault(rank, {})
            name = str(len(held))
            held[name] = piece.contiguous()
            chunks.append({"offsets": offsets, "sizes": sizes, "key": name,
                           "file": f"rank{rank:05d}.shards.safetensors"})
        index["tensors"][key] = {"dtype": {torch.float32: "F32", torch.int64: "I64"}[t.dtype],
                                 "size": list(t.shape), "chunks": chunks}
    data = {f"rank{r:05d}.shards.safetensors": b"".join(bytes(x) for x in encode_safetensors(
        held, {**STAMPS, "unbroken.part": "shards", "unbroken.rank": str(r)}))
        for r, held in files.items()}
    return read_index(json.dumps(index).encode(), f"{WHERE}/shards.json"), data


W = json.dumps(["model", "w"])
GRID = {W: [(1, ([0, 0], [2, 3])), (0, ([0, 3], [2, 2])), (0, ([2, 0], [2, 5]))]}
ROWS = {W: [(0, ([0, 0], [1, 5])), (1, ([1, 0], [3, 5]))]}


def reader(index: dict[str, Any], files: dict[str, bytes]) -> ShardReader:
    return ShardReader(index, files.__getitem__, WHERE, STAMPS)


def test_a_tensor_comes_back_whole_from_chunks_of_any_layout() -> None:
    w = torch.arange(20.0).reshape(4, 5)
    s = json.dumps(["model", "step"])
    index, files = shard({W: w, s: torch.tensor(7)}, {**GRID, s: [(0, ([], []))]})
    r = reader(index, files)
    assert torch.equal(r.tensor(W), w) and r.tensor(s).item() == 7
    assert r.layout(W) == [((0, 0), (2, 3)), ((0, 3), (2, 2)), ((2, 0), (2, 5))]
    assert [name for name, _ in r.files()] == ["rank00000.shards.safetensors",
                                               "rank00001.shards.safetensors"]


@pytest.mark.parametrize("damage, words", [
    (lambda t: t.pop("0"), "no tensor '0', which shards.json names for the chunk of "
                           "model.w at offsets [0, 3]"),
    (lambda t: t.update({"0": torch.zeros(4)}), "tensor '0' (the chunk of model.w at offsets "
                                                "[0, 3]) is float32 [4]; shards.json expects "
                                                "float32 [2, 2]"),
    (lambda t: t.update({"0": torch.zeros(2, 3)}), "is float32 [2, 3]; shards.json expects "
                                                   "float32 [2, 2]"),
    (lambda t: t.update({"0": torch.zeros(2, 2, dtype=torch.float64)}),
     "is float64 [2, 2]; shards.json expects float32 [2, 2]"),
])
def test_a_chunk_the_file_lacks_or_holds_otherwise_is_refused(damage: Any, words: str) -> None:
    index, files = shard({W: torch.zeros(4, 5)}, GRID)
    name = "rank00000.shards.safetensors"
    tensors, stamps = decode_safetensors(files[name], name)
    damage(tensors)
    files[name] = b"".join(bytes(x) for x in encode_safetensors(tensors, stamps))
    with pytest.raises(CorruptCheckpoint, match=f"^{WHERE}/{name}: ") as e:
        reader(index, files).tensor(W)
    assert words in str(e.value)


def test_a_shard_file_of_another_generation_or_rank_is_refused() -> None:
    index, files = shard({W: torch.zeros(4, 5)}, ROWS)
    files["rank00000.shards.safetensors"] = files["rank00001.shards.safetensors"]
    with pytest.raises(CorruptCheckpoint, match="rank00000.shards.safetensors: stamped .*"
                       "'unbroken.rank': '1'.* expected .*'unbroken.rank': '0'"):
        reader(index, files).tensor(W)


def test_diff_compares_across_chunkings_and_against_an_unsharded_tensor() -> None:
    w = torch.randn(4, 5)
    v = w.clone()
    v[3, 4] += 1.0
    a, b = (reader(*shard({W: t}, layout)) for t, layout in ((w, GRID), (v, ROWS)))
    assert tensor_diff(Sharded(a, W), Sharded(reader(*shard({W: w}, ROWS)), W)) is None
    found = tensor_diff(Sharded(a, W), Sharded(b, W))
    assert found is not None and (found["differing"], found["elements"]) == (1, 20)
    assert found["max_abs"] == pytest.approx(1.0) and found["a"] == "float32[4, 5]"
    assert tensor_diff(Sharded(b, W), v) is None  # an FSDP2 save against a plain one
    assert tensor_diff(w, Sharded(b, W))["differing"] == 1  # type: ignore[index]
    assert tensor_diff(Sharded(a, W), w.double())["change"] == "dtype"  # type: ignore[index]


def deep(tree: dict[str, Any], index: dict[str, Any], files: dict[str, bytes]) -> list[str]:
    return deep_problems(tree, MANIFEST, WHERE, index, read=files.__getitem__)


def test_deep_reports_the_first_nan_of_the_whole_tensor_whichever_file_holds_it() -> None:
    """GRID puts rows 0-1, columns 0-2 in rank 1's file (read last): its NaN at [1, 0] comes
    before rank 0's at [2, 4] in the tensor, and is named with its file."""
    w = torch.zeros(4, 5)
    w[2, 4] = w[1, 0] = math.nan
    w[3, 3] = math.inf  # (the model tensor no optimizer trains may hold inf: a mask)
    index, files = shard({W: w}, GRID)
    assert deep({"model": {}}, index, files) == [
        f"{WHERE}/rank00001.shards.safetensors: model tensor 'w' (float32 [4, 5], sharded in "
        "3 chunks) holds 2 NaN of 20 values, the first at index [1, 0]; expected no NaN"]
    trained = {"model": {}, "optimizer": {"param_groups": [{"params": ["w"]}], "state": {}}}
    [problem] = deep(trained, index, files)
    assert "holds 2 NaN and 1 inf of 20 values, the first at index [1, 0]" in problem


def test_deep_goes_on_past_a_broken_shard_file() -> None:
    w = torch.zeros(4, 5)
    w[2, 0] = math.nan
    index, files = shard({W: w}, ROWS)
    files["rank00000.shards.safetensors"] = b"not a safetensors file"
    problems = deep({"model": {}}, index, files)
    assert len(problems) == 2 and "[2, 0]" in problems[0], problems
    assert problems[1].startswith(f"{WHERE}/rank00000.shards.safetensors: "), problems
