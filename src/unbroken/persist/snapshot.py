"""A consistent snapshot of a state tree, taken at the update boundary: every tensor copied
into a host buffer reused from one save to the next (pinned when the tensor lives on a GPU),
everything else deep-copied, so nothing the training loop does after ``save()`` returns can
change what is written (the defect of PyTorch #144657 and Lightning #21079: a background save
of live tensors that mixes two steps)."""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..dist.sharded import is_sharded
from ..errors import SaveFailed, UnsupportedValue
from ..state.codec import MAX_DEPTH, encode_tree
from ..state.freed import shortfall
from ..state.views import address, view_ident
from .plans import Entry, Plan, Planning, unblock

# Path elements no user key equals: the buffers of an object's attributes and of dict keys.
_ATTRIBUTES, _KEY = object(), object()
# Leaves taken as they are: immutable, they cannot change after ``save()`` returns.
_IMMUTABLE = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype,
                        torch.device, torch.Size})
_NONE: dict[Any, Entry] = {}  # the entries of a container that has none yet (never written)


class SnapshotBuffers:
    """Host buffers by tree path, reused while a tensor keeps its shape, dtype and kind.
    At most one save is in flight, and the next snapshot is taken only after it ended, so a
    buffer is never written while a save still reads it."""

    def __init__(self) -> None:
        # Entries by the path of their container, then their key in it: no path tuple is
        # built per tensor, and the usual snapshot, which uses every entry, changes nothing.
        self._buffers: dict[tuple[Any, ...], dict[Any, Entry]] = {}
        self._plans: dict[tuple[Any, ...], Plan] = {}  # by the path of their container
        self._count = 0  # entries in _buffers; -1 after a snapshot that failed
        self._dropped = False  # entries dropped by the last snapshot: maybe a block's views
        self.nbytes = 0  # bytes copied by the last snapshot: those of its entries

    def take(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``tree`` that shares no mutable object with it."""
        # (Buffers made under inference_mode would be inference tensors, which a later
        # snapshot outside it could not write: a save from an evaluation hook.)
        with torch.inference_mode(False):
            try:
                return _Taking(self).tree(tree)
            except (MemoryError, RuntimeError) as e:
                if not isinstance(e, MemoryError) and "allocate" not in str(e):
                    raise
                # (no memory for the buffers: the save fails, typed; training may go on, and
                # the next snapshot makes what is missing)
                raise SaveFailed(f"no memory for the snapshot of an async save "
                                 f"({str(e).splitlines()[0][:200]}); older generations are "
                                 "untouched") from e


class _Taking(Planning):
    """One snapshot: the tree rebuilt (dicts, lists and tuples directly; any other container
    through ``copy.deepcopy``), every tensor replaced by its buffer. The CPU tensors' copies
    run at the end, in one ``_foreach_copy_`` call: 10,000 small tensors are common, and a
    ``copy_`` each costs more than their bytes. (Each torch call costs ~0.1-1 us, and each
    object made per tensor brings the garbage collector sooner: the usual tensor gets few.)"""

    def __init__(self, buffers: SnapshotBuffers) -> None:
        self.buffers = buffers
        self.cache = buffers._buffers
        self.plans = buffers._plans
        self.created = False  # an entry added or replaced: the unused ones are then dropped
        # Each view met and its buffer. The same view twice (tied weights: two state_dict
        # entries of one parameter) stays one tensor, as the encoder stores it once: views
        # are found by address (a tensor without one: by -id), then `view_ident`, which costs
        # more torch calls, only among the views at that address (``after``: the next one).
        self.src: list[torch.Tensor] = []
        self.bufs: list[torch.Tensor] = []
        self.views: dict[int, int] = {}
        self.after: dict[int, int] = {}
        # The views a plan took: (the index of its first in ``src``, its views' addresses ->
        # their index from there), the plan's own (`Plan.seen`), not copied into ``views``.
        self.placed: list[tuple[int, dict[int, int]]] = []
        # What the one _foreach_copy_ copies at the end: the CPU tensors met (in order) that
        # neither were copied alone (another device, a subclass) nor by a plan's block.
        self.to: list[torch.Tensor] = []
        self.of: list[torch.Tensor] = []
        self.cuda = False
        # id(tensor) -> its buffer, for deepcopy. The views join it only when a deepcopy
        # needs it (``merged`` of them so far): most trees need none.
        self.memo: dict[int, Any] = {}
        self.merged = 0

    def tree(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        b, count = self.buffers, self.buffers._count
        if b._dropped:
            b._dropped = False
            unblock(b._buffers, b._plans)
        b._count = -1  # (until this snapshot completes: a failed one may have added entries)
        out = self.fill({}, tree.items(), ())
        if self.to:
            with torch.no_grad():  # (a parameter's history is not the buffer's)
                try:
                    torch._foreach_copy_(self.to, self.of)
                except NotImplementedError:  # (a lazily negated float8: no negation in torch)
                    encode_tree(tree)  # the encoder names the tensor it refuses
                    raise
        if self.cuda:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        if self.created or len(self.bufs) != count:  # (each entry is used at most once)
            used = {id(x) for x in self.bufs}
            b._buffers = {p: kept for p, entries in self.cache.items()
                          if (kept := {k: e for k, e in entries.items() if id(e[0]) in used})}
            sizes = [e[3] for entries in b._buffers.values() for e in entries.values()]
            count, b.nbytes = len(sizes), sum(sizes)
            b._plans = {p: plan for p, plan in self.plans.items()
                        if all(id(x) in used for x in plan.bufs)}
            b._dropped = True
        b._count = count
        return out

    def fill(self, out: Any, items: Iterable[tuple[Any, Any]], path: tuple[Any, ...]) -> Any:
        """``out`` given the items of the container at ``path``, each key and value copied
        (a value's buffer found by its original key)."""
        if len(path) > MAX_DEPTH:  # (a container holding itself: the encoder's refusal)
            raise UnsupportedValue(f"{_shown(path[:8])}...: nested deeper than {MAX_DEPTH} "
                                   "levels; make its state_dict() return a tree, not a cycle")
        entries = self.cache.get(path, _NONE)
        views, placed, src, bufs, to, of = (self.views, self.placed, self.src, self.bufs,
                                            self.to, self.of)
        for k, v in items:
            key = k if type(k) in _IMMUTABLE else self.key(k, path)
            kind = type(v)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                # The usual case, inline in its fewest torch calls: a CPU tensor met first,
                # whose last buffer fits; anything else (a tie, a new shape, no address) in
                # `tensor`. (A parameter: the async save's model, not detached.)
                entry, buf = entries.get(k), None
                try:
                    ptr = (v.data_ptr() if entry is not None and v.is_cpu
                           and v.shape == entry[1] and v.dtype is entry[2] else 0)
                except RuntimeError:  # (a sparse tensor has no storage, a nested no shape)
                    ptr = 0
                if (ptr and ptr not in views and entry is not None  # (entry: for mypy)
                        and (not placed or self.met(ptr) is None)
                        and shortfall(v, ptr) is None):
                    views[ptr], buf = len(src), entry[0]
                    src.append(v)
                    bufs.append(buf)
                    of.append(v)
                    to.append(buf)
                out[key] = buf if buf is not None else self.tensor(v, path, k)
            elif kind in _IMMUTABLE:
                out[key] = v
            elif kind is dict:  # (the usual container, without `node`)
                out[key] = self.mapping({}, v, (*path, k))
            elif isinstance(v, torch.Tensor):
                out[key] = self.tensor(v, path, k)
            else:
                out[key] = self.node(v, (*path, k))
        return out

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...], key: Any) -> torch.Tensor:
        """Any tensor, entry ``key`` of the container at ``path``: its view's buffer if met
        already, else its entry's buffer (a new one if that does not fit), copied into."""
        if t.layout != torch.strided:  # (the encoder's refusals, before a buffer is made)
            raise UnsupportedValue(
                f"{_shown((*path, key))}: tensor with layout {t.layout} cannot be stored; "
                "convert it to a dense tensor (e.g. .to_dense()) in state_dict()")
        if t.is_meta or t.is_nested or t.is_quantized:
            what = ("a meta tensor holds no data to store; materialize it (e.g. .to_empty())"
                    if t.is_meta else "a nested tensor cannot be stored; store its "
                    "components (.unbind())" if t.is_nested else
                    f"tensors of dtype {t.dtype} cannot be stored (quantized dtypes are not "
                    "supported); convert them (e.g. .dequantize()) in state_dict()")
            raise UnsupportedValue(f"{_shown((*path, key))}: {what} before saving")
        # (A DTensor has no memory of its own to read, which `address` would refuse as
        # another tensor's: its buffer is a DTensor, which its own copy_ fills below.)
        ptr = 0 if type(t) is not torch.nn.Parameter and is_sharded(t) else address(
            t, _shown((*path, key)))
        at = ptr or -id(t)  # (addresses and ids are positive: the keys never clash)
        head = i = self.met(at)
        while i is not None:
            other = self.src[i]
            if other is t or (ptr and view_ident(other) == view_ident(t)):
                self.memo[id(t)] = self.bufs[i]
                return self.bufs[i]
            i = self.after.get(i)
        i = len(self.src)
        if head is not None:
            self.after[i] = head
        self.views[at] = i
        entries = self.cache.setdefault(path, {})
        entry = _fit(entries.get(key), t)
        if entry is not entries.get(key):
            entries[key], self.created = entry, True
        buf = entry[0]
        self.src.append(t)
        self.bufs.append(buf)
        kind = type(t)
        if t.is_cpu and (kind is torch.Tensor or kind is torch.nn.Parameter):
            self.of.append(t)
            self.to.append(buf)
        elif t.is_cpu:
            buf.copy_(t.detach())  # (a DTensor: its own copy_)
        else:
            self.cuda = self.cuda or t.device.type == "cuda"
            buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        return buf

    def met(self, at: int) -> int | None:
        """The index in ``src`` of the last view met at address ``at`` (the others follow
        by ``after``), or None."""
        i = self.views.get(at)
        if i is None:
            for first, where in self.placed:
                j = where.get(at)
                if j is not None:
                    return first + j
        return i

    def node(self, node: Any, path: tuple[Any, ...]) -> Any:
        """A container at ``path`` rebuilt, or anything else deep-copied."""
        kind = type(node)
        if kind is dict:
            return self.mapping({}, node, path)
        if kind is list or kind is tuple:
            if len(path) <= MAX_DEPTH and _IMMUTABLE.issuperset(map(type, node)):
                # (an optimizer group's parameter names: ~0.4 us a name spared in `fill`)
                return list(node) if kind is list else node
            items = self.fill({}, enumerate(node), path).values()
            return list(items) if kind is list else tuple(items)
        if kind is OrderedDict or kind is Counter:  # a module's state_dict: with _metadata
            out = self.mapping(kind(), node, path)
            if vars(node):
                vars(out).update(self.fill({}, vars(node).items(), (*path, _ATTRIBUTES)))
            return out
        if kind is np.ndarray and not node.dtype.hasobject:
            # (the RNG part's NumPy state, at every save: no tensor inside, so without the
            # memo below, whose ids of every tensor met cost ~1 ms for 10,000 tensors)
            return node.copy(order="K")  # (as deepcopy: the strides' order kept)
        # Anything else (a NumPy array, a subclass of a container): deepcopy, after its
        # tensors and every one met so far are in the memo, so that it takes their buffers.
        # (What the encoder cannot store is refused by it, typed, in the save.)
        for parent, key, t in _tensors(node, path):
            self.tensor(t, parent, key)
        self.memo.update(zip(map(id, self.src[self.merged:]), self.bufs[self.merged:]))
        self.merged = len(self.src)
        try:
            return copy.deepcopy(node, self.memo)
        except Exception as e:  # noqa: BLE001 -- a lock, a generator, an open file: typed
            raise UnsupportedValue(
                f"{_shown(path)}: value of type {kind.__module__}.{kind.__qualname__} cannot "
                f"be copied for an async save ({type(e).__name__}: {e!s:.120}), nor stored "
                "without pickle; return tensors, numbers, strings, bytes, lists, tuples or "
                "dicts from state_dict()") from None

    def key(self, key: Any, path: tuple[Any, ...]) -> Any:
        """A mutable dict key (a tensor, a tuple holding one): a copy, as any other value."""
        k = (_KEY, id(key))
        if isinstance(key, torch.Tensor):
            return self.tensor(key, path, k)
        return self.node(key, (*path, k))


def _fit(entry: Entry | None, t: torch.Tensor) -> Entry:
    """``entry`` if its buffer fits ``t`` (shape, dtype, kind), else a new buffer's."""
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    if entry is not None and t.shape == entry[1] and (
            t.dtype is entry[2] if plain
            else type(entry[0]) is type(t) and t.dtype == entry[0].dtype
            and _same_layout(entry[0], t)):
        return entry
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    elif plain:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")  # (whatever the default)
    else:  # a DTensor: the same mesh and placements, this rank's chunk
        buf = torch.empty_like(t.detach())
    return buf, t.shape, t.dtype if plain else None, t.nbytes


def _same_layout(buf: torch.Tensor, t: torch.Tensor) -> bool:
    placements = getattr(t, "placements", None)
    return placements is None or (placements == getattr(buf, "placements", None)
                                  and getattr(t, "device_mesh", None)
                                  == getattr(buf, "device_mesh", None))


def _tensors(node: Any, path: tuple[Any, ...]
             ) -> Iterator[tuple[tuple[Any, ...], Any, torch.Tensor]]:
    """(the path of its container, its key, the tensor) for each tensor in ``node``'s dicts,
    lists and tuples."""
    items = (node.items() if isinstance(node, Mapping)
             else enumerate(node) if isinstance(node, (list, tuple)) else ())
    for k, v in items:
        if isinstance(v, torch.Tensor):
            yield path, k, v
        else:
            yield from _tensors(v, (*path, k))


def _shown(path: tuple[Any, ...]) -> str:
    """A tree path as errors name it: the part, then the keys within it."""
    keys = ".".join("<key>" if type(k) is tuple else str(k) for k in path[1:])
    return f"part {path[0]!r}" + (f", {keys}" if keys else "")
