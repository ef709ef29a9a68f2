"""A consistent snapshot of a state tree, taken at the update boundary: every tensor copied
into a host buffer reused from one save to the next (pinned when the tensor lives on a GPU),
everything else deep-copied, so nothing the training loop does after ``save()`` returns can
change what is written (the defect of PyTorch #144657 and Lightning #21079: a background save
of live tensors that mixes two steps)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class SnapshotBuffers:
    """Host buffers by tree path, reused while a tensor keeps its shape, dtype and kind.
    At most one save is in flight, and the next snapshot is taken only after it ended, so a
    buffer is never written while a save still reads it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.nbytes = 0  # bytes copied by the last snapshot

    def take(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``tree`` that shares no mutable object with it."""
        memo: dict[int, Any] = {}
        seen: dict[tuple[Any, ...], torch.Tensor] = {}
        used: set[tuple[Any, ...]] = set()
        self.nbytes = 0
        cuda = False
        for path, t in _tensors(tree, ()):
            # The same view twice (tied weights: two state_dict entries of one parameter)
            # stays one tensor, as the encoder stores it once.
            ident = _ident(t)
            if ident in seen:
                memo[id(t)] = seen[ident]
                continue
            buf = self._buffer(path, t)
            used.add(path)
            cuda = cuda or t.device.type == "cuda"
            buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            self.nbytes += t.numel() * t.element_size()
            memo[id(t)] = seen[ident] = buf
        if cuda:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        self._buffers = {p: b for p, b in self._buffers.items() if p in used}
        return copy.deepcopy(dict(tree), memo)

    def _buffer(self, path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
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


def _ident(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensor objects the same data (one view of one storage)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a DTensor has no storage of its own
        ptr = 0
    if ptr == 0:
        return (id(t),)
    return (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


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
