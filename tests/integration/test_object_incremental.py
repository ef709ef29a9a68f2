"""Incremental generations on an object store (the real S3-compatible server, moto on
127.0.0.1, and fsspec's ``memory://``): an unchanged stable file is copied by the store
(CopyObject), not uploaded again, so the second save of a 99%-frozen state uploads a few
percent of the first; every generation still verifies and restores bit for bit on its own,
after retention deleted the one that first wrote the shared data; and a source that rotted
after it was verified fails the generation that copied it, whose save then falls back to
uploading everything."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
from _frozen import fresh, state_of, train_step
from conftest import BUCKET

import unbroken
from unbroken.errors import CorruptCheckpoint, SaveFailed
from unbroken.store.backends.objects import ObjectFS
from unbroken.store.opening import open_store


@pytest.fixture
def uploads(monkeypatch):
    """Bytes uploaded by each save, in order (every artifact goes through ``write_file``)."""
    sizes: list[int] = []
    write = ObjectFS.write_file

    def counted(self, path, chunks):
        size, digest = write(self, path, chunks)
        sizes[-1] += size
        return size, digest

    monkeypatch.setattr(ObjectFS, "write_file", counted)
    return sizes


@pytest.fixture(params=["s3", "memory"])
def target(request):
    """(run URL, storage options) on the S3 server or in fsspec's memory store."""
    if request.param == "memory":
        yield f"memory://unbroken-tests/{uuid.uuid4().hex}", None
        return
    s3 = request.getfixturevalue("s3")
    yield f"s3://{BUCKET}/incremental/{uuid.uuid4().hex[:12]}", s3["options"]


def test_unchanged_stable_files_are_copied_by_the_store_not_uploaded(target, uploads):
    url, options = target
    model, opt = fresh()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=2), storage_options=options) as ckpt:
        for s in range(1, 5):
            train_step(model, opt, s)
            ckpt.step_done(s)
            uploads.append(0)
            ckpt.save()
            saved[s] = state_of(model, opt)
    first, later = uploads[0], uploads[1:]
    assert first > 4_000_000, uploads
    assert all(n <= 0.02 * first for n in later), uploads  # the base: copied, never uploaded
    store = open_store(url, options)
    gens = [g.generation for g in store.scan()]
    assert gens == [3, 4], gens  # generation 1, which first wrote the base, is gone
    for g in store.scan():
        store.verify(g)
        names = [a.name for a in g.manifest.artifacts]
        assert any(".g1." in n for n in names), names  # the copied stable file, listed
    for s in (4, 3):  # (the newest first: restoring an older one abandons newer ones)
        other, other_opt = fresh()
        with unbroken.Checkpointer(url, model=other, optimizer=other_opt,
                                   storage_options=options) as reader:
            assert reader.restore(generation=s) == s
        got = state_of(other, other_opt)
        assert got.keys() == saved[s].keys()
        assert all(torch.equal(got[k], saved[s][k]) for k in got), s


def test_a_source_rotten_after_verification_fails_the_copy_and_the_next_save_uploads_all(
        uploads):
    url = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    model, opt = fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=3)) as ckpt:
        train_step(model, opt, 1)
        ckpt.step_done(1)
        uploads.append(0)
        ckpt.save()
        ckpt.wait()  # read back and verified: the rot comes after
        [stable] = [k for k in fs.find(f"{url}/gen-000000001") if ".g1." in k]
        data = bytearray(fs.cat_file(stable))
        data[-1] ^= 0xFF  # rot: the same size and version tag, other bytes
        key = fs._strip_protocol(stable)
        created = fs.store[key].created
        fs.pipe_file(stable, bytes(data))
        fs.store[key].created = created
        train_step(model, opt, 2)
        ckpt.step_done(2)
        uploads.append(0)
        ckpt.save()  # (read back in the background: its verdict comes with wait())
        with pytest.raises(SaveFailed, match="did not read back as written"):
            ckpt.wait()
        assert uploads[1] <= 0.02 * uploads[0], uploads  # it was copied, then caught
        train_step(model, opt, 3)
        ckpt.step_done(3)
        uploads.append(0)
        ckpt.save()
        want = state_of(model, opt)
    assert uploads[2] > 4_000_000, uploads  # nothing linked after a failed read-back
    store = open_store(url)
    gens = {g.generation: g for g in store.scan()}
    assert sorted(gens) == [1, 3]  # 2 was moved aside
    with pytest.raises(CorruptCheckpoint):
        store.verify(gens[1])  # (the rot itself)
    store.verify(gens[3])
    other, other_opt = fresh()
    with unbroken.Checkpointer(url, model=other, optimizer=other_opt) as reader:
        assert reader.restore() == 3
    got = state_of(other, other_opt)
    assert all(torch.equal(got[k], want[k]) for k in want)


def assert_restores(url, options, step, want):
    """The newest generation of ``url`` restores into a fresh model at ``step``, bit for
    bit ``want``."""
    other, other_opt = fresh()
    with unbroken.Checkpointer(url, model=other, optimizer=other_opt,
                               storage_options=options) as reader:
        assert reader.restore() == step
    got = state_of(other, other_opt)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture
def hashed(monkeypatch):
    """Bytes the read-backs downloaded to hash, by save (``hash_file`` reads every byte)."""
    sizes: list[int] = []
    real = ObjectFS.hash_file

    def counted(self, path, limit, drop_cache=False):
        size, digest = real(self, path, limit, drop_cache)
        sizes[-1] += size
        return size, digest

    monkeypatch.setattr(ObjectFS, "hash_file", counted)
    return sizes


def test_a_copy_holding_the_verified_checksum_is_not_downloaded_again(s3, uploads, hashed):
    """On S3 a copy's ETag is the MD5 the store computed over its bytes: equal to the one the
    source had when this process verified it, the copy holds the verified bytes, and the
    read-back downloads only what the save uploaded. Every generation still verifies in
    full (a fresh store hashes every byte) and restores bit for bit."""
    url = f"s3://{BUCKET}/incremental/{uuid.uuid4().hex[:12]}"
    model, opt = fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=2), storage_options=s3["options"],
                               read_back="sync") as ckpt:
        for s in range(1, 5):
            train_step(model, opt, s)
            ckpt.step_done(s)
            uploads.append(0)
            hashed.append(0)
            ckpt.save()
        want = state_of(model, opt)
    # the first save's files all read back (RUN.json, uploaded too, is not the generation's)
    assert 4_000_000 < hashed[0] <= uploads[0] < hashed[0] + 1000, (hashed, uploads)
    # a later save reads back what it uploaded, not the copies
    assert all(h == u <= 0.02 * uploads[0] for h, u in zip(hashed[1:], uploads[1:])), (
        hashed, uploads)
    store = open_store(url, s3["options"])
    for g in store.scan():
        store.verify(g)  # (a store of its own: every byte hashed)
    assert_restores(url, s3["options"], 4, want)


def test_a_copy_changed_before_its_read_back_is_downloaded_and_fails_the_save(
        s3, monkeypatch):
    """The copy is trusted only while the store still reports the checksum it had when it
    was made: one overwritten since (other bytes, same size) is downloaded, fails its hash,
    and the generation is moved aside; the save, whose state is still at hand (a read-back
    before save() returns), is written again with every file uploaded anew, with a warning;
    the one before it still restores."""
    from unbroken.store.objects import ObjectStore

    url = f"s3://{BUCKET}/incremental/{uuid.uuid4().hex[:12]}"
    real = ObjectStore._link

    def link_then_rot(self, linked, path):
        made = real(self, linked, path)
        if made:
            data = bytearray(self.fs.fs.cat_file(path))
            data[-1] ^= 0xFF
            self.fs.fs.pipe_file(path, bytes(data))
        return made

    model, opt = fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               storage_options=s3["options"], read_back="sync") as ckpt:
        train_step(model, opt, 1)
        ckpt.step_done(1)
        ckpt.save()
        want = state_of(model, opt)
        monkeypatch.setattr(ObjectStore, "_link", link_then_rot)
        train_step(model, opt, 2)
        ckpt.step_done(2)
        with pytest.warns(unbroken.UnbrokenWarning, match="did not read back as written"):
            ckpt.save()
        again = state_of(model, opt)
    store = open_store(url, s3["options"])
    assert [g.generation for g in store.scan()] == [1, 2]
    assert_restores(url, s3["options"], 2, again)
    assert want.keys() == again.keys() and not all(torch.equal(want[k], again[k]) for k in want)


def test_an_object_overwritten_after_its_hash_is_uploaded_anew_by_the_next_save(
        s3, monkeypatch, uploads):
    """An object overwritten just after its read-back hashed it (other bytes, same size: a new
    ETag, itself a checksum, which the next save could take for the verified one) is never
    copied: retention, right after, finds the generation's identity changed since it was
    verified, hashes it again and moves it aside. The next save uploads that file anew, and
    its generation verifies in a store of its own and restores bit for bit."""
    from unbroken.store.objects import ObjectStore

    url = f"s3://{BUCKET}/incremental/{uuid.uuid4().hex[:12]}"
    real = ObjectStore._check_artifact
    overwritten: list[str] = []

    def hash_then_overwrite(self, folder, a, from_disk=False):
        real(self, folder, a, from_disk)
        if ".g1." in a.name and not overwritten:  # a stable file of the first save
            path = f"{folder}/{a.name}"
            data = bytearray(self.fs.fs.cat_file(path))
            data[-1] ^= 0xFF
            self.fs.fs.pipe_file(path, bytes(data))
            overwritten.append(a.name)

    model, opt = fresh()
    with unbroken.Checkpointer(url, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=2), storage_options=s3["options"],
                               read_back="sync") as ckpt:
        monkeypatch.setattr(ObjectStore, "_check_artifact", hash_then_overwrite)
        train_step(model, opt, 1)
        ckpt.step_done(1)
        uploads.append(0)
        ckpt.save()
        monkeypatch.setattr(ObjectStore, "_check_artifact", real)
        assert overwritten, "no stable file was read back"
        train_step(model, opt, 2)
        ckpt.step_done(2)
        uploads.append(0)
        ckpt.save()
        want = state_of(model, opt)
    assert uploads[1] > 0.9 * uploads[0], uploads  # the stable file went up again
    store = open_store(url, s3["options"])
    assert [g.generation for g in store.scan()] == [2]
    assert [(e.name[:14], e.reason) for e in store.aside()] == [("gen-000000001-", "corrupt")]
    newest = store.scan()[-1]
    store.verify(newest)  # (a store of its own: every byte hashed)
    assert_restores(url, s3["options"], 2, want)
