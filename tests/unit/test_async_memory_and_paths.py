"""An outside attack on async saves (2026-12-05): a thread-mode snapshot that found no memory
for its buffers raised torch's own RuntimeError (process mode already said `SaveFailed`, but
blamed its persisting process); a run path that is a regular file was "opened read-only"
with a message about its LOCK file."""

from __future__ import annotations

import pytest
import torch

import unbroken
from unbroken.errors import SaveFailed, UnbrokenError
from unbroken.persist import snapshot


def test_no_memory_for_a_thread_snapshot_is_a_save_failed_and_the_next_save_works(
        tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 4)
    ck = unbroken.Checkpointer(str(tmp_path / "run"), model=model, async_save=True)
    ck.save(1)
    ck.wait()

    def no_memory(self, tree):  # noqa: ANN001 -- as torch's CPU allocator fails
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 200000000 bytes")

    monkeypatch.setattr(snapshot._Taking, "tree", no_memory)
    with pytest.raises(SaveFailed, match="no memory for the snapshot of an async save"):
        ck.save(2)
    monkeypatch.undo()
    with torch.no_grad():
        model.weight.add_(1)
    ck.save(3)
    assert ck.wait().generation == 3
    ck.close()
    again = torch.nn.Linear(4, 4)
    restored = unbroken.Checkpointer(str(tmp_path / "run"), model=again)
    assert restored.restore() == 3
    assert torch.equal(again.weight, model.weight)
    restored.close()


def test_other_errors_of_a_snapshot_are_not_taken_for_memory(tmp_path, monkeypatch):
    ck = unbroken.Checkpointer(str(tmp_path / "run"), model=torch.nn.Linear(2, 2),
                               async_save=True)

    def broken(self, tree):  # noqa: ANN001
        raise RuntimeError("something else")

    monkeypatch.setattr(snapshot._Taking, "tree", broken)
    with pytest.raises(RuntimeError, match="something else"):
        ck.save(1)
    monkeypatch.undo()
    ck.close()


def test_a_run_path_that_is_a_file_is_refused_as_such(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a folder")
    with pytest.raises(UnbrokenError, match="is a file, not a run folder"):
        unbroken.Checkpointer(str(path), model=torch.nn.Linear(2, 2))
    assert path.read_text() == "not a folder"


def test_a_live_loader_not_given_as_data_is_said_at_restore(tmp_path):
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = unbroken.ResumableLoader(ds, unbroken.ResumableSampler(8, batch_size=2, seed=0))
    ck = unbroken.Checkpointer(str(tmp_path / "a"), model=torch.nn.Linear(2, 2))
    with pytest.warns(unbroken.UnbrokenWarning, match="given to no Checkpointer") as said:
        ck.restore()
    assert said[0].filename == __file__
    ck.close()
    given = unbroken.Checkpointer(str(tmp_path / "b"), model=torch.nn.Linear(2, 2),
                                  data=loader)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given.restore()
    given.close()


def test_a_second_checkpointer_without_data_does_not_warn_of_the_first_one_s_loader(tmp_path):
    import gc
    gc.collect()  # (loaders of earlier tests, given to none)
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = unbroken.ResumableLoader(ds, unbroken.ResumableSampler(8, batch_size=2, seed=0))
    main = unbroken.Checkpointer(str(tmp_path / "main"), model=torch.nn.Linear(2, 2),
                                 data=loader)
    ema = unbroken.Checkpointer(str(tmp_path / "ema"), model=torch.nn.Linear(2, 2))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        main.restore()
        ema.restore()
    main.close()
    ema.close()
