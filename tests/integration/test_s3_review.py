"""Adversarial review of the object-store support on a real S3 protocol (moto's server, the
session fixture ``s3``). A failing test here is a demonstrated defect."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from conftest import BUCKET

import unbroken
from unbroken.errors import CorruptCheckpoint, ReadOnlyRun, StoreLocked
from unbroken.store.manifest import Manifest
from unbroken.store.objects import ObjectStore
from unbroken.store.opening import open_store


def run_url(name: str = "") -> str:
    return f"s3://{BUCKET}/review/{name or uuid.uuid4().hex[:12]}"


def manifest_of(generation):
    def make(artifacts):
        return Manifest(generation=generation, step=generation, run_id="r", incarnation=0,
                        artifacts=artifacts, parts=["model"], created="now")
    return make


def committed(url, s3, generations=(5,), payload=b"a" * 100) -> ObjectStore:
    store = open_store(url, s3["options"])
    assert isinstance(store, ObjectStore)
    store.lock()
    for n in generations:
        store.commit(n, {"model.safetensors": [payload]}, manifest_of(n))
    store.unlock()
    return store


# -- defects -----------------------------------------------------------------------------------


def test_a_store_that_listed_the_run_before_taking_the_lease_is_refused_while_it_is_held(s3):
    """s3fs answers info() from the listing cache that find() fills: a store that listed the
    run (a restore, an inspection, agreed_run after a read-only open) and then calls lock()
    while another writer holds the lease reads the live lease as 'absent', deletes it and
    takes the run: two writers."""
    url = run_url()
    a = committed(url, s3)  # RUN has objects: listing it caches its folder
    assert [g.generation for g in a.scan()] == [5]  # a reads the run first
    b = open_store(url, s3["options"])
    b.lock()  # the first writer takes the run
    try:
        with pytest.raises(StoreLocked):
            a.lock()
            a.unlock()
        b.renew()  # b still holds the run
    finally:
        b.unlock()


def test_a_checkpointer_that_opened_read_only_is_refused_the_lease_another_writer_took(
        s3, monkeypatch):
    """The same through a Checkpointer: its first lease upload fails on a transient error
    (opened read-only, warned; it lists the run to agree on it, which holds the debris of a
    first save that crashed), another writer takes the run, and the Checkpointer's first save
    then deletes that live lease and takes the run instead of failing."""
    from unbroken.store.backends.objects import ObjectFS

    url = run_url()
    fs = open_store(url, s3["options"]).fs.fs
    fs.pipe_file(f"{url}/gen-000000001/u-0123456789abcdef/model.safetensors", b"half")
    real = ObjectFS.create_file
    failures = [1]

    def create_file(self, path, data):  # a 503 on the first lease upload
        if path.endswith("LEASE.json") and failures[0]:
            failures[0] -= 1
            raise OSError(5, "503 Service Unavailable", path)
        return real(self, path, data)

    monkeypatch.setattr(ObjectFS, "create_file", create_file)
    model = torch.nn.Linear(2, 2)
    with pytest.warns(unbroken.UnbrokenWarning, match="opened read-only"):
        ckpt = unbroken.Checkpointer(url, model=model, storage_options=s3["options"])
    assert ckpt.read_only is not None
    other = open_store(url, s3["options"])
    other.lock()  # another writer takes the run
    try:
        with pytest.raises((StoreLocked, ReadOnlyRun)):
            ckpt.save(1)
        other.renew()  # StoreLocked here: its live lease was taken
    finally:
        other.unlock()
        ckpt.close()


def test_superseding_a_generation_on_s3_keeps_the_new_uploads_artifacts(s3):
    """publish(supersede=True) deletes the whole gen-N/ prefix, the new upload folder with it."""
    url = run_url()
    store = committed(url, s3)
    store.lock()
    try:
        new = store.commit(5, {"model.safetensors": [b"b" * 100]}, manifest_of(5),
                           supersede=True)
    finally:
        store.unlock()
    (g,) = open_store(url, s3["options"]).scan()
    assert g.ok and g.path == new.path, g.reason
    store.verify(g)


def test_a_directory_marker_inside_an_upload_folder_does_not_make_a_generation_corrupt(s3):
    """Zero-byte 'folder' objects (key ending in '/': the S3 console's 'Create folder', Hadoop
    S3A, some copy tools) are not files. One inside a generation's upload folder makes the
    generation 'corrupt' (listed as an extra artifact), so a run copied with such a tool
    refuses every generation, and retention moves them aside."""
    url = run_url()
    store = committed(url, s3)
    (g,) = store.scan()
    key = g.path[len(f"s3://{BUCKET}/"):] + "/"
    store.fs.fs.call_s3("put_object", Bucket=BUCKET, Key=key, Body=b"")
    (g,) = open_store(url, s3["options"]).scan()
    assert g.ok, g.reason


def test_a_warm_start_from_s3_uses_the_storage_options_given_to_the_checkpointer(
        s3, monkeypatch):
    """README: the endpoint and credentials are given 'as fsspec reads them (AWS_*, ...) or
    as storage_options'. A warm start opens its source without the Checkpointer's
    storage_options, so a source reachable only through them cannot be read."""
    old = run_url()
    model = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(old, model=model, storage_options=s3["options"]) as ckpt:
        ckpt.restore()
        ckpt.save(1)
    for var in ("FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    new = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(run_url(), model=new,
                               storage_options=s3["options"]) as ckpt:
        assert ckpt.restore(intent="warm_start", source=old) == 0
    assert torch.equal(new.weight, model.weight)


def test_a_run_url_with_a_version_query_never_writes_outside_the_run(s3):
    """'?versionId=' is legal in an S3 key, but s3fs splits it off as a version: every object
    of run '.../q?versionId=1' (its lease, then each artifact and manifest) is PUT to the one
    key '.../q', outside the run, each overwriting the last."""
    fs = open_store(run_url(), s3["options"]).fs.fs
    outside = f"{BUCKET}/review/{uuid.uuid4().hex[:8]}"
    try:
        store = open_store(f"s3://{outside}?versionId=1", s3["options"])
        store.lock()
        try:
            store.commit(5, {"model.safetensors": [b"a" * 100]}, manifest_of(5))
        finally:
            store.unlock()
    except (OSError, ValueError, unbroken.UnbrokenError):
        pass  # refusing such a URL is fine
    assert not fs.exists(outside), fs.cat_file(outside)[:200]


# -- behaviour confirmed -----------------------------------------------------------------------


def test_runs_whose_names_are_prefixes_of_each_other_stay_apart_on_s3(s3):
    stem = uuid.uuid4().hex[:8]
    committed(run_url(stem + "10"), s3, generations=(1, 2))
    short = open_store(run_url(stem + "1"), s3["options"])
    assert short.scan() == [] and short.debris() == [] and short.aside() == []
    short.lock()  # clears debris of its own run only
    short.unlock()
    other = open_store(run_url(stem + "10"), s3["options"])
    for g in other.scan():
        other.verify(g)
    assert [g.generation for g in other.scan()] == [1, 2]


@pytest.mark.parametrize("name", ["exp 1+ü=%20#x", "a//b", "with'quote"])
def test_run_names_with_odd_characters_round_trip(s3, name):
    url = run_url(uuid.uuid4().hex[:6] + name)
    committed(url, s3, generations=(1,))
    store = open_store(url, s3["options"])
    (g,) = store.scan()
    assert g.ok, g.reason
    store.verify(g)
    assert bytes(store.read_verified(g)["model.safetensors"]) == b"a" * 100


def test_a_missing_bucket_opens_read_only_and_restore_says_so(s3):
    with pytest.warns(unbroken.UnbrokenWarning, match="bucket does not exist"):
        ckpt = unbroken.Checkpointer("s3://no-such-bucket-for-review/run",
                                     model=torch.nn.Linear(2, 2),
                                     storage_options=s3["options"])
    with pytest.raises(ReadOnlyRun, match="bucket does not exist"):
        ckpt.restore()
    ckpt.close()


def test_an_artifact_larger_than_one_ranged_read_round_trips(s3):
    payload = os.urandom(37 << 20)  # three 16 MiB ranges, in parallel
    url = run_url()
    store = committed(url, s3, generations=(1,), payload=payload)
    (g,) = store.scan()
    store.verify(g)
    assert bytes(store.read_verified(g)["model.safetensors"]) == payload


def test_a_damaged_object_on_s3_is_refused_by_verify(s3):
    url = run_url()
    store = committed(url, s3, generations=(1,))
    (g,) = store.scan()
    store.fs.fs.pipe_file(f"{g.path}/model.safetensors", b"b" * 100)
    (g,) = open_store(url, s3["options"]).scan()
    with pytest.raises(CorruptCheckpoint, match="content hash"):
        store.verify(g)
