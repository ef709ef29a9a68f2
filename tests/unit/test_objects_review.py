"""Adversarial review of the object-store support (memory://): each test states a promise of
README "Object stores" or of the module docstrings, and checks it under a fault, a race or a
hostile object. A failing test here is a demonstrated defect."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
import uuid

import fsspec
import pytest
from test_objects import build, same, train  # helpers only (no test is re-collected)

import unbroken
from unbroken.errors import CorruptCheckpoint, StoreLocked
from unbroken.store.backends.objects import ObjectFS
from unbroken.store.generations import GenerationStore
from unbroken.store.lease import LEASE, Lease
from unbroken.store.manifest import Manifest
from unbroken.store.objects import ObjectStore
from unbroken.store.opening import open_store


@pytest.fixture
def url():
    u = f"memory://unbroken-review/{uuid.uuid4().hex}"
    yield u
    fs = fsspec.filesystem("memory")
    stem = u.rsplit("/", 1)[1]
    for key in fs.find("/unbroken-review"):
        if key.split("/")[2].startswith(stem):
            fs.rm_file(key)


def memfs():
    return fsspec.filesystem("memory")


def manifest_of(generation):
    def make(artifacts):
        return Manifest(generation=generation, step=generation, run_id="r", incarnation=0,
                        artifacts=artifacts, parts=["model"], created="now")
    return make


def verified_generations(store):
    """Numbers of the listed generations whose every byte verifies."""
    out = []
    for g in store.scan():
        if g.ok:
            try:
                store.verify(g)
            except CorruptCheckpoint:
                continue
            out.append(g.generation)
    return out


# -- supersede: a later save of the same step ---------------------------------------------------


def test_superseding_a_generation_keeps_the_new_uploads_artifacts(url):
    """publish(supersede=True) moves the old generation aside by deleting its whole prefix,
    which also holds the new save's upload folder: the manifest then names deleted objects."""
    store = open_store(url)
    store.lock()
    try:
        store.commit(5, {"model.safetensors": [b"a" * 100]}, manifest_of(5))
        new = store.commit(5, {"model.safetensors": [b"b" * 100]}, manifest_of(5),
                           supersede=True)
        (g,) = store.scan()
        assert g.ok, g.reason
        assert g.path == new.path
        store.verify(g)
    finally:
        store.unlock()


# -- an ambiguous commit (the manifest PUT succeeded, its reply was lost) ----------------------


class LostReply(ObjectFS):
    """The manifest's conditional create reaches the store, but the client sees an error: a
    read timeout (``retried=False``), or S3's 412 on s3fs's/botocore's automatic retry of that
    PUT (``retried=True``: FileExistsError)."""

    def __init__(self, fs, retried):
        super().__init__(fs)
        self.retried = retried

    def create_file(self, path, data):
        super().create_file(path, data)
        if path.endswith("MANIFEST.json"):
            if self.retried:
                raise FileExistsError(errno.EEXIST, "PreconditionFailed (retry)", path)
            raise OSError(errno.ETIMEDOUT, "read timeout", path)


@pytest.mark.parametrize("retried", [False, True], ids=["timeout", "retry-412"])
def test_a_commit_whose_reply_was_lost_never_leaves_a_manifest_without_its_objects(
        url, retried):
    """Either the generation is committed whole, or nothing is: publish's cleanup must not
    delete the upload folder that a manifest already names."""
    store = open_store(url)
    assert isinstance(store, ObjectStore)
    store.fs = store.lease.fs = LostReply(memfs(), retried)
    store.lock()
    try:
        # the manifest that reached the store is read back: ours, so the commit stands
        info = store.commit(5, {"model.safetensors": [b"x" * 100]}, manifest_of(5))
    finally:
        store.unlock()
    (g,) = open_store(url).scan()
    assert g.ok and g.path == info.path, f"a torn generation was committed: {g.reason}"
    open_store(url).verify(g)


# -- the lease ---------------------------------------------------------------------------------


@pytest.mark.parametrize("expires", ["1e300", "Infinity", "1" + "0" * 400])
def test_a_lease_with_an_absurd_expiry_is_a_typed_refusal_not_a_crash(url, expires):
    memfs().pipe_file(f"{url}/{LEASE}", (
        '{"lease": "x", "pid": 1, "host": "elsewhere", "expires": %s}' % expires).encode())
    store = open_store(url)
    store.lock()  # no writer writes such a lease: it is garbage, taken over without a crash
    store.unlock()


def test_a_live_lease_naming_an_impossible_pid_of_this_host_is_a_typed_refusal(url):
    """_dead_here() calls os.kill(pid, 0) on any positive int: OverflowError escapes."""
    memfs().pipe_file(f"{url}/{LEASE}", json.dumps(
        {"lease": "x", "pid": 2 ** 70, "host": socket.gethostname(),
         "expires": time.time() + 3600}).encode())
    with pytest.raises(StoreLocked, match="leased by a process it cannot name on"):
        open_store(url).lock()  # (not known to be gone: refused until the lease expires)


def test_a_lease_with_an_absurd_expiry_refuses_a_checkpointer_with_a_typed_error(url):
    memfs().pipe_file(f"{url}/{LEASE}", json.dumps(
        {"lease": "x", "pid": 1, "host": "elsewhere", "expires": 1e300}).encode())
    model, opt, loader, ckpt = build(url)  # taken over, as any garbage lease is
    assert ckpt.read_only is None
    ckpt.close()


class FlakyPut(ObjectFS):
    """``put_file`` fails ``failures`` times (a 503), then works."""

    def __init__(self, fs, failures=0):
        super().__init__(fs)
        self.failures = failures

    def put_file(self, path, data):
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EIO, "503 Slow Down", path)
        super().put_file(path, data)


def test_one_failed_heartbeat_does_not_stop_the_lease_being_renewed(url):
    """README: the lease is 'renewed every 20 s'. After one transient error the heartbeat
    thread returns for good, so a writer between saves loses its run to a second writer."""
    fs = FlakyPut(memfs())
    lease = Lease(fs, f"{url}/{LEASE}", 1.5)  # heartbeat every 0.5 s
    lease.acquire()
    try:
        fs.failures = 1  # the next renewal fails once
        time.sleep(2.25)  # the store is fine again; three more renewals were due
        other = Lease(ObjectFS(memfs()), f"{url}/{LEASE}", 1.5)
        with pytest.raises(StoreLocked):
            other.acquire()
            other.release()
    finally:
        lease.release()


class SlowPut(ObjectFS):
    """The heartbeat thread's lease PUT stalls (network latency) until released."""

    def __init__(self, fs):
        super().__init__(fs)
        self.entered, self.go = threading.Event(), threading.Event()

    def put_file(self, path, data):
        if threading.current_thread().name == "unbroken-lease":
            self.entered.set()
            self.go.wait(10)
        super().put_file(path, data)


def test_releasing_the_lease_while_the_heartbeat_renews_it_leaves_no_lease_behind(url):
    """close() releases the lease; a renewal in flight (read done, PUT pending) must not put
    it back afterwards, or the run stays leased to a writer that has gone."""
    fs = SlowPut(memfs())
    lease = Lease(fs, f"{url}/{LEASE}", 0.3)  # heartbeat every 0.1 s
    lease.acquire()
    thread = lease._heartbeat._thread
    assert fs.entered.wait(5)
    # close(): stop the heartbeat, delete the lease -- it waits for the renewal in flight,
    # which the network then lets through
    releasing = threading.Thread(target=lease.release)
    releasing.start()
    time.sleep(0.2)
    fs.go.set()
    releasing.join(5)
    thread.join(5)
    assert not releasing.is_alive() and not thread.is_alive()
    assert not memfs().exists(f"{url}/{LEASE}"), memfs().cat_file(f"{url}/{LEASE}")
    fresh = open_store(url)
    fresh.lock()  # this very process may write the run again at once
    fresh.unlock()


def test_a_writer_whose_lease_expired_cannot_overwrite_the_lease_another_took_over(url):
    """lease.py: 'A writer whose lease was taken over learns it at its next renewal and
    stops.' renew() reads then PUTs unconditionally: a takeover between the two is
    overwritten, the newcomer is thrown out, and the stalled writer goes on."""
    path = f"{url}/{LEASE}"
    stalled = Lease(ObjectFS(memfs()), path, 60.0)
    stalled.acquire()
    stalled._heartbeat.stop()
    # it stalled for longer than its lease: the lease object says it expired
    held = json.loads(memfs().cat_file(path))
    memfs().pipe_file(path, json.dumps({**held, "expires": time.time() - 1}).encode())
    newcomer = Lease(ObjectFS(memfs()), path, 60.0)
    read = stalled._read

    def read_then_takeover():
        out = read()  # the stalled writer has read its own (expired) lease ...
        newcomer.acquire()  # ... and a second writer takes the expired lease over
        return out

    stalled._read = read_then_takeover
    try:
        try:
            stalled.renew()  # the stalled writer wakes up and renews
        except StoreLocked:
            pass  # what lease.py promises
        else:
            print("the stalled writer renewed over the newcomer's lease:",
                  memfs().cat_file(path))
        stalled._read = read
        newcomer.renew()  # the newcomer still holds the run
    finally:
        stalled._read = read
        newcomer.release()
        stalled.release()


def test_a_lease_lost_during_the_read_back_ends_the_save_with_a_typed_error(url):
    """The heartbeat learns during a long read-back that another writer took the run over;
    retention then calls delete(), whose _need_lock raises a bare RuntimeError ('the run must
    be leased') that retain() does not catch: save() fails with an untyped error."""
    train(url, 3)
    model, opt, loader, ckpt = build(url, every=None, keep=unbroken.Keep(last=1))
    assert ckpt.restore() == 3
    verify = ckpt.store.verify
    path = f"{url}/{LEASE}"

    def verify_while_taken_over(info, *args, **kwargs):
        verify(info, *args, **kwargs)
        held = json.loads(memfs().cat_file(path))  # another writer takes the run over ...
        memfs().pipe_file(path, json.dumps({**held, "lease": "another-writer"}).encode())
        with pytest.raises(StoreLocked):
            ckpt.store.lease.renew()  # ... and the heartbeat's next renewal learns it

    ckpt.store.verify = verify_while_taken_over
    try:
        with pytest.raises(unbroken.UnbrokenError):
            ckpt.save(6)
            ckpt.wait()  # (the read-back and retention follow the commit)
    finally:
        ckpt.store.verify = verify
        ckpt.close()


class FailingManifestRead(ObjectFS):
    """Reading a manifest fails once with EIO (a 503 from the store)."""

    def __init__(self, fs):
        super().__init__(fs)
        self.failures = 1

    def read_file(self, path, limit, aligned=False):
        if path.endswith("MANIFEST.json") and self.failures:
            self.failures -= 1
            raise OSError(errno.EIO, "503 Service Unavailable", path)
        return super().read_file(path, limit, aligned)


def test_a_read_error_while_clearing_debris_neither_fails_lock_nor_strands_the_lease(url):
    """lock() takes the lease, then clears debris 'best effort'; a manifest read error there
    escapes lock() as a bare OSError with the lease held and its heartbeat renewing it, so
    this very process can never write the run again (StoreLocked: its own pid is alive)."""
    train(url, 3)
    store = open_store(url)
    store.fs = store.lease.fs = FailingManifestRead(memfs())
    try:
        store.lock()
    except OSError:
        assert not store.lease.held, "lock() failed but kept the lease (and its heartbeat)"
    else:
        store.unlock()
    again = open_store(url)
    again.lock()  # the run is writable again
    again.unlock()


def test_a_checkpointer_that_failed_to_open_leaves_the_run_writable(url, monkeypatch):
    train(url, 3)
    real = ObjectFS.read_file
    failures = [1]

    def read_file(self, path, limit, aligned=False):  # the first manifest read fails (503)
        if path.endswith("MANIFEST.json") and failures[0]:
            failures[0] -= 1
            raise OSError(errno.EIO, "503 Service Unavailable", path)
        return real(self, path, limit, aligned)

    monkeypatch.setattr(ObjectFS, "read_file", read_file)
    try:
        first = build(url)[3]
    except unbroken.UnbrokenError:
        pass  # a typed refusal is fine, and must not keep the lease
    else:
        first.close()  # opened (debris cleaning is best effort): it gives the lease back
    monkeypatch.setattr(ObjectFS, "read_file", real)
    model, opt, loader, ckpt = build(url)  # StoreLocked here: leased by this very pid
    assert ckpt.restore() == 3
    ckpt.close()


# -- the read cache ----------------------------------------------------------------------------


def test_the_read_cache_never_deletes_files_it_did_not_write(url, tmp_path):
    """cache_dir is a folder the user names; keep_only() deletes every file in it that is
    not an artifact of the generation just restored."""
    train(url, 6)
    cache = tmp_path / "ssd"
    cache.mkdir()
    (cache / "notes.txt").write_text("the user's own file")
    model, opt, loader, ckpt = build(url, cache_dir=cache)
    assert ckpt.restore() == 6
    ckpt.close()
    assert (cache / "notes.txt").exists(), "a restore deleted a file of the user's"


def test_a_restore_served_by_the_cache_does_not_mark_the_store_verified(url, tmp_path):
    """README: 'verification always reads the store'. A restore whose artifacts all came from
    the cache records the generation as verified without reading the store's bytes, and
    retention then counts a generation whose stored bytes are damaged as a kept good copy,
    deleting the last good older one."""
    keep = unbroken.Keep(last=2)
    train(url, 6, keep=keep)  # generations 3 and 6
    cache = tmp_path / "cache"
    model, opt, loader, ckpt = build(url, keep=keep, cache_dir=cache)
    assert ckpt.restore() == 6  # fills the cache
    ckpt.close()
    # the store's copy of generation 6 is damaged (same size)
    key = next(k for k in memfs().find(f"{url}/gen-000000006")
               if k.endswith("model.safetensors"))
    data = bytearray(memfs().cat_file(key))
    data[-1] ^= 0xFF
    memfs().pipe_file(key, bytes(data))
    model, opt, loader, ckpt = build(url, every=None, keep=keep, cache_dir=cache)
    assert ckpt.restore() == 6  # from the cache: the bytes hash right, fine
    six = next(g for g in ckpt.store.scan() if g.generation == 6)
    verdict = ckpt.store.verified(six)  # None: "every byte matches", never read from the store
    ckpt.save(9)
    ckpt.close()
    # Keep(last=2) over verified generations: 9 and 3 (6 is damaged); what is left instead
    store = open_store(url)
    left = [(g.generation, "verifies" if g.generation in verified_generations(store)
             else "damaged") for g in store.scan()]
    assert (verdict is not None, left) == (True, [(3, "verifies"), (9, "verifies")]), \
        (verdict, left)


# -- hostile or foreign keys -------------------------------------------------------------------


def test_a_foreign_prefix_spelling_a_generation_with_ten_digits_is_not_that_generation(url):
    """``gen-0000000006/`` (ten digits) matches the listing's pattern and is taken as
    generation 6, but checked against ``gen-000000006/MANIFEST.json``: generation 6 is listed
    twice, once 'corrupt', and retention moves the real, verified generation 6 aside."""
    train(url, 6)  # generations 3 and 6
    memfs().pipe_file(f"{url}/gen-0000000006/MANIFEST.json", b"{}")
    listed = [(g.generation, g.status) for g in open_store(url).scan()]
    train(url, 9)  # a save, and retention
    store = open_store(url)
    found = (listed, verified_generations(store), [e.name for e in store.aside()])
    assert found == ([(3, "complete"), (6, "complete")], [3, 6, 9], []), found


def test_inspect_reports_the_size_of_what_was_moved_aside_as_on_disk(url):
    """README: 'unbroken inspect|verify s3://... work as on disk'; aside/ entries of an
    object store have no size (bytes: null), measured with os.scandir on the URL."""
    from unbroken._runview import aside_entries
    train(url, 6)
    store = open_store(url)
    store.lock()
    store.move_aside(store.scan()[-1], "abandoned")
    store.unlock()
    (entry,) = aside_entries(open_store(url))
    assert entry["bytes"] is not None and entry["bytes"] > 0, entry


# -- what passes (behaviour confirmed) ---------------------------------------------------------


def test_runs_whose_names_are_prefixes_of_each_other_stay_apart(url):
    train(url + "0", 6)  # .../<id>0 beside .../<id>
    store = open_store(url)
    assert store.scan() == [] and store.debris() == [] and store.aside() == []
    store.lock()  # clearing debris must not touch the other run
    store.unlock()
    assert [g.generation for g in open_store(url + "0").scan()] == [3, 6]
    assert verified_generations(open_store(url + "0")) == [3, 6]


def test_url_spellings_of_one_run_name_the_same_root(url):
    tail = url[len("memory://"):]
    roots = {open_store(u).root for u in (url, url + "/", f"memory:///{tail}",
                                          f"memory:///{tail}//")}
    assert len(roots) == 1, roots


def test_a_manifest_cannot_name_a_folder_outside_its_generation(url):
    from unbroken.store.manifest import seal
    train(url, 3)
    key = f"{url}/gen-000000003/MANIFEST.json"
    raw = json.loads(memfs().cat_file(key))
    for folder in ("../gen-000000003/u-0123456789abcdef", "u-0123456789ABCDEF", "aside",
                   "u-0123456789abcdef/..", ""):
        memfs().pipe_file(key, seal({**raw, "folder": folder}))
        (g,) = open_store(url).scan()
        assert g.status == "corrupt", (folder, g)


def test_a_huge_listed_size_is_refused_before_reading(url):
    from unbroken.store.manifest import seal
    train(url, 3)
    key = f"{url}/gen-000000003/MANIFEST.json"
    raw = json.loads(memfs().cat_file(key))
    raw["artifacts"][0]["size"] = 1 << 60
    memfs().pipe_file(key, seal(raw))
    (g,) = open_store(url).scan()
    assert g.status == "corrupt" and "bytes, the manifest lists" in g.reason


def test_lease_garbage_is_taken_over(url):
    for junk in (b"", b"not json", b"[]", b'{"expires": "soon"}', b"x" * 10000,
                 b'{"expires": NaN}'):
        memfs().pipe_file(f"{url}/{LEASE}", junk)
        store = open_store(url)
        store.lock()
        store.unlock()


def test_a_reader_listing_while_the_writer_deletes_never_sees_a_corrupt_generation(url):
    """Deletion goes manifest first: every scan during it lists the generation complete or
    not at all."""
    store = open_store(url)
    store.lock()
    for n in range(1, 6):
        store.commit(n, {f"a{i}.bin": [bytes([i]) * 1000] for i in range(30)}, manifest_of(n))
    reader = open_store(url)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.extend(g.status for g in reader.scan())

    t = threading.Thread(target=watch)
    t.start()
    try:
        for g in store.scan()[:-1]:
            store.delete(g)
    finally:
        stop.set()
        t.join()
        store.unlock()
    assert set(seen) <= {"complete"}, set(seen)


def test_a_second_lock_in_the_same_process_is_refused_while_the_first_is_held(url):
    a, b = open_store(url), open_store(url)
    a.lock()
    try:
        with pytest.raises(StoreLocked):
            b.lock()
    finally:
        a.unlock()


def test_a_dead_writers_lease_on_another_host_waits_for_expiry(url):
    memfs().pipe_file(f"{url}/{LEASE}", json.dumps(
        {"lease": "x", "pid": 999999, "host": socket.gethostname() + "-other",
         "expires": time.time() + 3600}).encode())
    with pytest.raises(StoreLocked):
        open_store(url).lock()


def test_an_exception_from_the_state_being_encoded_is_not_turned_into_an_io_error(url,
                                                                                    tmp_path):
    """A local store lets an encoder's own error through; the object store reports it as
    OSError(EIO) 'naming the object' (a save then reads as an I/O failure of the store)."""
    def chunks():
        yield b"x"
        raise TypeError("cannot encode this value")

    local = GenerationStore(tmp_path / "run")
    local.lock()
    with pytest.raises(TypeError):
        local.commit(1, {"a.bin": chunks()}, manifest_of(1))
    local.unlock()
    store = open_store(url)
    store.lock()
    try:
        with pytest.raises(TypeError):
            store.commit(1, {"a.bin": chunks()}, manifest_of(1))
    finally:
        store.unlock()


def test_resumed_state_equals_saved_state_through_the_cache(url, tmp_path):
    state, _, _ = train(url, 6)
    for _ in range(2):
        model, opt, loader, ckpt = build(url, cache_dir=tmp_path / "c")
        assert ckpt.restore() == 6
        ckpt.close()
    assert same(model.state_dict(), state)
