"""The single writer of a run on an object store: a lease object, ``RUN/LEASE.json``.

An object store has no ``fcntl`` lock that dies with its process, so the writer holds a lease:
an object created only if absent (`ObjectFS.create_file`), naming its holder (pid and start
time; host name, boot and pid namespace) and an expiry, renewed by a heartbeat thread every
third of its length and at every commit. A second writer is refused (`StoreLocked`) while the
lease is live; it takes over a lease past its expiry (its writer stopped renewing: dead, or
cut off) or one whose holder was a process of this machine that is gone (a crashed writer
restarted here need not wait; a pid of another container under the same host name is never
taken for one of this machine). A writer whose lease was taken over learns it at its next
renewal and stops. Two writers that both take an expired lease at once are possible; the
conditional manifest upload still lets only one commit each generation
(`objects.ObjectStore.publish`)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from .._procs import _started, _stat
from ..errors import CorruptCheckpoint, StoreLocked
from .backends.objects import ObjectFS

LEASE = "LEASE.json"


class Lease:
    """The lease at ``path``; ``held`` while this writer holds it."""

    def __init__(self, fs: ObjectFS, path: str, seconds: float) -> None:
        self.fs, self.path, self.seconds = fs, path, seconds
        self.token: str | None = None  # this writer's lease id while it holds the lease
        self._heartbeat: _Heartbeat | None = None
        self._renewing = threading.Lock()  # the heartbeat and a commit renew it, one at a time

    @property
    def held(self) -> bool:
        return self.token is not None

    def _bytes(self, token: str) -> bytes:
        pid = os.getpid()
        return json.dumps({"lease": token, "pid": pid, "host": socket.gethostname(),
                           **_machine(), "started": _started(pid),
                           "expires": time.time() + self.seconds}).encode()

    def _read(self) -> dict[str, Any] | None:
        """What the lease object says; None when there is none or it is not a lease. An I/O
        error propagates: it says nothing about who holds the lease."""
        try:
            data = self.fs.read_file(self.path, 4096)
        except (FileNotFoundError, CorruptCheckpoint):
            return None
        try:
            raw = json.loads(bytes(data))
        except ValueError:
            return None
        if not isinstance(raw, dict):
            return None
        expires, pid = raw.get("expires"), raw.get("pid")
        # NaN, infinities and ints too large for a float all fail the range (before 5138)
        if not isinstance(expires, (int, float)) or isinstance(expires, bool) or \
                not 0 <= expires < 1e11:
            return None
        if type(pid) is not int or not 0 < pid < 1 << 31:
            raw["pid"] = None  # not a process this machine could have
        return raw

    def holder(self) -> dict[str, Any] | None:
        """`_read`, with an unreadable lease taken as none (best effort: taking over,
        giving back)."""
        try:
            return self._read()
        except OSError:
            return None

    def acquire(self) -> None:
        """Take the lease; `StoreLocked` names the holder of a live one."""
        token = uuid.uuid4().hex
        for _ in range(3):
            try:
                self.fs.create_file(self.path, self._bytes(token))
            except FileExistsError:
                holder = self._read()  # unreadable (an I/O error) is never taken over
                if holder is not None and holder["expires"] > time.time() and \
                        not _dead_here(holder):
                    who = (f"pid {holder['pid']}" if holder.get("pid") is not None
                           else "a process it cannot name")
                    raise StoreLocked(
                        f"{self.path}: the run is leased by {who} on "
                        f"{holder.get('host')} until {time.ctime(float(holder['expires']))}; "
                        "one writer per run: stop that one, or wait for its lease to expire"
                        ) from None
                try:  # expired, unreadable or its holder is gone: take it over
                    self.fs.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            self.token = token
            self._heartbeat = _Heartbeat(self, self.seconds / 3)
            return
        raise StoreLocked(f"{self.path}: another writer keeps taking the lease; one writer per "
                          "run")

    def renew(self) -> None:
        """Extend the lease; `StoreLocked` if another writer has taken it over meanwhile."""
        with self._renewing:
            token = self.token
            if token is None:
                raise StoreLocked(f"{self.path}: this writer's lease was lost")
            holder = self._read()  # an I/O error fails this renewal, not the lease
            if holder is None or holder.get("lease") != token or \
                    holder["expires"] <= time.time():  # expired: another may take it now
                self.token = None
                raise StoreLocked(f"{self.path}: this writer's lease ({token}) expired and "
                                  "another writer took the run over; this writer stops")
            self.fs.put_file(self.path, self._bytes(token))

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this writer's (after any
        renewal in progress, which would otherwise put it back)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        with self._renewing:
            token, self.token = self.token, None
            if token is None:
                return
            holder = self.holder()
            if holder is not None and holder.get("lease") == token:
                try:
                    self.fs.unlink(self.path)
                except OSError:
                    pass  # it expires


def _machine() -> dict[str, str | None]:
    """What makes a pid mean one process: this boot of this kernel and this pid namespace.
    Two containers may share a host name (host networking) but not a pid namespace, where
    the other's pid names nothing, or another process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot: str | None = f.read().strip()
    except OSError:
        boot = None
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"boot": boot, "pidns": pidns}


def _dead_here(holder: Mapping[str, Any]) -> bool:
    """Whether the lease's holder was a process of this machine that is gone. This machine:
    the same host name and, where the lease names them, the same boot and pid namespace.
    Gone: no such process; or, where the lease names them, one that died and was not reaped
    yet, or another process that was given its pid since (its start time differs)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False  # (`Lease._read` sets an impossible pid to None)
    here = _machine()
    placed = all(holder.get(k) is not None for k in here)
    if placed and any(holder.get(k) != v for k, v in here.items()):
        return False  # another machine or container under the same name: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    fields = _stat(pid) if placed else None  # (an older lease: only a missing process)
    if fields is None:
        return False
    if fields[0] in ("Z", "X"):
        return True  # dead, its parent has not reaped it yet
    started = holder.get("started")
    return type(started) is int and int(fields[19]) != started  # the pid was reused


class _Heartbeat:
    """Renews a lease every ``every`` seconds from a daemon thread, so a writer that saves
    rarely keeps the run, and one that died loses it within the lease's length."""

    def __init__(self, lease: Lease, every: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(lease, every), daemon=True,
                                        name="unbroken-lease")
        self._thread.start()

    def _run(self, lease: Lease, every: float) -> None:
        while not self._stop.wait(every):
            try:
                lease.renew()
            except OSError:
                continue  # a store that did not answer once: try again at the next beat
            except StoreLocked:
                return  # lost: the next commit reports it

    def stop(self) -> None:
        self._stop.set()
