"""The persisting process (`persist.process`): ``python -m unbroken.persist._worker RUN FD
[--member]``.

It never imports torch (nor does anything it imports: `unbroken`'s root imports its names
lazily): the snapshot is bytes in shared memory, and what it does with them (write, hash,
commit, read back, retention) needs none. It starts in about 0.3 s and holds about 30 MB,
beside every rank of a job; with torch it took 2-4 s and 230 MB.

Takes the persister byte of the run's lock first (handed over by its writer) and says it is
ready; holds it for its whole life. Then, over the socket ``FD`` (`_wire`), one request per
save: where the snapshot lies in the shared-memory segment (received as a descriptor when
new) and the manifest's fields; it commits, reads back, applies retention and replies. At the
end of its input (the writer said quit, or died) it ends: a save handed over before the
writer died is finished first.

In a job of many ranks every rank has one. A request then names the save's staging folder,
the rank and the job's size, and the persisting processes commit and read back together as
the ranks of a job do, their collectives going through files (`dist.filegroup`); only the
leader's holds the lock (a ``--member``, of any other rank, takes no byte of it: it writes
only its own files into the leader's staging folder), moves aside and applies retention."""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from .._pacing import Pacer, installed
from .._procs import PERSISTER_OF_ENV
from .._progress import Progress
from ..dist.commit import commit_staged, describe, read_back, save_failed
from ..dist.filegroup import FileGroup
from ..dist.group import Group, RankFailed
from ..errors import SaveFailed, UnbrokenError
from ..store.backends.killpoints import io_count
from ..store.generations import GenerationStore
from ..store.lock import take_persister
from ..store.manifest import Artifact, Manifest
from ..store.retention import Keep
from ..store.sources import Linked
from ..writer import RunWriter
from . import _wire


def _copy(path: str, chunk: int = 8 << 20) -> Iterator[bytes]:
    """A linked file's bytes, read again where a link cannot be made (the store checks that
    they hash as listed)."""
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield data


def _save(store: GenerationStore, request: dict[str, Any], shm: mmap.mmap, group: Group,
          reached: set[str]) -> dict[str, Any]:
    """One save, paced by ``persist_share`` until the writer's loop waits for it (the writer
    then writes the request's number into the segment's first bytes, `_wire.hurried`) or the writer
    is gone (nothing left to protect; finished sooner, it is at risk for less time).
    ``reached`` gets ``"committed"`` once the generation is committed (see `_persist`)."""
    share, seq = request.get("share"), request.get("seq", 0)
    writer = os.getppid()
    pacer = None if share is None else Pacer(
        float(share), time.process_time,
        lambda: _wire.hurried(shm) >= seq or os.getppid() != writer)
    with installed(pacer):
        return _persist(store, request, shm, group, reached)


def _persist(store: GenerationStore, request: dict[str, Any], shm: mmap.mmap, group: Group,
             reached: set[str]) -> dict[str, Any]:
    """One save: alone, or as one rank of a job (``group``, a `FileGroup`). ``reached`` gets
    ``"committed"`` once the generation is committed: a failure from there on (its read-back,
    which reads the files it linked too) is one of a generation that was written, and the
    writer's next save links nothing (the reply says so, ``committed``), as in the other
    modes; one before (a write that failed: ENOSPC) committed nothing, and the files the next
    save may link are as they were."""
    step = request["step"]
    view = memoryview(shm)
    artifacts: dict[str, Any] = {}
    try:
        for a in request["artifacts"]:
            if "link" in a:
                source, size, digest = a["link"]
                artifacts[a["name"]] = Linked(source, size, digest,
                                              functools.partial(_copy, source))
            else:
                artifacts[a["name"]] = [_piece(view, at, n) for at, n in a["pieces"]]
        fields = request["manifest"]

        def make_manifest(written: list[Artifact]) -> Manifest:
            return Manifest(artifacts=written, **fields)

        try:
            if group.active:
                info = commit_staged(group, store, step, request["job"]["staging"], artifacts,
                                     make_manifest, request["again"])
            else:
                info = store.commit(step, artifacts, make_manifest, supersede=request["again"])
        except OSError as e:
            raise save_failed(store.root, step, e) from e
    finally:
        artifacts.clear()
        view.release()
    reached.add("committed")
    read_back(group, store, info, Progress("", 0),
              [a["name"] for a in request["artifacts"] if "link" in a])
    keep = request["keep"]
    writer = RunWriter(store, Keep(keep["last"], keep["every"],
                                   tuple(keep["best"]) if keep["best"] else None,
                                   keep["aside"]), leader=group.leader, take_lock=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.retain(step)
    # (its mutating I/O so far: the crash torture spreads numbered I/O kills over it)
    return {"ok": True, "warnings": [str(w.message) for w in caught], "ops": io_count()}


def _piece(view: memoryview, at: int, n: int) -> memoryview:
    """Bytes of the snapshot, where the writer says they lie in the segment."""
    if not (0 <= at and 0 <= n and at + n <= len(view)):
        raise ValueError(f"a piece of {n} bytes at {at}, outside the {len(view)}-byte "
                         "snapshot segment")
    return view[at:at + n]


def _typed(store: GenerationStore, request: dict[str, Any], e: Exception) -> Exception:
    """A save's failure as the writer raises it: typed, naming the generation."""
    step = request.get("step")
    if isinstance(e, RankFailed):  # (one of a job's persisting processes died or gave up)
        return SaveFailed(f"{e}; generation {step} is not known to be committed and read "
                          "back by every rank: older generations are untouched, and a restore "
                          "verifies a generation before it uses it")
    if isinstance(e, (UnbrokenError, OSError)):
        return e
    return SaveFailed(f"{store.root}: the persisting process failed on generation {step} "
                      f"({type(e).__name__}: {e}); older generations are untouched")


def _job(store: GenerationStore, step: int, j: Mapping[str, Any]) -> FileGroup:
    return FileGroup(store.fs, j["staging"], step, j["rank"], j["size"], j["timeout"])


def _serve(store: GenerationStore, sock: socket.socket) -> None:
    segment: tuple[int, mmap.mmap] | None = None
    announced: dict[str, Any] | None = None  # a job's save this rank's writer is encoding
    while True:
        try:
            request = _wire.receive(sock)
        except (_wire.Closed, OSError, ValueError):
            if announced is not None:  # the other ranks' persisting processes wait for it
                with contextlib.suppress(Exception):
                    step = announced["step"]
                    _job(store, step, announced).close(SaveFailed(
                        f"the training process of rank {announced['rank']} ended before it "
                        f"handed its share of generation {step} over"))
            return  # the writer is gone (or said nothing more): nothing left to commit
        if request.get("quit"):
            return
        if "announce" in request:
            announced = request["announce"]
            continue
        announced = None
        # Taken: before anything is done with it (a writer whose persisting process ended
        # before this hands the save to a new one, `process`).
        with contextlib.suppress(OSError):  # (the writer is gone: the save goes on)
            _wire.send(sock, {"took": request.get("seq")})
        job: FileGroup | None = None
        error: Exception | None = None
        reached: set[str] = set()
        try:
            if "job" in request:
                job = _job(store, request["step"], request["job"])
            if segment is None or segment[0] != request["segment"]:
                fd = _wire.receive_fd(sock)
                try:
                    segment = (request["segment"], mmap.mmap(
                        fd, request["segment_size"], access=mmap.ACCESS_READ))
                finally:
                    os.close(fd)
            reply = _save(store, request, segment[1], job or Group(), reached)
        except Exception as e:  # noqa: BLE001 -- handed to the writer, typed
            error = _typed(store, request, e)
            # (committed: failed after its generation was committed, `_persist`)
            reply = {"ok": False, **describe(error), "committed": "committed" in reached}
        if job is not None:  # the other ranks' persisting processes stop waiting for this one
            job.close(error)
        reply["seq"] = request.get("seq")
        try:
            _wire.send(sock, reply)
        except OSError:
            pass  # the writer is gone; the save was finished all the same


def _behind_the_loop() -> None:
    """Never preempt the training loop on waking: Linux's SCHED_BATCH (same share of the
    CPU, no wakeup preemption). Woken by a save's request, a process of the default policy
    took the core of the writer still in its ``send`` (the other core busy): 2.5 ms of a
    10,000-tensor save's 19 ms blocked, against 0.1 ms so (measured, `benchmarks/`)."""
    with contextlib.suppress(AttributeError, OSError):  # (elsewhere than Linux: as it is)
        # (only from the default policy: a trainer run under SCHED_IDLE, or a real-time one,
        # keeps its persisting process under its own)
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def main(root: str, fd: int, takes_lock: bool) -> None:
    _behind_the_loop()
    sock = socket.socket(fileno=fd)
    store = GenerationStore(root)
    held = None
    if takes_lock:
        try:
            held = take_persister(store.root)
        except Exception as e:  # noqa: BLE001 -- the writer raises it at its next save
            with contextlib.suppress(OSError):  # (unless it is gone already)
                _wire.send(sock, {"ok": False, **describe(e)})
            return
    if str(os.getppid()) != os.environ.get(PERSISTER_OF_ENV):
        if held is not None:
            os.close(held)  # the writer died before handing anything over
        return
    if held is not None:
        store.adopt_lock(held)
    try:
        try:
            _wire.send(sock, {"ready": os.getpid()})
        except OSError:
            return  # the writer closed before its first save: nothing to commit
        _serve(store, sock)
    finally:
        store.unlock()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] != ["--member"])
