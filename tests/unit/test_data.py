"""Data position: sampler order, rank split, consumed-not-prefetched cursor, worker-independent
per-sample randomness, accumulation windows, global RNG isolation, O(1) resume."""

from __future__ import annotations

import pickle
import random
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

from unbroken.data import ResumableLoader, ResumableSampler, SampleKey, seeded
from unbroken.errors import StateMismatch, UnbrokenError, UpdateBoundaryError


class Augmented(torch.utils.data.Dataset):
    """Id-carrying samples with augmentation drawn from all three global RNGs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        noise = torch.rand(3) + float(np.random.rand()) + random.random()
        return {"id": torch.tensor(int(i)), "x": noise}


class Lazy(torch.utils.data.Dataset):
    """A huge dataset that exists only as a length (for O(1) resume checks)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


def masking_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = torch.utils.data.default_collate(samples)
    batch["mask"] = torch.rand(len(samples)) < 0.5  # randomness in collate
    return batch


def ids(sampler: ResumableSampler) -> list[list[int]]:
    return [[int(i) for i in b] for b in sampler]


def run(loader: ResumableLoader, batches: int | None = None) -> list[Any]:
    out = []
    for batch in loader:
        out.append(batch)
        if batches is not None and len(out) == batches:
            break
    return out


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


# -- order -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 13, 97, 1000, 1024, 4099, 65537])
def test_permutation_is_a_bijection(n: int) -> None:
    for seed, epoch in [(0, 0), (1, 5), (2**40, 3)]:
        s = ResumableSampler(n, 1, seed=seed)
        assert sorted(s.indices(epoch, 0, n).tolist()) == list(range(n))
    assert ResumableSampler(n, 1, shuffle=False).indices(0, 0, n).tolist() == list(range(n))


def test_order_is_a_function_of_seed_and_epoch() -> None:
    a, b = ResumableSampler(1000, 10, seed=7), ResumableSampler(1000, 10, seed=7)
    assert a.indices(3, 0, 1000).tolist() == b.indices(3, 0, 1000).tolist()
    assert a.indices(0, 0, 1000).tolist() != a.indices(1, 0, 1000).tolist()
    other = ResumableSampler(1000, 10, seed=8)
    assert a.indices(0, 0, 1000).tolist() != other.indices(0, 0, 1000).tolist()
    b.set_epoch(3)
    assert sum(ids(b), []) == a.indices(3, 0, 1000).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_any_batch_yields_exactly_the_tail(drop_last: bool) -> None:
    full = ResumableSampler(103, 10, seed=1, drop_last=drop_last)
    full.set_epoch(2)
    epoch = ids(full)
    assert len(epoch) == len(full) == (10 if drop_last else 11)
    assert sum(len(b) for b in epoch) == (100 if drop_last else 103)
    for k in range(len(epoch)):
        s = ResumableSampler(103, 10, seed=1, drop_last=drop_last)
        s.load_state_dict({**full.state_dict(), "epoch": 2, "consumed": 10 * k})
        assert ids(s) == epoch[k:]


def test_sample_keys_carry_position_and_behave_as_ints() -> None:
    s = ResumableSampler(50, 5, seed=3)
    s.set_position(1, 10)
    batch = next(iter(s))
    assert [k.position for k in batch] == list(range(10, 15)) and {k.epoch for k in batch} == {1}
    key = batch[0]
    assert pickle.loads(pickle.dumps(key)).position == 10
    data = list(range(100, 150))
    assert data[key] == 100 + int(key) and np.arange(50)[key] == int(key)
    assert int(torch.arange(50)[key]) == int(key)


# -- ranks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_shares_concatenate_to_the_global_batch(drop_last: bool) -> None:
    n, batch = 1006, 8  # final partial batch of 6 >= world size 4
    glob = ids(ResumableSampler(n, batch, seed=5, drop_last=drop_last))
    for world in (2, 4):
        shares = [ids(ResumableSampler(n, batch, seed=5, drop_last=drop_last, rank=r,
                                       world_size=world))
                  for r in range(world)]
        assert all(len(s) == len(glob) for s in shares)
        for b, g in enumerate(glob):
            assert sum((shares[r][b] for r in range(world)), []) == g  # contiguous, rank order
            sizes = [len(shares[r][b]) for r in range(world)]
            assert max(sizes) - min(sizes) <= 1


def test_world_size_change_at_a_boundary_continues_without_repeat_or_gap() -> None:
    n, batch = 200, 8
    reference = ids(ResumableSampler(n, batch, seed=9))
    two = [ResumableSampler(n, batch, seed=9, rank=r, world_size=2) for r in range(2)]
    seen = []
    iters = [iter(s) for s in two]
    for _ in range(7):  # 7 updates on 2 ranks
        seen.append(sum(([int(i) for i in next(it)] for it in iters), []))
        for s in two:
            s.advance()
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["consumed"] == 7 * batch
    four = [ResumableSampler(n, batch, seed=9, rank=r, world_size=4) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    for parts in zip(*[ids(s) for s in four]):
        seen.append(sum(parts, []))
    assert seen == reference
    assert sorted(sum(seen, [])) == list(range(n))


def test_invalid_layouts_and_states_are_refused() -> None:
    with pytest.raises(ValueError, match="divide by world_size"):
        ResumableSampler(100, 10, world_size=4)
    with pytest.raises(ValueError, match="drop_last=True"):
        ResumableSampler(1001, 8, world_size=4)  # final partial batch of 1 < 4 ranks
    s = ResumableSampler(1000, 10, seed=1)
    s.set_position(2, 30)
    state = s.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 30
    for kwargs, key in [({"num_samples": 999}, "num_samples"), ({"seed": 2}, "seed"),
                        ({"batch_size": 20}, "batch_size"), ({"shuffle": False}, "shuffle")]:
        args = {"num_samples": 1000, "batch_size": 10, "seed": 1, **kwargs}
        other = ResumableSampler(args.pop("num_samples"), args.pop("batch_size"), **args)
        with pytest.raises(StateMismatch, match=key):
            other.load_state_dict(state)
    other = ResumableSampler(1000, 10, seed=1, rank=1, world_size=2)  # world size may change
    other.load_state_dict(state)
    assert (other.epoch, other.consumed) == (2, 30)
    with pytest.raises(StateMismatch, match="boundary"):
        other.load_state_dict({**state, "consumed": 35})


# -- loader ------------------------------------------------------------------------------------


def make_loader(n: int = 64, batch: int = 8, **kwargs: Any) -> ResumableLoader:
    sampler = ResumableSampler(n, batch, seed=3)
    return ResumableLoader(seeded(Augmented(n), seed=11), sampler, collate_fn=masking_collate,
                           **kwargs)


def test_batches_identical_with_0_2_4_workers_persistent_or_not() -> None:
    reference = run(make_loader())
    assert len(reference) == 8
    for kwargs in [dict(num_workers=2), dict(num_workers=4),
                   dict(num_workers=2, persistent_workers=True, prefetch_factor=3)]:
        loader = make_loader(**kwargs)
        assert same(run(loader), reference), kwargs
        if kwargs.get("persistent_workers"):
            second = run(loader)  # epoch 1 through the same persistent workers
            fresh = make_loader()
            fresh.load_state_dict({**fresh.state_dict(), "epoch": 1})
            assert same(second, run(fresh))
    # different samples get different augmentation, epochs too
    assert not torch.equal(reference[0]["x"][0], reference[0]["x"][1])


def test_state_counts_consumed_not_prefetched_and_resume_changes_worker_count() -> None:
    reference = run(make_loader())
    loader = make_loader(num_workers=2, prefetch_factor=4)
    taken = run(loader, 3)
    time.sleep(0.2)  # let the workers read ahead
    state = loader.state_dict()
    assert state["consumed"] == 3 * 8 and loader.last_batch_ids == [int(i) for i in taken[2]["id"]]
    for workers in (0, 4):  # 2 -> 0 and 2 -> 4 workers across the restart
        resumed = make_loader(num_workers=workers)
        resumed.load_state_dict(state)
        assert same(taken + run(resumed), reference)


def test_resume_in_a_new_loader_at_every_boundary_sees_each_id_once() -> None:
    reference = run(make_loader())
    for k in range(9):
        first = make_loader()
        head = run(first, k) if k else []
        state = first.state_dict()
        resumed = make_loader()
        resumed.load_state_dict(state)
        tail = run(resumed) if resumed.epoch == 0 else []
        assert same(head + tail, reference), k
    # after the last batch the cursor rolls over: a resume starts epoch 1, not an empty epoch 0
    assert state["epoch"] == 1 and state["consumed"] == 0


def test_accumulation_windows_and_save_refused_mid_window() -> None:
    loader = make_loader(n=80, batch=8, accumulation=4)  # 10 batches: windows of 4, 4, 2
    sizes, boundaries = [], []
    it = iter(loader)
    for k in range(3):
        next(it)
        assert not loader.at_boundary
    with pytest.raises(UpdateBoundaryError,
                       match="save requested after 3 of 4 micro-batches of the update window; "
                             "save at an update boundary"):
        loader.state_dict()
    assert loader.consumed == 0
    next(it)
    assert loader.at_boundary and loader.state_dict()["consumed"] == 32
    for _ in it:
        sizes.append(loader.window_size)
        boundaries.append(loader.at_boundary)
    assert sizes == [4, 4, 4, 4, 2, 2]
    assert boundaries == [False, False, False, True, False, True]
    assert (loader.epoch, loader.consumed) == (1, 0)


def test_a_broken_off_window_is_replayed_and_stale_iterators_refuse() -> None:
    loader = make_loader(accumulation=2)
    first = run(loader, 3)  # window 2 unfinished after 3 micro-batches
    older = iter(loader)
    assert same([next(older)], first[2:3])  # the unfinished window starts over
    newer = iter(loader)
    with pytest.raises(UnbrokenError, match="superseded"):
        next(older)
    assert same([next(newer)], first[2:3])


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_does_not_advance_the_global_rngs(workers: int) -> None:
    def draws() -> tuple[Any, ...]:
        return torch.rand(4), np.random.rand(), random.random()

    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    expected = draws()
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    loader = make_loader(num_workers=workers)
    run(loader)
    run(loader, 2)
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_resume_is_o1_at_position_1e9_of_3e9() -> None:
    n = 3 * 10**9
    sampler = ResumableSampler(n, 32, seed=0)
    loader = ResumableLoader(Lazy(n), sampler)
    t0 = time.perf_counter()
    loader.load_state_dict({**sampler.state_dict(), "consumed": 10**9})
    batch = next(iter(loader))
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.05, elapsed
    assert batch.tolist() == sampler.indices(0, 10**9, 10**9 + 32).tolist()
    assert loader.consumed == 10**9 + 32


def test_seeded_isolates_and_restores_the_callers_rng() -> None:
    ds = seeded(Augmented(10), seed=1)
    key = SampleKey(4, epoch=2, position=7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a, b = ds[key], ds[key]
    assert torch.equal(a["x"], b["x"]) and torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(a["x"], ds[SampleKey(4, epoch=3, position=7)]["x"])
    assert len(ds) == 10 and ds.n == 10  # attributes pass through


def test_a_loader_with_persistent_workers_iterates_again_after_stop_workers():
    # (a Trainer that ends at a step limit stops the workers; its next train() iterates again)
    ds = torch.utils.data.TensorDataset(torch.arange(64.0))
    loader = ResumableLoader(ds, ResumableSampler(64, batch_size=8, seed=0),
                                      num_workers=2, persistent_workers=True)
    first = [b[0].tolist() for b in loader]
    loader.stop_workers()
    assert [b[0].tolist() for b in loader] != [] and loader.epoch == 2
    loader.stop_workers()
    loader.stop_workers()  # (twice: nothing left to stop)
    again = ResumableLoader(ds, ResumableSampler(64, batch_size=8, seed=0))
    assert [b[0].tolist() for b in again] == first
