"""`dist.commit.check_replicas`: ranks that save at different steps (a rank calling save()
alone) are refused naming each rank's step, before the replicas are compared; found from
outside (twenty-fourth session): the message blamed the counters or an optimizer state
("a DDP replica divergence") instead."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unbroken.dist.commit import check_replicas
from unbroken.errors import StateMismatch, UpdateBoundaryError


class _Ranks:
    """A group of ``len(steps)`` ranks whose other ranks gathered the same digests as this
    one, at their own ``steps`` (rank 0 is this one)."""

    active = True

    def __init__(self, steps: list[int], differ: int | None = None,
                 named: int | None = None) -> None:
        self.steps, self.differ, self.named = steps, differ, named

    def all_gather(self, value: list[Any], what: str) -> list[list[Any]]:
        out = []
        for rank, step in enumerate(self.steps):
            theirs = [step, *value[1:]]  # (step, the names' digest, a digest by name)
            if rank == self.differ:
                theirs[2] = "0" * 16
            if rank == self.named:  # (another parameter or part: one digest more)
                theirs[1:] = ["f" * 16, *theirs[2:], "1" * 16]
            out.append(theirs)
        return out


STATE = [("model w", torch.ones(2)), ("counters", {"step": 10})]


def test_ranks_saving_different_steps_are_named_with_their_steps() -> None:
    with pytest.raises(UpdateBoundaryError, match=r"step 10 on ranks \[0, 2, 3\], step 7 on "
                                                  r"rank \[1\]; every rank saves at the same"):
        check_replicas(_Ranks([10, 7, 10, 10]), 10, STATE)


def test_replicas_that_differ_are_still_named() -> None:
    with pytest.raises(StateMismatch, match=r"'model w' on rank\(s\) \[1\]"):
        check_replicas(_Ranks([10, 10], differ=1), 10, STATE)
    check_replicas(_Ranks([10, 10, 10, 10]), 10, STATE)  # alike: nothing raised


def test_ranks_holding_other_names_are_refused_before_their_digests_are_paired() -> None:
    """Found in review (thirty-fifth session): ranks whose models hold other parameters
    paired their digests by position (an IndexError where one list was longer)."""
    with pytest.raises(StateMismatch, match=r"the names of rank\(s\) \[2\]'s parameters, "
                                            r"buffers, optimizer state or parts differ"):
        check_replicas(_Ranks([10, 10, 10], named=2), 10, STATE)

    class _Rank2(_Ranks):  # (the same, as rank 2 sees it: rank 0's names differ from its own)
        def all_gather(self, value: list[Any], what: str) -> list[list[Any]]:
            out = super().all_gather(value, what)
            return [[x[0], "e" * 16, *x[2:]] if r < 2 else x for r, x in enumerate(out)]

    with pytest.raises(StateMismatch, match=r"the names of rank\(s\) \[2\]'s"):
        check_replicas(_Rank2([10, 10, 10], named=2), 10, STATE)


class _PG:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _DDP:
    def __init__(self, size: int, unused: bool) -> None:
        self.process_group, self.find_unused_parameters = _PG(size), unused


def test_ddp_of_3_or_more_ranks_rebuilding_its_buckets_is_warned_about() -> None:
    """Found from outside (twenty-fourth session): a 4-rank DDP job resumed within rounding,
    not bitwise; plain torch shows it (a new wrapper's first update runs on the initial
    buckets), and find_unused_parameters=True (buckets never rebuilt) makes it bitwise."""
    import warnings

    from unbroken.dist.group import warn_ddp_buckets
    from unbroken.errors import UnbrokenWarning

    with pytest.warns(UnbrokenWarning, match="on 4 ranks rebuilds its gradient buckets.*"
                                             "find_unused_parameters=True"):
        warn_ddp_buckets(_DDP(4, unused=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_ddp_buckets(_DDP(2, unused=False))  # (a + b is b + a)
        warn_ddp_buckets(_DDP(4, unused=True))


def test_a_run_folder_is_named_as_the_store_opens_it(tmp_path, monkeypatch) -> None:
    """What the ranks of a job compare (found in review, thirty-fifth session): a real path
    refused one path that resolves otherwise per node (a bind mount), which works, since each
    rank writes at the leader's path; ``file://`` was taken for a relative path."""
    import os

    from unbroken.store.opening import location_key, open_store

    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert location_key("link") == str(tmp_path / "link")  # (not resolved)
    assert location_key("link") != location_key(str(tmp_path / "real"))
    assert location_key(f"file://{tmp_path}/run") == str(tmp_path / "run")
    assert location_key(f"file://{tmp_path}/run") == open_store(f"file://{tmp_path}/run").root
    assert location_key("run/") == open_store("run/").root
    assert location_key("s3://bucket/runs/exp1/") == "s3://bucket/runs/exp1"


def test_a_part_kept_per_rank_is_not_called_a_replica_divergence() -> None:
    """Found from outside (thirty-fifth session): Lightning's logged metrics, rank-local in
    a DDP job, were refused as "a DDP replica divergence"."""
    state = [("model w", torch.ones(2)), ("extra.lightning", {"loss": 0.5})]
    with pytest.raises(StateMismatch, match=r"'extra.lightning' on rank\(s\) \[1\] differs from "
                                            r"rank 0 \(this part holds state of each rank's own"):
        check_replicas(_Ranks([10, 10], differ=1), 10, state[::-1])
