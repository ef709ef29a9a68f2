"""The single-writer lock of a run folder: ``RUN/LOCK``, POSIX ``fcntl`` locks (released by
the kernel when their holder dies; not inherited by forked DataLoader workers) on two bytes:
byte 0 is the writer's, byte 1 the persisting process's. A writer takes both; one that saves
through a persisting process of its own (`persist.process`) hands byte 1 over to it, so
that when the writer dies mid-save its persisting process still holds the run until the
save is committed, and the next writer waits for that before it reads the run.

Two ways to fail, told apart: another live process writes the run (`StoreLocked`, naming the
holder), or this folder cannot be written or locked here at all (`ReadOnlyRun`, naming the
cause: read-only media, no permission, a full disk, a filesystem without POSIX locks). Reading
needs no lock, so a caller may go on read-only after the second."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Callable

from ..errors import CorruptCheckpoint, ReadOnlyRun, StoreLocked, UnbrokenError

LOCK = "LOCK"
WRITER, PERSISTER = 0, 1  # the bytes of LOCK each holds
PERSISTER_WAIT = 600.0  # seconds a new writer waits for a dead writer's save to commit
_LOCKED_HERE: set[str] = set()  # fcntl locks are per process: guard against a second writer here


def errno_text(e: OSError) -> str:
    """An OS error as ``strerror [ENAME]``."""
    name = errno.errorcode.get(e.errno or 0)
    return f"{e.strerror or e}" + (f" [{name}]" if name else "")


def _unwritable(path: str, e: OSError, what: str) -> ReadOnlyRun:
    return ReadOnlyRun(f"{path}: {what}: {errno_text(e)}. Restoring from this folder works; "
                       "saving needs a writable folder with POSIX locks (use another folder, "
                       "or fix the mount or the disk)")


def acquire_writer_lock(root: str) -> int:
    """Lock ``root`` for this process (creating the folder) and return the lock's descriptor,
    or raise `StoreLocked` / `ReadOnlyRun` (see module doc)."""
    path = os.path.join(root, LOCK)
    key = os.path.realpath(path)
    if key in _LOCKED_HERE:
        raise StoreLocked(f"{path}: already held by another Checkpointer in this process; "
                          "close() it before opening the run folder again")
    if os.path.lexists(root) and not os.path.isdir(root):  # (makedirs says "File exists")
        raise UnbrokenError(f"{root}: is a file, not a run folder; give the Checkpointer a "
                            "folder (it is created if missing)")
    try:  # never follow a symlink: a planted LOCK -> ~/.bashrc would be truncated below
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW |
                     os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):  # (as any other file that is not one)
            kind = "a symbolic link" if e.errno == errno.ELOOP else "a folder"
            raise CorruptCheckpoint(f"{path}: is {kind}; the lock file must be a regular "
                                    "file inside the run folder (remove it)") from None
        raise _unwritable(path, e, "cannot be created or opened for writing") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpoint(f"{path}: not a regular file; the lock file must be a "
                                "regular file inside the run folder (remove it)")
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, WRITER)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise _unwritable(path, e, "cannot be locked (the filesystem offers no POSIX "
                              "locks, e.g. NFS without a lock daemon or a FUSE mount)") from None
        holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise StoreLocked(f"{path}: another live process writes this run ({holder}); stop "
                          "it, or point this run at another folder") from None
    try:
        _await_persister(fd, path)
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
    except OSError:
        pass  # the holder note is for people; the lock itself is held
    _LOCKED_HERE.add(key)
    return fd


def release_writer_lock(root: str, fd: int) -> None:
    os.close(fd)  # closing releases the fcntl lock
    _LOCKED_HERE.discard(os.path.realpath(os.path.join(root, LOCK)))


def _take_byte(fd: int, seconds: float, pause: float,
               waiting: Callable[[], None] | None = None) -> OSError | None:
    """Take the persister byte of the lock ``fd``, trying again every ``pause`` seconds for up
    to ``seconds`` (``waiting`` is called once, at the first retry); None once taken, else
    the error of the last attempt. Errors other than "held by another" raise."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, PERSISTER)
            return None
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() > deadline:
                return e
        if waiting is not None:
            waiting()
            waiting = None
        time.sleep(pause)


def _await_persister(fd: int, path: str) -> None:
    """Take the persister byte too, once the persisting process of a writer that died (if
    any) has committed its last save and exited: a writer never reads or changes the run
    while a save of its predecessor is still being written."""
    try:
        busy = _take_byte(fd, PERSISTER_WAIT, 0.05, lambda: logging.getLogger("unbroken").warning(
            "%s: waiting for the persisting process of an earlier writer to commit its last "
            "save", path))
    except OSError as e:
        raise _unwritable(path, e, "cannot be locked") from None
    if busy is not None:
        raise StoreLocked(f"{path}: the persisting process of an earlier writer still holds "
                          f"the run after {PERSISTER_WAIT:.0f} s; stop it (see `ps`), or point "
                          "this run at another folder")


def hand_over(fd: int) -> None:
    """(The writer.) Let a persisting process take the persister byte (`take_persister`)."""
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, PERSISTER)


def take_persister(root: str, settle: float = 2.0) -> int:
    """(A persisting process.) Hold the persister byte of ``root``'s lock, which its writer
    released just before starting it; returns the descriptor (closing it releases the byte).
    A byte still taken after ``settle`` seconds belongs to a later writer (this one's writer
    died), and then `StoreLocked`; a shorter hold is the persisting process of a writer that
    died while it started, which lets go as soon as it sees that."""
    path = os.path.join(root, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        busy = _take_byte(fd, settle, 0.01)
    except OSError as e:  # (no POSIX locks here: the same answer, typed)
        busy = e
    if busy is not None:
        os.close(fd)
        raise StoreLocked(f"{path}: the persister byte was not free ({errno_text(busy)}): its "
                          "writer is gone and another holds the run")
    return fd


def persister_gone(root: str, timeout: float) -> bool:
    """(Tools that watch a run from outside: the crash torture.) Wait until no process holds
    the persister byte of ``root``'s lock, i.e. the persisting process of a writer that died
    has committed its last save and exited; False when one still holds it after ``timeout``
    seconds. Takes the byte for an instant only (a writer starting meanwhile waits that long)."""
    try:
        fd = os.open(os.path.join(root, LOCK), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True  # no run yet
    try:
        return _take_byte(fd, timeout, 0.01) is None
    finally:
        os.close(fd)  # (releases the byte)
