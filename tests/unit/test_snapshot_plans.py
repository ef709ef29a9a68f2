"""`SnapshotBuffers.take` by a container's plan (a later snapshot of a state_dict or of an
optimizer's per-parameter state, taken in whole-list operations) against the same snapshot
taken by fresh buffers (no plan): over generated sequences of trees whose containers change
between snapshots in every way a plan must notice (a shape, a dtype, a key, a tie, an empty or
sparse tensor, an int key that equals a bool, a tensor replaced by a dict), each snapshot is the
tree's values at the call, shares no memory with it, and keeps ties exactly."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.errors import UnsupportedValue
from unbroken.persist import plans, snapshot
from unbroken.persist.snapshot import SnapshotBuffers
from unbroken.state.views import view_ident

N = plans.PLANNED + 4  # tensors in a container: enough for a plan

CHANGES = st.sampled_from([
    "none", "values", "shape", "dtype", "rename", "tie_in", "tie_across", "empty", "sparse",
    "bool_key", "dict_for_tensor", "parameter", "drop", "add", "inner_rename", "inner_shape",
    "noncontiguous", "tensor_for_dict", "custom_key", "inner_custom_key", "meta",
    "negative_view", "path_clash", "odict_for_dict", "all_shapes", "all_values", "swap",
    "tie_before", "view_before", "tie_after", "reinterpret", "freed", "shrunk"])


class Name(str):
    """A key equal to a plain one that is not immutable by type: a snapshot copies it (a
    plan, comparing keys by ``==``, must not take it for the plain one and share it)."""


def _model(n: int) -> OrderedDict[str, Any]:
    sd: OrderedDict[str, Any] = OrderedDict(
        (f"layer{i}.weight", torch.randn(3, 2)) for i in range(n))
    sd._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return sd


def _state(n: int) -> dict[str, Any]:
    return {f"layer{i}.weight": {"step": torch.tensor(float(i)), "exp_avg": torch.randn(3, 2)}
            for i in range(n)}


def _change(tree: dict[str, Any], change: str, i: int, take: Callable[[Any], Any]) -> None:
    """Change ``tree`` in place; a change to a tensor that cannot be stored checks that
    ``take`` (a snapshot, an encoding) refuses it, then undoes it."""
    model, state = tree["model"], tree["optimizer"]["state"]
    key = f"layer{i % N}.weight"
    t, entry = model.get(key), state.get(key)
    if change in ("values", "shape", "dtype", "reinterpret", "rename", "tie_in", "empty",
                  "sparse", "meta", "negative_view", "swap", "tie_before", "view_before",
                  "tie_after", "dict_for_tensor", "parameter", "drop", "noncontiguous", "freed",
                  "shrunk") and not (
                      isinstance(t, torch.Tensor) and not t.is_sparse):
        return  # (an earlier change took this tensor away)
    if change in ("tie_across", "tensor_for_dict", "inner_rename", "inner_shape",
                  "inner_custom_key") and not (
            isinstance(entry, dict) and "exp_avg" in entry and isinstance(t, torch.Tensor)):
        return
    if change == "values":
        model[key] = model[key] + 1
    elif change == "shape":
        model[key] = torch.randn(2, 3)
    elif change == "dtype":
        model[key] = model[key].double()
    elif change == "reinterpret":  # its bytes as another dtype: the same address and shape
        if t.is_neg():
            return  # (torch views no lazily negated tensor as another dtype)
        model[key] = model[key].view(torch.int32 if t.dtype == torch.float32 else torch.float32)
    elif change == "rename":
        model[f"renamed{i}"] = model.pop(key)
    elif change == "tie_in":
        model[f"layer{(i + 1) % N}.weight"] = model[key]
    elif change == "tie_across":
        state[key]["exp_avg"] = model[key]
    elif change == "empty":
        model[key] = torch.empty(0, 2)
    elif change == "sparse":  # refused (the encoder could not store it), then made dense
        model[key] = torch.zeros(3, 2).to_sparse()
        with pytest.raises(UnsupportedValue, match="layout torch.sparse_coo"):
            take(tree)
        model[key] = torch.randn(3, 2)
    elif change in ("freed", "shrunk"):  # its storage resized under it: refused (a copy
        # would read past its end), then whole again (a tensor that is all of its storage)
        if not (t.is_contiguous() and t.storage_offset() == 0 and t.nbytes > 8
                and t.untyped_storage().nbytes() == t.nbytes):
            return
        kept = t.detach().clone()
        t.untyped_storage().resize_(0 if change == "freed" else 8)
        try:  # (named by the first key met that holds it: a tie's other one may come first)
            with pytest.raises(UnsupportedValue, match=": a tensor of shape .* (whose "
                               "storage holds no memory|reaches [0-9]+ bytes of its storage)"):
                take(tree)
        finally:  # (whole again even if that fails: a report's repr would read it)
            t.untyped_storage().resize_(kept.nbytes)
            with torch.no_grad():
                t.copy_(kept)
    elif change == "bool_key":  # True == 1: a plan comparing keys by == alone would match
        tree["optimizer"]["state"] = {(True if k == "layer1.weight" else k): v
                                      for k, v in state.items()}
    elif change == "dict_for_tensor":
        model[key] = {"nested": torch.ones(3, 2)}
    elif change == "tensor_for_dict":
        state[key] = torch.ones(3, 2)
    elif change == "parameter":
        model[key] = torch.nn.Parameter(model[key].clone(),
                                        requires_grad=t.is_floating_point())
    elif change == "drop":
        del model[key]
    elif change == "add":
        state[f"new{i}"] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3, 2)}
    elif change == "inner_rename":
        state[key]["exp_avg_sq"] = state[key].pop("exp_avg")
    elif change == "inner_shape":
        state[key]["exp_avg"] = torch.randn(5)
    elif change == "meta":  # refused typed (not torch's NotImplementedError), then real
        model[key] = torch.empty(3, 2, device="meta")
        with pytest.raises(UnsupportedValue, match="a meta tensor holds no data"):
            take(tree)
        model[key] = torch.randn(3, 2)
    elif change == "custom_key":
        tree["model"] = type(model)((Name(k) if k == key else k, v) for k, v in model.items())
        tree["model"]._metadata = model._metadata
    elif change == "inner_custom_key":
        state[key] = {Name(k) if k == "step" else k: v for k, v in entry.items()}
    elif change == "negative_view":  # a view with the lazy negative bit: its memory is not
        model[key] = torch._neg_view(torch.randn(3, 2))  # its value (contiguous, as a plan's)
    elif change == "odict_for_dict":  # the same keys in another mapping type
        tree["optimizer"]["state"] = OrderedDict(state)
    elif change == "path_clash":  # a key met before the state_dict, equal to one of its paths
        tree.clear()
        tree.update({f"model.{key}": torch.ones(1), "model": model,
                     "optimizer": {"state": state, "lr": 0.1}})
    elif change == "noncontiguous":
        model[key] = torch.randn(2, 3).t()
    elif change == "all_shapes":  # every tensor of a block at once: its shape is another
        for k, v in model.items():
            if isinstance(v, torch.Tensor) and not v.is_sparse and v.numel():
                model[k] = torch.randn(v.numel() // 2 + 1, 2)
    elif change == "swap":  # two keys' tensors swapped: a plan's addresses, reordered
        other = f"layer{(i + 1) % N}.weight"
        if other != key and isinstance(model.get(other), torch.Tensor):
            model[key], model[other] = model[other], t
    elif change in ("tie_before", "view_before"):  # a part met before the planned ones
        items = [(k, v) for k, v in tree.items() if k != "before"]  # holding one of their
        tree.clear()  # tensors, or another view at its address
        tree.update([("before", {"x": t if change == "tie_before" else t[:1]}), *items])
    elif change == "tie_after":  # ... or met after them (found among the plan's views)
        tree["after"] = {"x": t}
    elif change == "all_values":  # the usual save: new values, the same tensors
        with torch.no_grad():
            for v in _tensors(tree, []):
                if not v.is_sparse and v.numel():
                    v.mul_(-1.5) if v.is_floating_point() else v.add_(3)


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _same_shape(a: Any, b: Any) -> None:
    """Same containers, keys (and their types) and order; tensors equal in value (a
    parameter's buffer is a plain tensor)."""
    assert type(a) is type(b) or isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b]
        # (a key of a mutable type -- any but the immutables -- is a copy in the snapshot)
        assert not [k for k, j in zip(a, b) if type(k) not in snapshot._IMMUTABLE and k is j]
        for k in a:
            _same_shape(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_shape(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.to_dense() if a.is_sparse else a, b.to_dense() if b.is_sparse else b)
    else:
        assert a == b


def _ident(t: torch.Tensor) -> Any:
    return view_ident(t) or id(t)


# Chunk sizes a plan's tensors are checked and copied by (`plans.CHUNK`): the real one (one
# chunk for these containers), and small ones whose chunks split blocks and place a change in
# any chunk, first or not in its part.
SIZES = st.sampled_from([plans.CHUNK, 1, 3, 7])


@settings(max_examples=40, deadline=None)
@given(changes=st.lists(st.tuples(CHANGES, st.integers(0, N - 1)), min_size=1, max_size=6),
       chunk=SIZES)
def test_a_planned_snapshot_is_the_snapshot_fresh_buffers_take(changes, chunk):
    _take_after(changes, chunk)


@pytest.mark.parametrize("chunk", SIZES.elements)
@pytest.mark.parametrize("change", CHANGES.elements)  # (each one alone, on every run)
def test_each_change_after_a_planned_snapshot_is_taken_as_by_fresh_buffers(change, chunk):
    _take_after([(change, 1), ("none", 0), (change, 2), (change, N - 3)], chunk)


def _take_after(changes: list[tuple[str, int]], chunk: int) -> None:
    real = plans.CHUNK
    plans.CHUNK = chunk  # (read as a plan is made)
    try:
        _taken_after(changes)
    finally:
        plans.CHUNK = real


def _taken_after(changes: list[tuple[str, int]]) -> None:
    torch.manual_seed(0)
    tree: dict[str, Any] = {"model": _model(N), "optimizer": {"state": _state(N), "lr": 0.1}}
    buffers = SnapshotBuffers()
    buffers.take(tree)
    for change, i in [("none", 0), *changes]:
        _change(tree, change, i, buffers.take)
        snap = buffers.take(tree)
        fresh = SnapshotBuffers().take(tree)
        _same_shape(snap, tree)
        _same_shape(snap, fresh)
        assert snap["model"]._metadata == tree["model"]._metadata
        src, got = _tensors(tree, []), _tensors(snap, [])
        assert len(src) == len(got)
        # one buffer per view: two leaves share a buffer exactly when they are one view
        groups: dict[Any, set[int]] = {}
        for a, x in zip(src, got):
            groups.setdefault(_ident(a), set()).add(id(x))
        assert all(len(g) == 1 for g in groups.values())
        assert len(set().union(*groups.values())) == len(groups)
        dense = [t for t in src if not t.is_sparse and t.numel()]
        before = [t.clone() for t in dense]
        with torch.no_grad():
            for t in dense:
                t.add_(1)  # the loop goes on: the snapshot keeps the values at the call
        kept = [t for t, s in zip(got, src) if not s.is_sparse and s.numel()]
        assert all(torch.equal(k, b) for k, b in zip(kept, before))
        assert not {t.data_ptr() for t in kept} & {t.data_ptr() for t in dense}
        with torch.no_grad():
            for t in dense:
                t.sub_(1)


def test_the_state_dict_and_the_optimizer_state_are_taken_by_their_plans():
    """The containers a plan is for really take it (not `fill`): the test above would pass
    with no plan at all."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(N)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2)).sum().backward()
    opt.step()

    def tree() -> dict[str, Any]:
        sd = opt.state_dict()
        return {"model": model.state_dict(), "optimizer": {"state": sd["state"]}}

    buffers = SnapshotBuffers()
    buffers.take(tree())
    assert set(buffers._plans) == {("model",), ("optimizer", "state")}
    taken = []
    real = snapshot._Taking.fill

    def fill(self, out, items, path):
        taken.append(path)
        return real(self, out, items, path)

    snapshot._Taking.fill = fill
    try:
        snap = buffers.take(tree())
    finally:
        snapshot._Taking.fill = real
    # by `fill`: the top level and the state_dict's _metadata, not the planned containers
    assert () in taken and not [p for p in taken if p[:1] == ("model",) and len(p) == 1
                                or p[:2] == ("optimizer", "state")]
    assert all(torch.equal(snap["model"][k], v) for k, v in model.state_dict().items())
    assert torch.equal(snap["optimizer"]["state"][0]["exp_avg"], opt.state[model[0].weight]
                       ["exp_avg"])


def test_small_tensors_of_one_shape_share_a_block_copied_by_one_stack():
    """A plan gives its small tensors of one shape and dtype views of one block (copied by one
    ``torch.stack``), a tensor alone of its kind or over `_BLOCKED` bytes a buffer of its own;
    a later snapshot writes the loop's new values through them."""
    big = plans.BLOCKED // 4 + 1  # float32 elements: just over the limit
    sd = OrderedDict((f"w{i}", torch.randn(3, 2)) for i in range(N))
    sd.update((f"b{i}", torch.randn(4)) for i in range(N))
    sd["odd"], sd["big"] = torch.randn(5, dtype=torch.float64), torch.randn(big)
    buffers = SnapshotBuffers()
    buffers.take({"model": sd})
    (plan,) = buffers._plans.values()
    assert sorted(tuple(b.shape) for b in plan.blocks) == [(N, 3, 2), (N, 4)]
    assert [list(sd)[i] for i in plan.loose] == ["odd", "big"]
    with torch.no_grad():
        for t in sd.values():
            t.mul_(-2)
    stacks = []
    real = torch.stack

    def stack(*a, **k):
        stacks.append(len(a[0]))
        return real(*a, **k)

    torch.stack = stack
    try:
        snap = buffers.take({"model": sd})["model"]
    finally:
        torch.stack = real
    assert sorted(stacks) == [N, N]
    assert all(torch.equal(snap[k], v) for k, v in sd.items())
    storages = {k: t.untyped_storage().data_ptr() for k, t in snap.items()}
    assert len({storages[f"w{i}"] for i in range(N)}) == 1
    assert len({storages[f"b{i}"] for i in range(N)}) == 1
    assert len(set(storages.values())) == 4
    assert snap["big"]._base is None and snap["big"].numel() == big


@pytest.mark.parametrize("chunk", [plans.CHUNK, 4])
@pytest.mark.parametrize("where", [0, 3, 5 * N // 2, 3 * N - 1])
@pytest.mark.parametrize("size", [0, 8])
def test_a_freed_storage_in_any_chunk_is_refused_before_a_stack_reads_it(where, chunk, size,
                                                                          monkeypatch):
    """A stack reading a tensor whose storage was freed or shrunk (its shape kept) would read
    past the storage's end: each chunk's addresses are read before its stack, a new one's
    storage is looked at, and the snapshot refuses the tensor as fresh buffers do, naming
    it."""
    monkeypatch.setattr(plans, "CHUNK", chunk)
    sd = OrderedDict((f"w{i}", torch.randn(3, 2)) for i in range(3 * N))
    buffers = SnapshotBuffers()
    buffers.take({"m": sd})
    assert buffers._plans
    buffers.take({"m": sd})  # (the plan has taken them: it knows their addresses)
    sd[f"w{where}"].untyped_storage().resize_(size)
    stacked = []
    real = torch.stack

    def stack(tensors, **k):
        assert all(t.untyped_storage().nbytes() >= t.nbytes for t in tensors), \
            "a stack read past a storage's end"
        stacked.append(len(tensors))
        return real(tensors, **k)

    monkeypatch.setattr(torch, "stack", stack)
    unheld = "whose storage holds no memory" if size == 0 else "reaches 24 bytes of its " \
        "storage, which holds 8"
    with pytest.raises(UnsupportedValue, match=f"w{where}: a tensor of shape \\[3, 2\\] "
                       f"{unheld}"):
        buffers.take({"m": sd})
    assert stacked or where < chunk  # (the chunks before the freed tensor's were stacked)
