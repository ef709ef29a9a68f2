"""A save that encodes its tensor files itself (sync, and process mode, whose blocked time
this is) lets the encoder's plans skip reading each tensor's shape, device, lazy bits and
contiguity: the tensor file's encoder checks each tensor as it copies it, a stack checking
the rest of its stretch (`tensorfile.encode_safetensors` with ``unchecked``), and a part
whose tensor no longer fits its plan is encoded again without plans
(`generation.encode_generation`). Whatever changed, every file's bytes are those of a save
without plans: each change on each kind of tensor a file holds (a stacked stretch, a
stretch too short to stack, a tensor of its own chunk), and generated sequences of
changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_snapshot_plans import CHANGES, N, _change, _model, _state

from unbroken.errors import UnsupportedValue
from unbroken.state import encodeplans, tensorfile
from unbroken.state import generation as G

META = {"unbroken.run_id": "r", "unbroken.generation": "1", "unbroken.incarnation": "0"}
# Which tensor of `_tree`'s model a change is made to: each kind of place in the file.
PLACES = {"stacked": "s.3", "short": "m.1", "own": "big.0", "stacked_first": "s.0"}


def _tree() -> dict[str, Any]:
    """A model whose file holds a stretch of 12 small tensors of one shape (stacked), one of
    3 (too short: a memmove each) and 2 tensors over 64 KiB (a chunk each), and an
    optimizer state of dicts (stacked), each mapping enough for a plan."""
    g = torch.Generator().manual_seed(0)
    model = {f"s.{i}": torch.randn(4, 4, generator=g) for i in range(12)}
    model.update({f"m.{i}": torch.randn(5, generator=g) for i in range(3)})
    model.update({f"big.{i}": torch.randn(160, 160, generator=g) for i in range(2)})
    state = {k: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4, 4, generator=g)}
             for i, k in enumerate(model) if k.startswith("s.")}
    state.update({f"x{i}": {"step": torch.tensor(1.0), "exp_avg": torch.ones(4, 4)}
                  for i in range(8)})
    return {"model": model, "optimizer": {"state": state, "lr": 0.1}}


def _bytes(artifacts: dict[str, Any]) -> dict[str, bytes]:
    return {name: b"".join(bytes(c) for c in chunks) for name, chunks in artifacts.items()}


def _same_as_unplanned(tree: dict[str, Any], layouts: dict[str, Any]) -> bool:
    """A save with the kept ``layouts`` (plans, deferred checks) writes what one without
    them writes; a tree that cannot be stored is refused alike (False)."""
    try:
        fresh = _bytes(G.encode_generation(tree, META))
    except UnsupportedValue as e:
        with pytest.raises(UnsupportedValue) as got:
            G.encode_generation(tree, META, layouts=layouts)
        assert str(got.value) == str(e)
        return False
    assert _bytes(G.encode_generation(tree, META, layouts=layouts)) == fresh
    return True


def _changed(t: torch.Tensor, change: str) -> torch.Tensor:
    """``t`` changed so that its address may stay what a plan expects (what the deferred
    checks see), but not its dtype, shape, contiguity or lazy bits."""
    if change == "same_numel_shape":  # the same bytes under another shape
        return t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)
    if change == "transposed":  # square: the same shape, not contiguous
        return t.t() if t.dim() == 2 else t.flip(0)
    if change == "negative_view":  # contiguous, its memory not its values
        return torch._neg_view(t)
    if change == "expanded":  # the same shape, one element's memory (stride 0)
        return t.reshape(-1)[:1].expand(t.shape)
    if change == "meta":
        return torch.empty(t.shape, device="meta")
    if change == "reinterpreted":  # the same bytes, address and shape, another dtype
        return t.view(torch.int32)
    if change == "cast":  # another dtype a stack casts into the stretch's
        return t.double()
    if change == "complex":  # one a stack refuses to cast
        return t.to(torch.complex64)
    if change == "data_retyped":  # a parameter whose data became another dtype in place
        p = torch.nn.Parameter(t.clone(), requires_grad=False)  # (an int one needs none)
        p.data = p.data.view(torch.int32)
        return p
    if change == "data_reshaped":  # a parameter whose data became another shape in place
        p = torch.nn.Parameter(t.clone())
        p.data = torch.randn(2, *t.shape)[0].reshape(-1)
        return p
    raise AssertionError(change)


CHANGED = ["same_numel_shape", "transposed", "negative_view", "expanded", "meta",
           "data_reshaped", "reinterpreted", "cast", "complex", "data_retyped"]


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("change", CHANGED)
def test_each_change_on_each_kind_of_place_writes_what_a_save_without_plans_writes(
        change, place):
    tree, layouts = _tree(), {}
    G.encode_generation(tree, META, layouts=layouts)
    _same_as_unplanned(tree, layouts)  # (planned, unchanged)
    key = PLACES[place]
    tree["model"][key] = _changed(tree["model"][key], change)
    _same_as_unplanned(tree, layouts)
    if change == "meta":  # (refused; the next save of real tensors is whole again)
        tree["model"][key] = torch.randn(tree["model"]["s.1" if "s." in key else key].shape)
    _same_as_unplanned(tree, layouts)
    _same_as_unplanned(tree, layouts)


def test_the_plans_really_skip_the_checks_the_file_encoder_makes(monkeypatch):
    """The tests here would pass with every check still made by the plan: a second save
    reads no tensor's shape through the plan's checks, and still writes the same bytes."""
    tree, layouts = _tree(), {}
    G.encode_generation(tree, META, layouts=layouts)

    def refused(t: torch.Tensor) -> Any:
        raise AssertionError("a shape or a dtype read by the plan")

    monkeypatch.setattr(encodeplans, "_SHAPE", refused)
    monkeypatch.setattr(encodeplans, "_DTYPE", refused)
    got = _bytes(G.encode_generation(tree, META, layouts=layouts))
    monkeypatch.undo()
    assert got == _bytes(G.encode_generation(tree, META))
    # and a tensor that no longer fits is caught by the file's encoder: planned again
    tree["model"]["s.5"] = tree["model"]["s.5"].t()
    calls = []
    real = tensorfile._fit

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(tensorfile, "_fit", counted)
    _same_as_unplanned(tree, layouts)
    assert calls  # (the file's encoder checked what the plan did not)


def test_a_process_mode_room_refused_midway_leaves_whole_chunks():
    """A part encoded again after its file was refused halfway asks the room again: every
    chunk the save returns holds its own bytes (the room's first gifts are left unused)."""
    tree, layouts = _tree(), {}
    G.encode_generation(tree, META, layouts=layouts)
    segment = bytearray(1 << 22)
    at = [0]

    def room(n: int) -> memoryview | None:
        if at[0] + n > len(segment):
            return None
        view = memoryview(segment)[at[0]:at[0] + n]
        at[0] += -(-n // 64) * 64
        return view

    tree["model"]["m.2"] = torch._neg_view(tree["model"]["m.2"])
    got = _bytes(G.encode_generation(tree, META, layouts=layouts, room=room))
    assert got == _bytes(G.encode_generation(tree, META))


@settings(max_examples=60, deadline=None)
@given(changes=st.lists(st.tuples(CHANGES, st.integers(0, N - 1)), min_size=1, max_size=6))
@example(changes=[("path_clash", 0), ("meta", 0)])  # (a tensor beside the mappings)
@example(changes=[("custom_key", 0), ("meta", 0)])
def test_generated_changes_write_what_saves_without_plans_write(changes):
    torch.manual_seed(0)
    tree: dict[str, Any] = {"model": _model(N), "optimizer": {"state": _state(N), "lr": 0.1}}
    layouts: dict[str, Any] = {}

    def take(t: dict[str, Any]) -> Any:  # (the tree, one part: a change may add a tensor)
        return G.encode_generation({"p": t}, META, layouts=layouts)

    take(tree)
    for change, i in [("none", 0), *changes]:
        _change(tree, change, i, take)
        if not _same_as_unplanned({"p": tree}, layouts):
            break  # (a custom key type: so is every later save of this tree)
