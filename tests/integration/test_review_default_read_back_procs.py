"""Review of the default background read-back (``read_back="background"``) with real
processes: DataLoader workers forked while a generation is read back in the background."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import unbroken
import unbroken.persisting


class _CollectorState(torch.utils.data.Dataset):
    """Each sample: whether the cyclic garbage collector is on in the worker that made it."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return int(gc.isenabled())


@pytest.mark.parametrize("options", [{}, {"async_save": True}], ids=["default", "async"])
def test_workers_forked_during_a_background_read_back_collect_garbage(tmp_path, monkeypatch,
                                                                       options):
    # An epoch that starts right after a save forks its DataLoader workers while the save is
    # read back beside the loop (or, async, persists in a thread that pauses the collector);
    # the pause of the collector must not be inherited for good.
    assert gc.isenabled()
    gate = threading.Event()
    real = unbroken.persisting.read_back

    def held(*args, **kwargs):
        assert gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(unbroken.persisting, "read_back", held)
    model = torch.nn.Linear(2, 2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model,
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 **options)
    try:
        ckpt.save(0)  # returns committed; the read-back waits for the gate
        loader = torch.utils.data.DataLoader(_CollectorState(), num_workers=1,
                                             multiprocessing_context="fork", timeout=10)
        in_workers = [int(x) for x in loader]
    finally:
        gate.set()
        ckpt.close()
    assert gc.isenabled()
    assert in_workers == [1, 1]
