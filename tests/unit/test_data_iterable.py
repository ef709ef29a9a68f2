"""Resumable iterable datasets with real DataLoader workers: the batches do not depend on the
worker count, a resume continues at the first item no completed update consumed whatever the
workers before and after, and trace ids identify samples rather than stream positions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

from unbroken.data import ResumableLoader, ResumableSampler
from unbroken.data.iterable import sample_id
from unbroken.errors import UnbrokenWarning, UpdateBoundaryError
from unbroken.state._digest import digest_tree

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:ResumableLoader. (Stream|Named) does not set")]

N, BATCH = 50, 4  # 13 batches per epoch, the last one of 2 items


class Stream(torch.utils.data.IterableDataset):
    """Epoch `epoch` from item `consumed` on, in a keyed order; item content = f(salt, index)."""

    def __init__(self, n: int = N, salt: float = 0.0, form: str = "dict") -> None:
        self.n, self.salt, self.form = n, salt, form
        self.epoch = self.consumed = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "salt": self.salt, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.salt = state["n"], state["salt"]
        self.epoch, self.consumed = state["epoch"], state["consumed"]

    def item(self, index: int) -> Any:
        x = torch.arange(3, dtype=torch.float64) + index + self.salt
        if self.form == "tensor":
            return x
        if self.form == "id":
            return {"id": torch.tensor(index), "x": x}
        return {"x": x}

    def positions(self) -> range:
        return range(self.consumed, self.n)

    def __iter__(self) -> Any:
        order = ResumableSampler(self.n, 1, seed=2).indices(self.epoch, 0, self.n)
        return (self.item(int(order[p])) for p in self.positions())


class SplitStream(Stream):
    """Yields only its worker's items (the `splits_by_worker` option)."""

    splits_by_worker = True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.batch_size = state["batch_size"]

    def positions(self) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return range(self.consumed, self.n)
        return (self.consumed + k for k in range(self.n - self.consumed)
                if k // self.batch_size % info.num_workers == info.id)


class Named(Stream):
    def sample_id(self, item: Any) -> int:
        return 1000 + int(item["x"][0])


def noisy_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = torch.utils.data.default_collate(items)
    batch["noise"] = torch.rand(len(items))  # randomness in collate
    return batch


def loader(workers: int, dataset: Stream | None = None, **kwargs: Any) -> ResumableLoader:
    if workers == 0:
        kwargs.pop("persistent_workers", None)
    return ResumableLoader(Stream() if dataset is None else dataset, batch_size=BATCH,
                           num_workers=workers, collate_fn=kwargs.pop("collate_fn", noisy_collate),
                           **kwargs)


def drain(ld: ResumableLoader, until: int = 2, stop: int | None = None) -> list[Any]:
    """(sample ids, batch) per batch until epoch `until`, or until `stop` batches."""
    out: list[Any] = []
    while ld.epoch < until:
        for batch in ld:
            out.append((ld.last_batch_ids, batch))
            if len(out) == stop:
                assert ld.at_boundary
                return out
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        return torch.equal(x, y)

    return len(a) == len(b) and all(i == j and eq(x, y) for (i, x), (j, y) in zip(a, b))


def indices(batches: list[Any]) -> list[int]:
    return [int(v) for _, b in batches for v in b["x"][:, 0]]


REFERENCE: list[Any] = []


def reference() -> list[Any]:
    if not REFERENCE:
        REFERENCE.extend(drain(loader(0)))
    return REFERENCE


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("persistent", [False, True])
def test_batches_do_not_depend_on_the_worker_count(workers: int, persistent: bool) -> None:
    ref = reference()
    assert len(ref) == 26 and [len(b["x"]) for _, b in ref[:13]] == [4] * 12 + [2]
    for epoch in range(2):  # every item once per epoch, in a different order each epoch
        got = indices(ref[13 * epoch:13 * (epoch + 1)])
        assert sorted(got) == list(range(N))
    assert indices(ref[:13]) != indices(ref[13:])
    assert same(drain(loader(workers, persistent_workers=persistent)), ref)


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_a_dataset_that_splits_itself_by_worker_gives_the_same_batches(workers: int) -> None:
    ref = reference()
    assert same(drain(loader(workers, SplitStream())), ref)
    first = loader(2, SplitStream(), accumulation=3)
    head = drain(first, stop=6)
    resumed = loader(workers, SplitStream(), accumulation=3)
    resumed.load_state_dict(first.state_dict())
    assert same(head + drain(resumed), ref)


def test_workers_that_read_the_whole_stream_are_warned_about() -> None:
    with pytest.warns(UnbrokenWarning, match="each of the 2 workers reads the whole stream"):
        loader(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnbrokenWarning)
        loader(1), loader(4, SplitStream())


# mid-epoch boundary, before the last window of epoch 0, epoch 1's start, mid epoch 1
@pytest.mark.parametrize("accumulation,stops", [(1, (6, 12, 13, 20)), (3, (6, 12, 13, 19))])
@pytest.mark.parametrize("before,after", [(2, 4), (4, 0), (0, 2)])
def test_resume_with_another_worker_count_yields_exactly_the_remaining_items(
        accumulation: int, stops: tuple[int, ...], before: int, after: int) -> None:
    ref = reference()
    for stop in stops:
        first = loader(before, accumulation=accumulation, prefetch_factor=4 if before else None)
        head = drain(first, stop=stop)
        state = first.state_dict()
        assert state["consumed"] == (stop % 13) * BATCH and state["epoch"] == stop // 13
        resumed = loader(after, accumulation=accumulation)
        resumed.load_state_dict(state)
        tail = drain(resumed)
        assert same(head + tail, ref), (stop, before, after)
        got = indices(head + tail)
        assert sorted(got[:N]) == list(range(N)) and sorted(got[N:]) == list(range(N))


RESUME_IN_A_FRESH_PROCESS = """
import json, sys, warnings
warnings.simplefilter("ignore")
from test_data_iterable import loader, drain
from unbroken.state._digest import digest_tree
resumed = loader(0, accumulation=3)
resumed.load_state_dict(json.loads(sys.stdin.read()))
print(json.dumps([[ids, digest_tree(batch)] for ids, batch in drain(resumed)]))
"""


def test_a_fresh_process_without_workers_continues_a_4_worker_run_bitwise() -> None:
    ref = [[ids, digest_tree(batch)] for ids, batch in reference()]
    first = loader(4, accumulation=3)
    head = [[ids, digest_tree(batch)] for ids, batch in drain(first, stop=9)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__)]
                                                      + sys.path)}
    out = subprocess.run([sys.executable, "-c", RESUME_IN_A_FRESH_PROCESS], env=env, check=True,
                         input=json.dumps(first.state_dict()), capture_output=True, text=True)
    assert head + json.loads(out.stdout) == ref


def test_windows_boundaries_and_mid_window_saves_with_workers() -> None:
    ld = loader(2, accumulation=3)
    it = iter(ld)
    sizes, boundaries = [], []
    for k in range(13):
        next(it)
        sizes.append(ld.window_size)
        boundaries.append(ld.at_boundary)
        if not ld.at_boundary:
            with pytest.raises(UpdateBoundaryError, match="micro-batches of the update window"):
                ld.state_dict()
    assert sizes == [3] * 12 + [1]
    assert boundaries == [k % 3 == 2 for k in range(12)] + [True]
    assert (ld.epoch, ld.consumed) == (1, 0)  # the end of the stream rolled the epoch over
    with pytest.raises(StopIteration):
        next(it)


def test_a_broken_off_window_is_replayed_by_persistent_workers() -> None:
    ref = reference()
    ld = loader(2, accumulation=3, persistent_workers=True)
    head = drain(ld, stop=6)
    for _ in range(2):  # two micro-batches of an unfinished window, then a new iter()
        it = iter(ld)
        next(it), next(it)
    assert not ld.at_boundary
    assert same(head + drain(ld), ref)


def test_persistent_workers_follow_load_state_dict_and_restart_on_a_new_dataset_state() -> None:
    ref = reference()
    ld = loader(4, persistent_workers=True)
    drain(ld, stop=9)
    saved = loader(0)
    head = drain(saved, stop=5)
    ld.load_state_dict(saved.state_dict())  # back to batch 5 of epoch 0
    assert same(head + drain(ld), ref)
    other = loader(0, Stream(salt=0.25))
    other_head = drain(other, stop=3)
    ld.load_state_dict(other.state_dict())  # another salt: the workers' copies are stale
    assert same(other_head + drain(ld), other_head + drain(other))


def test_ids_identify_samples_not_positions() -> None:
    a = drain(loader(2, Stream(salt=0.0), collate_fn=None), until=1)
    b = drain(loader(2, Stream(salt=0.5), collate_fn=None), until=1)
    ids_a, ids_b = [i for ids, _ in a for i in ids], [i for ids, _ in b for i in ids]
    assert len(set(ids_a)) == N and not set(ids_a) & set(ids_b)  # same positions, other samples
    # equal across worker counts and epochs (a sample keeps its id), and a content digest
    zero = drain(loader(0, Stream(salt=0.0), collate_fn=None))
    assert [ids for ids, _ in zero[:13]] == [ids for ids, _ in a]
    assert sorted(i for ids, _ in zero[13:] for i in ids) == sorted(ids_a)
    assert ids_a[0] == sample_id({"x": a[0][1]["x"][0]})
    tensors = drain(loader(4, Stream(form="tensor"), collate_fn=None), until=1)
    assert len({i for ids, _ in tensors for i in ids}) == N
    assert all(0 <= i < 2**63 for i in ids_a)


@pytest.mark.parametrize("workers", [0, 2])
def test_item_ids_and_sample_id_methods_are_used(workers: int) -> None:
    for dataset, offset in [(Stream(form="id"), 0), (Named(), 1000)]:
        batches = drain(loader(workers, dataset, collate_fn=None), until=1)
        for ids, batch in batches:
            assert ids == [offset + int(v) for v in batch["x"][:, 0]]
    assert sample_id({"id": np.int64(7)}) == 7 and sample_id({"id": 7, "x": 1}) == 7
    assert sample_id({"id": "seven"}) != sample_id({"id": "eight"})  # not an int: digested
    with pytest.raises(TypeError, match="sample_id"):
        sample_id(object())


def test_last_update_ids_cover_the_window() -> None:
    ld = loader(2, Stream(form="id"), accumulation=3, collate_fn=None)
    batches: list[list[int]] = []
    for batch in ld:
        batches.append([int(v) for v in batch["id"]])
        if ld.at_boundary:
            assert ld.last_update_ids == sum(batches[-ld.window_size:], [])
        elif len(batches) > 3:
            r = len(batches) % 3  # the last completed window ended r batches ago
            assert ld.last_update_ids == sum(batches[-r - 3:-r], [])
    assert len(batches) == 13 and ld.window_size == 1
