"""`unbroken.PerRank` outside a job: an extra like any other (in ``state.json``, restored
bitwise), refused when it wraps what has no state; and `saving.replicated`, the replica check's
list, leaves out the parts held per rank (a job's ranks compare the rest)."""

from __future__ import annotations

import json

import pytest
import torch

import unbroken
from unbroken.saving import replicated


class Counter:
    def __init__(self) -> None:
        self.values = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"values": self.values.clone(), "n": int(self.values.sum())}

    def load_state_dict(self, state: dict) -> None:
        self.values = state["values"].clone()


def test_a_per_rank_extra_in_one_process_is_an_extra_like_any_other(tmp_path):
    model = torch.nn.Linear(2, 2)
    mine = Counter()
    ck = unbroken.Checkpointer(tmp_path / "run", model=model,
                               extras={"mine": unbroken.PerRank(mine)})
    mine.values += torch.tensor([1.5, -2.0, 3.25])
    ck.save(1)
    ck.close()
    gen = tmp_path / "run" / "gen-000000001"
    assert "extra.mine" in json.loads((gen / "state.json").read_text())["parts"]
    assert not list(gen.glob("rank*"))
    again = Counter()
    ck = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2),
                               extras={"mine": unbroken.PerRank(again)})
    assert ck.restore() == 1
    ck.close()
    assert torch.equal(again.values, mine.values)


@pytest.mark.parametrize("thing", [object(), {"a": 1}, 3])
def test_per_rank_refuses_what_has_no_state(thing):
    with pytest.raises(TypeError, match="PerRank needs an object with state_dict"):
        unbroken.PerRank(thing)


def test_the_replica_check_leaves_out_the_parts_held_per_rank():
    tree = {"model": {"w": torch.ones(1)}, "rng": {}, "counters": {"step": 1, "epoch": 0},
            "extra.mine": {"v": 1}, "extra.shared": {"v": 2}}
    assert [name for name, _ in replicated(tree)] == [
        "model w", "counters", "extra.mine", "extra.shared"]
    assert [name for name, _ in replicated(tree, frozenset({"extra.mine"}))] == [
        "model w", "counters", "extra.shared"]
