"""Deliberate kills at named or numbered points of the store's I/O, for tests and torture (never
set in normal use).

Two kinds of deterministic kill, both by ``SIGKILL`` of the whole process group when this
process leads one (DataLoader workers die with it, as in a real crash):

* ``$UNBROKEN_KILL_AT``: comma-separated ``point`` or ``point@step`` entries naming fault points
  of the protocol (``artifact-N-written``, ``manifest-written``, ``before-rename``,
  ``after-rename``, ``retention-unlinked``, ``step-done``).
* ``$UNBROKEN_KILL_AT_OP``: comma-separated ``K`` or ``KIND:K`` entries: die just before the
  K-th mutating I/O operation this process performs through `LocalFS` (1-based; counted per
  process), or the K-th of one kind. Kinds: ``mkdir``, ``create``, ``write``, ``fsync``,
  ``fsync_dir``, ``rename``, ``unlink``, ``rmdir``. A kill at a ``write`` first writes half of
  the chunk, so the file is torn mid-write. Every I/O operation of a save, commit, retention
  deletion or restore can be chosen in turn, so each failure is reproducible from its number.
  With ``$UNBROKEN_KILL_NOTE`` naming a file, one line ``K KIND PATH`` is appended to it
  before dying (where the kill landed).

``$UNBROKEN_KILL_SELF_AT`` takes the entries of ``$UNBROKEN_KILL_AT`` but kills this process
alone, as the kernel's out-of-memory killer would pick one: a persisting process whose writer
lives on."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from ..._procs import kill_job

KILL_ENV = "UNBROKEN_KILL_AT"
KILL_SELF_ENV = "UNBROKEN_KILL_SELF_AT"
KILL_OP_ENV = "UNBROKEN_KILL_AT_OP"
KILL_NOTE_ENV = "UNBROKEN_KILL_NOTE"
# Operations that change the disk, in the order a commit typically performs them.
MUTATING = ("mkdir", "create", "write", "fsync", "fsync_dir", "rename", "unlink", "rmdir")
READ = "read"


def fault_point(name: str, step: int | None = None) -> None:
    """Die by SIGKILL here when ``$UNBROKEN_KILL_AT`` names this point.

    The variable holds comma-separated ``point`` or ``point@step`` entries. Killing the whole
    process group when we lead one takes DataLoader workers down with us, as a real crash would;
    a rank started by torchrun takes the whole job down (`_procs.kill_job`). The entries of
    ``$UNBROKEN_KILL_SELF_AT`` kill this process alone."""
    if _named(os.environ.get(KILL_SELF_ENV), name, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _named(os.environ.get(KILL_ENV), name, step):
        kill_job()


def _named(spec: str | None, name: str, step: int | None) -> bool:
    """Whether the ``point`` or ``point@step`` entries of ``spec`` name this point."""
    for entry in (spec or "").split(","):
        point, _, at = entry.strip().partition("@")
        if point == name and (not at or (step is not None and int(at) == step)):
            return True
    return False


class _Counter:
    """Mutating I/O operations of this process, in total and per kind. A forked child starts
    from zero: the counts belong to the process that performs the operations."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.total = 0
        self.by_kind: dict[str, int] = {}

    def tick(self, kind: str) -> tuple[int, int]:
        if self.pid != os.getpid():
            self.__init__()  # type: ignore[misc]
        self.total += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        return self.total, self.by_kind[kind]


_COUNTER = _Counter()


def io_count() -> int:
    """Mutating I/O operations this process has performed through `LocalFS` so far."""
    if _COUNTER.pid != os.getpid():
        return 0
    return _COUNTER.total


def _parse_op_spec(spec: str) -> list[tuple[str | None, int]]:
    out = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        kind, _, number = entry.rpartition(":")
        try:
            k = int(number)
        except ValueError:
            raise ValueError(f"${KILL_OP_ENV}: {entry!r} is not K or KIND:K") from None
        if kind and kind not in MUTATING:
            raise ValueError(f"${KILL_OP_ENV}: unknown operation kind {kind!r}; one of "
                             f"{', '.join(MUTATING)}")
        out.append((kind or None, k))
    return out


def io_fault_point(kind: str, path: str, before_death: Callable[[], None] | None = None) -> None:
    """Count one I/O operation about to happen; die here when ``$UNBROKEN_KILL_AT_OP`` names it.

    ``before_death`` runs first when the kill fires (a write uses it to tear the file)."""
    if kind == READ:
        return
    total, nth = _COUNTER.tick(kind)
    spec = os.environ.get(KILL_OP_ENV)
    if not spec:
        return
    for want_kind, k in _parse_op_spec(spec):
        if (want_kind is None and k == total) or (want_kind == kind and k == nth):
            note = os.environ.get(KILL_NOTE_ENV)
            if note:
                fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
                try:
                    os.write(fd, f"{total} {kind} {path}\n".encode())
                finally:
                    os.close(fd)
            if before_death is not None:
                before_death()
            kill_job()
