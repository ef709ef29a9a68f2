"""Persistent workers and a map-style dataset the loop changes between epochs (a curriculum's
``dataset.level = epoch``): torch's persistent workers keep the copy they started with, while a
resumed run's new workers start from the dataset as it is, so the two runs read different
items (found by an outside attack). The loader starts its persistent workers again when the
dataset's attributes changed since they started, in every run alike."""

from __future__ import annotations

import collections
import dataclasses
import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.data._persistent import workers_key


class _Levels(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.level = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i + 100 * self.level)])


@pytest.fixture(autouse=True)
def _no_loader_left():
    """The loaders built here are given to no Checkpointer: collected after each test, so a
    later test's restore in this process is not warned about them."""
    yield
    gc.collect()


def _batches(run: str, until: int, stop: int | None) -> list[list[float]]:
    """Train (nothing: record each batch) from the run's newest generation to update
    ``until``, saving and leaving after update ``stop``."""
    ds = _Levels()
    loader = unbroken.ResumableLoader(unbroken.seeded(ds, seed=1),  # (its level, wrapped)
                                      unbroken.ResumableSampler(8, batch_size=2, seed=3),
                                      num_workers=2, persistent_workers=True)
    ck = unbroken.Checkpointer(run, model=torch.nn.Linear(1, 1), data=loader)
    step = ck.restore()
    seen = []
    while step < until:
        ds.level = loader.epoch  # (the curriculum: set before each pass)
        for x in loader:
            seen.append(x.flatten().tolist())
            step += 1
            ck.step_done(step)
            if step in (stop, until):
                break
        if step == stop:
            ck.save()
            break
    ck.close()
    loader.stop_workers()
    return seen


def test_a_resumed_run_reads_what_the_uninterrupted_one_read(tmp_path):
    whole = _batches(str(tmp_path / "whole"), 10, None)
    first = _batches(str(tmp_path / "cut"), 10, 6)
    rest = _batches(str(tmp_path / "cut"), 10, None)
    assert first + rest == whole
    assert whole[4][0] >= 100  # (the second epoch reads level 1: workers started again)


def test_the_key_sees_attributes_set_not_contents_changed():
    ds = _Levels()
    wrapped = torch.utils.data.Subset(ds, [0, 1])
    before = workers_key(wrapped)
    ds.level = 1
    assert workers_key(wrapped) != before
    items = [1, 2]
    ds.items = items
    key = workers_key(wrapped)
    items.append(3)  # (a short list: its contents are the key's)
    assert workers_key(wrapped) != key
    ds.items, ds.weights = list(range(1000)), np.zeros(4)
    key = workers_key(wrapped)
    ds.items[5] = -1  # (in place in a long list or an array: not seen, as documented)
    ds.weights[0] = 1.0
    assert workers_key(wrapped) == key
    ds.items.append(1000)  # (a long list's length is seen)
    assert workers_key(wrapped) != key


class _Aug:
    def __init__(self) -> None:
        self.level = 0


class _Held(torch.utils.data.Dataset):
    """The level in an object the dataset holds, or in a small dict; the worker's pid too."""

    def __init__(self) -> None:
        self.aug, self.cfg = _Aug(), {"level": 0}

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        import os
        return torch.tensor([float(i + 100 * self.aug.level + 1000 * self.cfg["level"]),
                             float(os.getpid())])


def test_levels_held_in_objects_and_dicts_restart_the_workers_and_nothing_else_does():
    ds = _Held()
    loader = unbroken.ResumableLoader(unbroken.seeded(ds, seed=1),
                                      unbroken.ResumableSampler(8, batch_size=2, seed=3),
                                      num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(4):
        if epoch == 1:
            ds.aug.level = 1
        if epoch == 3:
            ds.cfg["level"] = 1
        items = torch.cat(list(loader))
        seen.append((items[:, 0].min().item(), set(items[:, 1].tolist())))
        loader.sampler.set_position(epoch + 1, 0)
    loader.stop_workers()
    assert [low for low, _ in seen] == [0.0, 100.0, 100.0, 1100.0]
    pids = [p for _, p in seen]
    assert pids[1] != pids[0] and pids[2] == pids[1] and pids[3] != pids[2]  # (no restart at 2)
    assert workers_key(float("nan")) == workers_key(float("nan"))


# -- what persistent workers copy, however it is held (found by an outside attack: a level two
# wrappers down, in a ConcatDataset's list, or on the collate_fn object, kept its old value in
# persistent workers while a resumed run's new workers read the new one) ---------------------


class _Params:
    def __init__(self) -> None:
        self.level = 0


class _Deep(torch.utils.data.Dataset):
    def __init__(self, base: int = 0) -> None:
        self.base, self.aug = base, _Aug()
        self.aug.params = _Params()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(self.base + i + 100 * self.aug.level
                                   + 1000 * self.aug.params.level)])


class _Rate:
    """A collate_fn whose rate the loop sets (a masking schedule); ``collate`` bound too."""

    def __init__(self) -> None:
        self.rate = 0

    def __call__(self, items: list) -> torch.Tensor:
        return torch.stack(items) + 10_000 * self.rate

    def collate(self, items: list) -> torch.Tensor:
        return self(items)


def _set_level(parts: tuple, epoch: int) -> None:
    for ds in parts[0]:
        ds.aug.level, ds.aug.params.level = epoch, epoch % 2
    parts[1].rate = epoch


def _held(how: str) -> tuple[list, _Rate, torch.utils.data.Dataset, object]:
    a, b, rate = _Deep(), _Deep(50), _Rate()
    dataset = {"subset of seeded": torch.utils.data.Subset(unbroken.seeded(a), list(range(8))),
               "seeded subset": unbroken.seeded(torch.utils.data.Subset(a, list(range(8)))),
               "concat": torch.utils.data.ConcatDataset([
                   torch.utils.data.Subset(a, [0, 1, 2, 3]),
                   torch.utils.data.Subset(b, [0, 1, 2, 3])]),
               "collate": a, "bound collate": a}[how]
    collate = {"collate": rate, "bound collate": rate.collate}.get(how)
    return [a, b], rate, dataset, collate


@pytest.mark.parametrize("how", ["subset of seeded", "seeded subset", "concat", "collate",
                                 "bound collate"])
def test_persistent_workers_read_what_new_workers_read(how):
    """The class of the defect: whatever the loop changes between passes, persistent workers
    give what new workers (a resumed run's) give from the objects as they are."""
    runs = []
    for persistent in (False, True):
        datasets, rate, dataset, collate = _held(how)
        loader = unbroken.ResumableLoader(dataset,
                                          unbroken.ResumableSampler(8, batch_size=4, seed=3),
                                          num_workers=2, persistent_workers=persistent,
                                          collate_fn=collate)
        seen = []
        while loader.epoch < 3:
            _set_level((datasets, rate), loader.epoch)
            seen += [x.flatten().tolist() for x in loader]
        loader.stop_workers()
        runs.append(seen)
    assert runs[0] == runs[1]
    assert max(runs[0][-1]) > max(runs[0][0])  # (the later passes read the later levels)


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self) -> None:
        self.state = {"epoch": 0, "consumed": 0}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)

    def __len__(self) -> int:
        return 8

    def __iter__(self):
        for i in range(self.state["consumed"], 8):
            yield torch.tensor([float(i)])


def test_an_iterable_datasets_persistent_workers_see_the_collate_fn_set():
    runs = []
    for persistent in (False, True):
        rate = _Rate()
        loader = unbroken.ResumableLoader(_Stream(), batch_size=4, collate_fn=rate,
                                          num_workers=2, persistent_workers=persistent)
        seen = []
        while loader.epoch < 3:
            rate.rate = loader.epoch
            seen += [x.flatten().tolist() for x in loader]
        loader.stop_workers()
        runs.append(seen)
    assert runs[0] == runs[1] and runs[0][-1][0] >= 20_000


class _Obj:
    pass


def _tree(draw_values: list, depth: int = 0) -> object:
    """A nest of objects, dicts, lists and tuples over ``draw_values`` (consumed in order)."""
    kind = draw_values.pop(0) % 4 if depth < 4 and draw_values else 4
    if kind == 4 or not draw_values:
        return draw_values.pop(0) if draw_values else 0
    children = [_tree(draw_values, depth + 1) for _ in range(1 + draw_values.pop(0) % 3)
                if draw_values]
    if kind == 0:
        o = _Obj()
        o.__dict__.update({f"a{i}": c for i, c in enumerate(children)} or {"a": 0})
        return o
    if kind == 1:
        return {f"k{i}": c for i, c in enumerate(children)}
    return list(children) if kind == 2 else tuple(children)


def _leaves(node: object, path: tuple = ()) -> list[tuple]:
    """Paths to the settable plain values (an object's attribute, a dict's or list's item)."""
    if isinstance(node, _Obj):
        items = node.__dict__.items()
    elif isinstance(node, (dict, list)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
    elif isinstance(node, tuple):
        return [p for i, c in enumerate(node) for p in _leaves(c, (*path, i))]  # (not its own)
    else:
        return []
    out = []
    for k, child in items:
        out += [(*path, k)] if isinstance(child, int) else _leaves(child, (*path, k))
    return out


def _set(node: object, path: tuple, value: int) -> None:
    for k in path[:-1]:
        node = getattr(node, k) if isinstance(node, _Obj) else node[k]
    if isinstance(node, _Obj):
        setattr(node, path[-1], value)
    else:
        node[path[-1]] = value


@given(st.lists(st.integers(0, 50), min_size=4, max_size=40), st.integers(0, 10**6))
@settings(max_examples=200, deadline=None)
def test_the_key_changes_with_any_value_set_and_with_nothing_else(values, pick):
    """Any plain value set anywhere in a nest of objects and short containers changes the key
    (at any depth); the key is the same again once it is set back, and a container replaced
    by an equal copy changes nothing."""
    root = _Obj()
    root.held = _tree(list(values))
    paths = _leaves(root)
    key = workers_key(root)
    assert workers_key(root) == key
    if not paths:
        return
    path = paths[pick % len(paths)]
    node = root
    for k in path:
        node = getattr(node, k) if isinstance(node, _Obj) else node[k]
    _set(root, path, node + 1)
    assert workers_key(root) != key, path
    _set(root, path, node)
    assert workers_key(root) == key
    if isinstance(root.held, (dict, list)):
        root.held = type(root.held)(root.held)  # (an equal copy)
        assert workers_key(root) == key


class _NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i: int) -> int:
        return int(i)


def test_a_seeded_dataset_without_a_length_is_taken_as_the_plain_one_is():
    """A map-style dataset without ``__len__`` (torch reads it through a batch sampler):
    wrapped in `seeded`, whose ``len()`` then raises, the loader was refused with a bare
    TypeError; it is read as the plain one is."""
    got = []
    for dataset in (_NoLen(), unbroken.seeded(_NoLen())):
        sampler = unbroken.ResumableSampler(8, batch_size=4, seed=1)
        got.append([b.tolist() for b in unbroken.ResumableLoader(dataset, sampler)])
    assert got[0] == got[1] and sorted(sum(got[0], [])) == list(range(8))


def test_the_key_sees_dict_subclasses_and_slotted_objects():
    @dataclasses.dataclass(slots=True)
    class Slotted:
        level: int = 0

    for holder, change in ((Slotted(), lambda h: setattr(h, "level", 1)),
                           (collections.OrderedDict(level=0), lambda h: h.update(level=1)),
                           (collections.defaultdict(int), lambda h: h.update(level=1))):
        key = workers_key(holder)
        change(holder)
        assert workers_key(holder) != key, holder
