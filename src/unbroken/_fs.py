"""The file-system seam: every write, fsync, rename and unlink of the store goes through here,
so tests can inject I/O faults and kill the process at numbered points."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
from collections.abc import Iterable

import xxhash

from .errors import CorruptCheckpoint

KILL_ENV = "UNBROKEN_KILL_AT"


def fault_point(name: str, step: int | None = None) -> None:
    """Die by SIGKILL here when ``$UNBROKEN_KILL_AT`` names this point.

    The variable holds comma-separated ``point`` or ``point@step`` entries. Killing the whole
    process group when we lead one takes DataLoader workers down with us, as a real crash would."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    for entry in spec.split(","):
        point, _, at = entry.strip().partition("@")
        if point == name and (not at or (step is not None and int(at) == step)):
            if os.getpgid(0) == os.getpid():
                os.killpg(os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class LocalFS:
    """POSIX file operations with the durability steps the commit protocol needs."""

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> tuple[int, str]:
        """Create ``path`` (never overwrite), write, fsync; return (size, xxh3-128 hex)."""
        h = xxhash.xxh3_128()
        size = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            for chunk in chunks:
                h.update(chunk)
                view = memoryview(chunk).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                    size += n
            os.fsync(fd)
        finally:
            os.close(fd)
        return size, h.hexdigest()

    def read_file(self, path: str, limit: int) -> bytes:
        """Read a regular file of at most ``limit`` bytes.

        O_NOFOLLOW | O_NONBLOCK + fstat: a symlink, FIFO or device in place of an artifact is
        refused without following it or hanging on it."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptCheckpoint(f"{path}: is a symbolic link; artifacts must be "
                                        "regular files inside their generation") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpoint(f"{path}: not a regular file (mode {oct(st.st_mode)})")
            if st.st_size > limit:
                raise CorruptCheckpoint(f"{path}: {st.st_size} bytes, over the {limit}-byte limit")
            buf = bytearray(st.st_size)
            view = memoryview(buf)
            got = 0
            while got < st.st_size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            if got != st.st_size:
                raise CorruptCheckpoint(f"{path}: shrank while being read ({got} of {st.st_size})")
            return bytes(buf)
        finally:
            os.close(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def rename(self, src: str, dst: str) -> None:
        """Rename without replacing: Linux lets a directory rename replace an empty directory."""
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "refusing to replace", dst)
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path)


def filesystem_type(path: str) -> str:
    """The mount type holding ``path`` (from /proc/mounts), or "unknown"."""
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        pass
    return fstype


# Directory rename is not guaranteed atomic (or durable on fsync) on these.
NON_ATOMIC_RENAME = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse", "sshfs", "glusterfs",
                     "ceph", "lustre", "virtiofs")


def rename_is_atomic(fstype: str) -> bool:
    return not any(fstype == t or fstype.startswith(t + ".") for t in NON_ATOMIC_RENAME)
