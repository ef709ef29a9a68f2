"""The encoder's plans (a mapping of many tensors encoded again by the last save's plan, in
whole-list checks) against encodings without plans: over the generated sequences of trees of
`test_snapshot_plans` (a shape, a dtype, a key, a tie, an empty, sparse or meta tensor, a
bool key, a custom str key, a dict for a tensor, ...), every save's skeleton, stored tensors,
kinds, addresses and safetensors bytes are those of an encoding without plans."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_snapshot_plans import CHANGES, N, _change, _model, _state

from unbroken.errors import UnsupportedValue
from unbroken.persist.snapshot import SnapshotBuffers
from unbroken.state import codec, encodeplans
from unbroken.state import generation as G
from unbroken.state.codec import encode_tree_for_file
from unbroken.state.jsontext import dumps_json
from unbroken.state.tensorfile import encode_safetensors


def _bytes(encoded: codec.Encoded) -> bytes:
    chunks = encode_safetensors(encoded.tensors, {"m": "1"}, prepared=True,
                                kinds=encoded.kinds, ptrs=encoded.ptrs)
    return b"".join(bytes(c) for c in chunks)


def _same(planned: codec.Encoded, fresh: codec.Encoded) -> None:
    # (a planned mapping's place holds a string, its JSON text in ``texts``: put back, the
    # document's bytes are those of the encoding without plans)
    assert not fresh.texts
    text = dumps_json(planned.skeleton, sort_keys=False, texts=planned.texts)
    assert text == dumps_json(fresh.skeleton, sort_keys=False)
    assert json.loads(text) == json.loads(dumps_json(fresh.skeleton, sort_keys=False))
    assert list(planned.tensors) == list(fresh.tensors)
    assert planned.kinds == fresh.kinds
    for (key, a), b in zip(planned.tensors.items(), fresh.tensors.values()):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
        assert type(a) is type(b) and a.requires_grad == b.requires_grad, key  # (detached)
    assert planned.ptrs == [t.data_ptr() for t in planned.tensors.values()]
    assert _bytes(planned) == _bytes(fresh)


@settings(max_examples=40, deadline=None)
@given(changes=st.lists(st.tuples(CHANGES, st.integers(0, N - 1)), min_size=1, max_size=6))
def test_a_planned_encoding_is_the_encoding_without_plans(changes):
    _encode_after(changes)


@pytest.mark.parametrize("change", CHANGES.elements)  # (each one alone, on every run)
def test_each_change_after_a_planned_save_is_encoded_as_without_plans(change):
    _encode_after([(change, 1), ("none", 0), (change, 2)])


@settings(max_examples=40, deadline=None)
@given(changes=st.lists(st.tuples(CHANGES, st.integers(0, N - 1)), min_size=1, max_size=6))
def test_an_owned_encoding_of_snapshots_is_the_encoding_without_plans(changes):
    """An async save encodes its snapshot's buffers as their owner (``owned``): a plan that
    meets the same buffer objects again skips their checks. Whatever changed in the live
    tree, the snapshot's encoding is the one without plans."""
    _encode_after(changes, SnapshotBuffers())


@pytest.mark.parametrize("change", CHANGES.elements)
def test_each_change_to_a_snapshotted_tree_is_encoded_as_without_plans(change):
    _encode_after([(change, 1), ("none", 0), (change, 2), ("all_values", 0)],
                  SnapshotBuffers())


def _encode_after(changes: list[tuple[str, int]], buffers: SnapshotBuffers | None = None
                  ) -> None:
    """Each change, then a save: its encoding by plans (of a snapshot of the tree, by its
    owner, with ``buffers``) is the one without plans."""
    torch.manual_seed(0)
    tree: dict[str, Any] = {"model": _model(N), "optimizer": {"state": _state(N), "lr": 0.1}}
    plans: dict[str, Any] = {}
    taken = (lambda t: t) if buffers is None else buffers.take
    owned = buffers is not None
    encode_tree_for_file(taken(tree), plans, owned)
    for change, i in [("none", 0), *changes]:
        _change(tree, change, i, lambda t: encode_tree_for_file(taken(t), plans, owned))
        saved = taken(tree)
        try:
            fresh = encode_tree_for_file(saved)
        except UnsupportedValue as e:  # (a custom key type): refused the same with a plan,
            with pytest.raises(UnsupportedValue, match=re.escape(str(e))):
                encode_tree_for_file(saved, plans, owned)
            break  # and so is every later save of this tree
        _same(encode_tree_for_file(saved, plans, owned), fresh)


def test_an_owners_buffers_met_again_are_not_checked_again(monkeypatch):
    """The owned plan really skips the per-tensor checks for the same buffers (the tests
    above would pass without it), and checks anew once a buffer is another object."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(N)])
    buffers, plans = SnapshotBuffers(), {}
    encode_tree_for_file(buffers.take({"model": model.state_dict()}), plans, True)
    encode_tree_for_file(buffers.take({"model": model.state_dict()}), plans, True)

    def refused(t: torch.Tensor) -> torch.dtype:
        raise AssertionError("a buffer checked again")

    monkeypatch.setattr(encodeplans, "_DTYPE", refused)
    with torch.no_grad():
        model[0].weight.add_(1)
    saved = buffers.take({"model": model.state_dict()})
    _same(encode_tree_for_file(saved, plans, True), encode_tree_for_file(saved))
    assert plans["model"].mine[0][0] is saved["model"]["0.weight"]
    model[0].weight = torch.nn.Parameter(torch.ones(3, 2))  # a new shape: a new buffer
    with pytest.raises(AssertionError, match="checked again"):
        encode_tree_for_file(buffers.take({"model": model.state_dict()}), plans, True)
    monkeypatch.undo()
    saved = buffers.take({"model": model.state_dict()})
    _same(encode_tree_for_file(saved, plans, True), encode_tree_for_file(saved))
    # not owned (the user's own tensors): every save checks them
    plans = {}
    encode_tree_for_file({"model": model.state_dict()}, plans)
    encode_tree_for_file({"model": model.state_dict()}, plans)
    assert plans["model"].mine == []


def test_the_state_dict_and_the_optimizer_state_are_encoded_by_their_plans():
    """The mappings a plan is for really take it: the test above would pass with none."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(N)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2)).sum().backward()
    opt.step()

    def tree() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    plans: dict[str, Any] = {}
    encode_tree_for_file(tree(), plans)
    assert set(plans) == {"model", "optimizer.state"}
    walked = []
    real = codec._Encoder.mapping

    def mapping(self, obj, path, depth):
        walked.append(path)
        return real(self, obj, path, depth)

    codec._Encoder.mapping = mapping
    try:
        planned = encode_tree_for_file(tree(), plans)
    finally:
        codec._Encoder.mapping = real
    assert "" in walked and not [p for p in walked if p == "model"
                                 or p.startswith("optimizer.state")]
    _same(planned, encode_tree_for_file(tree()))
    with torch.no_grad():  # values change in place between saves: the plan still fits
        for p in model.parameters():
            p.add_(1)
    again = encode_tree_for_file(tree(), plans)
    # the plans' own JSON texts, made once, in the places of their mappings
    assert again.texts[again.skeleton["model"]] is planned.texts[planned.skeleton["model"]]
    assert set(again.texts) == {again.skeleton["model"], again.skeleton["optimizer"]["state"]}
    _same(again, encode_tree_for_file(tree()))


def test_a_document_utf8_cannot_encode_is_written_as_without_plans():
    """A lone surrogate (what ``os.fsdecode`` makes of an undecodable file name) anywhere in
    the state switches the document to ASCII escapes: the planned mappings' texts, made as
    UTF-8 (here with a non-ASCII key), must switch with it, the bytes those of the encoding
    without plans."""
    sd = {f"w\u00e9{i}": torch.randn(2) for i in range(N)}
    tree: dict[str, Any] = {"model": sd, "files": ["data/\udc80.bin"], "note": "caf\u00e9"}
    plans: dict[str, Any] = {}
    encode_tree_for_file(tree, plans)
    planned = encode_tree_for_file(tree, plans)
    assert planned.texts  # (the plan was taken)
    fresh = encode_tree_for_file(tree)
    text = dumps_json(planned.skeleton, sort_keys=False, texts=planned.texts)
    assert text == dumps_json(fresh.skeleton, sort_keys=False)
    doc = json.loads(text)
    assert text.isascii() and doc["note"] == "caf\u00e9" and doc["files"] == ["data/\udc80.bin"]
    assert list(doc["model"]) == list(sd)


def test_a_string_of_the_state_like_a_place_holder_stays_itself():
    """The string a skeleton holds in a planned mapping's place is random, of this process:
    a state's own strings (even of its form) are written as they are."""
    plans: dict[str, Any] = {}
    sd = {f"w{i}": torch.randn(2) for i in range(N)}
    tree: dict[str, Any] = {"model": sd, "a": "unbroken.planned.0", "b": encodeplans._HOLDER[:-1]}
    encode_tree_for_file(tree, plans)
    planned = encode_tree_for_file(tree, plans)
    doc = json.loads(dumps_json(planned.skeleton, sort_keys=False, texts=planned.texts))
    assert doc["a"] == "unbroken.planned.0" and doc["b"] == encodeplans._HOLDER[:-1]
    assert doc == json.loads(dumps_json(encode_tree_for_file(tree).skeleton, sort_keys=False))


def _tree_of(spec: Any, at: str = "") -> Any:
    """A nested state from a Hypothesis spec: an int n is a mapping of n tensors of shape
    (2,), a list is a dict of its items' trees."""
    if isinstance(spec, int):
        return {f"{at}t{i}": torch.full((2,), float(i)) for i in range(spec)}
    return {f"k{i}": _tree_of(s, f"{at}{i}.") for i, s in enumerate(spec)}


_SPECS = st.recursive(st.sampled_from([0, 3, encodeplans._PLANNED, encodeplans._PLANNED + 5]),
                      lambda inner: st.lists(inner, min_size=1, max_size=3), max_leaves=6)


@settings(max_examples=80, deadline=None, database=None)
@given(st.lists(_SPECS, min_size=1, max_size=3),
       st.lists(st.sampled_from(["same", "add", "drop", "grow", "swap"]), min_size=2,
                max_size=6))
def test_nested_planned_mappings_write_what_an_unplanned_save_writes(base, ops):
    """Any nesting of mappings of many tensors (a part of several state_dicts, dicts of
    them), changing from save to save (an entry added or dropped, a mapping grown, two
    swapped, or nothing): every save's state.json is byte for byte that of a save without
    plans, and never holds a place-holder (the class of the review's nested-plan defect)."""
    layouts: dict[str, Any] = {}
    meta = {"unbroken.generation": "1"}
    spec: list[Any] = list(base)
    for op in ["same", *ops]:
        if op == "add":
            spec.append(3)
        elif op == "drop" and len(spec) > 1:
            spec.pop()
        elif op == "grow":
            spec[0] = spec[0] + 1 if isinstance(spec[0], int) else [*spec[0], 3]
        elif op == "swap" and len(spec) > 1:
            spec[0], spec[-1] = spec[-1], spec[0]
        tree = {"part": _tree_of(spec)}
        planned = b"".join(G.encode_generation(tree, meta, layouts=layouts)["state.json"])
        plain = b"".join(G.encode_generation(tree, meta)["state.json"])
        assert encodeplans._HOLDER.encode() not in planned, (base, ops, op)
        assert planned == plain, (base, ops, op)
