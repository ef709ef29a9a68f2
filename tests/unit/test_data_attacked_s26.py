"""Defects an outside reviewer found in the saved data position (session 26):

1. the iterable loader accepted a cursor no run writes: ``consumed`` off a batch boundary
   (every batch shifts), a bool ``consumed`` or ``epoch``, ``consumed`` past ``len(dataset)``
   (the epoch skipped);
2. `Packer` accepted an offset at or past its document's end (the rest of the document
   dropped), an epoch past int64 (its own next save then failed) and a bool epoch;
3. `ResumableSampler` accepted a bool epoch, an epoch past int64 and settings of the wrong
   type (``num_samples=50.0``, ``shuffle=1``, ...), since ``50.0 == 50``; the loader compared
   ``accumulation`` the same way; ``epoch=-1`` was reported as "not a global batch boundary";
4. the seeds of ``seeded(dataset, seed=)`` and ``ResumableLoader(seed=)`` were not saved: a
   resume with another one changed every augmentation / collate draw, silently;
5. `Packer` did not save its ``accumulation``, so a change on resume was accepted;
6. an empty pass of an iterable dataset rolled the epoch over outside any update, and the
   README loop's final ``save()`` was refused with `UpdateBoundaryError`.

A value no run writes is a `CorruptCheckpoint` (the generation is refused by name and the
previous verified one is used), which is also a `StateMismatch` (what these refusals raised
before); a valid setting that differs from the live one is a `StateMismatch` only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.data import Packer, ResumableLoader, ResumableSampler, seeded
from unbroken.errors import CorruptCheckpoint, StateMismatch, UpdateBoundaryError
from unbroken.store.manifest import seal

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore::unbroken.errors.UnbrokenWarning")]

SCALE = int(os.environ.get("UNBROKEN_PROPERTY_SCALE", "1"))
PROPERTY = settings(deadline=None, database=None, max_examples=40 * SCALE,
                    derandomize="UNBROKEN_PROPERTY_SCALE" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
INT64_MAX = (1 << 63) - 1


# -- values no run writes ------------------------------------------------------------------------

def not_int() -> st.SearchStrategy[Any]:
    """JSON values that are not an int: bools (``True == 1``), floats equal to ints
    (``4.0 == 4``), strings, null, lists, dicts."""
    return st.one_of(st.booleans(), st.integers(-3, 60).map(float), st.floats(allow_nan=False),
                     st.text(max_size=3), st.none(), st.lists(st.integers(0, 4), max_size=2),
                     st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=1))


def bad_int(lo: int, hi: int = INT64_MAX) -> st.SearchStrategy[Any]:
    """Anything but an int in ``[lo, hi]``: other types, and ints outside (past int64 too)."""
    return st.one_of(not_int(), st.integers(lo - 2**70, lo - 1), st.integers(hi + 1, hi + 2**70))


def bad_bool() -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(-2, 2), st.floats(allow_nan=False), st.text(max_size=2),
                     st.none())


def refused_as_damaged(check: Any, key: str) -> None:
    """``check()`` raises a `CorruptCheckpoint` that is also a `StateMismatch`, naming the key."""
    with pytest.raises(CorruptCheckpoint) as e:
        check()
    assert isinstance(e.value, StateMismatch), type(e.value)
    assert f"{key}=" in str(e.value), str(e.value)


# -- map-style loader and sampler (defects 3, 4) -------------------------------------------------

N, B, ACC = 50, 4, 3


class Augmented(torch.utils.data.Dataset[Any]):
    """Sample i: its index and a random draw (an augmentation)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.cat([torch.tensor([float(int(i))]), torch.rand(3)])


def noisy_collate(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples) + torch.rand(1)  # a random draw in collate (masking, mixing)


def map_loader(*, dseed: int | None = 7, lseed: int = 1, acc: int = ACC, n: int = N,
               batch: int = B, seed: int = 3, shuffle: bool = True) -> ResumableLoader:
    ds: Any = Augmented() if dseed is None else seeded(Augmented(), seed=dseed)
    if n != N:
        ds = seeded(torch.utils.data.TensorDataset(torch.zeros(n)), seed=dseed or 0)
    return ResumableLoader(ds, ResumableSampler(n, batch, seed=seed, shuffle=shuffle),
                           collate_fn=noisy_collate, seed=lseed, accumulation=acc)


def saved_map_state() -> dict[str, Any]:
    ld = map_loader()
    for _ in ld:
        if ld.at_boundary:
            break
    return ld.state_dict()


MAP_BAD: dict[str, st.SearchStrategy[Any]] = {
    "epoch": bad_int(0, INT64_MAX - 1), "num_samples": bad_int(1, 2**62),
    "batch_size": bad_int(1), "seed": not_int(), "shuffle": bad_bool(),
    "drop_last": bad_bool(), "version": st.one_of(st.just(1.0), st.just(True), st.text(max_size=2)),
    "world_size": bad_int(1), "accumulation": bad_int(1), "loader_seed": not_int(),
    "dataset_seed": not_int().filter(lambda v: v is not None),
    "consumed": st.one_of(bad_int(0, N), st.integers(0, N - 1).filter(lambda c: c % B)),
}


@PROPERTY
@given(data=st.data())
def test_map_state_values_no_run_writes_are_refused_typed(data: Any) -> None:
    """Every saved field of a map-style loader, given a value no run writes (another type,
    a bool for an int, a float equal to the int, out of range, off a batch boundary), is
    refused as damage naming the key, on validate and on load, and nothing moves."""
    key = data.draw(st.sampled_from(sorted(MAP_BAD)), label="key")
    value = data.draw(MAP_BAD[key], label="value")
    state = {**saved_map_state(), key: value}
    live = map_loader()
    refused_as_damaged(lambda: live.validate_state_dict(state, "gen-9 [data]"), key)
    refused_as_damaged(lambda: live.load_state_dict(state), key)
    if key not in ("accumulation", "loader_seed", "dataset_seed"):  # the sampler's own keys
        refused_as_damaged(lambda: live.sampler.check_state(state), key)
    assert (live.epoch, live.consumed) == (0, 0)


def test_the_reviewers_map_states_are_refused_and_the_message_names_the_place() -> None:
    state = saved_map_state()
    live = map_loader()
    for bad in ({"epoch": True}, {"epoch": 2**63}, {"num_samples": 50.0}, {"shuffle": 1},
                {"batch_size": 4.0}, {"accumulation": 3.0}, {"version": 1.0}):
        key = next(iter(bad))
        with pytest.raises(CorruptCheckpoint, match=rf"^gen-9 \[data\]: data state: {key}="):
            live.validate_state_dict({**state, **bad}, "gen-9 [data]")
    # the minor one: a negative epoch is named as the epoch, not as a batch boundary
    with pytest.raises(CorruptCheckpoint, match=r"epoch=-1 .*expected an int in \[0,") as e:
        live.sampler.check_state({**state, "epoch": -1})
    assert "boundary" not in str(e.value)
    with pytest.raises(StateMismatch, match="boundary"):  # off a boundary still says so
        live.sampler.check_state({**state, "consumed": 5})


@pytest.mark.parametrize("change", [{"n": 49}, {"batch": 8}, {"seed": 4}, {"shuffle": False},
                                    {"acc": 2}, {"lseed": 2}, {"dseed": 8}, {"dseed": None}])
def test_a_valid_but_different_setting_is_a_mismatch_not_damage(change: dict[str, Any]) -> None:
    """Another setting a run could have written is `StateMismatch` (the restore stops: an
    older generation would not fit either), never `CorruptCheckpoint` (which would skip to
    an older generation)."""
    live = map_loader(**change)
    with pytest.raises(StateMismatch) as e:
        live.validate_state_dict(saved_map_state(), "gen-9 [data]")
    assert not isinstance(e.value, CorruptCheckpoint), str(e.value)
    assert (live.epoch, live.consumed) == (0, 0)


def test_a_changed_seed_names_both_values() -> None:
    state = saved_map_state()
    with pytest.raises(StateMismatch, match=r"dataset_seed=7 \(seeded\(dataset, seed=7\)\).*"
                                            r"dataset_seed=8 \(seeded\(dataset, seed=8\)\)"):
        map_loader(dseed=8).load_state_dict(state)
    with pytest.raises(StateMismatch, match=r"dataset_seed=7 .*dataset_seed=None \(no seeded"):
        map_loader(dseed=None).load_state_dict(state)
    with pytest.raises(StateMismatch, match=r"saved loader_seed=1, live loader_seed=99"):
        map_loader(lseed=99).load_state_dict(state)


def test_a_generation_saved_without_the_seeds_still_loads() -> None:
    state = saved_map_state()
    old = {k: v for k, v in state.items() if k not in ("loader_seed", "dataset_seed")}
    live = map_loader(dseed=8, lseed=99)  # nothing to compare with: no check
    live.load_state_dict(old)
    assert (live.epoch, live.consumed) == (0, B * ACC)


# -- end to end: a resume continues bit for bit, a changed seed is refused (defect 4) -----------

def reseal(run: Path, **values: Any) -> None:
    """Edit the newest generation's data part and seal it again (what an attacker, or a
    damaged disk whose hashes were recomputed, leaves)."""
    gen = sorted(run.glob("gen-*"))[-1]
    doc = json.loads((gen / "state.json").read_bytes())
    doc["parts"]["data"].update(values)
    for key in [k for k, v in values.items() if v is ...]:
        del doc["parts"]["data"][key]
    data = json.dumps(doc).encode()
    (gen / "state.json").write_bytes(data)
    man = json.loads((gen / "MANIFEST.json").read_bytes())
    for a in man["artifacts"]:
        if a["name"] == "state.json":
            a["size"], a["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    (gen / "MANIFEST.json").write_bytes(seal(man))


def train(root: Path, *, dseed: int = 7, lseed: int = 1, stop: int | None = None,
          edit: dict[str, Any] | None = None) -> tuple[list[bytes], list[bytes]]:
    """The README loop for one epoch: the bytes of every micro-batch it trained on and of
    the final parameters. ``stop``: save after that update and return (an interruption)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = map_loader(dseed=dseed, lseed=lseed)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, data=loader,
                                 read_back="sync")
    seen: list[bytes] = []
    try:
        step = ckpt.restore()
        while loader.epoch < 1:
            for x in loader:
                seen.append(x.numpy().tobytes())
                model(x).square().mean().backward()
                if not loader.at_boundary:
                    continue
                opt.step()
                opt.zero_grad()
                step += 1
                ckpt.step_done(step)
                if step == stop:
                    ckpt.save()
                    return seen, []
        ckpt.save()
    finally:
        ckpt.close()
    return seen, [p.detach().numpy().tobytes() for p in model.parameters()]


def test_resume_with_the_same_seeds_is_bitwise_and_a_changed_seed_is_refused(
        tmp_path: Path) -> None:
    ref_seen, ref_params = train(tmp_path / "ref")
    head, _ = train(tmp_path / "run", stop=2)
    for dseed, lseed, key in ((8, 1, "dataset_seed"), (7, 99, "loader_seed")):
        with pytest.raises(StateMismatch, match=key) as e:
            train(tmp_path / "run", dseed=dseed, lseed=lseed)
        assert not isinstance(e.value, CorruptCheckpoint)
    tail, params = train(tmp_path / "run")
    assert head + tail == ref_seen
    assert params == ref_params


def test_a_resealed_damaged_map_state_is_refused_by_the_checkpointer(tmp_path: Path) -> None:
    train(tmp_path / "run", stop=2)  # one generation: a damaged one leaves none to use
    saved = {"epoch": 0, "num_samples": N, "shuffle": True, "accumulation": ACC,
             "dataset_seed": 7}
    for values in ({"epoch": True}, {"epoch": 2**63}, {"num_samples": 50.0, "shuffle": 1},
                   {"accumulation": 3.0}, {"dataset_seed": "7"}):
        reseal(tmp_path / "run", **values)
        with pytest.raises(CorruptCheckpoint, match="no generation verifies") as e:
            train(tmp_path / "run")
        assert next(iter(values)) + "=" in str(e.value)
        reseal(tmp_path / "run", **saved)
    reseal(tmp_path / "run", loader_seed=..., dataset_seed=...)  # as an older unbroken saved
    train(tmp_path / "run", dseed=8, lseed=2)  # loads: nothing recorded to compare


# -- iterable loader (defect 1, 6) ---------------------------------------------------------------

class Stream(torch.utils.data.IterableDataset[Any]):
    """Items ``epoch * 100 + k`` for k in ``[consumed, n)``; epochs in ``empty`` yield none."""

    def __init__(self, n: int = 10, empty: tuple[int, ...] = (), length: bool = True) -> None:
        self.n, self.empty, self.length = n, empty, length
        self.state: dict[str, Any] = {"epoch": 0, "consumed": 0}

    def __len__(self) -> int:
        if not self.length:
            raise TypeError("a stream of unknown length")
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)

    def __iter__(self) -> Any:
        epoch = self.state["epoch"]
        stop = 0 if epoch in self.empty else self.n
        return (torch.tensor([float(epoch * 100 + k)]) for k in range(self.state["consumed"], stop))


def stream_state(acc: int = 1) -> dict[str, Any]:
    ld = ResumableLoader(Stream(), batch_size=2, accumulation=acc)
    it = iter(ld)
    for _ in range(2 * acc):
        next(it)
    return ld.state_dict()


ITER_BAD: dict[str, st.SearchStrategy[Any]] = {
    "epoch": bad_int(0, INT64_MAX - 1), "batch_size": bad_int(1), "accumulation": bad_int(1),
    "loader_seed": not_int(), "version": st.one_of(st.just(1.0), st.just(True), st.none()),
    "consumed": st.one_of(bad_int(0), st.integers(0, 9).filter(lambda c: c % 2)),
    "dataset": st.one_of(st.none(), st.integers(), st.text(max_size=2), st.lists(st.none())),
}


@PROPERTY
@given(data=st.data())
def test_iterable_cursor_values_no_run_writes_are_refused_typed(data: Any) -> None:
    key = data.draw(st.sampled_from(sorted(ITER_BAD)), label="key")
    value = data.draw(ITER_BAD[key], label="value")
    state = {**stream_state(), key: value}
    live = ResumableLoader(Stream(), batch_size=2)
    refused_as_damaged(lambda: live.validate_state_dict(state, "gen-9 [data]"), key)
    refused_as_damaged(lambda: live.load_state_dict(state), key)
    assert (live.epoch, live.consumed) == (0, 0)


@PROPERTY
@given(consumed=st.integers(0, 2**40).map(lambda c: 2 * c), length=st.booleans())
def test_iterable_consumed_past_the_dataset_length_is_refused(consumed: int,
                                                               length: bool) -> None:
    """Past ``len(dataset)`` the resumed pass would be empty and skip the epoch: refused,
    naming both numbers; a stream without a length has nothing to compare with."""
    live = ResumableLoader(Stream(length=length), batch_size=2)
    state = {**stream_state(), "consumed": consumed}
    if consumed > 10 and length:
        with pytest.raises(StateMismatch, match=rf"consumed={consumed} .*len\(dataset\)=10"):
            live.load_state_dict(state)
        assert (live.epoch, live.consumed) == (0, 0)
    else:
        live.load_state_dict(state)
        assert (live.epoch, live.consumed) == (0, consumed)


def test_every_iterable_state_a_run_writes_resumes_bitwise() -> None:
    ld = ResumableLoader(Stream(), batch_size=2, accumulation=2)
    ref, states = [], []
    while ld.epoch < 2:
        for b in ld:
            ref.append(b.tolist())
            if ld.at_boundary:
                states.append((len(ref), ld.state_dict()))
    for done, state in states:
        live = ResumableLoader(Stream(), batch_size=2, accumulation=2)
        live.load_state_dict(json.loads(json.dumps(state)))  # as a restore decodes it
        rest = []
        while live.epoch < 2:
            rest += [b.tolist() for b in live]
        assert ref[:done] + rest == ref


def test_an_empty_epoch_of_a_stream_ends_at_a_boundary(tmp_path: Path) -> None:
    """The README loop over a stream whose epoch 1 is empty: its final save succeeds (no
    batch was handed out since the last update), and a resume continues from epoch 2."""
    def build() -> tuple[torch.nn.Module, Any, ResumableLoader, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = ResumableLoader(Stream(6, empty=(1, 2), length=False), batch_size=2)
        return model, opt, loader, unbroken.Checkpointer(tmp_path / "run", model=model,
                                                          optimizer=opt, data=loader)
    model, opt, loader, ckpt = build()
    step = ckpt.restore()
    while loader.epoch < 3:
        for b in loader:
            model(b).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            ckpt.step_done(step)
    # The last step_done left the cursor at (1, 0); the empty passes moved it to (3, 0)
    # without a batch: the save was refused before.
    ckpt.save()
    ckpt.close()
    model, opt, loader, ckpt = build()
    assert ckpt.restore() == step == 3 and (loader.epoch, loader.consumed) == (3, 0)
    ckpt.close()


def test_the_boundary_check_still_refuses_batches_handed_out(tmp_path: Path) -> None:
    """Not weakened: a batch handed out mid-window, or a whole epoch trained without
    ``step_done``, still makes ``save()`` refuse (that epoch also ends at (e+1, 0))."""
    for acc in (1, 2):
        loader = ResumableLoader(Stream(6), batch_size=2, accumulation=acc)
        model = torch.nn.Linear(1, 1)
        ckpt = unbroken.Checkpointer(tmp_path / f"run{acc}", model=model, data=loader)
        ckpt.restore()
        next(iter(loader))
        with pytest.raises(UpdateBoundaryError, match="handed out batches"):
            ckpt.save()
        ckpt.close()
    loader = ResumableLoader(Stream(6), batch_size=2)
    model = torch.nn.Linear(1, 1)
    ckpt = unbroken.Checkpointer(tmp_path / "whole", model=model, data=loader)
    ckpt.restore()
    assert len(list(loader)) == 3 and (loader.epoch, loader.consumed) == (1, 0)
    with pytest.raises(UpdateBoundaryError, match="handed out batches"):
        ckpt.save()
    ckpt.close()


# -- Packer (defects 2, 5) -----------------------------------------------------------------------

DOCS = [list(range(100 * d, 100 * d + 3 + d % 4)) for d in range(6)]  # lengths 3..6


def packer(acc: int = 1, **kw: Any) -> Packer:
    return Packer(DOCS, seq_len=4, batch_size=2, seed=1, accumulation=acc, **kw)


def take(pk: Packer, count: int) -> list[Any]:
    out: list[Any] = []
    for rows in pk:  # (stops right after the last one: the packer counts what it hands out)
        if len(out) == count:
            break
        out.append(rows.tolist())
        if len(out) == count:
            break
    return out


PACK_BAD: dict[str, st.SearchStrategy[Any]] = {
    "epoch": bad_int(0, INT64_MAX - 1), "documents": bad_int(0, len(DOCS) - 1),
    "offset": bad_int(0), "num_documents": bad_int(1), "seq_len": bad_int(1),
    "batch_size": bad_int(1), "seed": not_int(), "shuffle": bad_bool(),
    "eos_id": not_int().filter(lambda v: v is not None), "accumulation": bad_int(1),
    "version": st.one_of(st.just(1.0), st.just(True), st.none()),
}


@PROPERTY
@given(data=st.data())
def test_packer_values_no_run_writes_are_refused_typed(data: Any) -> None:
    key = data.draw(st.sampled_from(sorted(PACK_BAD)), label="key")
    value = data.draw(PACK_BAD[key], label="value")
    state = {**packer().state_dict(), key: value}
    live = packer()
    refused_as_damaged(lambda: live.validate_state_dict(state, "gen-9 [data]"), key)
    refused_as_damaged(lambda: live.load_state_dict(state), key)
    assert live.state_dict() == packer().state_dict()


@PROPERTY
@given(shuffle=st.booleans(), eos=st.sampled_from([None, -1]), epoch=st.integers(0, 3),
       documents=st.integers(0, len(DOCS) - 1), past=st.integers(0, 2**62))
def test_packer_offset_past_its_document_is_refused_before_a_token_goes_out(
        shuffle: bool, eos: int | None, epoch: int, documents: int, past: int) -> None:
    """The document's length is known once it is read: the restore takes the offset, and the
    first batch, which reads it, refuses it before handing out any token."""
    probe = packer(shuffle=shuffle, eos_id=eos)
    probe.load_state_dict({**probe.state_dict(), "epoch": epoch, "documents": documents})
    length = len(probe._document(epoch, documents)[1])
    live = packer(shuffle=shuffle, eos_id=eos)
    state = {**live.state_dict(), "epoch": epoch, "documents": documents,
             "offset": length + past}
    live.load_state_dict(state)
    it = iter(live)
    refused_as_damaged(lambda: next(it), "offset")
    assert live.last_batch_ids == [] and live.at_boundary and live.epoch == epoch


def test_every_packer_state_a_run_writes_resumes_bitwise() -> None:
    for acc in (1, 2):
        for shuffle in (True, False):
            ref_pk = packer(acc, shuffle=shuffle, eos_id=-1)
            ref, states = [], []
            for rows in ref_pk:
                ref.append(rows.tolist())
                if ref_pk.at_boundary:
                    states.append((len(ref), ref_pk.state_dict()))
                if len(ref) == 24:
                    break
            for done, state in states:
                live = packer(acc, shuffle=shuffle, eos_id=-1)
                live.load_state_dict(json.loads(json.dumps(state)))
                assert ref[:done] + take(live, len(ref) - done) == ref


def test_packer_accumulation_is_saved_and_a_change_is_refused() -> None:
    pk = packer(2)
    take(pk, 2)
    state = pk.state_dict()
    assert state["accumulation"] == 2
    with pytest.raises(StateMismatch, match="saved accumulation=2, live accumulation=3") as e:
        packer(3).load_state_dict(state)
    assert not isinstance(e.value, CorruptCheckpoint)
    old = {k: v for k, v in state.items() if k != "accumulation"}  # an older generation
    packer(3).load_state_dict(old)


def test_the_checks_cost_nothing_per_restore() -> None:
    """They run once per restore; a generous bound keeps a slow machine from failing."""
    cases = [(map_loader(), saved_map_state()), (packer(), packer().state_dict()),
             (ResumableLoader(Stream(), batch_size=2), stream_state())]
    for live, state in cases:
        start = time.perf_counter()
        for _ in range(200):
            live.validate_state_dict(state)
        assert (time.perf_counter() - start) / 200 < 1e-3
