"""Review of job saves: the file collectives of a job's persisting processes
(`dist.filegroup`) and the background part of a save (`persist.background`)."""

from __future__ import annotations

import os
import time

import pytest

from unbroken.dist.commit import commit_staged
from unbroken.dist.filegroup import FileGroup, stage
from unbroken.errors import SaveFailed
from unbroken.store.generations import GenerationStore


@pytest.mark.parametrize("post", ["{not json", "[1, 2]", '{"other": 1}', "symlink", "fifo"])
def test_an_unreadable_post_fails_the_commit_at_once_naming_the_file_and_rank(tmp_path, post):
    store = GenerationStore(tmp_path / "run")
    store.lock()
    staging = stage(store, 7, False)
    path = os.path.join(staging + ".job", "0001.rank00001.json")
    if post == "symlink":
        (tmp_path / "elsewhere.json").write_text('{"value": {"artifacts": [], "error": null}}')
        os.symlink(tmp_path / "elsewhere.json", path)
    elif post == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "w") as f:
            f.write(post)
    group = FileGroup(store.fs, staging, 7, 0, 2, timeout=5)
    started = time.monotonic()
    with pytest.raises(SaveFailed) as e:
        commit_staged(group, store, 7, staging, {"a": [b"x"]}, None, False)  # type: ignore
    group.close(e.value)  # (rank 1 is not waited for again)
    assert time.monotonic() - started < 2  # at once, not at the timeout
    message = str(e.value)
    assert f"{path}: rank 1's post cannot be read" in message, message
    assert "expected a JSON object with 'value'" in message, message
    assert "generation 7 was not committed" in message, message
    assert sorted(os.listdir(store.root)) == ["LOCK"]  # staging and job folder gone
    store.unlock()


def test_a_misshapen_done_fails_the_wait_naming_the_file(tmp_path):
    store = GenerationStore(tmp_path / "run")
    store.lock()
    staging = stage(store, 7, False)
    path = os.path.join(staging + ".job", "done.rank00001.json")
    with open(path, "w") as f:
        f.write('{"error": 5}')
    group = FileGroup(store.fs, staging, 7, 0, 2, timeout=5)
    with pytest.raises(SaveFailed) as e:
        commit_staged(group, store, 7, staging, {"a": [b"x"]}, None, False)  # type: ignore
    group.close(e.value)
    assert f"{path}: rank 1's post cannot be read: expected a JSON object with 'error'" in str(
        e.value) and "found the error '5'" in str(e.value)
    assert sorted(os.listdir(store.root)) == ["LOCK"]
    store.unlock()


def test_a_ctrl_c_as_the_background_part_ends_keeps_its_error_for_the_next_wait(
        tmp_path, monkeypatch):
    import torch

    import unbroken
    import unbroken.persisting

    def failing(*args, **kwargs):
        raise SaveFailed("the read-back failed")

    monkeypatch.setattr(unbroken.persisting, "read_back", failing)
    model = torch.nn.Linear(2, 1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model,
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt.restore()
    ckpt.save(1)
    in_flight = ckpt._in_flight
    assert in_flight is not None and in_flight._ended.wait(10)
    wait = in_flight._ended.wait

    def interrupted(*args):  # Ctrl-C lands after the background part ended
        monkeypatch.setattr(in_flight._ended, "wait", wait)
        raise KeyboardInterrupt

    monkeypatch.setattr(in_flight._ended, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.wait()
    with pytest.raises(SaveFailed, match="the read-back failed"):  # not lost
        ckpt.wait()
    ckpt.close()


def test_a_rank_interrupted_while_handing_its_save_over_is_named_with_its_interrupt(tmp_path):
    store = GenerationStore(tmp_path / "run")
    store.lock()
    staging = stage(store, 7, False)
    FileGroup(store.fs, staging, 7, 1, 2, timeout=5).close(KeyboardInterrupt())  # Ctrl-C
    group = FileGroup(store.fs, staging, 7, 0, 2, timeout=5)
    with pytest.raises(SaveFailed) as e:
        commit_staged(group, store, 7, staging, {"a": [b"x"]}, None, False)  # type: ignore
    group.close(e.value)
    assert "rank 1 gave up: KeyboardInterrupt;" in str(e.value), str(e.value)
    store.unlock()


def test_a_ctrl_c_in_close_with_a_save_in_flight_keeps_the_lock_until_close_ends_it(
        tmp_path, monkeypatch):
    """An interrupted close() used to release the lock with the read-back still running: a
    second writer then took the run, and the first one's retention failed untyped."""
    import threading

    import torch

    import unbroken
    import unbroken.persisting

    release = threading.Event()
    real = unbroken.persisting.read_back

    def slow(*args, **kwargs):
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(unbroken.persisting, "read_back", slow)
    model = torch.nn.Linear(2, 1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, keep=unbroken.Keep(last=1))
    ckpt.restore()
    ckpt.save(1)
    in_flight = ckpt._in_flight
    assert in_flight is not None

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(in_flight._ended, "wait", interrupted)  # Ctrl-C in close()'s wait
    with pytest.raises(KeyboardInterrupt):
        ckpt.close()
    with pytest.raises(unbroken.StoreLocked):  # still held: the save in flight needs it
        unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 1))
    monkeypatch.undo()  # (the real wait and read-back again)
    release.set()
    ckpt.close()  # finishes the save, then releases
    again = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 1))
    assert again.restore() == 1
    again.close()


def test_ranks_that_disagree_on_the_saved_metrics_agree_before_encoding(tmp_path, monkeypatch):
    """Saving a step again compares it with the generation saved: a rank whose metrics
    differ (its own loss) used to skip the collective encoding the others entered."""
    import unbroken.saving as saving

    class OtherRankDiffers:
        active, rank, size, leader = True, 0, 2, True

        def all_gather(self, value, what):
            return [value, False]  # rank 1 finds its metrics changed

    def never(*args, **kwargs):
        raise AssertionError("encoded on one rank only: its collectives would hang")

    monkeypatch.setattr(saving, "encode_share", never)
    store = GenerationStore(tmp_path / "run")
    store.lock()
    store.commit(3, {"a": [b"x"]}, lambda written: _manifest(written, 3))
    info = store.scan_one(3)
    assert info.ok
    assert not saving.saved_unchanged(store, OtherRankDiffers(), 3, {}, {})  # type: ignore
    store.unlock()


def _manifest(written, step):
    from unbroken.store.manifest import Manifest

    return Manifest(artifacts=written, generation=step, step=step, run_id="r", incarnation=0,
                    parts=[], parent=None, origin=None, identity={}, environment={},
                    retention={}, metrics={}, created="", world_size=2)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0.0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(tmp_path, timeout):
    import torch

    import unbroken

    with pytest.raises(ValueError, match="a finite number of seconds > 0"):
        unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 1),
                              async_timeout=timeout)
