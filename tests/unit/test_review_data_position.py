"""Adversarial review of the data position (ResumableSampler, ResumableLoader, iterable
datasets, Packer): property tests over random layouts and interruption points.

The promise under test: the position is counted in samples consumed by *completed updates*
(never what DataLoader workers prefetched), so a run interrupted at any update -- after the
workers read ahead and after the loop took micro-batches no update completed -- and resumed
with the same settings (any worker count) sees exactly the samples, in the same order and
with the same per-sample randomness, that an uninterrupted run sees, across epoch boundaries,
drop_last, shuffling, accumulation windows, world-size changes, iterable datasets and packing.
A resume with settings that would change the sequence either continues it exactly or is
refused with a typed `UnbrokenError`, leaving the live objects untouched.

Each interrupted state travels through JSON (what a checkpoint stores) before it is loaded.
Expected sequences are checked against oracles computed here, independently of the library
(epoch coverage, batch and window sizes, the Packer's token stream), and the resumed sequence
is compared with the uninterrupted one exactly."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.data import Packer, ResumableLoader, ResumableSampler, seeded
from unbroken.data._keyed import TAG_PACK, KeyedPermutation, mix
from unbroken.errors import IdentityMismatch, StateMismatch, UnbrokenError, UpdateBoundaryError

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:ResumableLoader. .* does not set")]

# The suite runs a fixed set of examples (derandomized: the same on every run). For a hunt,
# UNBROKEN_PROPERTY_SCALE=N multiplies the examples and draws them at random.
SCALE = int(os.environ.get("UNBROKEN_PROPERTY_SCALE", "1"))
PROPERTY = settings(deadline=None, database=None, max_examples=15 * SCALE,
                    derandomize="UNBROKEN_PROPERTY_SCALE" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
FEW = settings(PROPERTY, max_examples=6 * SCALE)  # examples that start DataLoader workers


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores: plain JSON, read back."""
    return json.loads(json.dumps(state))


# -- the order ---------------------------------------------------------------------------------


@PROPERTY
@given(n=st.integers(1, 5000), seed=st.integers(-2**70, 2**70), epoch=st.integers(0, 10**6),
       cut=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_the_order_is_a_bijection_and_any_slice_of_it_is_the_same_slice(
        n: int, seed: int, epoch: int, cut: tuple[float, float]) -> None:
    s = ResumableSampler(n, 1, seed=seed)
    whole = s.indices(epoch, 0, n).tolist()
    assert sorted(whole) == list(range(n))
    a, b = sorted(int(c * n) for c in cut)
    fresh = ResumableSampler(n, 1, seed=seed)  # nothing cached: a pure function of its inputs
    assert fresh.indices(epoch, a, b).tolist() == whole[a:b]
    assert [fresh.index(epoch, p) for p in range(a, min(b, a + 5))] == whole[a:min(b, a + 5)]


# -- map-style ---------------------------------------------------------------------------------


class Ids(torch.utils.data.Dataset):
    """Sample i is its own id plus per-sample noise (drawn from the global torch RNG, which
    `seeded` seeds from (seed, epoch, position))."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(int(i)), torch.rand(2, dtype=torch.float64)


Micro = tuple[tuple[int, ...], tuple[float, ...]]  # (ids, noise) of one micro-batch


def content(batch: Any) -> Micro:
    ids, noise = batch
    return tuple(int(i) for i in ids), tuple(float(v) for v in noise.reshape(-1))


def micro_batches(loader: Any, epochs: int) -> Iterator[Any]:
    """The README's loop structure: passes until the loader's epoch counter reaches `epochs`.
    A pass that runs out must have ended its epoch (else the loop would never end)."""
    while loader.epoch < epochs:
        epoch = loader.epoch
        for batch in loader:
            yield batch
        assert loader.epoch == epoch + 1, (
            f"a pass of epoch {epoch} ran out but the loader's epoch is {loader.epoch}")


def drive(loader: Any, epochs: int, *, stop: int | None = None, extra: int = 0,
          convert: Any = content, kill: bool = True) -> tuple[list[list[Any]], list[Any]]:
    """Updates (each the list of its micro-batches) and, after each, the (JSON round-tripped)
    state, loader.epoch and loader.consumed. With ``stop``: after ``stop`` updates take
    ``extra`` more micro-batches (work the kill loses), then abandon the loader (and, with
    ``kill``, stop its workers); the last entry of the second list is then the state to
    resume from (the fresh one when ``stop`` is 0)."""
    updates: list[list[Any]] = []
    after: list[Any] = []
    window: list[Any] = []
    gen = micro_batches(loader, epochs)
    if stop == 0:
        after.append((roundtrip(loader.state_dict()), loader.epoch, loader.consumed))
    for batch in gen if stop != 0 else ():
        window.append(convert(batch))
        if not loader.at_boundary:
            with pytest.raises(UpdateBoundaryError):
                loader.state_dict()
            continue
        assert len(window) == loader.window_size, (len(window), loader.window_size)
        updates.append(window)
        window = []
        after.append((roundtrip(loader.state_dict()), loader.epoch, loader.consumed))
        if stop is not None and len(updates) == stop:
            break
    if stop is not None:
        for _ in range(extra):  # the loop goes on past the last save; the kill loses this
            if next(gen, None) is None:
                break
        gen.close()
        if kill:
            loader.stop_workers()
    return updates, after


def epoch_layout(n: int, batch: int, drop_last: bool, acc: int) -> tuple[list[int], list[int]]:
    """Oracle: micro-batch sizes and window sizes (in micro-batches) of one epoch."""
    if drop_last:
        sizes = [batch] * (n // batch)
    else:
        sizes = [batch] * (n // batch) + ([n % batch] if n % batch else [])
    windows = [acc] * (len(sizes) // acc) + ([len(sizes) % acc] if len(sizes) % acc else [])
    return sizes, windows


def check_reference(updates: list[list[Micro]], after: list[Any], n: int, batch: int,
                    drop_last: bool, acc: int, shuffle: bool, epochs: int) -> None:
    """The uninterrupted run against the oracle: every epoch is the right samples, in batches
    and windows of the right sizes, and the cursor after each update is what was consumed."""
    sizes, windows = epoch_layout(n, batch, drop_last, acc)
    per_epoch = len(windows)
    assert len(updates) == per_epoch * epochs
    for e in range(epochs):
        mine = updates[e * per_epoch:(e + 1) * per_epoch]
        assert [len(u) for u in mine] == windows
        micro = [m for u in mine for m in u]
        assert [len(m[0]) for m in micro] == sizes
        ids = [i for m in micro for i in m[0]]
        assert len(set(ids)) == len(ids) == sum(sizes) and set(ids) <= set(range(n))
        if not drop_last:
            assert sorted(ids) == list(range(n))
        if not shuffle:
            assert ids == list(range(sum(sizes)))
        consumed = 0
        for u, (state, epoch, cons) in zip(mine, after[e * per_epoch:(e + 1) * per_epoch]):
            consumed += sum(len(m[0]) for m in u)
            last = consumed == sum(sizes)
            # the epoch the next update's data comes from (already the next one at the end)
            assert (epoch, cons) == ((e + 1, 0) if last else (e, consumed))
            assert (state["epoch"], state["consumed"]) == (epoch, cons)


@st.composite
def layouts(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(1, 40))
    batch = draw(st.integers(1, 9))
    drop_last = draw(st.booleans()) if n >= batch else False
    return dict(n=n, batch=batch, drop_last=drop_last, acc=draw(st.integers(1, 4)),
                shuffle=draw(st.booleans()), seed=draw(st.integers(0, 2**64)),
                epochs=draw(st.integers(1, 3)))


def map_loader(lay: dict[str, Any], workers: int = 0, persistent: bool = False,
               prefetch: int | None = None, **over: Any) -> ResumableLoader:
    p = {**lay, **over}
    sampler = ResumableSampler(p["n"], p["batch"], seed=p["seed"], shuffle=p["shuffle"],
                               drop_last=p["drop_last"], rank=p.get("rank", 0),
                               world_size=p.get("world", 1))
    return ResumableLoader(seeded(Ids(p["n"]), seed=7), sampler, num_workers=workers,
                           persistent_workers=persistent and workers > 0,
                           prefetch_factor=prefetch if workers else None,
                           accumulation=p["acc"])


_REFS: dict[str, Any] = {}


def reference(lay: dict[str, Any]) -> tuple[list[list[Micro]], list[Any]]:
    key = json.dumps(lay, sort_keys=True)
    if key not in _REFS:
        _REFS[key] = drive(map_loader(lay), lay["epochs"])
    return _REFS[key]


@PROPERTY
@given(lay=layouts(), data=st.data())
def test_map_resume_at_any_update_without_workers_matches_the_uninterrupted_run(
        lay: dict[str, Any], data: Any) -> None:
    ref, after = reference(lay)
    check_reference(ref, after, lay["n"], lay["batch"], lay["drop_last"], lay["acc"],
                    lay["shuffle"], lay["epochs"])
    stop = data.draw(st.integers(0, len(ref)), label="stop")
    extra = data.draw(st.integers(0, 5), label="extra")
    head, saved = drive(map_loader(lay), lay["epochs"], stop=stop, extra=extra)
    assert head == ref[:stop]
    resumed = map_loader(lay)
    resumed.load_state_dict(saved[-1][0])
    tail, _ = drive(resumed, lay["epochs"])
    assert head + tail == ref
    assert resumed.epoch == lay["epochs"] and resumed.at_boundary


@FEW
@given(lay=layouts(), data=st.data())
def test_map_resume_with_workers_prefetching_matches_the_uninterrupted_run(
        lay: dict[str, Any], data: Any) -> None:
    ref, _ = reference(lay)
    stop = data.draw(st.integers(0, len(ref)), label="stop")
    extra = data.draw(st.integers(0, 5), label="extra")
    before = data.draw(st.sampled_from([1, 2]), label="workers before")
    after = data.draw(st.sampled_from([0, 1, 2]), label="workers after")
    persistent = data.draw(st.booleans(), label="persistent")
    prefetch = data.draw(st.integers(1, 4), label="prefetch")
    first = map_loader(lay, before, persistent, prefetch)
    head, saved = drive(first, lay["epochs"], stop=stop, extra=extra)
    assert head == ref[:stop]
    resumed = map_loader(lay, after, persistent, prefetch)
    resumed.load_state_dict(saved[-1][0])
    tail, _ = drive(resumed, lay["epochs"])
    resumed.stop_workers()
    assert head + tail == ref


@FEW
@given(lay=layouts(), data=st.data())
def test_the_same_loader_reloaded_mid_run_with_persistent_workers_replays_exactly(
        lay: dict[str, Any], data: Any) -> None:
    """load_state_dict on a live loader whose persistent workers hold prefetched batches of
    a later position (a rollback to an earlier generation in the same process)."""
    ref, after = reference(lay)
    back = data.draw(st.integers(0, len(ref)), label="restore to update")
    ahead = data.draw(st.integers(back, len(ref)), label="run ahead to")
    loader = map_loader(lay, 2, True, 4)
    head, _ = drive(loader, lay["epochs"], stop=ahead, extra=2, kill=False)
    assert head == ref[:ahead]
    state = after[back - 1][0] if back else roundtrip(map_loader(lay).state_dict())
    loader.load_state_dict(state)
    tail, _ = drive(loader, lay["epochs"])
    loader.stop_workers()
    assert ref[:back] + tail == ref


# -- several ranks -----------------------------------------------------------------------------


@st.composite
def rank_layouts(draw: Any) -> dict[str, Any]:
    w1 = draw(st.sampled_from([1, 2, 3, 4]))
    w2 = draw(st.sampled_from([1, 2, 3, 4]))
    batch = math.lcm(w1, w2) * draw(st.integers(1, 2))
    n = draw(st.integers(1, 40))
    drop_last = draw(st.booleans())
    assume(n >= batch if drop_last else (n % batch == 0 or n % batch >= max(w1, w2)))
    return dict(n=n, batch=batch, drop_last=drop_last, acc=draw(st.integers(1, 3)),
                shuffle=draw(st.booleans()), seed=draw(st.integers(0, 2**32)),
                epochs=draw(st.integers(1, 2)), w1=w1, w2=w2)


def global_updates(loaders: list[ResumableLoader], epochs: int, stop: int | None = None,
                   extra: int = 0) -> tuple[list[list[Micro]], list[Any]]:
    """Ranks in lockstep; each global micro-batch is the ranks' shares in rank order."""
    gens = [micro_batches(ld, epochs) for ld in loaders]
    updates: list[list[Micro]] = []
    states: list[Any] = []
    window: list[Micro] = []
    ended = False
    while not ended:
        parts = [next(g, None) for g in gens]
        if all(p is None for p in parts):
            break
        assert all(p is not None for p in parts), "ranks disagree on the number of batches"
        shares = [content(p) for p in parts]
        sizes = [len(s[0]) for s in shares]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, sizes
        window.append((sum((s[0] for s in shares), ()), sum((s[1] for s in shares), ())))
        flags = {ld.at_boundary for ld in loaders}
        assert len(flags) == 1
        if not flags.pop():
            continue
        updates.append(window)
        window = []
        rank_states = [roundtrip(ld.state_dict()) for ld in loaders]
        assert all(s == rank_states[0] for s in rank_states)
        states.append(rank_states[0])
        if stop is not None and len(updates) == stop:
            for _ in range(extra):
                if any(next(g, None) is None for g in gens):
                    break
            ended = True
    for g in gens:
        g.close()
    return updates, states


@PROPERTY
@given(lay=rank_layouts(), data=st.data())
def test_a_world_size_change_at_any_update_continues_the_global_sequence(
        lay: dict[str, Any], data: Any) -> None:
    base = {k: lay[k] for k in ("n", "batch", "drop_last", "acc", "shuffle", "seed", "epochs")}
    ref, _ = reference(base)
    stop = data.draw(st.integers(0, len(ref)), label="stop")
    extra = data.draw(st.integers(0, 3), label="extra")
    first = [map_loader(base, rank=r, world=lay["w1"]) for r in range(lay["w1"])]
    if stop:
        head, states = global_updates(first, lay["epochs"], stop, extra)
        state = states[-1]
    else:
        head, state = [], roundtrip(first[0].state_dict())
    assert head == ref[:stop]  # the ranks' shares concatenate to the 1-rank global batches
    second = [map_loader(base, rank=r, world=lay["w2"]) for r in range(lay["w2"])]
    for ld in second:
        ld.load_state_dict(state)
    tail, _ = global_updates(second, lay["epochs"])
    assert head + tail == ref


# -- the sampler alone, under a plain DataLoader -----------------------------------------------


def plain_run(sampler: ResumableSampler, n: int, acc: int, epochs: int, *,
              set_epoch: bool = False, stop: int | None = None,
              first_epoch: int | None = None) -> list[list[Micro]]:
    """A plain DataLoader over the sampler; the loop tells the sampler what completed updates
    consumed with ``advance`` (the documented use without ResumableLoader). With
    ``set_epoch``, the DistributedSampler idiom: ``for epoch in range(start, epochs):
    sampler.set_epoch(epoch)``, starting at the epoch the restored sampler names."""
    dl = torch.utils.data.DataLoader(seeded(Ids(n), seed=7), batch_sampler=sampler)
    updates: list[list[Micro]] = []
    for epoch in range(sampler.epoch if first_epoch is None else first_epoch, epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        window: list[Micro] = []
        for batch in dl:
            window.append(content(batch))
            if len(window) < acc:
                continue
            sampler.advance(len(window))
            updates.append(window)
            window = []
            if len(updates) == stop:
                return updates
        if window:  # the epoch's last, shorter window
            sampler.advance(len(window))
            updates.append(window)
            if len(updates) == stop:
                return updates
    return updates


@PROPERTY
@given(lay=layouts(), data=st.data())
def test_sampler_with_a_plain_dataloader_and_advance_resumes_exactly(
        lay: dict[str, Any], data: Any) -> None:
    ref, _ = reference(lay)

    def sampler() -> ResumableSampler:
        return ResumableSampler(lay["n"], lay["batch"], seed=lay["seed"],
                                shuffle=lay["shuffle"], drop_last=lay["drop_last"])

    assert plain_run(sampler(), lay["n"], lay["acc"], lay["epochs"]) == ref
    stop = data.draw(st.integers(1, len(ref)), label="stop")
    first = sampler()
    head = plain_run(first, lay["n"], lay["acc"], lay["epochs"], stop=stop)
    resumed = sampler()
    resumed.load_state_dict(roundtrip(first.state_dict()))
    assert head + plain_run(resumed, lay["n"], lay["acc"], lay["epochs"]) == ref


def test_the_distributed_sampler_idiom_after_a_mid_epoch_resume_never_repeats_samples() -> None:
    """`ResumableSampler.set_epoch` is documented as DistributedSampler-compatible, and every
    DistributedSampler loop calls ``sampler.set_epoch(epoch)`` at the start of each epoch --
    the resumed one included. After a resume at a mid-epoch cursor that call must keep the
    cursor (or refuse loudly with an UnbrokenError); rewinding to the epoch's first sample
    silently trains the samples the completed updates already consumed a second time."""
    lay = dict(n=40, batch=4, drop_last=False, acc=1, shuffle=True, seed=5, epochs=2)
    ref, _ = reference(lay)

    def sampler() -> ResumableSampler:
        return ResumableSampler(40, 4, seed=5)

    assert plain_run(sampler(), 40, 1, 2, set_epoch=True) == ref  # a fresh run is fine
    first = sampler()
    head = plain_run(first, 40, 1, 2, set_epoch=True, stop=3)  # 3 of epoch 0's 10 batches
    state = roundtrip(first.state_dict())
    assert (state["epoch"], state["consumed"]) == (0, 12)
    resumed = sampler()
    resumed.load_state_dict(state)
    try:
        tail = plain_run(resumed, 40, 1, 2, set_epoch=True)
    except UnbrokenError:
        return  # refused loudly: acceptable
    seen = [i for u in head + tail for m in u for i in m[0]]
    repeated = sorted(i for i in set(seen[:40]) if seen[:52].count(i) > 1)
    assert head + tail == ref, (
        f"after a resume at (epoch 0, consumed 12), set_epoch(0) rewound the cursor: "
        f"{len(head + tail) - len(ref)} extra updates, samples {repeated} trained twice "
        f"in epoch 0")


def test_set_epoch_back_to_an_epoch_the_restored_cursor_passed_is_refused_or_harmless() -> None:
    """A loop that counts its epochs from 0 again after a resume in epoch 1 calls
    ``set_epoch(0)``: training epoch 0 a second time must not happen silently."""
    lay = dict(n=40, batch=4, drop_last=False, acc=1, shuffle=True, seed=5, epochs=2)
    ref, _ = reference(lay)
    first = ResumableSampler(40, 4, seed=5)
    head = plain_run(first, 40, 1, 2, set_epoch=True, stop=13)  # 3 batches into epoch 1
    state = roundtrip(first.state_dict())
    assert (state["epoch"], state["consumed"]) == (1, 12)
    resumed = ResumableSampler(40, 4, seed=5)
    resumed.load_state_dict(state)
    try:
        tail = plain_run(resumed, 40, 1, 2, set_epoch=True, first_epoch=0)
    except UnbrokenError:
        return  # refused loudly
    assert head + tail == ref, "set_epoch(0) after a resume in epoch 1 trained epoch 0 again"


# -- a resume with other settings --------------------------------------------------------------


CHANGES = ["num_samples", "batch_size", "drop_last", "seed", "shuffle", "accumulation",
           "world_size", "workers"]


@PROPERTY
@given(lay=layouts(), change=st.sampled_from(CHANGES), data=st.data())
def test_a_resume_with_other_settings_continues_exactly_or_is_refused_before_any_change(
        lay: dict[str, Any], change: str, data: Any) -> None:
    ref, after = reference(lay)
    stop = data.draw(st.integers(1, len(ref)), label="stop")
    state = after[stop - 1][0]
    over: dict[str, Any] = {}
    if change == "num_samples":
        over["n"] = lay["n"] + data.draw(st.sampled_from([-1, 1, 7]))
        assume(over["n"] >= 1 and (over["n"] >= lay["batch"] or not lay["drop_last"]))
    elif change == "batch_size":
        over["batch"] = data.draw(st.integers(1, 9).filter(lambda b: b != lay["batch"]))
        assume(lay["n"] >= over["batch"] or not lay["drop_last"])
    elif change == "drop_last":
        over["drop_last"] = not lay["drop_last"]
        assume(lay["n"] >= lay["batch"])
    elif change == "seed":
        over["seed"] = lay["seed"] + 1
    elif change == "shuffle":
        over["shuffle"] = not lay["shuffle"]
    elif change == "accumulation":
        over["acc"] = data.draw(st.integers(1, 4).filter(lambda a: a != lay["acc"]))
    elif change == "world_size":  # same global batch, another split: must continue
        world = data.draw(st.sampled_from([2, 3]))
        assume(lay["batch"] % world == 0 and (lay["drop_last"] or lay["n"] % lay["batch"] == 0
                                              or lay["n"] % lay["batch"] >= world))
        over["world"] = world
    workers = 2 if change == "workers" else 0
    live = [map_loader(lay, workers, **over, rank=r) for r in range(over.get("world", 1))]
    try:
        for ld in live:
            ld.load_state_dict(state)
    except UnbrokenError as e:
        assert isinstance(e, StateMismatch), type(e)
        assert change not in ("world_size", "workers"), f"a harmless change refused: {e}"
        # nothing moved: the live loader still starts its own first epoch
        assert (live[0].epoch, live[0].consumed) == (0, 0) and live[0].at_boundary
        return
    # accepted: the sample stream must continue exactly where the saved run stopped
    tail, _ = global_updates(live, lay["epochs"])
    for ld in live:
        ld.stop_workers()
    want = [i for u in ref[stop:] for m in u for i in m[0]]
    got = [i for u in tail for m in u for i in m[0]]
    assert got == want, f"{change}={over}: the resumed stream skips or repeats samples"
    if change in ("world_size", "workers"):
        assert tail == ref[stop:]  # the same updates, bit for bit


# -- iterable datasets -------------------------------------------------------------------------


class Stream(torch.utils.data.IterableDataset):
    """A resumable stream of `n` items per epoch in an order of its own (NumPy's, not the
    library's), from item `consumed` on. Its state names its length and seed, and a resume
    into another stream is refused by the dataset itself."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch = self.consumed = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["n"], state["seed"]) != (self.n, self.seed):
            raise StateMismatch(f"stream state of another stream: {state}")
        self.epoch, self.consumed = state["epoch"], state["consumed"]
        self.batch_size = state.get("batch_size")

    def order(self, epoch: int) -> list[int]:
        return np.random.RandomState([self.seed, epoch]).permutation(self.n).tolist()

    def positions(self) -> Any:
        return range(self.consumed, self.n)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self.order(self.epoch)
        for p in self.positions():
            i = order[p]
            yield {"id": i, "x": torch.tensor([i + 0.5, self.epoch], dtype=torch.float64)}


class SplitStream(Stream):
    splits_by_worker = True

    def positions(self) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return range(self.consumed, self.n)
        return (p for p in range(self.consumed, self.n)
                if (p - self.consumed) // self.batch_size % info.num_workers == info.id)


def stream_content(batch: dict[str, torch.Tensor]) -> Micro:
    return (tuple(int(i) for i in batch["id"]),
            tuple(float(v) for v in batch["x"].reshape(-1)))


@st.composite
def stream_layouts(draw: Any) -> dict[str, Any]:
    return dict(n=draw(st.integers(0, 30)), batch=draw(st.integers(1, 7)),
                acc=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**31)),
                epochs=draw(st.integers(1, 3)), split=draw(st.booleans()))


def stream_loader(lay: dict[str, Any], workers: int = 0, persistent: bool = False
                  ) -> ResumableLoader:
    ds = (SplitStream if lay["split"] else Stream)(lay["n"], lay["seed"])
    return ResumableLoader(ds, batch_size=lay["batch"], num_workers=workers,
                           persistent_workers=persistent and workers > 0,
                           accumulation=lay["acc"])


def check_stream_reference(ref: list[list[Micro]], after: list[Any], lay: dict[str, Any]
                           ) -> None:
    sizes, windows = epoch_layout(lay["n"], lay["batch"], False, lay["acc"])
    per = len(windows)
    assert len(ref) == per * lay["epochs"]
    order = Stream(lay["n"], lay["seed"]).order
    for e in range(lay["epochs"]):
        mine = ref[e * per:(e + 1) * per]
        assert [len(u) for u in mine] == windows
        assert [len(m[0]) for u in mine for m in u] == sizes
        assert [i for u in mine for m in u for i in m[0]] == order(e)
        consumed = 0
        for u, (state, epoch, cons) in zip(mine, after[e * per:(e + 1) * per]):
            consumed += sum(len(m[0]) for m in u)
            # items consumed by completed updates; at the stream's end, the next epoch
            want = (e + 1, 0) if consumed == lay["n"] else (e, consumed)
            assert (epoch, cons) == want and (state["epoch"], state["consumed"]) == want


_STREAM_REFS: dict[str, Any] = {}


def stream_reference(lay: dict[str, Any]) -> tuple[list[list[Micro]], list[Any]]:
    key = json.dumps(lay, sort_keys=True)
    if key not in _STREAM_REFS:
        ref, after = drive(stream_loader(lay), lay["epochs"], convert=stream_content)
        check_stream_reference(ref, after, lay)
        _STREAM_REFS[key] = ref, after
    return _STREAM_REFS[key]


@FEW
@given(lay=stream_layouts(), data=st.data())
def test_iterable_resume_at_any_update_with_any_workers_matches_the_uninterrupted_run(
        lay: dict[str, Any], data: Any) -> None:
    ref, _ = stream_reference(lay)
    stop = data.draw(st.integers(0, len(ref)), label="stop")
    extra = data.draw(st.integers(0, 4), label="extra")
    before = data.draw(st.sampled_from([0, 1, 2]), label="workers before")
    after = data.draw(st.sampled_from([0, 1, 2]), label="workers after")
    persistent = data.draw(st.booleans(), label="persistent")
    first = stream_loader(lay, before, persistent)
    head, saved = drive(first, lay["epochs"], stop=stop, extra=extra, convert=stream_content)
    assert head == ref[:stop]
    resumed = stream_loader(lay, after, persistent)
    resumed.load_state_dict(saved[-1][0])
    tail, _ = drive(resumed, lay["epochs"], convert=stream_content)
    resumed.stop_workers()
    assert head + tail == ref
    assert resumed.epoch == lay["epochs"]


@PROPERTY
@given(lay=stream_layouts(), data=st.data())
def test_iterable_resume_with_another_batch_size_or_accumulation_is_refused(
        lay: dict[str, Any], data: Any) -> None:
    ref, after = stream_reference(lay)
    assume(len(ref) > 0)
    stop = data.draw(st.integers(1, len(ref)), label="stop")
    key = data.draw(st.sampled_from(["batch", "acc"]))
    other = {**lay, key: lay[key] + data.draw(st.integers(1, 3))}
    live = stream_loader(other)
    with pytest.raises(StateMismatch):
        live.load_state_dict(after[stop - 1][0])
    assert (live.epoch, live.consumed) == (0, 0)


# -- packing -----------------------------------------------------------------------------------


@st.composite
def pack_layouts(draw: Any) -> dict[str, Any]:
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=8))
    eos = draw(st.sampled_from([None, -1]))
    assume(eos is not None or sum(lengths) > 0)
    return dict(lengths=lengths, seq_len=draw(st.integers(1, 9)),
                batch=draw(st.integers(1, 3)), acc=draw(st.integers(1, 3)), eos=eos,
                shuffle=draw(st.booleans()), seed=draw(st.integers(0, 2**40)),
                batches=draw(st.integers(1, 25)))


def packer(lay: dict[str, Any], **over: Any) -> Packer:
    p = {**lay, **over}
    docs = [[1000 * d + j for j in range(length)] for d, length in enumerate(p["lengths"])]
    return Packer(docs, p["seq_len"], batch_size=p["batch"], seed=p["seed"],
                  shuffle=p["shuffle"], eos_id=p["eos"], accumulation=p["acc"])


def take(pk: Packer, count: int) -> list[list[list[int]]]:
    out: list[list[list[int]]] = []
    if count == 0:
        return out
    for rows in pk:
        out.append(rows.tolist())
        if len(out) == count:
            break
    return out


def pack_oracle(lay: dict[str, Any], tokens: int) -> list[int]:
    """The packed stream built here: each epoch's documents in the keyed order, eos after each,
    concatenated across epochs."""
    out: list[int] = []
    epoch = 0
    k = len(lay["lengths"])
    while len(out) < tokens:
        order = (KeyedPermutation(k, mix(TAG_PACK, lay["seed"], epoch))(np.arange(k)).tolist()
                 if lay["shuffle"] else list(range(k)))
        for d in order:
            out += [1000 * d + j for j in range(lay["lengths"][d])]
            if lay["eos"] is not None:
                out.append(lay["eos"])
        epoch += 1
    return out[:tokens]


@PROPERTY
@given(lay=pack_layouts(), data=st.data())
def test_packer_resume_at_any_update_boundary_continues_the_token_stream(
        lay: dict[str, Any], data: Any) -> None:
    total = lay["batches"]
    ref = take(packer(lay), total)
    flat = [t for b in ref for row in b for t in row]
    assert flat == pack_oracle(lay, len(flat))
    updates = -(-total // lay["acc"])
    k = data.draw(st.integers(0, updates - 1), label="updates done") * lay["acc"]
    extra = data.draw(st.integers(0, 2 * lay["acc"]), label="extra")
    first = packer(lay)
    head = take(first, k)
    state = roundtrip(first.state_dict())
    assert first.at_boundary
    it = iter(first)  # the loop goes on past the save (a new iter replays from the boundary)
    for _ in range(extra):
        next(it)
    if extra % lay["acc"]:
        with pytest.raises(UpdateBoundaryError):
            first.state_dict()
    resumed = packer(lay)
    resumed.load_state_dict(state)
    assert head + take(resumed, total - k) == ref
    # other settings that would change the stream are refused
    for over in ({"seq_len": lay["seq_len"] + 1}, {"seed": lay["seed"] + 1},
                 {"lengths": lay["lengths"] + [3]}, {"eos": -2}):
        if over.get("seed") is not None and not lay["shuffle"]:
            continue
        with pytest.raises(StateMismatch):
            packer(lay, **over).load_state_dict(state)


def test_packer_with_mostly_empty_shuffled_documents_keeps_packing() -> None:
    """Documents [], [1000], [] (empty ones are common after filtering), shuffled, no eos: the
    stream is the token 1000 once per epoch. Epoch 0's order is [1, 0, 2] and epoch 1's is
    [2, 0, 1], so between two tokens the packer passes 4 empty documents in a row (the tail
    of one epoch and the head of the next) -- more than there are documents, but never a
    whole epoch without a token. It must go on packing, not claim there are no tokens."""
    lay = dict(lengths=[0, 1, 0], seq_len=1, batch=1, acc=1, eos=None, shuffle=True, seed=1,
               batches=6)
    orders = [KeyedPermutation(3, mix(TAG_PACK, 1, e))(np.arange(3)).tolist() for e in (0, 1)]
    assert orders == [[1, 0, 2], [2, 0, 1]]  # the layout this test is about
    got = take(packer(lay), 6)
    assert got == [[[1000]]] * 6 == [[[t]] for t in pack_oracle(lay, 6)]


# -- through the Checkpointer ------------------------------------------------------------------


def ckpt_setup(root: Any, *, n: int = 45, batch: int = 4, acc: int = 2, workers: int = 0,
               data_rev: str = "v1") -> tuple[torch.nn.Module, ResumableLoader, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = ResumableSampler(n, batch, seed=3)
    loader = ResumableLoader(seeded(Ids(n), seed=7), sampler, num_workers=workers,
                             accumulation=acc)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, data=loader,
                                 identity=unbroken.Identity(config={"lr": 0.01}, data=data_rev),
                                 read_back="sync")
    return model, loader, ckpt


def train(model: torch.nn.Module, loader: ResumableLoader, ckpt: Any, step: int,
          epochs: int, save_at: int | None = None, stop_at: int | None = None) -> list[Any]:
    """The README loop; returns the updates (micro-batch contents)."""
    updates, window = [], []
    for batch in micro_batches(loader, epochs):
        window.append(content(batch))
        ids, noise = batch
        (model(noise.float()).sum() / loader.window_size).backward()
        if not loader.at_boundary:
            continue
        ckpt.optimizer.step()
        ckpt.optimizer.zero_grad()
        step += 1
        ckpt.step_done(step)
        updates.append(window)
        window = []
        if step == save_at:
            ckpt.save()
        if step == stop_at:
            loader.stop_workers()
            break
    return updates
    return updates


def test_checkpointer_resume_continues_and_other_data_settings_are_refused_untouched(
        tmp_path: Any) -> None:
    """Through save/restore: the same settings continue exactly (2 workers -> 0); a changed
    batch size, accumulation or dataset length raises StateMismatch and a changed data
    revision IdentityMismatch, each before any live object (weights, cursor) changed."""
    epochs = 2
    model, loader, ckpt = ckpt_setup(tmp_path / "ref")
    ref = train(model, loader, ckpt, ckpt.restore(), epochs)
    ckpt.close()
    # 45 samples, batch 4: 12 batches (last of 1), windows 2: 6 updates per epoch
    assert [len(u) for u in ref] == [2] * 12

    root = tmp_path / "run"
    model, loader, ckpt = ckpt_setup(root, workers=2)
    head = train(model, loader, ckpt, ckpt.restore(), epochs, save_at=5, stop_at=7)
    ckpt.close()
    assert head == ref[:7]

    for kwargs, error in [({"batch": 5}, StateMismatch), ({"acc": 3}, StateMismatch),
                          ({"n": 44}, StateMismatch), ({"data_rev": "v2"}, IdentityMismatch)]:
        model, loader, ckpt = ckpt_setup(root, **kwargs)
        fresh = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(error):
            ckpt.restore()
        assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items()), kwargs
        assert (loader.epoch, loader.consumed) == (0, 0), kwargs
        ckpt.close()

    model, loader, ckpt = ckpt_setup(root, workers=0)
    step = ckpt.restore()
    assert step == 5 and (loader.epoch, loader.consumed) == (0, 5 * 2 * 4)
    tail = train(model, loader, ckpt, step, epochs)
    ckpt.close()
    assert head[:5] + tail == ref


def test_checkpointer_refuses_an_iterable_stream_whose_dataset_refuses_its_state(
        tmp_path: Any) -> None:
    """An iterable dataset that recognizes another stream (its length changed) refuses the
    saved state: the restore raises StateMismatch and no live object changed."""
    def build(n: int) -> tuple[torch.nn.Module, ResumableLoader, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        loader = ResumableLoader(Stream(n, 1), batch_size=4, accumulation=2)
        return model, loader, unbroken.Checkpointer(tmp_path / "run", model=model, data=loader,
                                                    read_back="sync")

    model, loader, ckpt = build(30)
    ckpt.restore()
    step = 0
    for batch in loader:
        if loader.at_boundary:
            with torch.no_grad():
                model.weight.add_(1.0)
            step += 1
            ckpt.step_done(step)
            if step == 2:
                ckpt.save()
                break
    ckpt.close()
    model, loader, ckpt = build(31)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatch):
        ckpt.restore()
    assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items())
    assert (loader.epoch, loader.consumed) == (0, 0)
    assert loader.dataset.n == 31 and loader.dataset.consumed == 0
    ckpt.close()
    model, loader, ckpt = build(30)
    assert ckpt.restore() == 2 and (loader.epoch, loader.consumed) == (0, 16)
    assert [int(i) for i in next(iter(loader))["id"]] == Stream(30, 1).order(0)[16:20]
    ckpt.close()
