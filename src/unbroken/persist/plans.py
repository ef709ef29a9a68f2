"""The async snapshot's plans: how the last snapshot took a container of many tensors (a
model's state_dict, an optimizer's per-parameter state), so that a later one takes it in
whole-list operations instead of a Python step per tensor, its small tensors copied a block
at a time (`Planning`, mixed into `snapshot._Taking`). A plan is used only while the
container still fits it; anything else goes the per-tensor way (`_Taking.fill`), whose
result a plan must equal exactly."""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from itertools import chain, groupby
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..state.encodeplans import Inner, inner_of, planned_leaves
from ..state.freed import shortfall
from ..state.tensorfile import CHUNK

# A buffer with the shape, dtype and bytes of the tensors it fits, kept beside it: reading
# them from the buffer again costs ~0.1 us a torch call, for 10,000 small tensors each save.
# The dtype is None for a buffer of another kind than a plain tensor (a DTensor's), which a
# plain tensor's check then never takes.
Entry = tuple[torch.Tensor, torch.Size, torch.dtype | None, int]

# A container holding this many tensors or more is taken by its `Plan` when it can be.
PLANNED = 16
# A plan's tensors of at most this many bytes share a buffer (a block) with the others of
# their shape and dtype, copied into it by one ``torch.stack``: for small tensors the cost of
# a copy is its call (~1 us a tensor in ``_foreach_copy_``, ~0.4 us in a stack), not bytes.
BLOCKED = 1 << 16
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # copied by the one _foreach_copy_
_PLAIN_KEYS = frozenset({str, int})  # keys a plan compares (``==`` of anything else is code)
_DICT = frozenset({dict})
_SHAPE, _DTYPE, _NBYTES = (operator.attrgetter(a) for a in ("shape", "dtype", "nbytes"))
_DATA_PTR = torch.Tensor.data_ptr


class Part(NamedTuple):
    """A block's members in one chunk, ``take`` of a plan's tensors (the first at index
    ``first``, of ``shape``), copied by one ``torch.stack`` into ``out``, their rows of the
    block."""

    take: Callable[[list[torch.Tensor]], Any]
    first: int
    shape: torch.Size
    out: torch.Tensor


# (the chunk's first index, its end, its parts)
Chunk = tuple[int, int, list[Part]]


class Plan(NamedTuple):
    """How the last snapshot took a container of many tensors: a model's state_dict (keys ->
    tensors: ``inner`` None) or an optimizer's per-parameter state (keys -> dicts of tensors:
    ``inner``, their keys). A later snapshot of a container with the same keys whose
    tensors still fit ``bufs`` (same order, ``dtypes``) is taken with a few whole-list
    operations instead of a Python step per tensor (see `Planning.planned`).

    The small tensors of one shape and dtype have views of one of the ``blocks`` as their
    buffers, copied a ``CHUNK`` at a time (``chunks``: `Part`); the others (``loose``, their
    indices) a buffer each, of ``loose_shapes``.
    ``rows`` (with ``inner``): the snapshot's dict for each key, its names -> buffers, given
    to every snapshot the plan takes (they only ever map the names to the plan's buffers,
    and a snapshot is taken only after the last one's save ended: no two trees in use share
    them): ~0.3 us a key not spent building them anew. ``out``: the container the plan
    filled, given whole the same way (unless it has attributes, which a snapshot may set).
    ``seen``: the addresses of the tensors the plan last took, and each one's index among
    them (empty until it took some): the same addresses again, which were unique, are
    checked only against the other tensors met (~1.5 ms for 10,000 tensors)."""

    keys: list[Any]
    inner: Inner | None
    rows: list[dict[Any, torch.Tensor]] | None
    out: dict[Any, Any]
    bufs: list[torch.Tensor]
    dtypes: list[torch.dtype]
    loose: list[int]
    loose_shapes: list[torch.Size]
    blocks: list[torch.Tensor]
    chunks: list[Chunk]
    seen: list[Any]


class Planning:
    """The plan-taking part of a snapshot (`snapshot._Taking`, whose state it shares): a
    container taken by its plan (`mapping`, `planned`), and planned after the per-tensor way
    took it (`plan`, `blocked`)."""

    if TYPE_CHECKING:  # (what `_Taking` holds and does)
        cache: dict[tuple[Any, ...], dict[Any, Entry]]
        plans: dict[tuple[Any, ...], Plan]
        created: bool
        src: list[torch.Tensor]
        bufs: list[torch.Tensor]
        views: dict[int, int]
        placed: list[tuple[int, dict[int, int]]]
        after: dict[int, int]
        to: list[torch.Tensor]
        of: list[torch.Tensor]

        def fill(self, out: Any, items: Iterable[tuple[Any, Any]], path: tuple[Any, ...]
                 ) -> Any: ...

    def mapping(self, out: Any, d: Mapping[Any, Any], path: tuple[Any, ...]) -> Any:
        """``out`` filled with the items of the dict ``d`` at ``path``: by the plan of the last
        snapshot when it still fits, else by `fill` (then planned for the next snapshot)."""
        # (Out of the plans while `fill` runs: a fill that raises may replace a buffer the
        # plan holds, and a plan used after that would drop the new one as unused. A
        # Counter's ``update`` counts: it never takes a plan.)
        plan = self.plans.pop(path, None)
        if (plan is not None and (type(out) is dict or type(out) is OrderedDict)
                and self.planned(d, plan)):
            if type(plan.out) is type(out) and not getattr(plan.out, "__dict__", None):
                self.plans[path] = plan
                return plan.out  # (the same keys to the same buffers or rows)
            out.update(zip(plan.keys, plan.bufs if plan.rows is None else plan.rows))
            self.plans[path] = plan._replace(out=out)
            return out
        start, copies = len(self.bufs), len(self.to)
        self.fill(out, d.items(), path)
        if len(self.bufs) - start >= PLANNED or plan is not None:
            self.plan(out, d, path, start, copies)
        return out

    def planned(self, d: Mapping[Any, Any], plan: Plan) -> bool:
        """Take ``d`` by ``plan`` if it fits: the same keys (plain str and int keys, whose
        ``==`` runs no user code), the same number of tensors, each a plain CPU tensor of its
        buffer's shape and dtype, none a view met already in this snapshot (a tie) or at the
        address of another. What `fill` checks one tensor at a time, here in whole-list
        operations, a chunk at a time (`CHUNK`): its addresses read (where one is new, none
        of a storage freed or shrunk under its tensor, which a stack would read past its
        end: `state.freed`), its blocks' members stacked, then its dtypes
        read. A part's shapes are checked by its first tensor's and by ``torch.stack``,
        which refuses tensors of unequal shapes or on another device than the CPU. False
        (its buffers maybe written, nothing else done) if not."""
        tensors = planned_leaves(d, plan.keys, plan.inner)
        if tensors is None:
            return False
        ptrs: list[int] = []
        dtypes: list[torch.dtype] = []
        # (the addresses the plan last took: a tensor met again at its address is taken as
        # it was, a resize moves a storage's memory but for the case `state.freed` names; a
        # tensor at a new address is looked at)
        last = plan.seen[0] if plan.seen else None
        try:
            if (len(tensors) != len(plan.bufs) or not _PLAIN.issuperset(map(type, tensors))
                    # (a block's tensors on another device: its stack refuses them)
                    or not all([tensors[i].is_cpu for i in plan.loose])
                    or [tensors[i].shape for i in plan.loose] != plan.loose_shapes):
                return False
            with torch.no_grad():  # (a parameter's history is not the buffer's)
                for lo, hi, parts in plan.chunks:
                    chunk = tensors[lo:hi]
                    got = list(map(_DATA_PTR, chunk))  # (a sparse tensor has none: it raises)
                    if (last is None or got != last[lo:hi]) and any(map(shortfall, chunk,
                                                                          got)):
                        return False  # (a storage freed or shrunk under it: `fill` refuses it)
                    for take, first, shape, out in parts:
                        # (stack resizes an ``out`` of another shape, which it checks the
                        # others by)
                        if tensors[first].shape != shape:
                            return False
                        torch.stack(take(tensors), out=out)
                    ptrs += got
                    dtypes += map(_DTYPE, chunk)
        except (RuntimeError, NotImplementedError, TypeError):
            # An exotic tensor (`fill` says what), a shape in a block changed (`fill`, into
            # the same buffers), a dtype a stack cannot cast (complex into a float block).
            return False
        if dtypes != plan.dtypes:
            return False  # (a stack casts: its values are copied again by `fill`)
        seen = plan.seen
        if seen and ptrs == seen[0]:
            where = seen[1]
        else:
            seen.clear()
            empty = 0 in ptrs  # an empty tensor has no address: known by its id, as in `tensor`
            if empty:
                ptrs = [p or -id(t) for p, t in zip(ptrs, tensors)]
            where = dict(zip(ptrs, range(len(ptrs))))
            if len(where) != len(ptrs):
                return False  # views at one address: `fill` (it compares the views)
            if not empty:  # (ids are not kept: another object may take an id)
                seen[:] = ptrs, where
        taken = where.keys()
        if not (self.views.keys().isdisjoint(taken)
                and all(w.keys().isdisjoint(taken) for _, w in self.placed)):
            return False  # a tie with a tensor met before: `fill` (it compares the views)
        self.placed.append((len(self.src), where))
        self.src.extend(tensors)
        self.bufs.extend(plan.bufs)
        for i in plan.loose:
            self.of.append(tensors[i])
            self.to.append(plan.bufs[i])
        return True

    def plan(self, out: Any, d: Mapping[Any, Any], path: tuple[Any, ...], start: int,
             copies: int) -> None:
        """After `fill` took ``d`` into ``out``: its plan, if every tensor it holds (directly,
        or in dicts one level down) got a buffer of its own, in order, copied by the one
        _foreach_copy_ (``start``: the first one's index in ``bufs``, ``copies`` in ``to``);
        else none. Its small tensors' buffers are replaced by views of blocks (`blocked`)."""
        self.plans.pop(path, None)
        bufs = self.bufs[start:]
        if (type(out) is not dict and type(out) is not OrderedDict  # (Counter.update adds)
                or len(self.to) - copies != len(bufs)
                # two views at one address (met before: `after`), which `planned` refuses:
                # a plan made each time would make new blocks each time
                or not self.after.keys().isdisjoint(range(start, len(self.src)))
                or not _PLAIN_KEYS.issuperset(map(type, d))):
            return
        values = list(out.values())
        inner = None
        if len(values) != len(bufs):
            if not (_DICT.issuperset(map(type, values))
                    and _DICT.issuperset(map(type, d.values()))):
                return
            inner = list(map(list, values))
            if not _PLAIN_KEYS.issuperset(map(type, chain.from_iterable(inner))):
                return
            values = [t for v in values for t in v.values()]
            if len(values) != len(bufs):
                return
        if not all(map(operator.is_, values, bufs)):
            return
        keys = list(d)
        blocks, chunks, loose = self.blocked(out, keys, inner, path, bufs)
        self.bufs[start:] = self.to[copies:] = bufs
        rows = None if inner is None else list(out.values())  # (their buffers now blocks')
        self.plans[path] = Plan(keys, None if inner is None else inner_of(inner), rows, out,
                                bufs, list(map(_DTYPE, bufs)), loose,
                                [bufs[i].shape for i in loose], blocks, chunks, [])

    def blocked(self, out: Any, keys: list[Any], inner: list[list[Any]] | None,
                path: tuple[Any, ...], bufs: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[Chunk], list[int]]:
        """Give the small tensors among ``bufs`` (a plan's, in place) views of one block per
        shape and dtype, in ``out`` and in their entries too, one block at a time (each
        replaced buffer is freed as its block is made); return the blocks, their members by
        chunk, and the indices of the others."""
        groups: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
        loose = []
        for i, (shape, dtype, size) in enumerate(zip(map(_SHAPE, bufs), map(_DTYPE, bufs),
                                                     map(_NBYTES, bufs))):
            if 0 < size <= BLOCKED:  # (an empty tensor: a buffer of its own, no address)
                groups.setdefault((shape, dtype), []).append(i)
            else:
                loose.append(i)
        places = ([(out, k) for k in keys] if inner is None
                  else [(out[k], name) for k, names in zip(keys, inner) for name in names])
        entries = ([(self.cache[path], k) for k in keys] if inner is None
                   else [(self.cache[(*path, k)], name) for k, names in zip(keys, inner)
                         for name in names])
        blocks = []
        parts: list[list[Part]] = [[] for _ in range(0, len(bufs), CHUNK)]
        for (shape, dtype), idx in groups.items():
            if len(idx) == 1:
                loose.append(idx[0])
                continue
            block = torch.empty((len(idx), *shape), dtype=dtype, device="cpu")
            for i, view in zip(idx, block.unbind()):
                bufs[i] = view
                container, key = places[i]
                container[key] = view
                held, name = entries[i]
                held[name] = (view, shape, dtype, view.nbytes)
            blocks.append(block)
            for c, members in groupby(range(len(idx)), lambda j: idx[j] // CHUNK):
                rows = list(members)
                at = [idx[j] for j in rows]
                # (one member: a slice, which gives a list of it)
                take = operator.itemgetter(*at) if len(at) > 1 else operator.itemgetter(
                    slice(at[0], at[0] + 1))
                parts[c].append(Part(take, at[0], shape, block[rows[0]:rows[-1] + 1]))
        self.created = self.created or bool(blocks)  # (the replaced buffers are dropped)
        loose.sort()
        chunks = [(c * CHUNK, (c + 1) * CHUNK, p) for c, p in enumerate(parts)]
        return blocks, chunks, loose


def unblock(buffers: dict[tuple[Any, ...], dict[Any, Entry]],
            plans: dict[tuple[Any, ...], Plan]) -> None:
    """Give the entries that are views of a block some of whose views were dropped (their
    container shrank, its plan is gone) buffers of their own: a view keeps its whole block
    alive. A plan holding such a view (a plan made anew after a shrink keeps a block's last
    view as a loose buffer) is dropped with it: the next snapshot plans the container again,
    with the new buffers. (A plan's blocks are used whole while it lasts. Done as the next
    snapshot starts: the last one's tree holds the views it was copied into.)"""
    views = [(entries, k, e) for entries in buffers.values() for k, e in entries.items()
             if e[0]._base is not None]
    if not views:
        return
    used = Counter(id(e[0]._base) for _, _, e in views)
    replaced = set()
    for entries, k, (view, shape, dtype, size) in views:
        base = view._base
        assert base is not None  # (for mypy: listed above)
        if used[id(base)] < len(base):
            entries[k] = (torch.empty(shape, dtype=dtype, device="cpu"), shape, dtype, size)
            replaced.add(id(view))
    for path in [p for p, plan in plans.items() if not replaced.isdisjoint(map(id, plan.bufs))]:
        del plans[path]
