"""``unbroken diff`` and ``unbroken verify --deep`` read the sharded tensors of a real FSDP2
generation (2 gloo ranks forked from the test zygote, 127.0.0.1, 30 s process-group timeout): every
weight and optimizer moment of it is a DTensor, saved as chunks indexed by ``shards.json``
in each rank's ``rankNNNNN.shards.safetensors`` and absent from the state tree.

One job is run (module fixture); every other generation is a copy of it with one rank's
shard file edited and the manifest resealed (sizes, hashes, its checksum): what a bit flip
the hash could not see, or a tool, leaves. Before the fix diff called such copies equal
("every part bitwise identical") and ``verify --deep`` passed a NaN weight."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import forked

from unbroken.cli import main
from unbroken.state.tensorfile import encode_safetensors
from unbroken.state.tensorread import decode_safetensors
from unbroken.store.manifest import MANIFEST
from unbroken.torture._case import Case

GEN = "gen-000000005"
WEIGHT = ["model", "0.weight"]  # float32 [32, 8]: rows 0-15 on rank 0, 16-31 on rank 1
MOMENT = ["optimizer", "state", "0.weight", "exp_avg"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP2 job of one epoch (generations 5, 10 and 15)."""
    tmp = tmp_path_factory.mktemp("sharded-tools")
    r = forked(2, tmp / "run", tmp / "t.jsonl", "--fsdp", "--workers", "0", "--epochs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    index = json.loads((tmp / "run" / GEN / "shards.json").read_text())
    chunks = index["tensors"][json.dumps(WEIGHT)]["chunks"]
    assert [c["file"] for c in chunks] == ["rank00000.shards.safetensors",
                                           "rank00001.shards.safetensors"]
    return tmp / "run"


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    (to / "LOCK").unlink(missing_ok=True)
    return to


def reseal(gen: Path, name: str, data: bytes | None) -> None:
    """Write (or, ``data`` None, delete) ``name`` in ``gen`` and make the manifest agree."""
    case = Case(0, random.Random(0), str(gen.parent), [str(gen)], outside="", marker="")
    if data is None:
        (gen / name).unlink()
        doc = case.manifest(str(gen))
        doc["artifacts"] = [a for a in doc["artifacts"] if a["name"] != name]
        case.save_manifest(str(gen), doc)
        return
    case.write(str(gen), name, data)
    case.restamp(str(gen), name)


def edit(gen: Path, path: list[Any], at: tuple[int, ...],
         change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Change element ``at`` (its index in the whole tensor ``path``) in the chunk holding it,
    in that chunk's shard file, and reseal."""
    index = json.loads((gen / "shards.json").read_text())
    for c in index["tensors"][json.dumps(path)]["chunks"]:
        local = tuple(i - o for i, o in zip(at, c["offsets"]))
        if all(0 <= i < s for i, s in zip(local, c["sizes"])):
            break
    else:
        raise AssertionError(f"no chunk of {path} holds {at}")
    tensors, stamps = decode_safetensors((gen / c["file"]).read_bytes(), c["file"])
    tensors = {k: v.clone() for k, v in tensors.items()}
    chunk = tensors[c["key"]].view(c["sizes"])
    chunk[local] = change(chunk[local])
    reseal(gen, c["file"], b"".join(bytes(x) for x in encode_safetensors(tensors, stamps)))


def rechunk(gen: Path) -> None:
    """Make ``gen`` hold each sharded tensor whole, as one chunk in rank 0's file (as if one
    process had saved it): other chunking, the same values."""
    index = json.loads((gen / "shards.json").read_text())
    files = {name: decode_safetensors((gen / name).read_bytes(), name)
             for name in {c["file"] for e in index["tensors"].values() for c in e["chunks"]}}
    whole: dict[str, torch.Tensor] = {}
    for n, (key, entry) in enumerate(index["tensors"].items()):
        t = torch.empty(entry["size"])
        for c in entry["chunks"]:
            view = t
            for dim, (o, s) in enumerate(zip(c["offsets"], c["sizes"])):
                view = view.narrow(dim, o, s)
            view.copy_(files[c["file"]][0][c["key"]].view(c["sizes"]))
        whole[str(n)] = t
        entry["chunks"] = [{"file": "rank00000.shards.safetensors", "key": str(n),
                            "offsets": [0] * len(entry["size"]), "sizes": entry["size"]}]
    stamps = files["rank00000.shards.safetensors"][1]
    reseal(gen, "rank00000.shards.safetensors",
           b"".join(bytes(x) for x in encode_safetensors(whole, stamps)))
    reseal(gen, "rank00001.shards.safetensors", None)
    reseal(gen, "shards.json", json.dumps(index).encode())


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def changed(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job with two values of generation 5 changed in rank 1's chunks: a weight (+0.5)
    and its Adam moment (-0.25)."""
    folder = copy_run(run, tmp_path_factory.mktemp("changed") / "run")
    edit(folder / GEN, WEIGHT, (19, 1), lambda v: v + 0.5)
    edit(folder / GEN, MOMENT, (30, 7), lambda v: v - 0.25)
    return folder


def test_diff_compares_sharded_weights_and_moments(run: Path, changed: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, same = cli(capsys, "diff", str(run / GEN), str(changed / "gen-000000010"))
    assert rc == 1  # (another step: a sanity check of the copy)
    rc, out = cli(capsys, "diff", str(run / GEN), str(changed / GEN))
    assert rc == 1 and not out["equal"], out
    model, opt = out["parts"]["model"], out["parts"]["optimizer"]
    assert model["status"] == opt["status"] == "different"
    assert model["compared"] == 4  # 0.weight, 0.bias, 3.weight, 3.bias: all sharded
    [w] = model["entries"]
    assert (w["key"], w["change"], w["differing"], w["elements"]) == ("0.weight", "values", 1,
                                                                      256)
    assert w["max_abs"] == pytest.approx(0.5, abs=1e-6)
    [m] = opt["entries"]
    assert (m["key"], m["differing"], m["elements"]) == ("state/0.weight/exp_avg", 1, 256)
    assert m["max_abs"] == pytest.approx(0.25, abs=1e-6)
    assert {k for k, p in out["parts"].items() if p["status"] == "equal"} == {
        "scheduler", "data", "counters", "rng[rank 0]", "rng[rank 1]"}
    assert not any("not compared" in n for n in out["notes"]), out["notes"]
    # the text: the right part names, never "bitwise identical"
    capsys.readouterr()
    assert main(["diff", str(run / GEN), str(changed / GEN)]) == 1
    text = capsys.readouterr().out
    assert "verdict: different: model (1 of 4 entries), optimizer (1 of 26 entries)" in text
    # and a generation against its own copy: equal, every sharded tensor compared
    rc, out = cli(capsys, "diff", str(run / GEN), str(copy_run(run, changed.parent / "same")
                                                      / GEN))
    assert rc == 0 and out["parts"]["model"]["compared"] == 4, out


def test_diff_reassembles_generations_chunked_otherwise(run: Path, changed: Path,
                                                        tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """Generation 5 of ``changed`` rewritten with each sharded tensor as one chunk (a save
    of one process): equal to ``changed`` itself, and differing from the job's own by the
    same two elements."""
    folder = copy_run(changed, tmp_path / "run")
    rechunk(folder / GEN)
    assert not (folder / GEN / "rank00001.shards.safetensors").exists()
    assert main(["verify", str(folder), "--generation", "5"]) == 0
    rc, out = cli(capsys, "diff", str(changed / GEN), str(folder / GEN))
    assert rc == 0 and out["equal"] and out["parts"]["model"]["compared"] == 4, out
    rc, out = cli(capsys, "diff", str(run / GEN), str(folder / GEN))
    assert rc == 1, out
    assert [(e["key"], e["differing"]) for p in ("model", "optimizer")
            for e in out["parts"][p]["entries"]] == [("0.weight", 1),
                                                     ("state/0.weight/exp_avg", 1)]


def test_verify_deep_checks_the_values_of_sharded_tensors(run: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """NaNs in both ranks' chunks of a weight, an inf in an Adam moment of rank 1's: plain
    verify passes (the hashes agree), --deep names each tensor once, with every NaN counted,
    the first by its index in the whole tensor and the file that holds it."""
    rc, out = cli(capsys, "verify", "--deep", str(run))
    assert rc == 0, out  # a real FSDP2 job: nothing to report
    folder = copy_run(run, tmp_path / "run")
    edit(folder / GEN, WEIGHT, (19, 1), lambda v: torch.tensor(math.nan))
    edit(folder / GEN, WEIGHT, (2, 3), lambda v: torch.tensor(math.nan))
    edit(folder / GEN, ["optimizer", "state", "0.bias", "exp_avg_sq"], (17,),
         lambda v: torch.tensor(math.inf))
    assert main(["verify", str(folder)]) == 0
    rc, out = cli(capsys, "verify", "--deep", str(folder))
    assert rc == 1
    five, *rest = out["generations"]
    assert [g["status"] for g in rest] == ["verified", "verified"]
    assert five["status"] == "corrupt"
    assert five["problems"] == [
        f"{folder / GEN}/rank00000.shards.safetensors: model tensor '0.weight' (float32 "
        "[32, 8], sharded in 2 chunks) holds 2 NaN and 0 inf of 256 values, the first at "
        "index [2, 3]; expected finite values",
        f"{folder / GEN}/rank00001.shards.safetensors: optimizer state['0.bias']['exp_avg_sq']"
        " (float32 [32], sharded in 2 chunks) holds 0 NaN and 1 inf of 32 values, the first "
        "at index [17]; expected finite values"]


def test_verify_deep_names_a_chunk_its_shard_file_lacks(run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """A shard file resealed without one chunk the index names (its hash agrees with the
    manifest): plain verify cannot see it, --deep names file, key and tensor, and diff
    refuses the generation (exit 2) instead of comparing less."""
    folder = copy_run(run, tmp_path / "run")
    gen = folder / GEN
    name = "rank00001.shards.safetensors"
    tensors, stamps = decode_safetensors((gen / name).read_bytes(), name)
    index = json.loads((gen / "shards.json").read_text())
    key = next(c["key"] for c in index["tensors"][json.dumps(WEIGHT)]["chunks"]
               if c["file"] == name)
    del tensors[key]
    reseal(gen, name, b"".join(bytes(x) for x in encode_safetensors(tensors, stamps)))
    assert (gen / MANIFEST).exists() and main(["verify", str(folder)]) == 0
    rc, out = cli(capsys, "verify", "--deep", str(folder), "--generation", "5")
    assert rc == 1
    [problem] = out["generations"][0]["problems"]
    assert problem == (f"{gen}/{name}: no tensor {key!r}, which shards.json names for the "
                       "chunk of model.0.weight at offsets [16, 0]")
    capsys.readouterr()
    assert main(["diff", str(run / GEN), str(gen)]) == 2
    assert f"no tensor {key!r}" in capsys.readouterr().err
