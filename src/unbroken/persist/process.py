"""Saves that survive the training process (``async_save="process"``): the snapshot is copied
into shared memory and a persisting process of this writer writes, commits, reads back and
verifies the generation, then applies retention. If the training process dies (SIGKILL, an
out-of-memory kill) after ``save()`` returned, the persisting process still commits that
generation, verified as usual, and the next writer of the run waits for it (the lock's
persister byte, `store.lock`) before it reads the run.

The persisting process is started once, in a session of its own (a Ctrl-C of the training
job does not stop a save midway), and talks to the writer in JSON lines over its standard
input and output: nothing is pickled. The shared-memory segment is reused from one save to
the next (at most one save is in flight), and either side removes it when it ends."""

from __future__ import annotations

import glob
import json
import mmap
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from typing import IO, Any

from .._procs import PERSISTER_OF_ENV
from ..dist.commit import rebuild
from ..errors import SaveFailed
from ..state.incremental import Linked, Source
from ..store.generations import GenerationStore

_PREFIX = "unbroken-snapshot-"


def _shm_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _remove_stale() -> None:
    """Segments of writers and persisting processes that are all gone (both killed)."""
    for path in glob.glob(os.path.join(_shm_folder(), f"{_PREFIX}*")):
        pid = os.path.basename(path)[len(_PREFIX):].split("-")[0]
        if pid.isdecimal() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(path)
            except OSError:
                pass


class ProcessPersister:
    """The persisting process of one writer (see module doc)."""

    def __init__(self, store: GenerationStore) -> None:
        self._store = store
        self._proc: subprocess.Popen[bytes] | None = None
        self._shm_path: str | None = None
        self._shm: mmap.mmap | None = None
        self.nbytes = 0  # bytes copied by the last snapshot

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is None:  # the first one: the persister byte goes to it
            _remove_stale()
            self._store.hand_over()
        env = {**os.environ, PERSISTER_OF_ENV: str(os.getpid()), "UNBROKEN_PROGRESS": "0"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.persist._worker", self._store.root],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        return self._proc

    def start(self) -> None:
        """Start the persisting process now (it imports torch: a second or two, overlapped
        with whatever the training script does before its first save)."""
        if self._proc is None:
            self._start()

    def _segment(self, size: int) -> mmap.mmap:
        """The reused shared-memory segment, grown to ``size`` bytes when needed."""
        if self._shm is not None and len(self._shm) >= size:
            return self._shm
        self._drop_segment()
        path = os.path.join(_shm_folder(), f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            self._shm = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self._shm_path = path
        return self._shm

    def _drop_segment(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass  # the persisting process removed it when it ended
            self._shm_path = None

    def submit(self, request: Mapping[str, Any], artifacts: Mapping[str, Source]) -> None:
        """Copy ``artifacts`` into shared memory (the snapshot: when this returns, nothing
        the training loop does changes what is written) and hand the save over."""
        chunked = {n: [memoryview(c).cast("B") for c in chunks]
                   for n, chunks in artifacts.items() if not isinstance(chunks, Linked)}
        total = sum(c.nbytes for chunks in chunked.values() for c in chunks)
        view = memoryview(self._segment(total))
        listed: list[dict[str, Any]] = []
        offset = 0
        for name, chunks in artifacts.items():
            if isinstance(chunks, Linked):
                listed.append({"name": name, "link": [chunks.source, chunks.size,
                                                      chunks.xxh3_128]})
                continue
            start = offset
            for c in chunked[name]:
                view[offset:offset + c.nbytes] = c
                offset += c.nbytes
            listed.append({"name": name, "offset": start, "size": offset - start})
        view.release()
        self.nbytes = total
        line = json.dumps({**request, "shm": self._shm_path, "artifacts": listed}) + "\n"
        proc = self._proc if self._proc is not None and self._proc.poll() is None \
            else self._start()
        try:
            _send(proc.stdin, line.encode())
        except OSError:  # it died between saves: a new one takes over
            _send(self._start().stdin, line.encode())

    def result(self) -> dict[str, Any]:
        """Block until the save handed over ended; its reply, or raise its error."""
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            raise SaveFailed(f"{self._store.root}: the persisting process (pid "
                             f"{self._proc.pid}) ended with exit code {code} before the save "
                             "was committed; older generations are untouched")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise rebuild(reply)
        return reply

    def close(self) -> None:
        """End the persisting process (after the save in flight: the caller waited) and
        remove the segment; the persister byte returns with the process's end."""
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._drop_segment()


def _send(pipe: IO[bytes] | None, data: bytes) -> None:
    assert pipe is not None
    pipe.write(data)
    pipe.flush()
