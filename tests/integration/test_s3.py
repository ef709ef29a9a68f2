"""Runs on a real S3-compatible server (moto's server mode on 127.0.0.1, started and stopped
here): SIGKILLs during upload, manifest and retention leave a verified generation or none and
resume bitwise; two writers cannot both commit a generation (S3's If-None-Match); the CLI reads
``s3://`` URLs; a 2-rank DDP job checkpoints there and resumes bitwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from conftest import BUCKET, SCRIPTS

from unbroken.errors import CommitConflict
from unbroken.store.manifest import Manifest
from unbroken.store.objects import ObjectStore
from unbroken.store.opening import open_store

SCRIPT = str(SCRIPTS / "object_train.py")


def run_url() -> str:
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:12]}"  # BUCKET: made by the s3 fixture


def train(s3, url, until, tmp_path, kill=None, digest=None):
    env = {**os.environ, **s3["env"]}
    env.pop("UNBROKEN_KILL_AT", None)
    env.pop("UNBROKEN_KILL_AT_OP", None)
    env.update(kill or {})
    args = [sys.executable, SCRIPT, url, str(until)]
    if digest:
        args += ["--digest", str(digest)]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                          start_new_session=True)  # a kill takes the workers down too


def verified_only(store: ObjectStore) -> list[int]:
    """Every generation listed verifies (never a torn one); their numbers."""
    out = []
    for g in store.scan():
        assert g.ok, g.reason
        store.verify(g)
        out.append(g.generation)
    return out


UNTIL = 14


@pytest.fixture(scope="module")
def uninterrupted(s3, tmp_path_factory):
    """The run's URL and the digests of its final state."""
    tmp = tmp_path_factory.mktemp("s3ref")
    url = run_url()
    r = train(s3, url, UNTIL, tmp, digest=tmp / "ref.json")
    assert r.returncode == 0, r.stderr[-3000:]
    return url, json.loads((tmp / "ref.json").read_text())


@pytest.mark.parametrize("kill", [
    {"UNBROKEN_KILL_AT": "artifact-2-written@9"},  # between uploads: 9 never committed
    {"UNBROKEN_KILL_AT": "retention-unlinked@3"},  # a deletion stopped after the manifest
    {"UNBROKEN_KILL_AT_OP": "write:23"},  # inside an upload, counted
], ids=["artifact", "retention", "op-write"])
# (A kill right after the manifest upload, committed before retention ran, is the "after
# commit" case every local kill test covers; on S3 it left nothing the others do not.)
def test_a_run_killed_while_writing_to_s3_keeps_verified_generations_and_resumes_bitwise(
        s3, uninterrupted, tmp_path, kill):
    url = run_url()
    killed = train(s3, url, UNTIL, tmp_path, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    store = open_store(url, s3["options"])
    assert isinstance(store, ObjectStore)
    before = verified_only(store)
    assert before, "nothing committed before the kill"
    resumed = train(s3, url, UNTIL, tmp_path, digest=tmp_path / "d.json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "d.json").read_text()) == uninterrupted[1]
    assert verified_only(store) == [9, 12]
    assert store.debris() == []  # the dead writer's uploads were cleared


def test_two_writers_racing_on_s3_commit_a_generation_once(s3):
    url = run_url()
    a, b = open_store(url, s3["options"]), open_store(url, s3["options"])
    assert isinstance(a, ObjectStore) and isinstance(b, ObjectStore) and a.fs.atomic_create
    a.lock()
    b.lease.token = "stalled"  # b's lease was taken over while it stalled; it goes on
    b.lease.renew = lambda: None

    def manifest(artifacts):
        return Manifest(generation=4, step=4, run_id="r", incarnation=0, artifacts=artifacts,
                        parts=["model"], created="now")

    staging = b.stage(4)
    mine = b.write_artifacts(staging, {"model.safetensors": [b"b" * 4096]}, 4)
    won = a.commit(4, {"model.safetensors": [b"a" * 4096]}, manifest)
    with pytest.raises(CommitConflict, match="another writer committed generation 4 first"):
        b.publish(staging, 4, manifest(mine))
    (only,) = a.scan()
    assert only.path == won.path
    a.verify(only)
    assert b.debris() == []
    a.unlock()


def test_inspect_and_verify_read_s3_urls_with_json(s3, uninterrupted):
    url = uninterrupted[0]
    env = {**os.environ, **s3["env"]}
    for command, status in (("inspect", "complete"), ("verify", "verified")):
        r = subprocess.run([sys.executable, "-m", "unbroken.cli", command, url, "--json"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert [(g["generation"], g["status"]) for g in out["generations"]] == \
            [(9, status), (12, status)]
