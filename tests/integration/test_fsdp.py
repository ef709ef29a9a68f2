"""Sharded state (FSDP2's ``fully_shard``) through DCP inside unbroken's generation, on gloo:
a job of 2 killed and resumed bitwise; its generation restored on 1, 2 and 4 ranks and into a
plain model with every tensor equal element for element and the global sample order
continuing; a corrupt shard of one rank makes every rank fall back together."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from _launch import (
    SCRIPT,
    assert_job_killed,
    assert_resumed_bitwise,
    first_restores,
    forked,
    gens,
    torchrun,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """An uninterrupted job of 2 saving in the background (digests of the whole state after
    update 15, and the global batch of update 16), and the same job killed after update 17
    (newest generation: 15)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    # (The reference saves in the background, every 5 updates: its snapshot takes the
    # DTensors' local chunks, refused as storage-less tensors before the thirty-sixth session.
    # The killed job saves in the foreground: its generation 15 is committed when it dies.)
    ref = forked(2, tmp / "ref", tmp / "ref.jsonl", "--fsdp", "--workers", "0", "--dump",
                 str(tmp / "ref.json"), "--dump-at", "15", "--async-save")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert gens(tmp / "ref"), ref.stderr[-3000:]  # (committed in the background)
    killed = torchrun(2, tmp / "killed", tmp / "k.jsonl", "--fsdp", "--workers", "0",
                      env={"UNBROKEN_KILL_AT": "step-done@17"})
    assert_job_killed(killed)
    return tmp


def resume(runs: Path, tmp_path: Path, n: int, *args: str) -> tuple[dict, str]:
    """The dump of a resumed copy of the killed job, and its stderr."""
    folder = tmp_path / "run"
    shutil.copytree(runs / "killed", folder)
    r = forked(n, folder, tmp_path / "r.jsonl", "--fsdp", "--workers", "0", "--dump",
               str(tmp_path / "d.json"), "--dump-at", "15", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "d.json").read_text()), r.stderr


def test_the_generation_holds_each_ranks_chunks_once(runs):
    names = set(p.name for p in (runs / "killed" / "gen-000000015").iterdir())
    assert {"shards.json", "rank00000.shards.safetensors",
            "rank00001.shards.safetensors"} <= names
    assert "model.safetensors" not in names  # every weight is sharded: no rank writes it whole
    index = json.loads((runs / "killed" / "gen-000000015" / "shards.json").read_text())
    chunks = index["tensors"]['["model", "0.weight"]']["chunks"]
    assert [c["offsets"] for c in chunks] == [[0, 0], [16, 0]]


def test_a_killed_fsdp_job_resumes_bitwise_on_every_rank(runs, tmp_path):
    dump, _ = resume(runs, tmp_path, 2)
    ref = json.loads((runs / "ref.json").read_text())
    assert dump == ref
    assert_resumed_bitwise(runs / "ref.jsonl", [runs / "k.jsonl",
                           tmp_path / "r.jsonl"], 15)


def test_each_rank_reads_only_the_shard_files_its_chunks_are_in(runs, tmp_path):
    """Restored on the saving job's 2 ranks and mesh, each rank reads its own shard file, not
    the other's (each is read whole: every rank's would be the whole model and optimizer)."""
    folder = tmp_path / "run"
    shutil.copytree(runs / "killed", folder)
    log = tmp_path / "reads"
    r = forked(2, folder, tmp_path / "r.jsonl", "--fsdp", "--workers", "0", "--epochs", "1",
               env={"READ_LOG": str(log)})
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        shards = [n for n in Path(f"{log}.{rank}").read_text().split()
                  if n.startswith("gen-000000015/") and n.endswith(".shards.safetensors")]
        assert shards == [f"gen-000000015/rank{rank:05d}.shards.safetensors"], (rank, shards)


@pytest.mark.parametrize("ranks", [1, 4])
def test_a_job_of_two_restores_on_another_world_size_element_for_element(runs, tmp_path,
                                                                         ranks):
    dump, stderr = resume(runs, tmp_path, ranks)
    ref = json.loads((runs / "ref.json").read_text())
    if ranks == 1:
        assert "the random streams of ranks 1..1 are dropped" in stderr
    else:  # ranks 2 and 3 had no streams saved: the equivalence left is said
        assert "rank 3 of 4: its random streams start afresh" in stderr
    assert dump["state"] == ref["state"]  # model and AdamW state, whole, equal
    assert len(ref["state"]) == 4 + 4 * 3  # 4 tensors, each with step, exp_avg, exp_avg_sq
    assert dump["ids"] == ref["ids"]  # the global batch of update 16, re-split over the ranks


def test_a_sharded_generation_restores_into_a_plain_model(runs, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(SCRIPT))  # as for the script itself
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import torch

    import unbroken

    shutil.copytree(runs / "killed", tmp_path / "run")
    data = script.dataset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = unbroken.ResumableLoader(unbroken.seeded(data, seed=0),
                                      unbroken.ResumableSampler(len(data), batch_size=16, seed=0))
    with pytest.warns(unbroken.UnbrokenWarning, match="world_size: saved 2, now 1"):
        with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                   scheduler=sched, data=loader) as ckpt:
            assert ckpt.restore() == 15
    ref = json.loads((runs / "ref.json").read_text())
    assert script.full_state(model, opt) == ref["state"]
    assert next(iter(loader))[2].tolist() == ref["ids"]


def test_a_corrupt_shard_of_one_rank_makes_every_rank_fall_back(runs, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(runs / "killed", folder)
    shard = folder / "gen-000000015" / "rank00001.shards.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    r = forked(2, folder, tmp_path / "t.jsonl", "--fsdp", "--workers", "0", "--epochs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 1: " in r.stderr and "rank00001.shards.safetensors" in r.stderr
    for restore in first_restores(tmp_path / "t.jsonl"):
        assert restore["step"] == 10 and restore["rejected"] == ["gen-000000015"]


def test_an_unsharded_generation_into_an_fsdp2_model_is_refused_before_any_change(tmp_path):
    """Refused while validating (as every rank's verdict is agreed), naming the tensor, with
    the live optimizer and scheduler as they were; not by the model's own load after the
    optimizer and the small parts were loaded."""
    from conftest import run_script

    r = run_script("fsdp_unsharded_into_sharded.py", str(tmp_path), fresh_interpreter=True,
                   timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["error"] == "StateMismatch", got
    assert "'0.weight' is sharded in the live model" in got["message"], got
    assert "saved unsharded" in got["message"], got
    assert (got["optimizer_states"], got["last_epoch"], got["lr"]) == (0, 0, 0.01), got
