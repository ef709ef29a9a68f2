"""Regression tests for the promises a save and a restore keep (issue 8): save never loses
what it wrote or what retention had to keep; restore never crashes on what it reads; every
refusal is a typed error that names the file and the way on."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import (
    CorruptCheckpoint,
    ReadOnlyRun,
    RunNotRestored,
    SaveFailed,
    UnbrokenWarning,
    UnsupportedValue,
)
from unbroken.store.backends.local import FaultyFS
from unbroken.store.manifest import MANIFEST, seal
from unbroken.store.runrecord import RUN_FILE


class Ids:
    """An extra whose state is a big NumPy array (a data pipeline's id list)."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def state_dict(self):
        return {"ids": self.ids, "name": "shard-\udcff.bin"}  # an undecodable file name

    def load_state_dict(self, state):
        self.ids = state["ids"]
        self.name = state["name"]


def build(root, keep=None, extras=None, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, keep=keep or unbroken.Keep(),
                                 extras=extras)
    return model, opt, ckpt


def update(model, opt, ckpt, save=False, **metrics):
    loss = model(torch.randn(5, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ckpt.step_done(ckpt.step + 1)
    if save:
        ckpt.save(metrics=metrics)
        ckpt.wait()  # read back and retention applied: what these promises are about


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def gens(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("gen-"))


def flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def reseal_listing(gen: Path, name: str, data: bytes) -> None:
    """Replace an artifact and reseal the manifest around it: hash and size then match, so the
    decoders are what meets the content."""
    import xxhash

    (gen / name).write_bytes(data)
    doc = json.loads((gen / MANIFEST).read_bytes())
    for a in doc["artifacts"]:
        if a["name"] == name:
            a["size"], a["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    (gen / MANIFEST).write_bytes(seal(doc))


def two_generations(root) -> dict:
    """Generations 1 and 2 of a fresh run; returns the weights saved in generation 1."""
    model, opt, ckpt = build(root)
    ckpt.restore()
    update(model, opt, ckpt, save=True)
    at_one = weights(model)
    update(model, opt, ckpt, save=True)
    ckpt.close()
    return at_one


# -- 1. save never deletes what it just saved; the first save into a used folder is refused ---


def test_first_save_into_a_used_folder_without_restore_is_refused_up_front(tmp_path):
    root = tmp_path / "run"
    model, opt, ckpt = build(root)
    ckpt.restore()
    for _ in range(10):
        update(model, opt, ckpt)
    ckpt.save()
    run_id = ckpt.run_id
    ckpt.close()
    model, opt, ckpt = build(root)  # a script that forgot restore()
    update(model, opt, ckpt)
    update(model, opt, ckpt)
    with pytest.raises(RunNotRestored) as e:
        ckpt.save()
    msg = str(e.value)
    assert run_id in msg and "step 10" in msg and "restore()" in msg and "another" in msg
    assert gens(root) == ["gen-000000010"]  # nothing written, nothing deleted
    assert not [n for n in os.listdir(root) if n.startswith(".staging")]
    ckpt.close()


def test_the_generation_just_committed_is_never_deleted(tmp_path):
    """An abandoned newer generation that cannot be moved aside stays the highest number;
    retention with last=1 used to keep only that one and delete the new save at once."""
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=5))
    ckpt.restore()
    for _ in range(10):
        update(model, opt, ckpt, save=True)
    ckpt.close()
    stuck = FaultyFS(kind="rename", match="gen-000000010", times=-1)
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=1))
    ckpt.store.fs = stuck
    with pytest.warns(UnbrokenWarning, match="gen-000000010: abandoned; could not be moved"):
        assert ckpt.restore(generation=8) == 8
    update(model, opt, ckpt)
    with pytest.warns(UnbrokenWarning, match="retried at the next save"):
        ckpt.save()
        ckpt.wait()  # (retention follows the read-back, in the background)
    saved = weights(model)
    assert gens(root) == ["gen-000000009", "gen-000000010"]
    ckpt.close()
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=1), seed=7)
    ckpt.store.fs = stuck
    with pytest.warns(UnbrokenWarning):
        assert ckpt.restore(generation=9) == 9  # the one just saved was kept, as written
    assert same(weights(model), saved)
    ckpt.close()


def test_a_leftover_in_the_way_of_a_save_is_moved_aside_or_named(tmp_path):
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=5))
    ckpt.restore()
    for _ in range(3):
        update(model, opt, ckpt, save=True)
    ckpt.close()
    (root / "aside").write_text("not a folder")  # moving aside fails
    model, opt, ckpt = build(root)
    with pytest.warns(UnbrokenWarning, match="could not be moved aside"):
        assert ckpt.restore(generation=2) == 2
    update(model, opt, ckpt)
    with pytest.raises(SaveFailed, match="in the way of generation 3.*by hand"):
        ckpt.save()  # gen 3 (abandoned) is never overwritten
    (root / "aside").unlink()
    ckpt.save()
    assert [e.reason for e in ckpt.store.aside()] == ["abandoned"]
    ckpt.close()


# -- 2. retention decides on verified generations ---------------------------------------------


def test_retention_never_counts_a_rotten_generation_as_a_kept_copy(tmp_path):
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=2))
    ckpt.restore()
    update(model, opt, ckpt, save=True)
    at_one = weights(model)
    update(model, opt, ckpt, save=True)
    flip(root / "gen-000000002" / "model.safetensors")  # the newest rots on disk
    with pytest.warns(UnbrokenWarning, match="corrupt generation, moved aside.*gen-000000002"):
        update(model, opt, ckpt, save=True)
    assert gens(root) == ["gen-000000001", "gen-000000003"]  # the good older one stays
    assert [e.reason for e in ckpt.store.aside()] == ["corrupt"]
    flip(root / "gen-000000003" / "model.safetensors")  # and then the newest rots too
    ckpt.close()
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=2), seed=1)
    assert ckpt.restore() == 1
    assert same(weights(model), at_one)
    ckpt.close()


def test_retention_verifies_from_a_cache_keyed_by_file_identity(tmp_path, monkeypatch):
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=3))
    ckpt.restore()
    hashed: list[str] = []
    real = ckpt.store.fs.hash_file

    def counting(path, *a, **k):
        hashed.append(os.path.basename(os.path.dirname(path)))
        return real(path, *a, **k)

    monkeypatch.setattr(ckpt.store.fs, "hash_file", counting)
    for _ in range(6):
        update(model, opt, ckpt, save=True)
    # each generation hashed once, by its own read-back; retention reused the verdicts
    per_gen = {g: hashed.count(g) for g in set(hashed)}
    assert set(per_gen.values()) == {len(os.listdir(root / "gen-000000006")) - 1}
    ckpt.close()


# -- 3. what save writes, restore can read --------------------------------------------------


def test_a_big_array_in_an_extra_goes_to_safetensors_and_round_trips(tmp_path):
    ids = np.arange(3_000_000, dtype=np.int64)[::-1].copy()
    root = tmp_path / "run"
    model, opt, ckpt = build(root, extras={"ids": Ids(ids)})
    ckpt.restore()
    update(model, opt, ckpt, save=True)
    ckpt.close()
    gen = root / "gen-000000001"
    assert (gen / "state.json").stat().st_size < 64 * 1024
    assert (gen / "extra.ids.safetensors").stat().st_size > ids.nbytes
    restored = Ids(np.zeros(1))
    model, opt, ckpt = build(root, extras={"ids": restored})
    assert ckpt.restore() == 1
    assert np.array_equal(restored.ids, ids) and restored.ids.dtype == ids.dtype
    assert restored.name == "shard-\udcff.bin"  # a surrogate-escaped name survives exactly
    ckpt.close()


def test_a_state_over_the_readers_limit_is_refused_before_anything_is_written(tmp_path,
                                                                             monkeypatch):
    import unbroken.state.generation as G
    import unbroken.state.parts as S

    for module in (S, G):  # (the writer's and the reader's limit)
        monkeypatch.setattr(module, "MAX_STATE_BYTES", 64 * 1024)
    root = tmp_path / "run"

    class Notes:
        notes: list[str] = []

        def state_dict(self):
            return {"notes": self.notes}

        def load_state_dict(self, state):
            self.notes = state["notes"]

    notes = Notes()
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=1), extras={"notes": notes})
    ckpt.restore()
    update(model, opt, ckpt, save=True)
    notes.notes = ["x" * 100] * 1000
    update(model, opt, ckpt)
    with pytest.raises(UnsupportedValue, match=r"state.json would be .* over the 65536-byte "
                                                r"limit.*'extra.notes'"):
        ckpt.save()
    assert gens(root) == ["gen-000000001"]  # retention never ran: the older one is untouched
    ckpt.close()


def test_an_unencodable_extra_names_its_part(tmp_path):
    import collections

    class Window:
        def state_dict(self):
            return {"recent": collections.deque([1, 2])}

        def load_state_dict(self, state):
            pass

    with pytest.raises(UnsupportedValue, match=r"part 'extra.window': recent: .*deque"):
        build(tmp_path / "run", extras={"window": Window()})  # when built, not hours in
    assert not (tmp_path / "run" / "LOCK").exists()


# -- 4. another run's generation is never continued silently ------------------------------------


def two_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, steps in ((a, 4), (b, 2)):
        model, opt, ckpt = build(root, seed=len(str(root)))
        ckpt.restore()
        for _ in range(steps):
            update(model, opt, ckpt, save=True)
        ckpt.close()
    shutil.copytree(a / "gen-000000004", b / "gen-000000004")  # byte for byte
    return a, b


def test_a_generation_copied_from_another_run_is_refused_and_moved_aside(tmp_path):
    a, b = two_runs(tmp_path)
    model, opt, ckpt = build(b)
    assert ckpt.restore() == 2
    path, why = ckpt.rejected[0]
    assert path.endswith("gen-000000004") and "written by run" in why and "adopt=True" in why
    assert [e.reason for e in ckpt.store.aside()] == ["foreign"]
    ckpt.close()


def test_run_ids_that_look_alike_are_told_apart_in_the_refusal(tmp_path):
    """A run id read from a file is shown escaped: one with a NUL at its end, printed raw,
    reads as the other, and the refusal as nonsense."""
    a, b = two_runs(tmp_path)
    record = json.loads((b / "RUN.json").read_text())
    ours = record["run_id"]
    theirs = json.loads((a / "gen-000000004" / "MANIFEST.json").read_text())["run_id"]
    model, opt, ckpt = build(b)
    ckpt.restore()
    why = ckpt.rejected[0][1]
    assert f"written by run {theirs!r}, but this folder holds run {ours!r}" in why
    ckpt.close()


def test_adopt_continues_from_a_foreign_generation_and_records_the_lineage(tmp_path, capsys):
    a, b = two_runs(tmp_path)
    foreign_run = json.loads((a / RUN_FILE).read_bytes())["run_id"]
    code = cli_main(["inspect", str(b)])
    assert code == 1 and "foreign" in capsys.readouterr().out
    model, opt, ckpt = build(b)
    assert ckpt.restore(adopt=True) == 4
    own = ckpt.run_id
    update(model, opt, ckpt, save=True)
    ckpt.close()
    record = json.loads((b / RUN_FILE).read_bytes())
    assert record["run_id"] == own != foreign_run and record["lineage"] == [foreign_run]
    assert cli_main(["verify", str(b)]) == 0  # gen 4 is part of the run now
    model, opt, ckpt = build(b)
    assert ckpt.restore(generation=4) == 4  # adopted: no longer foreign
    ckpt.close()


# -- 5, 6. values that used to crash -------------------------------------------------------------


def test_a_nan_loss_at_a_save_step_is_stored_and_ranks_last_for_best(tmp_path):
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=1, best=("loss", "min")))
    ckpt.restore()
    for loss in (float("nan"), 0.5, float("nan"), float("inf")):
        update(model, opt, ckpt)
        ckpt.save(metrics={"loss": torch.tensor(loss)})
    ckpt.close()
    assert gens(root) == ["gen-000000002", "gen-000000004"]  # best 0.5, and the newest
    doc = json.loads((root / "gen-000000004" / MANIFEST).read_bytes())
    assert doc["metrics"] == {"loss": "inf"}
    code = cli_main(["inspect", str(root), "--json"])
    assert code == 0


def test_step_done_with_a_nan_loss_saves(tmp_path):
    model, opt, ckpt = build(tmp_path / "run")
    ckpt.every = 1
    ckpt.restore()
    loss = model(torch.randn(5, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert ckpt.step_done(1, loss=torch.tensor(float("nan")))
    ckpt.close()


@pytest.mark.parametrize("value", ["high", [1.0], 10 ** 400, torch.ones(2)], ids=repr)
def test_a_metric_that_is_not_a_number_is_refused_before_writing(tmp_path, value):
    model, opt, ckpt = build(tmp_path / "run")
    ckpt.restore()
    update(model, opt, ckpt)
    with pytest.raises(UnsupportedValue, match="metric 'acc'"):
        ckpt.save(metrics={"acc": value})
    assert gens(tmp_path / "run") == []
    ckpt.close()


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"1" + b"0" * 5000])
def test_an_out_of_range_number_in_a_state_file_falls_back(tmp_path, number):
    root = tmp_path / "run"
    at_one = two_generations(root)
    gen = root / "gen-000000002"
    text = (gen / "state.json").read_bytes().replace(b'"step":2', b'"step":' + number, 1)
    reseal_listing(gen, "state.json", text)
    model, opt, ckpt = build(root, seed=3)
    assert ckpt.restore() == 1
    assert same(weights(model), at_one)
    assert "gen-000000002" in ckpt.rejected[0][0]
    ckpt.close()


# -- 7. unwritable folders and failing moves ------------------------------------------------------


def test_restore_falls_back_when_a_refused_generation_cannot_be_moved_aside(tmp_path):
    root = tmp_path / "run"
    at_one = two_generations(root)
    flip(root / "gen-000000002" / "model.safetensors")
    for err in (errno.EPERM, errno.EIO):
        model, opt, ckpt = build(root, seed=4)
        ckpt.store.fs = FaultyFS(kind="rename", err=err, times=-1)
        with pytest.warns(UnbrokenWarning, match="could not be moved aside.*left in place"):
            assert ckpt.restore() == 1
        assert same(weights(model), at_one)
        assert (root / "gen-000000002").exists()
        ckpt.close()


def _refuse_lock_file(monkeypatch, err):
    import unbroken.store.generations as store

    real = os.open

    def fake_open(path, flags, *a, **k):
        if str(path).endswith("LOCK") and flags & os.O_CREAT:
            raise OSError(err, os.strerror(err), path)
        return real(path, flags, *a, **k)

    monkeypatch.setattr(store.os, "open", fake_open)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_a_folder_that_cannot_be_written_restores_and_refuses_only_the_save(tmp_path,
                                                                           monkeypatch, err):
    root = tmp_path / "run"
    at_one = two_generations(root)
    flip(root / "gen-000000002" / "model.safetensors")  # restore must not try to move it
    _refuse_lock_file(monkeypatch, err)
    before = sorted(os.listdir(root))
    with pytest.warns(UnbrokenWarning, match="opened read-only"):
        model, opt, ckpt = build(root, seed=5)
    assert ckpt.read_only is not None
    assert ckpt.restore() == 1 and same(weights(model), at_one)
    assert sorted(os.listdir(root)) == before  # nothing written, nothing moved
    update(model, opt, ckpt)
    with pytest.raises(ReadOnlyRun, match=f"cannot save: .*{errno.errorcode[err]}"):
        ckpt.save()
    ckpt.close()


def test_a_filesystem_without_locks_is_not_reported_as_another_writer(tmp_path, monkeypatch):
    root = tmp_path / "run"
    model, opt, ckpt = build(root)
    ckpt.restore()
    update(model, opt, ckpt, save=True)
    ckpt.close()

    def no_locks(fd, op, *a):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, ckpt = build(root)
    text = " ".join(str(w.message) for w in caught)
    assert "ENOLCK" in text and "no POSIX locks" in text and "another live process" not in text
    assert ckpt.restore() == 1
    update(model, opt, ckpt)
    with pytest.raises(ReadOnlyRun, match="ENOLCK"):
        ckpt.save()
    ckpt.close()


def test_a_read_only_checkpointer_becomes_the_writer_when_the_disk_allows_it(tmp_path,
                                                                            monkeypatch):
    root = tmp_path / "run"
    model, opt, ckpt = build(root)
    ckpt.restore()
    update(model, opt, ckpt, save=True)
    update(model, opt, ckpt, save=True)
    ckpt.close()
    flip(root / "gen-000000002" / "model.safetensors")
    with monkeypatch.context() as m:
        _refuse_lock_file(m, errno.ENOSPC)
        with pytest.warns(UnbrokenWarning):
            model, opt, ckpt = build(root)
        assert ckpt.restore() == 1  # gen 2 refused; moving it aside waits for the lock
    update(model, opt, ckpt)
    ckpt.save()  # space is back: the lock is taken, gen 2 moved aside, gen 2 written anew
    assert [e.reason for e in ckpt.store.aside()] == ["corrupt"]
    assert gens(root) == ["gen-000000001", "gen-000000002"]
    ckpt.close()


# -- 10. aside/ is labelled by the real reason and bounded -----------------------------------------


def test_aside_is_labelled_by_reason_and_bounded(tmp_path):
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=5, aside=2))
    ckpt.restore()
    for _ in range(5):
        update(model, opt, ckpt, save=True)
    ckpt.close()
    for step in (5, 4, 3):
        flip(root / f"gen-{step:09d}" / "model.safetensors")  # a hash failure, not "abandoned"
        model, opt, ckpt = build(root, keep=unbroken.Keep(last=5, aside=2))
        assert ckpt.restore() == step - 1
        ckpt.close()
    entries = ckpt.store.aside()
    assert [(e.name[:13], e.reason) for e in entries] == [("gen-000000005", "corrupt"),
                                                          ("gen-000000004", "corrupt"),
                                                          ("gen-000000003", "corrupt")]
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=5, aside=2))
    assert ckpt.restore(generation=1) == 1  # gen 2 is abandoned: moved aside, not deleted
    assert [e.reason for e in ckpt.store.aside()] == ["corrupt"] * 3 + ["abandoned"]
    update(model, opt, ckpt, save=True)  # the run moved on: aside/ shrinks to Keep(aside=2)
    ckpt.close()
    assert [e.reason for e in ckpt.store.aside()] == ["corrupt", "abandoned"]


def test_restoring_an_older_generation_deletes_nothing(tmp_path):
    """restore(generation=N) only reads: newer generations go to aside/ whole, even with
    Keep(aside=0); they may only be pruned once the new branch has committed a save."""
    root = tmp_path / "run"
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=10, aside=0))
    ckpt.restore()
    for _ in range(6):
        update(model, opt, ckpt, save=True)
    ckpt.close()
    model, opt, ckpt = build(root, keep=unbroken.Keep(last=10, aside=0))
    assert ckpt.restore(generation=2) == 2
    ckpt.close()
    assert gens(root) == ["gen-000000001", "gen-000000002"]
    assert sorted(e.name[:13] for e in ckpt.store.aside()) == [
        f"gen-{n:09d}" for n in range(3, 7)]


# -- found by an outside review ------------------------------------------------------------------


def _damage_run_record(root: Path, how: str) -> None:
    record = root / RUN_FILE
    if how == "delete":
        record.unlink()
    else:
        flip(record, 10)


@pytest.mark.parametrize("how", ["delete", "flip"])
def test_without_a_trustworthy_run_record_the_majority_run_holds_the_folder(tmp_path, how):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, steps, seed in ((a, 3, 1), (b, 1, 2)):
        model, opt, ckpt = build(root, seed=seed)
        ckpt.restore()
        for _ in range(steps):
            update(model, opt, ckpt, save=True)
        at_last = weights(model)
        ckpt.close()
        if root == a:
            a_last = at_last
    shutil.copytree(b / "gen-000000001", a / "gen-000000000")  # older, of another run
    _damage_run_record(a, how)
    model, opt, ckpt = build(a, seed=3)
    assert ckpt.restore() == 3 and same(weights(model), a_last)
    assert ckpt.rejected == [] and ckpt.store.aside() == []  # nothing of this run set aside
    ckpt.close()


def test_a_tie_between_two_runs_without_a_record_is_refused_unless_adopted(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, seed in ((a, 1), (b, 2)):
        model, opt, ckpt = build(root, seed=seed)
        ckpt.restore()
        update(model, opt, ckpt, save=root == a)
        update(model, opt, ckpt, save=root == b)
        ckpt.close()
    shutil.copytree(b / "gen-000000002", a / "gen-000000002")  # one generation each
    (a / RUN_FILE).unlink()
    model, opt, ckpt = build(a, seed=3)
    with pytest.raises(CorruptCheckpoint, match=r"RUN.json: missing, and the generations "
                                                r"name 2 runs.*adopt=True"):
        ckpt.restore()
    assert ckpt.restore(adopt=True) == 2
    ckpt.close()


@pytest.mark.parametrize("store", ["local", "memory"])
def test_a_later_save_of_the_same_step_with_changed_state_supersedes_it(tmp_path, store):
    """The per-epoch scheduler pattern: step_done saved the epoch's last update, then the
    scheduler steps and the script saves again: that state must be the one kept (on an
    object store too, where the new upload sits beside the generation it supersedes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    root = tmp_path / "run" if store == "local" else f"memory://promises/{uuid.uuid4().hex}"
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, scheduler=sched, every=2)
    ckpt.restore()
    for step in (1, 2):
        model(torch.ones(3)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step)
    assert ckpt.save() is None  # nothing changed since step_done saved 2: a no-op
    sched.step()  # the end of the epoch
    info = ckpt.save()
    assert info is not None and info.generation == 2
    assert [e.reason for e in ckpt.store.aside()] == ["superseded"]
    ckpt.close()
    model2 = torch.nn.Linear(3, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    with unbroken.Checkpointer(root, model=model2, optimizer=opt2, scheduler=sched2) as c:
        assert c.restore() == 2
    assert sched2.last_epoch == 1 and opt2.param_groups[0]["lr"] == 0.05


def test_an_extra_whose_state_is_not_a_dict_is_refused_when_built(tmp_path):
    class Ids:
        def state_dict(self):
            return [1, 2, 3]

        def load_state_dict(self, state):
            pass

    with pytest.raises(UnsupportedValue, match=r"part 'extra.ids'.*returned a list; it must "
                                               r"return a dict"):
        build(tmp_path / "run", extras={"ids": Ids()})


_BAD = [({"loss": "abc"}, "metric 'loss'"),
        ({"loss": torch.tensor([1.0, 2.0])}, "metric 'loss'"),
        ({"grad_norm": torch.ones(3)}, "metric 'grad_norm'"),
        ({"acc": np.complex64(1 + 1j)}, "'acc'")]


# (a batch only feeds the trace: without one it is never looked at)
@pytest.mark.parametrize("kw, what, traced", [(kw, what, t) for kw, what in _BAD
                                              for t in (False, True)]
                         + [({"batch": {"a": object()}}, "step_done.batch", True)])
def test_bad_step_done_values_are_refused_before_anything_changes(tmp_path, kw, what, traced):
    extra = {"trace": tmp_path / "t.jsonl"} if traced else {}
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=1, **extra)
    ckpt.restore()
    model(torch.ones(3)).sum().backward()
    opt.step()
    with pytest.raises(UnsupportedValue, match=what.replace("(", r"\(")):
        ckpt.step_done(1, **kw)
    assert ckpt.step == 0 and not gens(tmp_path / "run")
    ckpt.step_done(1)  # the same update, reported properly
    assert gens(tmp_path / "run") == ["gen-000000001"]
    ckpt.close()


def test_a_run_record_that_is_a_folder_is_named_with_the_remedy(tmp_path):
    root = tmp_path / "run"
    model, opt, ckpt = build(root)
    ckpt.restore()
    ckpt.close()
    (root / RUN_FILE).mkdir()
    model, opt, ckpt = build(root)
    ckpt.restore()
    update(model, opt, ckpt)
    with pytest.raises(SaveFailed, match="RUN.json: not a regular file.*remove it"):
        ckpt.save()
    ckpt.close()


def test_an_empty_folder_that_cannot_be_written_is_refused_at_restore(tmp_path, monkeypatch):
    _refuse_lock_file(monkeypatch, errno.EROFS)
    with pytest.warns(UnbrokenWarning):
        model, opt, ckpt = build(tmp_path / "run")
    with pytest.raises(ReadOnlyRun, match="nothing to restore, and no save could be written"):
        ckpt.restore()  # not hours later, at the first save
    ckpt.close()


def test_large_bytes_and_frozen_arrays_save_without_warnings(tmp_path):
    frozen = np.arange(5000, dtype=np.int32)
    frozen.setflags(write=False)

    class Blob:
        def state_dict(self):
            return {"raw": bytes(range(256)) * 64, "ids": frozen}

        def load_state_dict(self, state):
            pass

    model, opt, ckpt = build(tmp_path / "run", extras={"blob": Blob()})
    ckpt.restore()
    update(model, opt, ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save()
    ckpt.close()


def test_a_restore_after_the_folder_was_emptied_refuses_instead_of_starting_over(tmp_path):
    """restore() returns 0 for "start fresh"; a Checkpointer whose live model holds updates
    it counted (and saved into generations deleted since) must not say that: the loop would
    count from 0 again with trained weights, and the next save would name them step 0."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 0
        assert ckpt.restore() == 0  # nothing counted yet: still a fresh start
        for step in (1, 2, 3):
            ckpt.step_done(step)
        with pytest.raises(unbroken.NoCheckpoint, match="counted 3 completed updates"):
            ckpt.restore()
        ckpt.save()
        assert ckpt.restore() == 3
        for gen in (tmp_path / "run").glob("gen-*"):
            shutil.rmtree(gen)
        with pytest.raises(unbroken.NoCheckpoint, match=r"run: no generation to restore.*"
                           r"saved step 3.*new Checkpointer"):
            ckpt.restore()
        assert ckpt.step == 3
    fresh = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2))
    assert fresh.restore() == 0  # a new Checkpointer on the emptied folder starts over
    fresh.close()


def test_a_model_on_the_meta_device_is_refused_not_restored_empty(tmp_path):
    """Copying into a meta tensor does nothing: restore() returned the step with the model
    still empty. It names the tensor and the way on, and changes nothing."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    with torch.device("meta"):
        lazy = torch.nn.Linear(2, 2)
    lazy_opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    for intent, source, folder, optimizer in (("continue", None, "run", lazy_opt),
                                              ("warm_start", tmp_path / "run", "new", None)):
        with unbroken.Checkpointer(tmp_path / folder, model=lazy,
                                   optimizer=optimizer) as ckpt:
            with pytest.raises(unbroken.StateMismatch, match=r"live model tensor 'weight' is "
                               r"on the meta device.*to_empty"):
                ckpt.restore(intent, source=source)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("gen-")) \
        == ["gen-000000001"]  # nothing set aside
    lazy.to_empty(device="cpu")
    with unbroken.Checkpointer(tmp_path / "run", model=lazy,
                               optimizer=torch.optim.SGD(lazy.parameters(), lr=0.1)) as ckpt:
        assert ckpt.restore() == 1
    assert torch.equal(lazy.weight, model.weight) and torch.equal(lazy.bias, model.bias)


def test_a_scaler_or_scheduler_of_another_configuration_is_refused(tmp_path):
    """A continuation refuses a configuration change by name: an enabled GradScaler's state
    restored into a disabled one (its loss scale was dropped silently), and a scheduler of
    another class with the same keys (LambdaLR into MultiplicativeLR was accepted)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, scheduler=sched,
                               scaler=torch.amp.GradScaler("cpu")) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    cases = {"disabled scaler": (sched, torch.amp.GradScaler("cpu", enabled=False),
                                 r"scaler state holds .*'scale'.*is it disabled"),
             "other scheduler": (torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda s: 0.9),
                                 torch.amp.GradScaler("cpu"),
                                 r"scheduler was a torch.optim.lr_scheduler.LambdaLR, the live "
                                 r"one is a torch.optim.lr_scheduler.MultiplicativeLR")}
    for name, (scheduler, scaler, said) in cases.items():
        with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                   scheduler=scheduler, scaler=scaler) as ckpt:
            with pytest.raises(unbroken.StateMismatch, match=said):
                ckpt.restore()
    assert [p.name for p in (tmp_path / "run").glob("gen-*")] == ["gen-000000001"]
