"""The encoder's plans: how the last save encoded a mapping of many tensors (a model's
state_dict, an optimizer's per-parameter state), so that a later save encodes it by a few
whole-list checks instead of a Python step per tensor (`Planning`, mixed into
`codec._Encoder`), and writes its JSON text made once. A plan is used only while the mapping
still fits it; anything else goes the per-tensor way (`_Encoder.mapping`), whose result a
plan must equal exactly. (The async snapshot's plans, `persist.plans`, share
`planned_leaves`.)"""

from __future__ import annotations

import json
import operator
import uuid
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from itertools import chain, count
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .freed import shortfall

# A mapping holding this many tensors or more is encoded by its `_Plan` when it can be.
_PLANNED = 16
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_PLAIN_KEYS = frozenset({str, int})  # keys a plan compares (``==`` of anything else is code)
_DICT = frozenset({dict})
_SHAPE, _DTYPE, _IS_CPU = (operator.attrgetter(a) for a in ("shape", "dtype", "is_cpu"))
_T = torch.Tensor


# An optimizer state's per-key dicts as a plan knows them: their keys in a row, and how many
# each holds (compared in two whole-list operations, not a list per key).
Inner = tuple[list[Any], list[int]]


def inner_of(names: list[list[Any]]) -> Inner:
    """``names`` (each dict's keys) as a plan keeps them (`Inner`)."""
    return list(chain.from_iterable(names)), list(map(len, names))


def planned_leaves(obj: Mapping[Any, Any], keys: list[Any], inner: Inner | None
                   ) -> list[Any] | None:
    """A mapping's values (``inner`` None) or its dicts' values in order, when its keys are
    a plan's ``keys`` and its dicts' keys are ``inner`` (plain str and int keys, whose ``==``
    runs no user code); None if not. What a plan (the encoder's, the async snapshot's)
    checks first, in whole-list operations."""
    got = list(obj)
    if not _PLAIN_KEYS.issuperset(map(type, got)) or got != keys:
        return None
    values = list(obj.values())
    if inner is None:
        return values
    if not _DICT.issuperset(map(type, values)) or list(map(len, values)) != inner[1]:
        return None
    names = list(chain.from_iterable(values))
    if not _PLAIN_KEYS.issuperset(map(type, names)) or names != inner[0]:
        return None
    return list(chain.from_iterable(map(dict.values, values)))


class Listed(Mapping[str, Any]):
    """An encoding's tensors by key where a plan took all of them (`Planning.planned`): the
    plan's paths and the tensors, in order, made into a dict only if a key is looked up
    (~0.6 ms not spent hashing 10,000 keys in a save, whose file reads them in order)."""

    __slots__ = ("_keys", "_values", "_dict")

    def __init__(self, keys: list[str], values: list[Any]) -> None:
        self._keys, self._values = keys, values
        self._dict: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __getitem__(self, key: str) -> Any:
        if self._dict is None:
            self._dict = dict(zip(self._keys, self._values))
        return self._dict[key]

    def items(self) -> ItemsView[str, Any]:
        return _Pairs(self)

    def values(self) -> ValuesView[Any]:
        return _Values(self)


class _Pairs(ItemsView[str, Any]):
    def __init__(self, listed: Listed) -> None:
        super().__init__(listed)
        self._listed = listed

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return zip(self._listed._keys, self._listed._values)


class _Values(ValuesView[Any]):
    def __init__(self, listed: Listed) -> None:
        super().__init__(listed)
        self._listed = listed

    def __iter__(self) -> Iterator[Any]:
        return iter(self._listed._values)


class _Plan(NamedTuple):
    """How the last save encoded a mapping of many tensors: a model's state_dict (keys ->
    tensors: ``inner`` None) or an optimizer's per-parameter state (keys -> dicts of tensors:
    ``inner``, their keys). Every tensor was stored as itself under its path (``kinds``,
    in order) and referenced by a plain ``{"$t": "tensor", "key": path}`` (``refs``). A later
    save of a mapping of the same type and keys whose tensors are still plain, contiguous CPU
    tensors of the same dtypes and shapes, none of them met before in the part, gets the same
    ``skeleton`` (the same object, never changed) from a few whole-list checks instead of a
    Python step per tensor (`_Encoder.planned`), and its JSON text, made once (``text``: empty
    until then), instead of the ~1 us a tensor reference costs ``json.dumps`` each save.

    ``mine``: for an encoder of buffers its caller owns (`encode_tree_for_file`), the tensors
    the plan last took and their addresses: the same objects again are taken without their
    checks (empty for any other encoder). ``seen``: for any other encoder, the addresses of
    the tensors the plan last took and each one's index among them: the same addresses
    again, which were unique, are checked only against the views met before (~1.3 ms for
    10,000 tensors not spent indexing them again)."""

    kind: type
    keys: list[Any]
    inner: Inner | None
    kinds: list[tuple[str, torch.dtype, torch.Size]]
    paths: list[str]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    refs: list[dict[str, Any]]
    skeleton: Any
    text: list[str]
    mine: list[Any]
    seen: list[Any]


# What a skeleton holds in place of a planned mapping's skeleton, followed by a number (one
# count for every encoder: the parts of a document are encoded apart): a string no state
# holds (random, of this process), replaced by the plan's JSON text when the document is
# written (`jsontext.dumps_json` with ``texts``).
_HOLDER = f"unbroken.planned.{uuid.uuid4().hex}."
_HOLDERS = count()



class Planning:
    """The plan-taking part of an encoder (`codec._Encoder`, whose state it shares): a
    mapping encoded by its plan (`by_plan`, `planned`), and planned after the per-tensor way
    encoded it (`plan`)."""

    if TYPE_CHECKING:  # (what `_Encoder` holds and does)
        plans: dict[str, _Plan] | None
        owned: bool
        defer: bool
        unchecked: bool
        texts: dict[str, str]
        tensors: dict[str, torch.Tensor]
        listed: Listed | None
        kinds: list[tuple[str, torch.dtype, torch.Size]]
        ptrs: list[int]
        _views: dict[int, Any]
        _placed: list[tuple[dict[int, int], list[Any], list[dict[str, Any]]]]
        met: set[str]

        def mapping(self, obj: Any, path: str, depth: int) -> Any: ...

        def settle(self) -> None: ...

    def by_plan(self, obj: Any, path: str, depth: int, plans: dict[str, _Plan]) -> Any:
        """`mapping`, by the plan of the last save when it still fits (then planned for the
        next save, if it holds enough tensors). A plan is out of ``plans`` while `mapping`
        runs: one that raises may have stored what the plan would not know of."""
        plan = plans.pop(path, None)
        self.met.add(path)
        if plan is not None and self.planned(obj, plan):
            plans[path] = plan
            if not plan.text:
                plan.text.append(json.dumps(plan.skeleton, separators=(",", ":"),
                                            allow_nan=False, ensure_ascii=False))
            holder = f"{_HOLDER}{next(_HOLDERS)}"
            self.texts[holder] = plan.text[0]
            return holder
        start, holders = len(self.kinds), len(self.texts)
        skeleton = self.mapping(obj, path, depth)
        # (A mapping holding a planned one is not planned: its skeleton holds that one's
        # place-holder, which only this save's ``texts`` fill in.)
        if len(self.kinds) - start >= _PLANNED and len(self.texts) == holders:
            self.plan(obj, path, skeleton, start)
        return skeleton

    def planned(self, obj: Mapping[Any, Any], plan: _Plan) -> bool:
        """Take ``obj`` by ``plan`` if it fits (see `_Plan`): its tensors stored, their
        kinds and addresses recorded, as `tensor` would; False (nothing done) if not. With
        ``defer``, each tensor's dtype, shape, device, lazy bit, contiguity and, once the plan
        knows them, address are not read here (~7 ms for 10,000 tensors, in a process-mode
        save's blocked time): the tensor file's encoder checks each as it copies it (a
        stack's addresses before it, its dtypes after it, while they are in the cache), or
        the copy (a ``torch.stack``) refuses what does not fit, and then the part is encoded
        again without plans (``unchecked``: see `codec.encode_tree_for_file`)."""
        tensors = (planned_leaves(obj, plan.keys, plan.inner) if type(obj) is plan.kind
                   else None)
        if tensors is None:
            return False
        mine = plan.mine
        if mine and len(tensors) == len(mine[0]) and all(map(operator.is_, tensors, mine[0])):
            # The owner's own buffers, the objects checked last time: a buffer is never
            # reshaped, retyped or moved (a new shape gets a new one), so nothing below
            # can have changed (~0.5 us a tensor, half of it reading cold tensors).
            _, ptrs, where = mine
        else:
            try:
                if (len(tensors) != len(plan.kinds)
                        or not _PLAIN_TENSORS.issuperset(map(type, tensors))
                        or not self.defer and (
                            list(map(_DTYPE, tensors)) != plan.dtypes
                            or list(map(_SHAPE, tensors)) != plan.shapes
                            or not all(map(_IS_CPU, tensors))
                            or any(map(_T.is_neg, tensors))  # (no complex dtype: no conj bit)
                            or not all(map(_T.is_contiguous, tensors)))):
                    return False
                seen = plan.seen
                # (deferred: the last save's addresses, which were unique; the file's encoder
                # reads each tensor's before it copies it, and refuses the file if one moved)
                ptrs = seen[0] if self.defer and seen else list(map(_T.data_ptr, tensors))
            except (RuntimeError, NotImplementedError):  # (a sparse tensor has no address)
                return False  # (an exotic tensor: `tensor` says what)
            if seen and (ptrs is seen[0] or ptrs == seen[0]):  # (deferred: the same list)
                where = seen[1]
            else:
                seen.clear()
                where = dict(zip(ptrs, range(len(ptrs))))
                if (0 in ptrs or len(where) != len(ptrs)
                        or any(map(shortfall, tensors, ptrs))):
                    # an empty tensor (a meta one), a tie, a storage freed or shrunk under
                    # its tensor (looked at when its address is new): `tensor` tells them
                    # apart
                    return False
                if not self.owned:
                    seen[:] = ptrs, where
            self.unchecked = self.unchecked or self.defer
            if self.owned:  # (kept for the next save, which meets these buffers again)
                mine[:] = [tensors, ptrs, where]
        if self.listed is not None:  # (a second plan: the keys are compared as a dict's)
            self.settle()
        views, stored, taken = self._views, self.tensors, where.keys()
        # (none met before, the common case: ~0.3 ms not spent hashing 10,000 of each)
        if (views and not views.keys().isdisjoint(taken)
                or not all(w.keys().isdisjoint(taken) for w, _, _ in self._placed)
                or stored and not stored.keys().isdisjoint(plan.paths)):
            return False  # a view met before, a key taken: `tensor` (it tells them apart)
        if stored:
            stored.update(zip(plan.paths, tensors))
        else:  # the encoding's first tensors, kept as the plan lists them (`Listed`)
            self.listed = Listed(plan.paths, tensors)
        self.kinds.extend(plan.kinds)
        self.ptrs.extend(ptrs)
        self._placed.append((where, tensors, plan.refs))  # (found by `codec._Encoder.held`)
        return True

    def plan(self, obj: Mapping[Any, Any], path: str, skeleton: Any, start: int) -> None:
        """After ``obj`` was encoded into ``skeleton`` (its tensors from ``start`` on in
        ``kinds``): its plan, if every tensor it holds (directly, or in dicts one level down)
        was stored as itself under its own path and referenced plainly."""
        assert self.plans is not None
        kinds = self.kinds[start:]
        if not _PLAIN_KEYS.issuperset(map(type, obj)):
            return
        dot = f"{path}." if path else ""
        values = list(obj.values())
        inner = None
        if _PLAIN_TENSORS.issuperset(map(type, values)):
            tensors, want = values, [f"{dot}{k}" for k in obj]
        elif _DICT.issuperset(map(type, values)):
            inner = list(map(list, values))
            if not _PLAIN_KEYS.issuperset(map(type, chain.from_iterable(inner))):
                return
            tensors = [v for d in values for v in d.values()]
            want = [f"{dot}{k}.{i}" for k, names in zip(obj, inner) for i in names]
        else:
            return
        if (len(tensors) != len(kinds) or [k for k, _, _ in kinds] != want
                or not all(map(operator.is_, map(self.tensors.__getitem__, want), tensors))
                or any(d.is_complex for _, d, _ in kinds)):
            return  # a tie, a copy (detached, resolved, made contiguous), a renamed key
        refs: list[dict[str, Any]] = []
        for ptr in self.ptrs[start:]:
            held = self._views.get(ptr)
            if type(held) is not tuple or len(held[1]) != 2:  # (not one plain reference)
                return
            refs.append(held[1])
        self.plans[path] = _Plan(type(obj), list(obj),
                                 None if inner is None else inner_of(inner), kinds, want,
                                 [s for _, _, s in kinds], [d for _, d, _ in kinds], refs,
                                 skeleton, [], _mine(tensors, self.ptrs[start:])
                                 if self.owned else [], [])


def _mine(tensors: list[Any], ptrs: list[int]) -> list[Any]:
    """A plan's tensors and what `_Encoder.planned` adds of them: their addresses and each
    address's index (kept for an owner's buffers, `_Plan.mine`)."""
    return [tensors, ptrs, dict(zip(ptrs, range(len(ptrs))))]
