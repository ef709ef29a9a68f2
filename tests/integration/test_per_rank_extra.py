"""Extras held per rank (`unbroken.PerRank`) in a gloo job (its ranks forked from the test
zygote: `_launch.forked`; saved through persisting processes, under torchrun:
test_lightning_ddp.py): saved by 2 ranks, each rank restores its own
state of them, while a plain extra and the model are shared; a job of 3 ranks gives its new
rank rank 0's (and says so). A model with BatchNorm, whose statistics each rank updates
with its own batch, saves rank 0's (DDP copies them to every rank at each forward) with a
warning instead of refusing the replicas. `unbroken verify` and
`unbroken inspect` read such a generation; the ranks' files hold only their own parts, and a
rank's file resealed with another set of parts (one missing, one more, a shared one again) is
refused by `verify` and by a restore, naming that file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _launch import forked
from conftest import SCRIPTS, run_script
from test_sharded_tools_s25 import reseal

SCRIPT = str(SCRIPTS / "per_rank_extra.py")
DECAY = 0.5 * 0.9 ** 3


def _job(n: int, tmp: Path, mode: str, *args: str) -> tuple[dict[int, dict], str]:
    r = forked(n, tmp / "run", tmp / f"{mode}{n}.trace", "--mode", mode, *args,
                 script=SCRIPT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return {x["rank"]: x for x in lines}, r.stderr


def _own(rank: int) -> dict:
    """What rank ``rank`` of the saving job held at step 3."""
    return {"count": 3 * (rank + 1), "values": [3.0 * rank, 30.0 * rank, 6.0]}


def test_each_rank_restores_its_own_and_a_new_rank_rank_zeros(tmp_path):
    saved, err = _job(2, tmp_path, "save")
    assert sorted(saved) == [0, 1], saved
    # (BatchNorm's statistics, each rank's own after its forward: rank 0's saved, warned)
    assert "differ across ranks (BatchNorm's running statistics" in err, err[-3000:]
    gen = tmp_path / "run" / "gen-000000003"
    parts = {name: sorted(json.loads((gen / name).read_text())["parts"])
             for name in ("state.json", "rank00000.state.json", "rank00001.state.json")}
    assert parts["rank00000.state.json"] == parts["rank00001.state.json"] == [
        "extra.mine", "rng"], parts
    assert "extra.mine" not in parts["state.json"] and "extra.shared" in parts["state.json"]

    got, _ = _job(2, tmp_path, "restore")
    for rank in (0, 1):
        assert got[rank]["step"] == 3 and got[rank]["decay"] == pytest.approx(DECAY)
        assert {k: got[rank][k] for k in ("count", "values")} == _own(rank), got

    got, err = _job(3, tmp_path, "restore")
    assert [{k: got[r][k] for k in ("count", "values")} for r in range(3)] == [
        _own(0), _own(1), _own(0)], got
    assert "extras held per rank, if any, are rank 0's" in err, err[-3000:]

    for command in (["verify", "--deep", str(tmp_path / "run")],
                    ["inspect", "--json", str(tmp_path / "run")]):
        r = run_script("unbroken", *command)
        assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])

    gen = tmp_path / "run" / "gen-000000003"
    own = json.loads((gen / "rank00001.state.json").read_text())
    shared = json.loads((gen / "state.json").read_text())["parts"]
    for change in ({"extra.mine": None}, {"extra.bogus": {"x": 1}},
                   {"extra.shared": shared["extra.shared"]}):
        parts = {k: v for k, v in {**own["parts"], **change}.items() if v is not None}
        shutil.rmtree(tmp_path / "forged", ignore_errors=True)
        shutil.copytree(tmp_path / "run", tmp_path / "forged")
        reseal(tmp_path / "forged" / gen.name, "rank00001.state.json",
               json.dumps({**own, "parts": parts}).encode())
        r = run_script("unbroken", "verify", str(tmp_path / "forged"))
        assert r.returncode == 1 and "rank00001.state.json: holds parts" in r.stdout, (
            change, r.stdout[-2000:], r.stderr[-2000:])
        if "extra.mine" not in change:
            continue  # (a restore checks each rank's parts as verify does: one case is run)
        r = forked(2, tmp_path / "forged", tmp_path / "forged.trace", "--mode", "restore",
                     script=SCRIPT)
        # (the only generation refused: no start from scratch over it)
        assert r.returncode != 0 and "no generation verifies" in r.stderr, r.stderr[-3000:]
        assert "rank00001.state.json: holds parts" in r.stderr, r.stderr[-3000:]
