"""GenerationStore: commit protocol, scan statuses, verification, lock, delete, move aside."""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

import unbroken
from unbroken.errors import CorruptCheckpoint, StoreLocked
from unbroken.store.aside import ASIDE
from unbroken.store.backends.local import LocalFS
from unbroken.store.generations import GenerationStore, generation_name
from unbroken.store.lock import LOCK
from unbroken.store.manifest import MANIFEST, Artifact, Manifest, seal

FILES = {"model.safetensors": b"\x01" * 1000, "state.json": b'{"step": 1}', "empty.bin": b""}


def manifest_for(generation: int):
    def make(artifacts: list[Artifact]) -> Manifest:
        return Manifest(generation=generation, step=generation * 10, run_id="run-1",
                        incarnation=0, artifacts=artifacts, parts=["model"], created="now")
    return make


def commit(store: GenerationStore, generation: int, files=None):
    files = FILES if files is None else files
    return store.commit(generation, {k: [v] for k, v in files.items()}, manifest_for(generation))


def gen_dir(root: Path, generation: int) -> Path:
    return root / generation_name(generation)


def debris(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith((".staging-", ".trash-")))


@pytest.fixture
def stores():
    """Make stores; every one is unlocked at teardown (the lock registry is process-wide)."""
    made: list[GenerationStore] = []

    def make(root, fs=None, lock=True) -> GenerationStore:
        s = GenerationStore(root, fs)
        made.append(s)
        if lock:
            s.lock()
        return s

    yield make
    for s in made:
        s.unlock()


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "run"


def run_with_timeout(fn, timeout=5.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not finish."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} hung for {timeout}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---------------------------------------------------------------------------------------------
# commit, scan, read


def test_commit_scan_read_round_trip(root, stores):
    store = stores(root)
    info = commit(store, 5)
    assert info.ok and info.generation == 5 and info.path == str(gen_dir(root, 5))
    assert sorted(os.listdir(info.path)) == sorted([*FILES, MANIFEST])
    assert debris(root) == []

    [found] = GenerationStore(root).scan()  # reading needs no lock
    assert found.status == "complete" and found.ok and found.reason == ""
    assert found.manifest == info.manifest
    for name, data in FILES.items():
        a = found.manifest.artifact(name)
        assert a.size == len(data) and a.xxh3_128 == xxhash.xxh3_128(data).hexdigest()
    assert found.manifest.generation == 5 and found.manifest.step == 50

    assert store.read_verified(found) == FILES
    assert store.read_verified(found, ["state.json"]) == {"state.json": FILES["state.json"]}
    store.verify(found)
    assert store.scan_one(5).manifest == info.manifest


def test_commit_writes_chunked_memoryviews(root, stores):
    store = stores(root)
    chunks = [memoryview(b"abc"), b"", memoryview(bytearray(b"def")), memoryview(b"\x00" * 5000)]
    info = store.commit(1, {"x.bin": chunks}, manifest_for(1))
    assert store.read_verified(info) == {"x.bin": b"abcdef" + b"\x00" * 5000}


def test_scan_orders_generations_and_ignores_other_entries(root, stores):
    store = stores(root)
    for g in (30, 4, 1000000000, 12):
        commit(store, g)
    (root / "aside").mkdir(exist_ok=True)
    (root / "notes.txt").write_text("hi")
    (root / "gen-12").mkdir()  # too few digits: not a generation folder
    assert [i.generation for i in store.scan()] == [4, 12, 30, 1000000000]
    assert all(i.ok for i in store.scan())


def test_a_generation_under_a_name_with_more_zeros_is_not_a_second_one(root, stores):
    """gen-0000000003 beside gen-000000003 (a copy, a hand-made name) would be a second
    generation 3, and which one a restore continued from would depend on the listing's order;
    alone, a padded name is no generation either. Neither is listed, moved or removed, as the
    object store ignores such prefixes."""
    import shutil

    store = stores(root)
    commit(store, 3)
    shutil.copytree(gen_dir(root, 3), root / "gen-0000000003")
    shutil.copytree(gen_dir(root, 3), root / "gen-00000000004")
    (root / "gen-00000000004" / MANIFEST).write_bytes(
        seal(json.loads((gen_dir(root, 3) / MANIFEST).read_bytes()) | {"generation": 4}))
    assert [(i.generation, i.path) for i in store.scan()] == [(3, str(gen_dir(root, 3)))]
    assert store.scan()[0].ok
    store.unlock()
    store.lock()  # (the debris sweep leaves them alone)
    assert (root / "gen-0000000003").is_dir() and (root / "gen-00000000004").is_dir()


def test_scan_of_a_missing_root(tmp_path):
    assert GenerationStore(tmp_path / "nope").scan() == []


def test_torn_generation_without_manifest(root, stores):
    store = stores(root)
    commit(store, 1)
    torn = gen_dir(root, 2)
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half")
    infos = store.scan()
    assert [(i.generation, i.status) for i in infos] == [(1, "complete"), (2, "torn")]
    assert MANIFEST in infos[1].reason and not infos[1].ok and infos[1].manifest is None
    with pytest.raises(CorruptCheckpoint, match="MANIFEST.json"):
        store.read_verified(infos[1])


def _corrupt(root, store, mutate):
    info = commit(store, 3)
    mutate(Path(info.path))
    found = store.scan_one(3)
    assert found.status == "corrupt" and not found.ok and found.manifest is None
    assert [i.status for i in store.scan()] == ["corrupt"]
    with pytest.raises(CorruptCheckpoint):
        store.read_verified(found)
    return found.reason


def test_corrupt_size_mismatch(root, stores):
    def grow(p):
        with open(p / "model.safetensors", "ab") as f:
            f.write(b"x")
    reason = _corrupt(root, stores(root), grow)
    assert "model.safetensors" in reason and "1001" in reason and "1000" in reason


def test_corrupt_truncated_artifact(root, stores):
    reason = _corrupt(root, stores(root),
                      lambda p: os.truncate(p / "model.safetensors", 10))
    assert "model.safetensors" in reason


def test_corrupt_extra_unlisted_file(root, stores):
    reason = _corrupt(root, stores(root), lambda p: (p / "sneaky.bin").write_bytes(b""))
    assert "sneaky.bin" in reason and "not listed" in reason


def test_corrupt_extra_unlisted_folder(root, stores):
    reason = _corrupt(root, stores(root), lambda p: (p / "sub").mkdir())
    assert "sub" in reason


def test_corrupt_missing_artifact(root, stores):
    reason = _corrupt(root, stores(root), lambda p: (p / "state.json").unlink())
    assert "state.json" in reason and "missing" in reason


def test_corrupt_unparseable_manifest(root, stores):
    reason = _corrupt(root, stores(root), lambda p: (p / MANIFEST).write_bytes(b"{garbage"))
    assert MANIFEST in reason


def _edit_manifest(p: Path, change, sealed: bool = False) -> None:
    doc = json.loads((p / MANIFEST).read_bytes())
    change(doc)
    (p / MANIFEST).write_bytes(seal(doc) if sealed else json.dumps(doc).encode())


@pytest.mark.parametrize("change", [
    lambda d: d.update(step=d["step"] + 1),
    lambda d: d.update(parent={"run_id": "run-1", "generation": 2, "incarnation": 0}),
    lambda d: d["artifacts"][0].update(xxh3_128="f" + d["artifacts"][0]["xxh3_128"][1:]),
    lambda d: d.update(identity={"config": {"hash": "0" * 32}}),
    lambda d: d.pop("checksum"),
], ids=["step", "parent", "hash-digit", "identity", "no-checksum"])
def test_corrupt_manifest_edited_after_commit(root, stores, change):
    """A manifest field edited in place still parses; its checksum makes it corruption."""
    reason = _corrupt(root, stores(root), lambda p: _edit_manifest(p, change))
    assert MANIFEST in reason and "manifest checksum" in reason


def test_a_resealed_manifest_edit_reaches_the_deeper_checks(root, stores):
    def grow(doc):
        doc["artifacts"][0]["size"] += 1
    reason = _corrupt(root, stores(root), lambda p: _edit_manifest(p, grow, sealed=True))
    assert "checksum" not in reason and "bytes, the manifest lists" in reason


def test_corrupt_manifest_names_another_generation(root, stores):
    store = stores(root)
    commit(store, 3)
    os.rename(gen_dir(root, 3), gen_dir(root, 4))  # e.g. copied into the wrong folder
    [found] = store.scan()
    assert (found.generation, found.status) == (4, "corrupt")
    assert "generation 3" in found.reason and "generation 4" in found.reason


def test_flipped_byte_is_caught_by_the_hash_and_names_the_file(root, stores):
    store = stores(root)
    commit(store, 7)
    path = gen_dir(root, 7) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[500] ^= 0x01
    path.write_bytes(bytes(data))
    [found] = store.scan()
    assert found.ok  # same size: the cheap check cannot see it
    with pytest.raises(CorruptCheckpoint) as e:
        store.read_verified(found)
    assert str(path) in str(e.value) and "hash" in str(e.value)
    with pytest.raises(CorruptCheckpoint, match="model.safetensors"):
        store.verify(found)
    # the other files still read fine on their own
    assert store.read_verified(found, ["state.json"]) == {"state.json": FILES["state.json"]}


def test_artifact_grown_after_scan_is_refused(root, stores):
    store = stores(root)
    info = commit(store, 1)
    with open(Path(info.path) / "state.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(CorruptCheckpoint, match="state.json"):
        store.read_verified(info)


def test_symlinked_artifact_is_refused(root, stores, tmp_path):
    store = stores(root)
    info = commit(store, 1)
    target = tmp_path / "elsewhere.json"
    target.write_bytes(FILES["state.json"])  # same bytes: only the link itself is wrong
    link = Path(info.path) / "state.json"
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        run_with_timeout(lambda: store.read_verified(info))


def test_symlinked_manifest_is_refused(root, stores, tmp_path):
    store = stores(root)
    info = commit(store, 1)
    manifest = Path(info.path) / MANIFEST
    copy = tmp_path / "m.json"
    copy.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(copy)
    found = store.scan_one(1)
    assert found.status == "corrupt" and "symbolic link" in found.reason


def test_fifo_in_place_of_an_artifact_is_refused_without_hanging(root, stores):
    store = stores(root)
    info = commit(store, 1)
    fifo = Path(info.path) / "empty.bin"  # a 0-byte artifact: the FIFO even has the right size
    fifo.unlink()
    os.mkfifo(fifo)
    found = run_with_timeout(lambda: store.scan_one(1))
    assert found.status in ("complete", "corrupt")
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        run_with_timeout(lambda: store.read_verified(info))
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        run_with_timeout(lambda: store.read_verified(info, ["empty.bin"]))


def test_fifo_in_place_of_the_manifest_does_not_hang_scan(root, stores):
    store = stores(root)
    info = commit(store, 1)
    manifest = Path(info.path) / MANIFEST
    manifest.unlink()
    os.mkfifo(manifest)
    [found] = run_with_timeout(store.scan)
    assert found.status == "corrupt" and "not a regular file" in found.reason


# ---------------------------------------------------------------------------------------------
# staging debris and the lock


def test_staging_debris_is_ignored_by_scan_and_removed_by_lock(root, stores):
    store = stores(root)
    commit(store, 1)
    store.unlock()
    staging = root / ".staging-000000002-abcdef012345"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"partial")
    (staging / MANIFEST).write_bytes(gen_dir(root, 1).joinpath(MANIFEST).read_bytes())
    trash = root / ".trash-0123456789ab"
    trash.mkdir()
    (trash / "state.json").write_bytes(b"{}")
    assert [i.generation for i in GenerationStore(root).scan()] == [1]
    assert debris(root) == [".staging-000000002-abcdef012345", ".trash-0123456789ab"]
    stores(root)  # the next writer cleans up
    assert debris(root) == []
    assert [(i.generation, i.ok) for i in GenerationStore(root).scan()] == [(1, True)]


def test_second_lock_in_the_same_process(root, stores):
    first = stores(root)
    with pytest.raises(StoreLocked, match=LOCK):
        stores(root)
    with pytest.raises(StoreLocked):
        stores(str(root) + "/")  # the same folder spelled differently
    with pytest.raises(StoreLocked):
        first.lock()
    first.unlock()
    again = stores(root)  # released: a new writer may take it
    commit(again, 1)


def test_lock_writes_the_holder(root, stores):
    stores(root)
    text = (root / LOCK).read_text()
    assert f"pid {os.getpid()}" in text


# The child imports only unbroken.store.generations, without the package __init__ (which
# imports torch, seconds on a small machine): everything the lock does is the real code.
_CHILD = r"""
import sys, time, types
sys.path.insert(0, {src!r})
pkg = types.ModuleType("unbroken"); pkg.__path__ = [{pkgdir!r}]
sys.modules["unbroken"] = pkg
from unbroken.store.generations import GenerationStore
GenerationStore(sys.argv[1]).lock()
print("locked", flush=True)
time.sleep(60)
"""


def _start_holder(root: Path) -> subprocess.Popen:
    pkgdir = os.path.dirname(unbroken.__file__)
    code = _CHILD.format(src=os.path.dirname(pkgdir), pkgdir=pkgdir)
    child = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    ready, _, _ = select.select([child.stdout], [], [], 30)
    line = child.stdout.readline() if ready else b""
    if line.strip() != b"locked":
        child.kill()
        _, err = child.communicate()
        pytest.fail(f"lock holder did not start: {line!r} {err.decode()[-2000:]}")
    return child


def test_lock_held_by_another_live_process(root, stores):
    child = _start_holder(root)
    try:
        with pytest.raises(StoreLocked) as e:
            stores(root)
        assert f"pid {child.pid}" in str(e.value)  # names the holder
        assert child.poll() is None
        assert (root / LOCK).read_text().startswith(f"pid {child.pid} ")  # not overwritten
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    start = time.monotonic()
    store = stores(root)  # the kernel dropped the dead holder's lock
    assert time.monotonic() - start < 1.0
    assert f"pid {os.getpid()}" in (root / LOCK).read_text()
    commit(store, 1)


# ---------------------------------------------------------------------------------------------
# changing the folder


class RecordingFS(LocalFS):
    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.ops: list[tuple[str, ...]] = []

    def _rel(self, p: str) -> str:
        return os.path.relpath(p, self.root)

    def write_file(self, path, chunks):
        self.ops.append(("write_file", self._rel(path)))
        return super().write_file(path, chunks)

    def fsync_dir(self, path):
        self.ops.append(("fsync_dir", self._rel(path)))
        super().fsync_dir(path)

    def mkdir(self, path):
        self.ops.append(("mkdir", self._rel(path)))
        super().mkdir(path)

    def rename(self, src, dst):
        self.ops.append(("rename", self._rel(src), self._rel(dst)))
        super().rename(src, dst)

    def unlink(self, path):
        self.ops.append(("unlink", self._rel(path)))
        super().unlink(path)

    def rmtree(self, path):
        self.ops.append(("rmtree", self._rel(path)))
        super().rmtree(path)


def test_commit_order_manifest_last_then_rename(root, stores):
    fs = RecordingFS(root)
    store = stores(root, fs)
    commit(store, 9)
    kinds = [op[0] for op in fs.ops]
    assert kinds == ["mkdir", "write_file", "write_file", "write_file", "write_file",
                     "fsync_dir", "rename", "fsync_dir"]
    staging = fs.ops[0][1]
    assert staging.startswith(".staging-000000009-")
    assert fs.ops[4] == ("write_file", f"{staging}/{MANIFEST}")
    assert fs.ops[5] == ("fsync_dir", staging)
    assert fs.ops[6] == ("rename", staging, "gen-000000009")
    assert fs.ops[7] == ("fsync_dir", ".")


def test_delete_removes_the_manifest_first_and_leaves_nothing(root, stores):
    fs = RecordingFS(root)
    store = stores(root, fs)
    old, new = commit(store, 1), commit(store, 2)
    fs.ops.clear()
    store.delete(old)
    assert fs.ops[0] == ("unlink", f"gen-000000001/{MANIFEST}")
    kinds = [op[0] for op in fs.ops]
    assert kinds.index("unlink") < kinds.index("rename") < kinds.index("rmtree")
    rename = fs.ops[kinds.index("rename")]
    assert rename[1] == "gen-000000001" and rename[2].startswith(".trash-")
    assert fs.ops[kinds.index("rmtree")][1] == rename[2]
    assert not gen_dir(root, 1).exists()
    assert debris(root) == []
    assert [(i.generation, i.ok) for i in store.scan()] == [(2, True)]
    store.verify(store.scan_one(2))
    assert new.ok


def test_delete_of_a_torn_generation(root, stores):
    store = stores(root)
    torn = gen_dir(root, 4)
    torn.mkdir(parents=True)
    (torn / "x").write_bytes(b"1")
    [info] = store.scan()
    assert info.status == "torn"
    store.delete(info)
    assert not torn.exists() and store.scan() == [] and debris(root) == []


def test_move_aside_keeps_the_folder_under_a_unique_name(root, stores):
    store = stores(root)
    info = commit(store, 1)
    dest1 = store.move_aside(info, "corrupt")
    assert os.path.dirname(dest1) == str(root / ASIDE)
    assert os.path.basename(dest1).startswith("gen-000000001-corrupt-")
    assert not gen_dir(root, 1).exists()
    assert sorted(os.listdir(dest1)) == sorted([*FILES, MANIFEST])
    assert store.scan() == []  # aside/ is not listed
    info2 = commit(store, 1, {"other.bin": b"second"})  # the number can be reused
    dest2 = store.move_aside(info2, "corrupt")
    assert dest2 != dest1
    assert os.listdir(dest1) != os.listdir(dest2)
    assert sorted(os.listdir(root / ASIDE)) == sorted([os.path.basename(dest1),
                                                      os.path.basename(dest2)])


def test_commit_refuses_to_overwrite_an_existing_generation(root, stores):
    store = stores(root)
    commit(store, 3)
    before = {n: (gen_dir(root, 3) / n).read_bytes() for n in os.listdir(gen_dir(root, 3))}
    with pytest.raises(FileExistsError):
        commit(store, 3, {"model.safetensors": b"new"})
    after = {n: (gen_dir(root, 3) / n).read_bytes() for n in os.listdir(gen_dir(root, 3))}
    assert before == after and debris(root) == []
    # even a torn folder of that number is not replaced
    gen_dir(root, 4).mkdir()
    with pytest.raises(FileExistsError):
        commit(store, 4)
    assert os.listdir(gen_dir(root, 4)) == [] and debris(root) == []


class FailingFS(LocalFS):
    """write_file raises ENOSPC on its ``fail_at``-th call (1-based)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0

    def write_file(self, path, chunks):
        self.calls += 1
        if self.calls == self.fail_at:
            # leave a partial file behind, as a full disk would
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().write_file(path, chunks)


def test_failure_mid_commit_leaves_no_trace(root, stores):
    store = stores(root)
    old = commit(store, 1)
    old_bytes = store.read_verified(old)
    store.fs = fs = FailingFS(fail_at=2)
    with pytest.raises(OSError) as e:
        commit(store, 2)
    assert e.value.errno == errno.ENOSPC
    assert fs.calls == 2
    assert debris(root) == []
    assert not gen_dir(root, 2).exists()
    [info] = store.scan()
    assert info.generation == 1 and info.ok
    assert store.read_verified(info) == old_bytes
    # the writer can go on once the disk has room again
    fs.fail_at = -1
    assert commit(store, 2).ok
    assert [i.generation for i in store.scan() if i.ok] == [1, 2]


@pytest.mark.parametrize("exc", [ValueError("bad manifest"), KeyboardInterrupt()])
def test_failure_building_the_manifest_leaves_no_trace(root, stores, exc):
    store = stores(root)
    commit(store, 1)

    def make(artifacts):
        raise exc

    with pytest.raises(type(exc)):
        store.commit(2, {"a.bin": [b"x"]}, make)
    assert debris(root) == [] and not gen_dir(root, 2).exists()
    assert [i.generation for i in store.scan()] == [1]


def test_changing_the_folder_needs_the_lock(root, stores):
    writer = stores(root)
    info = commit(writer, 1)
    reader = stores(root, lock=False)
    with pytest.raises(RuntimeError, match="lock"):
        commit(reader, 2)
    with pytest.raises(RuntimeError, match="lock"):
        reader.delete(info)
    with pytest.raises(RuntimeError, match="lock"):
        reader.move_aside(info, "x")
    assert debris(root) == [] and not gen_dir(root, 2).exists()
    writer.unlock()
    with pytest.raises(RuntimeError, match="lock"):
        commit(writer, 2)
    with pytest.raises(RuntimeError, match="lock"):
        writer.delete(info)
    assert store_ok(root) == [1]


def store_ok(root: Path) -> list[int]:
    return [i.generation for i in GenerationStore(root).scan() if i.ok]


@pytest.mark.parametrize("name", ["gen-000000001\n", "gen-\u0660\u0660\u0660\u0660\u0660\u0660"
                                  "\u0660\u0660\u0661", "gen-00000000\uff11", " gen-000000001",
                                  "gen-000000001 ", "gen-00000001"], ids=repr)
def test_only_ascii_generation_names_are_generations(root, stores, name):
    store = stores(root)
    commit(store, 2)
    os.rename(gen_dir(root, 2), root / name)
    assert store.scan() == []


def test_aside_is_bounded_oldest_first(root, stores):
    store = stores(root)
    for g in range(1, 6):
        commit(store, g)
    for g, why in zip(range(1, 6), ("corrupt", "abandoned", "foreign", "corrupt", "abandoned")):
        store.move_aside(store.scan_one(g), why)
    assert len(store.aside()) == 5  # moving never deletes
    store.prune_aside(2)
    entries = store.aside()
    assert [(e.name[:13], e.reason) for e in entries] == [("gen-000000003", "foreign"),
                                                          ("gen-000000004", "corrupt"),
                                                          ("gen-000000005", "abandoned")]
    assert all(e.moved for e in entries) and not debris(root)
    with pytest.raises(ValueError, match="why="):
        store.move_aside(store.scan_one(5), "because")


def test_verified_is_cached_by_file_identity(root, stores):
    store = stores(root)
    info = commit(store, 1)
    assert store.verified(store.scan_one(1)) is None  # hashed once
    hashed = []
    real = store.fs.hash_file
    store.fs.hash_file = lambda *a, **k: (hashed.append(a[0]), real(*a, **k))[1]
    assert store.verified(store.scan_one(1)) is None and hashed == []  # cached
    path = Path(info.path) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))  # same size, new content: the identity changed
    why = store.verified(store.scan_one(1))
    assert why is not None and "content hash" in why and hashed
