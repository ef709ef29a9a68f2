"""`SnapshotBuffers.take` on its fast path (a later snapshot of the same tree: every CPU
tensor's buffer already there) keeps what the first one promises: a copy at the call that no
later change reaches, one buffer per view (tied weights), a buffer reused while its tensor
keeps shape, dtype and kind, and none kept for a path no longer in the tree."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from unbroken.errors import UnsupportedValue
from unbroken.persist.snapshot import SnapshotBuffers


def model_tree(model: torch.nn.Module) -> dict:
    return {"model": model.state_dict(), "extra": {"steps": [torch.tensor(3.0)], "n": 1}}


def test_later_snapshots_reuse_the_buffers_and_copy_the_values_at_the_call():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    buffers = SnapshotBuffers()
    first = buffers.take(model_tree(model))
    ptrs = {k: v.data_ptr() for k, v in first["model"].items()}
    for _ in range(2):  # the state_dict is taken anew: new tensor objects, the same paths
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        snap = buffers.take(model_tree(model))
        assert {k: v.data_ptr() for k, v in snap["model"].items()} == ptrs
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3)  # the loop goes on after take() returned
        assert all(torch.equal(snap["model"][k], want[k]) for k in want)
        assert snap["model"]._metadata == model.state_dict()._metadata
        assert torch.equal(snap["extra"]["steps"][0], torch.tensor(3.0))
    assert buffers.nbytes == sum(v.nbytes for v in want.values()) + 4


def test_tied_views_stay_one_buffer_and_other_views_of_the_address_do_not():
    w = torch.randn(4, 3)
    buffers = SnapshotBuffers()
    for _ in range(3):  # the first snapshot makes the buffers, the later ones reuse them
        tree = {"a": {"w": w, "tied": w.detach()}, "l": [w.view(4, 3), w[0], w.t()],
                "t": (w.detach(),)}
        snap = buffers.take(tree)
        one = snap["a"]["w"]
        assert snap["a"]["tied"] is one and snap["l"][0] is one and snap["t"][0] is one
        assert snap["l"][1] is not one and snap["l"][2] is not one
        assert torch.equal(snap["l"][1], w[0]) and torch.equal(snap["l"][2], w.t())
        assert buffers.nbytes == w.nbytes + w[0].nbytes + w.nbytes
        w.add_(1)
        assert not torch.equal(one, w)


def test_a_new_shape_or_dtype_gets_a_new_buffer_and_a_dropped_path_none():
    buffers = SnapshotBuffers()
    first = buffers.take({"x": torch.zeros(3), "y": torch.zeros(2), "gone": torch.ones(5)})
    x_ptr, y_ptr, gone = first["x"].data_ptr(), first["y"].data_ptr(), weakref.ref(first["gone"])
    del first
    snap = buffers.take({"x": torch.arange(4.0), "y": torch.ones(2, dtype=torch.float64)})
    assert snap["x"].data_ptr() != x_ptr and torch.equal(snap["x"], torch.arange(4.0))
    assert snap["y"].dtype == torch.float64 and snap["y"].data_ptr() != y_ptr
    assert torch.equal(snap["y"], torch.ones(2, dtype=torch.float64))
    gc.collect()
    assert gone() is None  # not kept for a path the last snapshot did not use
    assert buffers.nbytes == 4 * 4 + 2 * 8


def test_parameters_and_deep_copied_leaves_take_the_reused_buffers():
    class Holder:  # not a container the snapshot rebuilds: deep-copied with the memo
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    model = torch.nn.Linear(2, 2)
    buffers = SnapshotBuffers()
    ptrs = None
    for _ in range(2):
        sd = model.state_dict(keep_vars=True)  # the parameters themselves
        snap = buffers.take({"model": sd, "holder": Holder(sd["weight"])})
        assert not snap["model"]["weight"].requires_grad
        assert torch.equal(snap["model"]["weight"], model.weight.detach())
        assert snap["holder"].t is snap["model"]["weight"]
        now = [v.data_ptr() for v in snap["model"].values()]
        assert ptrs is None or now == ptrs
        ptrs = now


def test_a_snapshot_after_a_failed_one_is_whole():
    class Uncopyable:
        def __deepcopy__(self, memo):
            raise TypeError("no copy")

    buffers = SnapshotBuffers()
    buffers.take({"a": torch.zeros(2), "c": torch.zeros(1)})
    with pytest.raises(UnsupportedValue, match="no copy"):
        buffers.take({"a": torch.zeros(2), "b": torch.ones(7), "bad": Uncopyable()})
    snap = buffers.take({"a": torch.full((2,), 2.0), "b": torch.ones(7)})
    assert torch.equal(snap["a"], torch.full((2,), 2.0)) and torch.equal(snap["b"], torch.ones(7))
    assert buffers.nbytes == 2 * 4 + 7 * 4  # this snapshot's, whatever the failed one left


def test_numpy_arrays_are_copied_at_the_call_and_an_object_array_deeply():
    """A NumPy array (the RNG part's state at every save) is copied without the deepcopy
    memo: a copy of its values at the call, in its own memory, writable, of its dtype and
    strides' order; an object array (which may hold anything) still goes through deepcopy."""
    import numpy as np

    frozen = np.arange(6, dtype=np.uint32)
    frozen.flags.writeable = False
    inner = [torch.ones(2)]
    tree = {"rng": {"state": np.arange(624, dtype=np.uint32), "frozen": frozen,
                    "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
                    "objects": np.array([inner, 3], dtype=object)}}
    buffers = SnapshotBuffers()
    for _ in range(2):
        snap = buffers.take(tree)["rng"]
        want = {k: v.copy() for k, v in tree["rng"].items() if k != "objects"}
        tree["rng"]["state"] += 1  # the loop goes on after take() returned
        tree["rng"]["fortran"] *= 2
        for k, v in want.items():
            assert type(snap[k]) is np.ndarray and snap[k].dtype == v.dtype
            assert np.array_equal(snap[k], v) and not np.shares_memory(snap[k], tree["rng"][k])
            assert snap[k].flags.writeable
        assert snap["fortran"].flags.f_contiguous
        objects = snap["objects"]
        assert objects[0] is not inner and torch.equal(objects[0][0], torch.ones(2))
        inner[0].add_(1)
        assert torch.equal(objects[0][0], torch.ones(2))
        inner[0].sub_(1)
