"""Saves that survive the training process (``async_save="process"``): the snapshot is copied
into shared memory and a persisting process of this writer writes, commits, reads back and
verifies the generation, then applies retention. If the training process dies (SIGKILL, an
out-of-memory kill) after ``save()`` returned, the persisting process still commits that
generation, verified as usual, and the next writer of the run waits for it (the lock's
persister byte, `store.lock`) before it reads the run.

The persisting process is started with the Checkpointer, in a session of its own (a Ctrl-C
of the training job does not stop a save midway). It takes the persister byte first and says
so; no save is handed over before that, so a save ``save()`` returned from is always in the
hands of a process that holds the run. The two talk in JSON messages over a Unix socket pair
(`_wire`; nothing is pickled). The snapshot lives in an anonymous shared-memory file
(``memfd``) allocated in full up front (a full ``/dev/shm`` or memory limit is a `SaveFailed`,
never a SIGBUS) and passed to the persisting process as a descriptor: it is freed when both
processes have let go of it, whichever dies, and never named in a folder another job sees.
It is reused from one save to the next (at most one save is in flight).

In a job of many ranks every rank has a persisting process of its own, and they commit each
generation together through files (`dist.filegroup`); only the leader's takes the persister
byte (the other ranks hold no lock: they write their own files into the leader's staging
folder).

A persisting process says it took a save (``took``) before it does anything with it. One that
ended before that (killed between two saves: it may look alive for a moment after its
SIGKILL, until its last thread is gone) has written nothing of the save, which is then handed
to a new one once, with a warning; one that ended after is a `SaveFailed` (the generation may
be committed or not: a restore verifies it)."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..dist.commit import rebuild
from ..errors import SaveFailed, UnbrokenWarning
from ..state.tensorfile import Room
from ..store.generations import GenerationStore
from ..store.sources import Linked, Source
from . import _wire
from .launch import launch

_HANDSHAKE_S = 300.0  # for the persisting process to start and take the lock
_ENDING_S = 60.0  # for a persisting process whose socket closed to be gone
_TORCH_COPY = 1 << 20  # chunks from this size are copied by torch (threads), smaller by Python
_SLACK = 1 << 20  # a new segment's size is a multiple of this


class ProcessPersister:
    """The persisting process of one writer (see module doc)."""

    def __init__(self, store: GenerationStore, takes_lock: bool = True,
                 timeout: float = 600.0) -> None:
        """``takes_lock``: the persisting process holds the run's persister byte (one
        process, or the leader of a job). ``timeout``: how long the persisting processes of a
        job wait for one another (``async_timeout``)."""
        self._store = store
        self._takes_lock = takes_lock
        self.timeout = timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._handed_over = False  # the persister byte went to a persisting process
        self._running = False  # the running persisting process said it is ready
        self._seq = 0
        self._shm: mmap.mmap | None = None
        self._shm_fd: int | None = None
        self._shm_id = 0
        self._shm_sent = False  # the running persisting process has the segment
        # chunks built in the segment by the save being encoded (`room`): id -> (the view
        # given, its offset), and where the room's next chunk goes
        self._placed: dict[int, tuple[memoryview, int]] = {}
        self._room_end = _wire.HEAD
        self.nbytes = 0  # bytes of the last snapshot
        self.built = 0  # of which built in the segment by the encoder (`room`), not copied
        self.io_ops = 0  # mutating I/O operations of the persisting process, at its last reply
        self.died = False  # the persisting process ended before replying to the last save
        # the last save failed after its generation was committed (its read-back: what it
        # linked may be what failed), as its persisting process replied
        self.committed = False
        # what the save under way tells the persisting process (its announce, its request),
        # the process each went to (by `_started`), whether it said it took the request, and
        # whether one that ended before taking it was replaced yet (once a save)
        self._announce: dict[str, Any] | None = None
        self._message: dict[str, Any] | None = None
        self._sent_to: dict[str, int] = {}
        self._started = 0  # persisting processes started so far
        self._step: int | None = None
        self._taken = False
        self._replaced = False
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(me))

    def _fail(self, what: str, e: BaseException) -> SaveFailed:
        proc = self._proc
        pid = proc.pid if proc is not None else "none"
        if proc is not None and isinstance(e, (_wire.Closed, ConnectionError)):
            # (its socket closes before it can be reaped: it is ending)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_ENDING_S)
        if proc is not None and proc.poll() is not None:
            self._proc = None  # (its end is told here: the next save starts one, unwarned)
        return SaveFailed(f"{self._store.root}: {what} (persisting process {pid}): {e}; older "
                          "generations are untouched")

    def start(self) -> None:
        """Start the persisting process now (a fraction of a second: it never imports torch,
        see `persist._worker`), overlapped with whatever the script does before its first
        save."""
        if self._proc is None:
            self._start()

    def _start(self) -> None:
        if self._takes_lock and not self._handed_over:  # the first since the lock was taken
            self._store.hand_over()
            self._handed_over = True
        self._disconnect()
        self._proc, mine = launch(self._store.root, not self._takes_lock)
        self._sock, self._running, self._shm_sent = mine, False, False
        self._started += 1

    def _ready(self) -> socket.socket:
        """The socket of a persisting process that is ready (holding the run, where it takes
        the lock), started again if it died since the last save."""
        if self._proc is not None and self._proc.poll() is not None:
            # (ended between two saves, found before this one was sent: as `_replace` warns)
            warnings.warn(f"{self._store.root}: the persisting process {self._proc.pid} had "
                          f"ended (exit code {self._proc.returncode}) since the last save; a "
                          "new one takes this one", UnbrokenWarning, stacklevel=3)
            self._proc = None
        if self._proc is None:
            self._start()
        assert self._sock is not None
        if not self._running:  # (it starts in a fraction of a second; a loaded machine: more)
            self._sock.settimeout(_HANDSHAKE_S)
            try:
                said = _wire.receive(self._sock)
            finally:
                self._sock.settimeout(None)
            if "ready" not in said:
                raise rebuild(said) if "type" in said else SaveFailed(str(said)[:200])
            self._running = True
        return self._sock

    def _segment(self, size: int) -> mmap.mmap:
        """The reused shared-memory segment, grown to ``size`` bytes when needed."""
        if self._shm is not None and len(self._shm) >= size:
            return self._shm
        self._drop_segment()
        fd = os.memfd_create("unbroken-snapshot", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, max(size, 1))  # all of it now: no SIGBUS while copying
            self._shm = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            raise
        self._shm_fd, self._shm_id, self._shm_sent = fd, self._shm_id + 1, False
        return self._shm

    def _drop_segment(self) -> None:
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:  # a chunk built in it is still viewed: unmapped with the view
                pass
            self._shm = None
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None

    def room(self) -> Room:
        """Room in the segment for the chunks of the next snapshot that the encoder builds
        itself (`state.tensorfile.Room`: gathered small tensors), which `submit` then lists
        instead of copying: the segment of the last save, from its start (none before the
        first save). Only while no save is in flight (the persisting process reads the
        segment until it replies)."""
        self._placed, self._room_end = {}, _wire.HEAD
        return _Room(self, self._shm)

    def announce(self, step: int, job: Mapping[str, Any]) -> None:
        """Tell the persisting process which save of a job (``job``: staging folder, rank,
        size, timeout) this rank takes part in, before the snapshot: if this process dies
        before `submit` (killed while it encodes), the persisting process says so to the
        others', whose wait for this rank's files then ends at once, not at the timeout
        (holding the run's lock meanwhile)."""
        self._announce, self._message, self._sent_to = {"announce": {"step": step, **job}}, None, {}
        self._step, self._taken, self._replaced = step, False, False
        self._deliver("announced")

    def submit(self, request: Mapping[str, Any], artifacts: Mapping[str, Source]) -> None:
        """Copy ``artifacts`` into shared memory (the snapshot: when this returns, nothing
        the training loop does changes what is written) and hand the save over to a
        persisting process that holds the run. A chunk built in this save's `room` is there
        already: it is only listed."""
        placed, self._placed = self._placed, {}
        start, self._room_end = self._room_end, _wire.HEAD
        # each artifact's chunks in order, with their offset where built in the segment
        pieces: dict[str, list[tuple[memoryview, int | None]]] = {}
        total = copied = 0
        for name, chunks in artifacts.items():
            if isinstance(chunks, Linked):
                continue
            mine = pieces[name] = []
            for c in chunks:
                built = placed.get(id(c))
                if built is not None and built[0] is c:
                    mine.append((c, built[1]))
                else:
                    mine.append((memoryview(c).cast("B"), None))
                    copied += mine[-1][0].nbytes
                total += mine[-1][0].nbytes
        size = start + copied
        if self._shm is None or len(self._shm) < size:
            # a new segment (the old one stays mapped while its chunks are viewed: they are
            # copied too), with room to spare: a header grows with the step's digits, and
            # the room aligns each chunk it gives
            start, copied = _wire.HEAD, total
            size = -(-(_wire.HEAD + total + 64 * sum(map(len, pieces.values()))) // _SLACK) * _SLACK
            pieces = {n: [(c, None) for c, _ in mine] for n, mine in pieces.items()}
            # (never the same one, even where all of it would fit: its built chunks, copied
            # from their places, would be overwritten by the ones copied before them -- a
            # room that ran out after gifts left unused, by a part encoded again)
            self._drop_segment()
        try:
            view = memoryview(self._segment(size))
        except OSError as e:
            raise SaveFailed(f"{self._store.root}: no shared memory in this process for a "
                             f"snapshot of {total} bytes ({e}); older generations are "
                             "untouched") from e
        listed: list[dict[str, Any]] = []
        offset = start
        _wire.hurry(view, 0)  # (not hurried: see `hurry`)
        into = torch.frombuffer(view, dtype=torch.uint8)
        for name, chunks in artifacts.items():
            if isinstance(chunks, Linked):
                listed.append({"name": name, "link": [chunks.source, chunks.size,
                                                      chunks.xxh3_128]})
                continue
            spans: list[list[int]] = []
            for c, at in pieces[name]:
                if at is not None:
                    spans.append([at, c.nbytes])
                    continue
                if c.nbytes >= _TORCH_COPY and not c.readonly:
                    # torch copies with its intra-op threads, as the thread mode's snapshot
                    into[offset:offset + c.nbytes].copy_(torch.frombuffer(c, dtype=torch.uint8))
                else:
                    view[offset:offset + c.nbytes] = c
                spans.append([offset, c.nbytes])
                offset += c.nbytes
            listed.append({"name": name, "pieces": spans})
        del into, pieces, placed
        view.release()
        self.nbytes, self.built = total, total - copied
        assert self._shm is not None
        self._seq += 1
        self._message = {**request, "seq": self._seq, "segment": self._shm_id,
                         "segment_size": len(self._shm), "artifacts": listed}
        if "job" not in request:  # (a job's save began with its announce)
            self._announce, self._sent_to, self._replaced = None, {}, False
        self._step, self._taken = request.get("step"), False
        self._deliver("handed over")

    def _deliver(self, what: str) -> None:
        """Send the save's announce and request to a persisting process that is ready, each
        once; if it ended before it took the request, once more to a new one (`_replace`)."""
        try:
            self._send()
        except (OSError, _wire.Closed, ValueError) as e:
            if not self._replace(e):
                raise self._fail(f"the save could not be {what}", e) from e
            try:
                self._send()
            except (OSError, _wire.Closed, ValueError) as e2:
                raise self._fail(f"the save could not be {what}", e2) from e2

    def _send(self) -> None:
        sock = self._ready()
        if self._announce is not None and self._sent_to.get("announce") != self._started:
            _wire.send(sock, self._announce)
            self._sent_to["announce"] = self._started
        if self._message is not None and self._sent_to.get("request") != self._started:
            _wire.send(sock, self._message, None if self._shm_sent else self._shm_fd)
            self._shm_sent = True
            self._sent_to["request"] = self._started

    def _replace(self, e: BaseException) -> bool:
        """After the connection failed (``e``): whether the persisting process has ended
        without taking the save under way, and no other was started for this save yet; then
        the next `_send` starts one (with a warning that names the one that ended)."""
        proc = self._proc
        if (proc is None or self._taken or self._replaced
                or not isinstance(e, (_wire.Closed, ConnectionError))):
            return False  # (a garbled message or a timeout: not a process that ended)
        try:
            code = proc.wait(timeout=_ENDING_S)  # (its socket is closed: it is ending)
        except subprocess.TimeoutExpired:
            return False
        self._proc, self._replaced = None, True  # (the next `_ready` starts one)
        warnings.warn(f"{self._store.root}: the persisting process {proc.pid} had ended (exit "
                      f"code {code}: {e}) before it took the save of generation {self._step}; "
                      "a new one takes it", UnbrokenWarning, stacklevel=2)
        return True

    def result(self) -> dict[str, Any]:
        """Block until the save handed over ended; its reply, or raise its error (``died``
        tells whether the persisting process ended without replying, ``committed`` whether
        the save failed after its generation was committed)."""
        assert self._sock is not None and self._proc is not None
        self.died = self.committed = False
        while True:
            try:
                reply = _wire.receive(self._sock)
            except (OSError, _wire.Closed, ValueError) as e:
                if self._replace(e):
                    self.died = True  # (until the new one holds the save)
                    self._deliver("handed over")
                    self.died = False
                    continue
                code = self._proc.wait()
                self.died = True
                raise self._fail(f"it ended with exit code {code} before it replied to the "
                                 f"save of generation {self._step} (which may be committed or "
                                 "not: a restore verifies it)", e) from None
            if reply.get("took") == self._seq:
                self._taken = True
            elif reply.get("seq") == self._seq:
                break
        if not reply.get("ok"):
            self.committed = bool(reply.get("committed"))
            raise rebuild(reply)
        self.io_ops = int(reply.get("ops", 0))
        return reply

    def hurry(self) -> None:
        """The loop waits for the save in flight: a paced persisting process goes on at full
        speed (it reads the number of the newest save to hurry from the segment's head)."""
        if self._shm is not None:
            _wire.hurry(self._shm, self._seq)

    def close(self) -> None:
        """End the persisting process (the caller waited for the save in flight: it is idle)
        and free the segment; the persister byte returns with the process's end."""
        proc, self._proc = self._proc, None
        # The writer releases its lock next, the persister byte with it: a save after close()
        # takes the lock again (as the other modes do) and hands the byte to a new process.
        self._handed_over = False
        if proc is not None and self._sock is not None:
            try:
                _wire.send(self._sock, {"quit": True})
            except OSError:
                pass
        self._disconnect()
        if proc is not None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._drop_segment()

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Room:
    """`ProcessPersister.room`: gifts of the segment ``shm`` one after the other, each 64-byte
    aligned, while it is the persister's segment and has room; ``rewind`` gives again those
    from a ``mark`` on (a file refused midway: its chunks are built again)."""

    def __init__(self, persister: ProcessPersister, shm: mmap.mmap | None) -> None:
        self._persister, self._shm = persister, shm

    def __call__(self, n: int) -> memoryview | None:
        p, shm = self._persister, self._shm
        if shm is None or shm is not p._shm or p._room_end + n > len(shm):
            return None
        view = memoryview(shm)[p._room_end:p._room_end + n]
        p._placed[id(view)] = (view, p._room_end)
        p._room_end += -(-n // 64) * 64
        return view

    def mark(self) -> int:
        return self._persister._room_end

    def rewind(self, mark: int) -> None:
        p = self._persister
        p._placed = {k: placed for k, placed in p._placed.items() if placed[1] < mark}
        p._room_end = min(p._room_end, mark)


def _forget_in_child(me: weakref.ref[ProcessPersister]) -> None:
    """In a process forked from the writer (a DataLoader worker): let go of the socket and the
    segment, so the persisting process sees the writer's end when the writer ends."""
    persister = me()
    if persister is None:
        return
    if persister._sock is not None:
        os.close(persister._sock.detach())
        persister._sock = None
    if persister._shm_fd is not None:
        os.close(persister._shm_fd)
        persister._shm_fd = None
    persister._proc = None
