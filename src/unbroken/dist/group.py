"""The ranks of a job, as one Checkpointer sees them, and the few collectives unbroken needs.

A process outside ``torch.distributed`` (or with ``world_size == 1``) is a group of one and
every collective is the identity, so single-process code pays nothing. Payloads travel as
JSON in ``uint8`` tensors (``torch.distributed``'s object collectives pickle; unbroken never
does). A collective that fails (a rank died: gloo sees the connection close; or it stayed away
past the process group's timeout) raises `RankFailed`, never hangs beyond that timeout.

torch is imported by the collectives, not with this module: the persisting process
(`persist._worker`) uses groups of files (`dist.filegroup`) and never imports torch."""

from __future__ import annotations

import datetime
import functools
import json
import struct
import sys
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ..errors import SaveFailed, UnbrokenError, UnbrokenWarning

if TYPE_CHECKING:
    import torch


def background_group(process_group: Any, timeout: float) -> Group:
    """A gloo group over the ranks of ``process_group`` (default: all), for collectives that
    run beside the training loop's (an async save): collective; every rank calls it at the
    same point."""
    import torch.distributed as dist

    if process_group is None:
        group = Group(dist.new_group(backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout)))
        # (named by a counter that never goes back: a later group never meets this one's
        # rendezvous keys in the store, so `close` may tear it down)
        group.disposable = True
        return group
    # A subgroup's ranks alone make it (others may be making their own subgroup's at the same
    # point: a group of every rank's would pair them up wrongly), named by its ranks. Never
    # torn down: torch names the next group of the same ranks as this one once it is gone,
    # and its rendezvous would read this one's keys, left in the store.
    return Group(dist.new_group(ranks=dist.get_process_group_ranks(process_group),
                                backend="gloo", timeout=datetime.timedelta(seconds=timeout),
                                use_local_synchronization=True))


def warn_ddp_buckets(ddp: Any) -> None:
    """Warn that a `DistributedDataParallel` of 3 or more ranks resumes within rounding, not
    bitwise, unless its buckets are never rebuilt.

    DDP regroups its gradient buckets in the order the first backward produced gradients,
    after a wrapper's first iteration; a resumed job's new wrapper runs its first update on
    the initial buckets. An element's place in a bucket decides the order in which the
    all-reduce sums it over the ranks: with 2 ranks a + b is b + a, with more the sums round
    otherwise. ``find_unused_parameters=True`` keeps the first buckets for the whole run
    (measured, plain torch, 4 gloo ranks, a wrapper made anew at the third update: the
    weights differed; with it, equal)."""
    import warnings

    group = getattr(ddp, "process_group", None)
    size = group.size() if group is not None and hasattr(group, "size") else 1
    if size >= 3 and not getattr(ddp, "find_unused_parameters", False):
        warnings.warn(UnbrokenWarning(
            f"DistributedDataParallel on {size} ranks rebuilds its gradient buckets after its "
            "first iteration, and a resumed job's new wrapper starts on the initial ones: the "
            "first update after a resume sums gradients in another order (equal within "
            "rounding, not bitwise). Wrap with DistributedDataParallel(..., "
            "find_unused_parameters=True), whose buckets are never rebuilt, for a bitwise "
            "resume"), stacklevel=3)


class RankFailed(UnbrokenError):
    """Another rank of the job failed, died or stayed away from a collective."""


# Bytes of a collective's name the ranks gather when their collectives differ (the message).
_NAMED = 32
# A collective's header: its value (a payload's size, an integer) below its tag (a crc32);
# the largest value it holds stands for one too large on some rank.
_VALUE_BITS = 31
_TOO_LARGE = (1 << _VALUE_BITS) - 1

_P = ParamSpec("_P")
_R = TypeVar("_R")


def saving(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """A part of a save: another rank failing in its collectives fails the save, a
    `SaveFailed` (what a caller of ``save()`` catches), not a bare `RankFailed`."""
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except RankFailed as e:
            raise SaveFailed(f"{e}; the save failed (older generations are untouched)") from e
    return wrapper


class Group:
    """The job's ranks (``process_group``: default, the initialized default group)."""

    def __init__(self, process_group: Any = None) -> None:
        # (a process that never imported torch.distributed cannot have joined a job)
        dist: Any = sys.modules.get("torch.distributed")
        joined = dist is not None and dist.is_available() and dist.is_initialized()
        if joined and process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(f"process_group: this rank (rank {dist.get_rank()} of the world) is "
                             "not one of its ranks; pass the subgroup this rank belongs to")
        self.active = joined and dist.get_world_size(process_group) > 1
        self.pg = process_group
        self.disposable = False  # (a group `background_group` made that `destroy` may end)
        self.rank = dist.get_rank(process_group) if self.active else 0
        self.size = dist.get_world_size(process_group) if self.active else 1
        # torch names a broadcast's source by its rank in the world, not in the group
        self._leader_rank = (dist.get_global_rank(process_group, 0)
                             if self.active and process_group is not None else 0)
        # NCCL moves CUDA tensors only: the payloads go through this rank's current device.
        self.device = "cpu"
        if self.active and dist.get_backend(process_group) == "nccl":
            import torch

            self.device = f"cuda:{torch.cuda.current_device()}"

    @property
    def leader(self) -> bool:
        """Rank 0: the writer lock, the manifest, retention and every decision."""
        return self.rank == 0

    def destroy(self) -> None:
        """Tear down a group `background_group` made (``disposable``; any other is left as
        it is), once no collective of its is pending on any rank: its gloo threads and
        connections end here, not in the interpreter's teardown, where a live group's
        threads can abort the process ("terminate called without an active exception").
        Local, not collective."""
        dist: Any = sys.modules.get("torch.distributed")
        if self.disposable and self.pg is not None and dist is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.pg)
            except (RuntimeError, ValueError):  # (already gone with the default group)
                pass
            # (and no reference kept: the group's threads end with its last one, which
            # otherwise lives until the interpreter's teardown)
            self.pg = None
        self.active = False

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args, group=self.pg)
        except RuntimeError as e:
            raise RankFailed(f"rank {self.rank} of {self.size}: {what} failed: another rank "
                             "failed or died, or did not get here (every rank calls save(), "
                             "step_done() and restore() alike, at the same steps) "
                             f"({str(e).splitlines()[0][:200]})") from None

    def _header(self, value: int, what: str, kind: str) -> int:
        """The largest of every rank's ``value``, found with the tag of the collective each
        rank is in (its kind and name): the first step of every collective here, one
        all-reduce of one shape, so that two different ones (a rank saving while another
        restores) meet on it and fail on every rank alike, naming what each was doing,
        instead of pairing payloads of unlike sizes. (An all-reduce: an all-gather costs up to
        6x as much at 4 ranks on 2 cores, measured; the names are gathered only when the tags
        differ, which every rank sees.)"""
        import torch
        import torch.distributed as dist

        # (a value out of range is sent as the largest, and refused on every rank alike)
        fits = 0 <= value < _TOO_LARGE
        name = what.encode()
        tag = zlib.crc32(kind.encode() + b":" + name)  # (one kind of collective, by name)
        # Two integers, as cheap as one in gloo (three cost 1.4x at 2 ranks, 1.6x at 4): the
        # tag above the value, whose largest is the largest value when the tags are equal,
        # and the negated tag, whose largest is the smallest tag.
        t = torch.tensor([tag << _VALUE_BITS | (value if fits else _TOO_LARGE), -tag],
                         dtype=torch.int64, device=self.device)
        self._call(what, dist.all_reduce, t, dist.ReduceOp.MAX)
        top, least = t.cpu().tolist()
        if top >> _VALUE_BITS == -least:  # (the largest tag is the smallest: all are this one)
            largest = int(top & _TOO_LARGE)
            if largest == _TOO_LARGE:
                where = f"this rank's, {value}" if not fits else "another rank's"
                raise UnbrokenError(f"{what}: a value too large for a collective ({where}; "
                                    f"0 to {_TOO_LARGE - 1} fit); nothing was done")
            return largest
        text = name[:_NAMED].ljust(_NAMED, b"\0")
        mine = torch.tensor([tag, *struct.unpack(f"<{_NAMED // 8}q", text)],
                            dtype=torch.int64, device=self.device)
        out = [self._zeros(1 + _NAMED // 8, torch.int64) for _ in range(self.size)]
        self._call(what, dist.all_gather, out, mine)
        rows = [row.cpu().tolist() for row in out]
        names = {r: struct.pack(f"<{_NAMED // 8}q", *row[1:]).rstrip(b"\0").decode(
            errors="replace") for r, row in enumerate(rows) if row[0] != tag}
        doing = "; ".join(f"rank {r} was {w!r}" + " (another kind)" * (w == what)
                          for r, w in names.items())
        raise RankFailed(f"rank {self.rank} of {self.size}: {what} failed: {doing} (the ranks "
                         "did not call the Checkpointer alike: one saved, restored or built "
                         "one where another did not, as a rank that left its loop early or "
                         "raised does); nothing was done")

    def all_gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order, on every rank."""
        if not self.active:
            return [value]
        import torch
        import torch.distributed as dist

        data = json.dumps(value).encode()
        longest = self._header(len(data), what, "all_gather")
        # (padded with spaces, which JSON ignores after a value: no rank's size is needed)
        padded = torch.frombuffer(bytearray(data.ljust(longest)), dtype=torch.uint8)
        out = [self._zeros(longest, torch.uint8) for _ in range(self.size)]
        self._call(what, dist.all_gather, out, padded.to(self.device))
        return [json.loads(bytes(t.cpu().numpy()).decode()) for t in out]

    def broadcast(self, value: Any, what: str) -> Any:
        """The leader's JSON-able ``value`` on every rank."""
        if not self.active:
            return value
        import torch
        import torch.distributed as dist

        data = json.dumps(value).encode() if self.leader else b""
        size = self._header(len(data), what, "broadcast")
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
               if self.leader else self._zeros(size, torch.uint8))
        if buf.numel():
            self._call(what, dist.broadcast, buf, self._leader_rank)
        return json.loads(bytes(buf.cpu().numpy()).decode())

    def max_int(self, value: int, what: str) -> int:
        """The largest of every rank's ``value`` (0 <= value < 2**31): one all-reduce of two
        integers."""
        if not self.active:
            return value
        return self._header(value, what, "max_int")

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        import torch

        return torch.zeros(n, dtype=dtype, device=self.device)

    def agree(self, problem: str | None, what: str) -> list[str]:
        """Each rank's problem (None: fine) gathered: the problems of every rank, named."""
        return [f"rank {r}: {p}" for r, p in enumerate(self.all_gather(problem, what)) if p]
