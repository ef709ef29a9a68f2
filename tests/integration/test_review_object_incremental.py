"""Review of incremental generations on an object store: an unchanged stable file is copied
inside the store (CopyObject) only while it is still the object that was verified. Attacked
here: the source deleted, resized, rewritten with other bytes (a new version tag, or the same
one faked on ``memory://``), re-uploaded with the same bytes; the copy itself failing,
coming out short or wrong; random sequences of damage under retention and three save modes;
the same step saved twice; a restore served from the read cache. Every time: no listed
generation that verifies holds other bytes than the state saved at its step, a generation
fails verification only where a file it holds was damaged, a save fails only where it copied
a source whose rot could not be seen, the save after a failure uploads everything, and the
save after a good one uploads ~1%."""

from __future__ import annotations

import datetime
import random
import re
import uuid

import fsspec
import pytest
import torch
from _frozen import fresh as _fresh
from _frozen import train_step as _step
from conftest import BUCKET
from safetensors.torch import load

import unbroken
from unbroken.errors import CorruptCheckpoint, SaveFailed, UnbrokenError
from unbroken.store.backends.objects import ObjectFS
from unbroken.store.opening import open_store

BIG = 4_000_000  # the frozen base: 4 MB
_GEN_DIR = re.compile(r"/gen-0*([0-9]+)/(u-[0-9a-f]{16})/([^/]+)$")


def _expected(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The live state, named as a generation's files name it (independent of the encoding):
    ``model.<state_dict key>``, ``optimizer.state.<param name>.<key>``."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"optimizer.state.{names[id(p)]}.{k}"] = torch.as_tensor(v).clone()
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: object) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (what, k)
        assert torch.equal(got[k], want[k]), (what, k)


def _stored(store, g) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors generation ``g`` holds, read from the store and
    hash-checked (`read_verified`), decoded straight from its safetensors files."""
    out: dict[str, torch.Tensor] = {}
    for name, data in store.read_verified(g).items():
        part = name.split(".")[0]
        if name.endswith(".safetensors") and part in ("model", "optimizer"):
            for k, v in load(bytes(data)).items():
                assert f"{part}.{k}" not in out, (g.generation, name, k)  # in one file only
                out[f"{part}.{k}"] = v
    return out


def _restored(url: str, options=None, generation: int | None = None
              ) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = _fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt,
                               storage_options=options) as reader:
        step = reader.restore(generation=generation)
    return step, _expected(model, opt)


@pytest.fixture
def uploads(monkeypatch):
    """Bytes uploaded by each save (append 0 before it): every artifact goes through
    ``write_file``; a copy inside the store does not."""
    sizes: list[int] = []
    write = ObjectFS.write_file

    def counted(self, path, chunks):
        size, digest = write(self, path, chunks)
        if sizes:
            sizes[-1] += size
        return size, digest

    monkeypatch.setattr(ObjectFS, "write_file", counted)
    return sizes


# -- damage to objects of fsspec's memory store -------------------------------------------------

MEM = fsspec.filesystem("memory")
CONTENT = ("delete", "grow", "shrink", "flip_new_tag", "flip_same_tag")  # bytes change
KINDS = (*CONTENT, "same_bytes_new_tag")


def _keys(url: str) -> dict[str, tuple[int, str, str]]:
    """Every object of the run's listed generations: key -> (generation, upload, name)."""
    out = {}
    for key in MEM.find(url):
        m = _GEN_DIR.search(key)
        if m and "/aside/" not in key:
            out[key] = (int(m.group(1)), m.group(2), m.group(3))
    return out


def _stable_key(url: str, generation: int) -> str:
    [key] = [k for k, (g, _, n) in _keys(url).items()
             if g == generation and re.fullmatch(r"model\.g[0-9]+(\.[0-9]+)?\.safetensors", n)]
    return key


def _damage(key: str, kind: str, at: int = 0) -> None:
    """Damage one object in ``memory://`` (``at``: which byte a flip changes)."""
    assert kind in KINDS, kind
    entry = MEM.store[key]
    created = entry.created
    data = bytearray(entry.getvalue())
    if kind == "delete":
        MEM.rm_file(key)
        return
    if kind == "grow":
        data += b"\0" * 8
    elif kind == "shrink":
        del data[-8:]
    elif kind.startswith("flip"):
        data[at % len(data)] ^= 0x5A
    MEM.pipe_file(key, bytes(data))
    if kind.endswith("same_tag"):
        MEM.store[key].created = created  # rot: the same size and version tag, other bytes
    elif MEM.store[key].created == created:  # an upload: a new version tag, always
        MEM.store[key].created = created + datetime.timedelta(seconds=1)


def _check_listing(url: str, saved: dict[int, dict[str, torch.Tensor]],
                   damaged_folders: set[str], options=None) -> list[int]:
    """Every listed generation either verifies and holds exactly the state saved at its
    step, or is one whose files were damaged (and then it must not verify). Returns the
    generations that verify."""
    store = open_store(url, options)
    good = []
    for g in store.scan():
        hit = any(f"/gen-{g.generation:09d}/" in f for f in damaged_folders)
        if not hit:
            assert g.ok, (g.generation, g.status, g.reason)
            store.verify(g)
            _same(_stored(store, g), saved[g.generation], g.generation)
            good.append(g.generation)
        elif g.ok:
            with pytest.raises(CorruptCheckpoint):
                store.verify(g)
    return good


# -- 1. the newest generation's stable object damaged between two saves ----------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("read_back", ["sync", "background"])
def test_source_damaged_between_saves(kind, read_back, uploads):
    url = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    model, opt = _fresh()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    damaged: set[str] = set()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=4), read_back=read_back) as ckpt:
        for s in (1, 2, 3, 4):
            _step(model, opt, s)
            ckpt.step_done(s)
            uploads.append(0)
            failed = None
            try:
                ckpt.save()
                ckpt.wait()
            except UnbrokenError as e:
                failed = e
            if s == 2:
                # the copy of a source whose rot cannot be seen (same size and tag) is
                # caught by the read-back; every other change is seen: uploaded anew. A
                # read-back before save() returns writes the generation again in full at
                # once (the state saved is at hand); one beside the loop fails it (the next
                # save writes every file)
                if kind == "flip_same_tag" and read_back == "background":
                    assert isinstance(failed, SaveFailed), failed
                    assert "did not read back as written" in str(failed)
                    assert uploads[1] <= 0.02 * uploads[0], uploads
                else:
                    assert failed is None, failed
                    saved[s] = _expected(model, opt)
                    assert uploads[1] > BIG, uploads
            else:
                assert failed is None, failed
                saved[s] = _expected(model, opt)
            if s == 1:
                key = _stable_key(url, 1)
                _damage(key, kind)
                if kind in CONTENT:
                    damaged.add(key.rsplit("/", 1)[0])
    assert uploads[0] > BIG, uploads
    # after a failed read-back everything is uploaded again, never copied from a bad source
    lost = kind == "flip_same_tag" and read_back == "background"  # (generation 2)
    assert (uploads[2] > BIG) == lost, uploads
    assert uploads[3] <= 0.02 * uploads[0], uploads  # copied again from a good one
    good = _check_listing(url, saved, damaged)
    assert 4 in good and 3 in good, good
    assert (1 in good) == (kind not in CONTENT), good  # only damage fails a generation
    assert (2 in good) == (not lost), good  # a failed save is moved aside
    for g in sorted(good, reverse=True):  # newest first (an older one abandons newer ones)
        step, got = _restored(url, generation=g)
        assert step == g
        _same(got, saved[g], g)


# -- 2. the copy itself goes wrong -------------------------------------------------------------

@pytest.mark.parametrize("fault", ["raises", "short", "wrong_bytes", "source_gone"])
def test_copy_faults_fall_back_or_fail_the_generation(fault, uploads, monkeypatch):
    """Inside the store the copy raises, comes out short, comes out with other bytes of
    the same size, or the source vanishes just before it: the first two and the last upload
    the file anew (the save succeeds), the third is caught by the read-back."""
    url = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    copy = ObjectFS.copy
    armed = [False]
    gone: set[str] = set()

    def faulty(self, src, dst):
        if not (armed[0] and ".g" in dst.rsplit("/", 1)[1]):
            return copy(self, src, dst)
        armed[0] = False
        if fault == "raises":
            raise OSError(5, "copy failed", dst)
        if fault == "source_gone":
            MEM.rm_file(MEM._strip_protocol(src))
            gone.add(MEM._strip_protocol(src).rsplit("/", 1)[0])
            return copy(self, src, dst)
        copy(self, src, dst)
        key = MEM._strip_protocol(dst)
        data = bytearray(MEM.store[key].getvalue())
        if fault == "short":
            del data[-100:]
        else:
            data[len(data) // 2] ^= 0xFF
        MEM.pipe_file(key, bytes(data))

    monkeypatch.setattr(ObjectFS, "copy", faulty)
    model, opt = _fresh()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=4), read_back="sync") as ckpt:
        for s in (1, 2, 3):
            _step(model, opt, s)
            ckpt.step_done(s)
            uploads.append(0)
            armed[0] = s == 2
            if s == 2 and fault == "wrong_bytes":  # (written again in full, at once)
                with pytest.warns(unbroken.UnbrokenWarning,
                                  match="did not read back as written"):
                    ckpt.save()
                saved[s] = _expected(model, opt)
                continue
            ckpt.save()
            saved[s] = _expected(model, opt)
    assert not armed[0]  # the fault fired
    if fault == "wrong_bytes":
        assert uploads[1] > BIG, uploads  # the failed copy, then all of it uploaded
        assert uploads[2] <= 0.02 * uploads[0], uploads
    else:
        assert uploads[1] > BIG, uploads  # uploaded anew from memory
        assert uploads[2] <= 0.02 * uploads[0], uploads
    good = _check_listing(url, saved, gone)
    assert good == ([2, 3] if fault == "source_gone" else [1, 2, 3]), good
    step, got = _restored(url)
    assert step == 3
    _same(got, saved[3], 3)


# -- 3. random sequences: damage, retention, save modes --------------------------------------

MODES = {"sync": {"read_back": "sync"}, "background": {"read_back": "background"},
         "thread": {"async_save": True}}


@pytest.mark.parametrize("seed", [11, 12, 13, 14, 15, 16])
def test_random_damage_under_retention(seed, uploads):
    rng = random.Random(seed)
    mode = list(MODES)[seed % 3]
    keep = rng.randint(1, 3)
    url = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    model, opt = _fresh()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    damaged: dict[str, str] = {}  # key -> kind (each object damaged at most once)
    held: str | None = None  # the stable object the next save may copy
    base_changed = False
    log = []
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=keep), **MODES[mode]) as ckpt:
        for s in range(1, 11):
            _step(model, opt, 1000 * seed + s)
            if rng.random() < 0.15:  # the "frozen" base changed on purpose (a merge)
                with torch.no_grad():
                    model.base.weight[rng.randrange(1000)] += 1.0
                base_changed = True
            ckpt.step_done(s)
            kind = damaged.get(held) if held else None
            if held is None or base_changed:
                expect = "all"
            elif kind == "flip_same_tag":  # (a read-back beside the loop fails the save;
                # one in save() or in an async save's background writes it again in full)
                expect = "fail" if mode == "background" else "all"
            elif kind is None:
                expect = "copy"
            else:
                expect = "all"
            uploads.append(0)
            try:
                ckpt.save()
                ckpt.wait()
                failed = None
            except UnbrokenError as e:
                failed = e
            log.append((s, expect, kind, uploads[-1], type(failed).__name__))
            if expect == "fail":
                assert isinstance(failed, SaveFailed), log
                assert uploads[-1] <= 0.02 * uploads[0], log
                held = None
            else:
                assert failed is None, (log, failed)
                assert (uploads[-1] > BIG) == (expect == "all"), log
                if expect == "copy":
                    assert uploads[-1] <= 0.02 * uploads[0], log
                saved[s] = _expected(model, opt)
                held = _stable_key(url, s)
            base_changed = False
            folders = {k.rsplit("/", 1)[0] for k, kd in damaged.items() if kd in CONTENT}
            good = _check_listing(url, saved, folders)
            if failed is None:
                assert s in good, (log, good)
            else:
                assert s not in [g.generation for g in open_store(url).scan()], log
            # damage between saves: 0-2 objects, the held source with a high chance
            keys = [k for k in _keys(url) if k not in damaged]
            for _ in range(rng.choice((0, 1, 1, 2)) if s < 10 else 0):
                if held in keys and rng.random() < 0.6:
                    key = held
                elif keys:
                    key = rng.choice(keys)
                else:
                    break
                keys.remove(key)
                damaged[key] = rng.choice(KINDS)
                _damage(key, damaged[key], rng.randrange(1 << 30))
                log.append(("damaged", key.rsplit("/", 3)[1:], damaged[key]))
    folders = {k.rsplit("/", 1)[0] for k, kd in damaged.items() if kd in CONTENT}
    good = _check_listing(url, saved, folders)
    assert good, log
    step, got = _restored(url)
    assert step == max(good), (step, good, log)
    _same(got, saved[step], step)


# -- 4. the same step saved twice -----------------------------------------------------------

def test_same_step_saved_again_copies_and_supersedes(uploads):
    url = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    model, opt = _fresh()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=3), read_back="sync") as ckpt:
        _step(model, opt, 1)
        ckpt.step_done(1)
        uploads.append(0)
        ckpt.save()
        with torch.no_grad():
            model.head.weight.mul_(0.5)  # an end-of-epoch change, no optimizer step
        uploads.append(0)
        ckpt.save(1)  # supersedes generation 1, copying its stable file from itself
        saved[1] = _expected(model, opt)
        uploads.append(0)
        assert ckpt.save(1) is None  # unchanged: nothing written
        _step(model, opt, 2)
        ckpt.step_done(2)
        uploads.append(0)
        ckpt.save()
        saved[2] = _expected(model, opt)
        # the same step again after its stable object was re-uploaded with other bytes (a
        # new version tag): no longer verifies, so it is saved anew, uploading it anew
        _damage(_stable_key(url, 2), "flip_new_tag", 12345)
        uploads.append(0)
        ckpt.save(2)
        # and once more after rot the store cannot show (the tag faked): the copy is caught
        # by the read-back, the superseded generation (rotten itself) is put back, and the
        # save (its state at hand) supersedes it again with every file uploaded anew
        # (only the optimizer's settings change: the model's file, head and base unchanged
        # since the last save of this step, is first copied)
        opt.param_groups[0]["lr"] = 5e-3
        _damage(_stable_key(url, 2), "flip_same_tag", 777)
        uploads.append(0)
        with pytest.warns(unbroken.UnbrokenWarning, match="did not read back as written"):
            ckpt.save(2)
        saved[2] = _expected(model, opt)
        after = open_store(url)
        listed = {g.generation: g for g in after.scan()}
        assert sorted(listed) == [1, 2], listed
        after.verify(listed[2])
        _step(model, opt, 3)
        ckpt.step_done(3)
        uploads.append(0)
        ckpt.save()
        saved[3] = _expected(model, opt)
    first = uploads[0]
    assert first > BIG and uploads[1] <= 0.02 * first and uploads[2] == 0, uploads
    assert uploads[3] <= 0.02 * first, uploads  # copied from the superseding save's folder
    assert uploads[4] > BIG, uploads  # the source changed: uploaded anew
    assert uploads[5] > BIG, uploads  # copied (from the rot), caught, all uploaded anew
    assert uploads[6] <= 0.02 * first, uploads  # copied from the good one again
    good = _check_listing(url, saved, set())
    assert good == [1, 2, 3], good
    gens = [g.generation for g in open_store(url).scan()]
    assert gens == [1, 2, 3], gens
    for g in (3, 2, 1):
        step, got = _restored(url, generation=g)
        assert step == g
        _same(got, saved[g], g)


# -- 5. the real S3 server: ETags ---------------------------------------------------------------

def test_s3_source_overwritten_or_deleted_is_uploaded_anew(s3, uploads):
    import s3fs

    options = s3["options"]
    url = f"s3://{BUCKET}/review-incremental/{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)

    def stable(generation: int) -> str:
        [key] = [k for k in fs.find(url[len("s3://"):])
                 if f"/gen-{generation:09d}/" in k and ".g" in k.rsplit("/", 1)[1]]
        return key

    model, opt = _fresh()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    damaged = set()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=4), read_back="sync",
                               storage_options=options) as ckpt:
        for s in (1, 2, 3, 4):
            _step(model, opt, s)
            ckpt.step_done(s)
            uploads.append(0)
            ckpt.save()
            saved[s] = _expected(model, opt)
            key = stable(s)
            if s == 1:  # overwritten: the same size, other bytes (a new ETag)
                data = bytearray(fs.cat_file(key))
                data[len(data) // 3] ^= 0x01
                fs.pipe_file(key, bytes(data))
                damaged.add(key.rsplit("/", 1)[0])
            elif s == 2:
                fs.rm_file(key)
                damaged.add(key.rsplit("/", 1)[0])
    first = uploads[0]
    assert first > BIG and uploads[1] > BIG and uploads[2] > BIG, uploads
    assert uploads[3] <= 0.02 * first, uploads
    good = _check_listing(url, saved, damaged, options)
    assert good == [3, 4], good
    step, got = _restored(url, options)
    assert step == 4
    _same(got, saved[4], 4)


# -- 6. a restore served by the read cache, then an incremental save ---------------------------

def test_save_after_a_cached_restore_does_not_copy_an_unverified_source(tmp_path, uploads):
    """A restore reads artifacts from the local cache when they hash right there, so it
    never verified the store's objects. An object rewritten in the store since (other bytes,
    a new version tag) must then not be copied into the next generation, whose save would
    fail its read-back for it: it is uploaded from memory instead."""
    url = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    cache = tmp_path / "cache"
    model, opt = _fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               read_back="sync") as ckpt:
        _step(model, opt, 1)
        ckpt.step_done(1)
        ckpt.save()
    want1 = _expected(model, opt)
    model, opt = _fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, cache_dir=cache) as reader:
        assert reader.restore() == 1  # fills the cache
    key = _stable_key(url, 1)
    _damage(key, "flip_new_tag", 4242)  # the store's object rewritten, visibly
    model, opt = _fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               read_back="sync", cache_dir=cache) as ckpt:
        assert ckpt.restore() == 1  # the right bytes, from the cache
        _same(_expected(model, opt), want1, 1)
        _step(model, opt, 2)
        ckpt.step_done(2)
        uploads.append(0)
        try:
            ckpt.save()
            failed = None
        except SaveFailed as e:
            failed = e
        want2 = _expected(model, opt)
    assert failed is None, f"{failed} (uploaded {uploads})"
    good = _check_listing(url, {1: want1, 2: want2}, {key.rsplit("/", 1)[0]})
    assert good == [2], good
