"""Runs on an object store (fsspec ``memory://``): commit without rename, listing-based
newest, uploads never read before their manifest, the lease, conditional commits, fallback
past damaged objects, retention, and the CLI on URLs. The S3 server runs the same protocol in
``tests/integration/test_s3.py``."""

from __future__ import annotations

import errno
import json
import subprocess
import uuid

import fsspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unbroken
from unbroken import cli
from unbroken.errors import CommitConflict, StoreLocked
from unbroken.store.backends.objects import ObjectFS, is_checksum, version_of
from unbroken.store.lease import LEASE
from unbroken.store.objects import ObjectStore
from unbroken.store.opening import open_store


@pytest.fixture
def url():
    u = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    yield u
    fs = fsspec.filesystem("memory")
    for key in fs.find(u.rsplit("/", 1)[0]):
        if key.split("/")[2].startswith(u.rsplit("/", 1)[1]):
            fs.rm_file(key)


def memfs():
    return fsspec.filesystem("memory")


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g) + 0.1 * torch.randn(4), torch.tensor(i % 3)


def build(url, every=3, keep=None, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)
    sampler = unbroken.ResumableSampler(40, batch_size=4, seed=1)
    loader = unbroken.ResumableLoader(unbroken.seeded(Noisy(), seed=2), sampler)
    ckpt = unbroken.Checkpointer(url, model=model, optimizer=opt, scheduler=sched, data=loader,
                                 every=every, keep=keep or unbroken.Keep(last=3), **options)
    ckpt.sched = sched
    return model, opt, loader, ckpt


def train(url, until, every=3, keep=None, **options):
    """Train from the run's newest generation up to update ``until``; the model's and the
    optimizer's state at the end."""
    model, opt, loader, ckpt = build(url, every, keep, **options)
    step = ckpt.restore()
    while step < until:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.sched.step()
            step += 1
            ckpt.step_done(step, loss=loss)
            if step == until:
                break
    ckpt.close()
    return model.state_dict(), opt.state_dict(), ckpt


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("options", [{}, {"async_save": True}, {"incremental": True},
                                     {"read_back": "background"}],
                         ids=["sync", "async", "incremental", "read-back-later"])
def test_a_run_resumed_on_an_object_store_equals_the_uninterrupted_run(url, options):
    whole = train(url + "-whole", 23)
    train(url, 14, **options)  # saved at 12; updates 13 and 14 are lost and redone
    resumed = train(url, 23, **options)
    assert same(whole[0], resumed[0]) and same(whole[1], resumed[1])
    names = sorted(g.name for g in open_store(url).scan())
    assert names == ["gen-000000015", "gen-000000018", "gen-000000021"]


def test_generations_live_under_upload_folders_named_by_their_manifests(url):
    train(url, 6)
    fs = memfs()
    keys = sorted(k.split("/unbroken-tests/", 1)[1].split("/", 1)[1] for k in fs.find(url))
    manifest = json.loads(fs.cat_file(f"{url}/gen-000000006/MANIFEST.json"))
    folder = manifest["folder"]
    assert folder.startswith("u-") and f"gen-000000006/{folder}/model.safetensors" in keys
    assert "RUN.json" in keys and LEASE not in keys  # the lease went with close()


def test_an_upload_without_a_manifest_is_never_read_and_is_cleared_by_the_next_writer(url):
    train(url, 6)
    fs = memfs()
    debris = f"{url}/gen-000000009/u-0123456789abcdef/model.safetensors"
    fs.pipe_file(debris, b"half an upload")
    store = open_store(url)
    assert [g.name for g in store.scan()] == ["gen-000000003", "gen-000000006"]
    assert store.debris() == [("gen-000000009/u-0123456789abcdef",
                               "in-progress or interrupted save, ignored")]
    model, opt, loader, ckpt = build(url)
    assert ckpt.restore() == 6
    ckpt.close()
    assert not fs.exists(debris)


def objects_of_newest(url):
    fs = memfs()
    manifest = f"{url}/gen-000000006/MANIFEST.json"
    folder = json.loads(fs.cat_file(manifest))["folder"]
    return manifest, folder, sorted(k for k in fs.find(f"{url}/gen-000000006") if folder in k)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra", "manifest"])
def test_every_damaged_object_of_the_newest_generation_falls_back_to_the_previous(url, damage):
    train(url, 6)
    manifest, folder, objects = objects_of_newest(url)
    count = 1 if damage in ("extra", "manifest") else len(objects)
    fs = memfs()
    for i in range(count):
        run = f"{url}-{i}"
        fs.copy(url + "/", run + "/", recursive=True)  # a fresh copy of the two generations
        key = run + (manifest[len(url):] if damage == "manifest" else
                     objects[i][len(fs._strip_protocol(url)):])
        data = bytearray(fs.cat_file(key))
        if damage in ("flip", "manifest"):
            data[len(data) // 2] ^= 0x01
            fs.pipe_file(key, bytes(data))
        elif damage == "truncate":
            fs.pipe_file(key, bytes(data[:-1]))
        elif damage == "delete":
            fs.rm_file(key)
        else:
            fs.pipe_file(f"{run}/gen-000000006/{folder}/stray.bin", b"x")
        model, opt, loader, ckpt = build(run)
        assert ckpt.restore() == 3, key
        assert ckpt.rejected and "gen-000000006" in ckpt.rejected[0][0]
        ckpt.close()
        assert [e.reason for e in ckpt.store.aside()] == ["corrupt"]  # kept, never loaded
        assert [g.name for g in ckpt.store.scan()] == ["gen-000000003"]


def test_a_second_writer_is_refused_while_the_lease_is_live_and_named(url):
    model, opt, loader, first = build(url)
    first.restore()
    with pytest.raises(StoreLocked, match=r"LEASE.json: the run is leased by pid \d+"):
        build(url)
    first.close()
    model2, opt2, loader2, second = build(url)
    assert second.restore() == 0
    second.close()


def test_the_lease_of_a_dead_writer_on_this_machine_is_taken_over_at_once(url):
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket
    import time
    memfs().pipe_file(f"{url}/{LEASE}", json.dumps(
        {"lease": "x", "pid": dead.pid, "host": socket.gethostname(),
         "expires": time.time() + 3600}).encode())
    train(url, 3)
    assert [g.name for g in open_store(url).scan()] == ["gen-000000003"]


def test_a_writer_whose_lease_was_taken_over_stops_with_a_typed_error(url):
    model, opt, loader, ckpt = build(url, every=1)
    ckpt.restore()
    lease = f"{url}/{LEASE}"
    held = json.loads(memfs().cat_file(lease))
    memfs().pipe_file(lease, json.dumps({**held, "lease": "someone-else"}).encode())
    x, y = next(iter(loader))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(StoreLocked, match="expired and another writer took the run over"):
        ckpt.step_done(1)
    assert open_store(url).scan() == []


def test_two_writers_racing_for_one_generation_commit_it_once(url):
    """Both believe they hold the run (a lease taken over while its writer stalled): the
    conditional manifest upload lets exactly one commit generation 5."""
    a, b = open_store(url), open_store(url)
    assert isinstance(a, ObjectStore) and isinstance(b, ObjectStore)
    a.lock()
    b.lease.token = "stalled"  # b's lease expired unnoticed; it goes on
    b.lease.renew = lambda: None
    from unbroken.store.manifest import Manifest

    def manifest(artifacts):
        return Manifest(generation=5, step=5, run_id="r", incarnation=0, artifacts=artifacts,
                        parts=["model"], created="now")

    staging = b.stage(5)  # b begins its save before a commits
    mine = b.write_artifacts(staging, {"model.safetensors": [b"b" * 100]}, 5)
    won = a.commit(5, {"model.safetensors": [b"a" * 100]}, manifest)
    with pytest.raises(CommitConflict, match="another writer committed generation 5 first"):
        b.publish(staging, 5, manifest(mine))
    (only,) = a.scan()
    assert only.ok and only.path == won.path
    a.verify(only)
    assert b.debris() == []  # the loser's upload went with its failure
    a.unlock()


def test_retention_keeps_the_newest_and_deletes_older_generations_manifest_first(url):
    train(url, 21, every=3, keep=unbroken.Keep(last=2))
    store = open_store(url)
    assert [g.name for g in store.scan()] == ["gen-000000018", "gen-000000021"]
    assert store.debris() == []
    assert not [k for k in memfs().find(url) if "gen-000000015" in k]


def test_inspect_and_verify_take_a_url_with_json(url, capsys):
    train(url, 6)
    assert cli.main(["inspect", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["generation"] for g in out["generations"]] == [3, 6]
    assert out["ok"] and out["debris"] == []
    assert cli.main(["verify", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["status"] for g in out["generations"]] == ["verified", "verified"]
    key = next(k for k in memfs().find(f"{url}/gen-000000006") if k.endswith("state.json"))
    data = bytearray(memfs().cat_file(key))
    data[0] ^= 1
    memfs().pipe_file(key, bytes(data))
    assert cli.main(["verify", url, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["generations"][1]["status"] == "corrupt"
    assert "state.json: content hash" in out["generations"][1]["reason"]


def test_a_url_without_an_installed_backend_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no filesystem for this URL"):
        open_store("nosuchproto://bucket/run")
    assert cli.main(["inspect", "nosuchproto://bucket/run"]) == 2


def test_a_persisting_process_is_refused_for_an_object_store(url):
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="local run folder"):
        unbroken.Checkpointer(url, model=model, async_save="process")


class FailingAt(ObjectFS):
    """An `ObjectFS` whose ``nth`` operation (reads included) raises ``OSError(EIO)``."""

    def __init__(self, fs, nth):
        super().__init__(fs)
        self.nth, self.seen = nth, 0

    def _op(self, kind, path):
        self.seen += 1
        if self.seen == self.nth:
            raise OSError(errno.EIO, "injected", path)

    def read_file(self, path, limit, aligned=False):
        self._op("read", path)
        return super().read_file(path, limit, aligned)


def test_an_io_error_at_every_operation_of_a_save_loses_nothing(url):
    """A save (upload, manifest, read-back, retention) failing at each of its operations in
    turn: the save raises or succeeds, and the run then holds only verified generations, the
    newest being the new one or the one before; a restore continues from it."""
    base = url + "-base"
    train(base, 6, keep=unbroken.Keep(last=2))
    fs = memfs()
    nth, outcomes = 1, set()
    while True:
        run = f"{url}-{nth}"
        fs.copy(base + "/", run + "/", recursive=True)
        model, opt, loader, ckpt = build(run, every=None, keep=unbroken.Keep(last=2))
        assert ckpt.restore() == 6
        faulty = FailingAt(ckpt.store.fs.fs, nth)
        ckpt.store.fs = faulty
        ckpt.store.lease.fs = faulty
        try:
            ckpt.save(9)
            ckpt.wait()  # the read-back and retention, in the background, with the fault
            outcomes.add("saved")
        except (unbroken.SaveFailed, unbroken.CorruptCheckpoint, unbroken.StoreLocked) as e:
            outcomes.add(type(e).__name__)
        ckpt.store.fs = ckpt.store.lease.fs = ObjectFS(faulty.fs)
        ckpt.close()
        store = open_store(run)
        found = [g.generation for g in store.scan()]
        for g in store.scan():
            assert g.ok, g.reason
            store.verify(g)
        assert found[-1] in (6, 9), (nth, found)
        model, opt, loader, ckpt = build(run)
        assert ckpt.restore() == found[-1]
        ckpt.close()
        if faulty.seen < nth:  # the save needed fewer operations: every one has failed once
            break
        nth += 1
    assert nth > 10 and "saved" in outcomes and "SaveFailed" in outcomes, (nth, outcomes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_a_manifest_is_a_verdict_never_a_crash(url, data):
    """Random edits of the newest manifest's bytes (flips, cuts, insertions): listing gives a
    verdict, and a restore falls back to the previous generation or refuses with a typed
    error; nothing else escapes."""
    base = url + "-m"
    if not memfs().exists(base + "/gen-000000006/MANIFEST.json"):
        train(base, 6)
    run = f"{url}-{uuid.uuid4().hex[:6]}"
    memfs().copy(base + "/", run + "/", recursive=True)
    key = f"{run}/gen-000000006/MANIFEST.json"
    raw = bytearray(memfs().cat_file(key))
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, max(0, len(raw) - 1)))
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and raw:
            raw[where] ^= data.draw(st.integers(1, 255))
        elif how == "cut":
            del raw[where:where + data.draw(st.integers(1, 64))]
        else:
            raw[where:where] = data.draw(st.binary(min_size=1, max_size=16))
    memfs().pipe_file(key, bytes(raw))
    for g in open_store(run).scan():
        assert g.status in ("complete", "corrupt")
    model, opt, loader, ckpt = build(run)
    try:
        assert ckpt.restore() in (3, 6)
    except unbroken.UnbrokenError:
        pass
    finally:
        ckpt.close()


def test_a_local_cache_serves_the_next_restore_and_never_a_wrong_byte(url, tmp_path):
    train(url, 6)
    cache = tmp_path / "cache"

    def restore():
        model, opt, loader, ckpt = build(url, cache_dir=cache)
        reads = []
        read = ckpt.store.fs.read_file
        ckpt.store.fs.read_file = lambda p, *a, **k: reads.append(p) or read(p, *a, **k)
        assert ckpt.restore() == 6
        ckpt.close()
        return [p.rsplit("/", 1)[1] for p in reads if "/u-" in p], model.state_dict()

    first, state = restore()
    assert sorted(first) == ["model.safetensors", "optimizer.safetensors", "rng.safetensors",
                             "state.json"]
    assert len(list(cache.iterdir())) == 4
    second, again = restore()
    assert second == [] and same(state, again)  # every artifact from the cache
    for f in cache.iterdir():  # a damaged cache entry is read from the store instead
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    third, again = restore()
    assert len(third) == 4 and same(state, again)


def test_a_restore_downloads_each_large_artifact_once(url, monkeypatch):
    """Even a file a local restore maps and copies from (hashed, then read again from the
    page cache) is downloaded once from an object store: read whole, hashed as it arrives,
    never hashed streaming and then downloaded again."""
    from unbroken.picking import _MAP_MIN

    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    with unbroken.Checkpointer(url, model=model, optimizer=opt) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    fs = memfs()
    sizes = {k.rsplit("/", 1)[1]: fs.info(k)["size"] for k in fs.find(url)
             if "/gen-" in k}
    assert sizes["optimizer.safetensors"] >= _MAP_MIN  # (a file a restore copies from)
    fetched: dict[str, int] = {}
    real = ObjectFS._pieces

    def counted(self, path, size):
        for start, data in real(self, path, size):
            name = path.rsplit("/", 1)[1]
            fetched[name] = fetched.get(name, 0) + len(data)
            yield start, data

    monkeypatch.setattr(ObjectFS, "_pieces", counted)
    expected = [t.clone() for t in opt.state[model.weight].values()]
    with unbroken.Checkpointer(url, model=model, optimizer=opt) as ckpt:  # live state: copied
        with torch.no_grad():
            model.weight.zero_()
        assert ckpt.restore() == 1
    artifacts = {n: s for n, s in sizes.items() if n != "MANIFEST.json"}  # (read by scans)
    assert {n: fetched.get(n) for n in artifacts} == artifacts
    assert all(torch.equal(a, b) for a, b in zip(opt.state[model.weight].values(), expected))


@pytest.mark.parametrize("info, trusted", [
    ({"ETag": '"d41d8cd98f00b204e9800998ecf8427e"'}, True),  # S3, one part: the MD5
    ({"ETag": "d41d8cd98f00b204e9800998ecf8427e"}, True),
    ({"ETag": '"d41d8cd98f00b204e9800998ecf8427e-3"'}, True),  # multipart: of the parts' MD5s
    ({"ETag": '"d41d8cd98f00b204e9800998ecf8427e-"'}, False),
    ({"etag": "CJ+Qh7Ozu/QCEAE=", "md5Hash": "1B2M2Y8AsgTpgAmY7PhCfg=="}, False),  # GCS etag
    ({"md5Hash": "1B2M2Y8AsgTpgAmY7PhCfg=="}, True),
    ({"etag": '"0x8DBF0E0F5A3C2B1"'}, False),  # Azure
    ({"created": 1700000000.0}, False),  # memory://: a time
    ({}, False),
])
def test_only_a_content_checksum_lets_a_copy_skip_its_download(info, trusted):
    """A copy is trusted without its bytes only by a tag that is the store's checksum of
    them: an S3 ETag or GCS's md5Hash, never another store's etag, a generation or a time."""
    assert is_checksum(version_of(info)) is trusted
