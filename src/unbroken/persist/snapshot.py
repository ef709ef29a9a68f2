"""A consistent snapshot of a state tree, taken at the update boundary: every tensor copied
into a host buffer reused from one save to the next (pinned when the tensor lives on a GPU),
everything else deep-copied, so nothing the training loop does after ``save()`` returns can
change what is written (the defect of PyTorch #144657 and Lightning #21079: a background save
of live tensors that mixes two steps)."""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..state.codec import ViewMemo

# Path elements no user key equals: the buffers of an object's attributes and of dict keys.
_ATTRIBUTES, _KEY = object(), object()
# Leaves taken as they are: immutable, they cannot change after ``save()`` returns.
_IMMUTABLE = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype,
                        torch.device, torch.Size})


class SnapshotBuffers:
    """Host buffers by tree path, reused while a tensor keeps its shape, dtype and kind.
    At most one save is in flight, and the next snapshot is taken only after it ended, so a
    buffer is never written while a save still reads it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.nbytes = 0  # bytes copied by the last snapshot

    def take(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``tree`` that shares no mutable object with it."""
        return _Taking(self).tree(tree)

    def _buffer(self, path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if (buf is not None and type(t) is torch.Tensor and type(buf) is torch.Tensor
                and buf.dtype == t.dtype and buf.shape == t.shape):
            return buf  # (the usual case, without the checks below: a call costs ~1 us)
        if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                or type(buf) is not type(t) or not _same_layout(buf, t)):
            if t.device.type == "cuda":
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            elif type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
                buf = torch.empty(t.shape, dtype=t.dtype)
            else:  # a DTensor: the same mesh and placements, this rank's chunk
                buf = torch.empty_like(t.detach())
            self._buffers[path] = buf
        return buf


class _Taking:
    """One snapshot: the tree rebuilt (dicts, lists and tuples directly; any other container
    through ``copy.deepcopy``), every tensor replaced by its buffer. The CPU tensors' copies
    run at the end, in one ``_foreach_copy_`` call: 10,000 small tensors are common, and a
    ``copy_`` each costs more than their bytes."""

    def __init__(self, buffers: SnapshotBuffers) -> None:
        self.buffers = buffers
        self.memo: dict[int, Any] = {}  # id(tensor) -> its buffer, for deepcopy
        self.seen = ViewMemo()  # one buffer per view
        self.used: set[tuple[Any, ...]] = set()
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.cuda = False
        buffers.nbytes = 0

    def tree(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: self.node(v, (k,)) for k, v in tree.items()}
        if self.dst:
            with torch.no_grad():  # (a parameter's history is not the buffer's)
                torch._foreach_copy_(self.dst, self.src)
        if self.cuda:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        b = self.buffers
        b._buffers = {p: buf for p, buf in b._buffers.items() if p in self.used}
        return out

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        # The same view twice (tied weights: two state_dict entries of one parameter) stays
        # one tensor, as the encoder stores it once.
        key, buf = self.seen.find(t)
        if buf is None:
            buf = self.buffers._buffer(path, t)
            self.seen.add(key, t, buf)
            self.used.add(path)
            kind = type(t)
            if t.is_cpu and (kind is torch.Tensor or kind is torch.nn.Parameter):
                self.dst.append(buf)
                self.src.append(t)
            elif t.is_cpu:
                buf.copy_(t.detach())  # (a DTensor: its own copy_)
            else:
                self.cuda = self.cuda or t.device.type == "cuda"
                buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            self.buffers.nbytes += t.nbytes
        self.memo[id(t)] = buf
        return buf

    def node(self, node: Any, path: tuple[Any, ...]) -> Any:
        kind = type(node)
        if kind is torch.Tensor:
            return self.tensor(node, path)
        if kind in _IMMUTABLE:
            return node
        if isinstance(node, torch.Tensor):
            return self.tensor(node, path)
        if kind is dict:
            return {k if type(k) in _IMMUTABLE else self.key(k, path): self.node(v, (*path, k))
                    for k, v in node.items()}
        if kind is list:
            return [self.node(v, (*path, i)) for i, v in enumerate(node)]
        if kind is tuple:
            return tuple([self.node(v, (*path, i)) for i, v in enumerate(node)])
        if kind is OrderedDict or kind is Counter:  # a module's state_dict: with _metadata
            out: Any = kind()
            for k, v in node.items():
                out[k if type(k) in _IMMUTABLE else self.key(k, path)] = self.node(v, (*path, k))
            if vars(node):
                vars(out).update(self.node(vars(node), (*path, _ATTRIBUTES)))
            return out
        # Anything else (a NumPy array, a subclass of a container): deepcopy, after its
        # tensors are in the memo, so that it takes their buffers.
        for p, t in _tensors(node, path):
            self.tensor(t, p)
        return copy.deepcopy(node, self.memo)

    def key(self, key: Any, path: tuple[Any, ...]) -> Any:
        """A mutable dict key (a tensor, a tuple holding one): a copy, as any other value."""
        return self.node(key, (*path, _KEY, id(key)))


def _same_layout(buf: torch.Tensor, t: torch.Tensor) -> bool:
    placements = getattr(t, "placements", None)
    return placements is None or (placements == getattr(buf, "placements", None)
                                  and getattr(t, "device_mesh", None)
                                  == getattr(buf, "device_mesh", None))


def _tensors(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _tensors(v, (*path, i))
