"""The persisting processes of a job (``async_save="process"``) as a `Group` whose
collectives go through files: they cannot join the training job's process group, yet they
must commit one generation per job (`dist.commit.commit_staged`) and read it back
(`commit.read_back`) exactly as the ranks of a job do.

The files lie in the save's *job folder*, beside its staging folder and named after it
(``RUN/.staging-000000600-<id>.job/``): outside the generation (its published folder holds only
what its manifest lists) and, like staging, debris that listing ignores and the next writer
removes. The leader's training process creates it with the staging folder (`stage`). In it:

* ``NNNN.rankRRRRR.json``: rank R's part of the N-th collective of this save (every rank runs
  the same sequence): ``{"value": ...}``, all ranks' in an all-gather, the leader's in a
  broadcast. Each is published whole (a temporary file, fsynced, renamed, the folder fsynced),
  so a reader never sees half of one.
* ``done.rankRRRRR.json``: rank R will post nothing more for this save, and why
  (``{"error": null}`` after its last collective, else the error it gave up on). A rank
  waiting for a collective that finds the missing rank's ``done`` fails at once, naming it.

Every wait gives up after ``timeout`` seconds (`RankFailed`, naming the silent ranks and the
generation), at once when the job folder is gone (the leader gave up on the save), and at
once, naming the file, when a post cannot be read as one (a symlink, a FIFO, torn JSON: not
written by a persisting process). A rank whose persisting process died is posted ``done``
for by its training process when it learns of it (`persisting`). The leader removes the
job folder once every other rank that took part is done with it."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import Any

from ..errors import UnbrokenError
from ..store.backends.local import LocalFS
from ..store.generations import GenerationStore
from ..store.lock import errno_text
from .commit import describe
from .group import Group, RankFailed

JOB_SUFFIX = ".job"
_MAX_POST = 64 << 20  # a post names a rank's files: far below this
# Seconds between looks at the folder while waiting (an open per missing rank): from the
# first, growing to the last, so that a long wait (the leader writing a large model) does
# not keep a shared filesystem's metadata server busy on behalf of every rank.
_POLL, _POLL_MAX = 0.005, 0.1
_GONE = "the job folder is gone: the leader's persisting process gave up on this save"
_HOST = socket.gethostname()


def _since(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's field 22);
    None when there is no such process, or it is a zombie (killed, not yet reaped by the
    training process that started it): dead either way."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])



def stage(store: GenerationStore, generation: int, supersede: bool) -> str:
    """(The leader's training process, holding the lock.) The staging folder of
    ``generation`` and its job folder; the staging folder's path."""
    staging = store.stage(generation, supersede)
    try:
        store.fs.mkdir(staging + JOB_SUFFIX)
    except OSError:
        store.discard(staging)
        raise
    return staging


class FileGroup(Group):
    """Rank ``rank`` of ``size`` persisting processes saving ``generation`` into ``staging``
    (see module doc)."""

    def __init__(self, fs: LocalFS, staging: str, generation: int, rank: int, size: int,
                 timeout: float) -> None:
        # (Not Group.__init__: no torch.distributed here.)
        self.active, self.pg, self.rank, self.size = True, None, rank, size
        self.device = "cpu"
        self.staging, self.folder = staging, staging + JOB_SUFFIX
        self.generation, self.timeout = generation, timeout
        self._fs = fs
        self._seq = 0
        self._absent: set[int] = set()  # ranks that missed a collective: not waited for again
        self._posters: dict[int, list[Any]] = {}  # rank -> [host, pid, since] of its posts

    def all_gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order (see module doc)."""
        name = self._next()
        self._post(f"{name}.{_rank(self.rank)}", {"value": value}, what)
        got = self._await(name, range(self.size), what)
        return [got[r] for r in range(self.size)]

    def broadcast(self, value: Any, what: str) -> Any:
        """The leader's JSON-able ``value`` on every rank."""
        name = self._next()
        if self.leader:
            self._post(f"{name}.{_rank(0)}", {"value": value}, what)
            return value
        return self._await(name, [0], what)[0]

    def max_int(self, value: int, what: str) -> int:
        """The largest of every rank's ``value``."""
        return int(max(self.all_gather(value, what)))

    def close(self, error: BaseException | None) -> None:
        """This rank is finished with the save (``error``: what it gave up on). The leader
        then waits (``timeout``) for every other rank that took part to be finished too,
        removes the job folder and, if it gave up before committing, the staging folder."""
        with suppress(RankFailed):  # (the folder is gone: nobody waits for this any more)
            self._post(f"done.{_rank(self.rank)}",
                       {"error": None if error is None else describe(error)}, "finishing")
        if not self.leader:
            return
        self._poll({r: f"done.{_rank(r)}" for r in range(1, self.size) if r not in self._absent},
                   time.monotonic() + self.timeout)
        with suppress(OSError):  # (else debris: the next writer removes it)
            self._fs.rmtree(self.folder)
        if error is not None and os.path.lexists(self.staging):
            with suppress(OSError):
                self._fs.rmtree(self.staging)

    # -- the files -------------------------------------------------------------------------

    def _next(self) -> str:
        self._seq += 1
        return f"{self._seq:04d}"

    def _where(self, what: str) -> str:
        return (f"{self.folder}: {what} (generation {self.generation}) failed in the "
                f"persisting process of rank {self.rank} of {self.size}")

    def _post(self, name: str, value: Any, what: str) -> None:
        final = os.path.join(self.folder, f"{name}.json")
        temporary = os.path.join(self.folder, f".{name}.{os.getpid()}.tmp")
        try:
            # (who posts, for `_dead`: this machine, this process, and when it started)
            by = (_HOST, os.getpid(), _since(os.getpid()))
            self._fs.write_file(temporary, [json.dumps({**value, "by": by}).encode()])
            self._fs.rename(temporary, final)
            self._fs.fsync_dir(self.folder)
        except OSError as e:
            why = (_GONE if not os.path.isdir(self.folder) else
                   f"it could not post to the job folder ({errno_text(e)})")
            raise RankFailed(f"{self._where(what)}: {why}") from None

    def _look(self, names: dict[int, str], what: str) -> dict[int, dict[str, Any]]:
        """The posts ``names`` (by rank) that are there now; `RankFailed` for one that is
        not what a persisting process posts (its rank is not waited for again)."""
        found = {}
        for r, name in names.items():
            path = os.path.join(self.folder, f"{name}.json")
            key = "error" if name.startswith("done.") else "value"
            try:
                value = json.loads(bytes(self._fs.read_file(path, _MAX_POST)))
                why = _misshapen(value, key)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, UnbrokenError) as e:  # (a symlink, FIFO, torn JSON)
                why = errno_text(e) if isinstance(e, OSError) else str(e)
            if why is None and isinstance(value.get("by"), list) and len(value["by"]) == 3:
                self._posters[r] = value["by"]
            if why is not None:
                self._absent.add(r)
                raise RankFailed(
                    f"{self._where(what)}: {path}: rank {r}'s post cannot be read: expected a "
                    f"JSON object with {key!r}, written whole by its persisting process; "
                    f"{why}. Something else wrote in the job folder or the disk is failing: "
                    "this save is abandoned, check the run folder's storage")
            found[r] = value
        return found

    def _dead(self, ranks: Iterable[int]) -> dict[int, str]:
        """Of ``ranks``, those whose persisting process is known to have died: it posted
        before, from this machine, and that process is gone (a job's persisting processes
        on other machines are waited for until the timeout)."""
        out = {}
        for r in ranks:
            host, pid, since = self._posters.get(r, (None, 0, None))
            if host == _HOST and isinstance(pid, int) and since is not None \
                    and _since(pid) != since:
                out[r] = f"rank {r}'s persisting process (pid {pid}) died"
        return out

    def _poll(self, names: dict[int, str], deadline: float) -> None:
        """Wait until the posts ``names`` are all there (or unreadable), the deadline passed,
        the job folder is gone, or the processes that owe them died."""
        pause = _POLL
        while names and time.monotonic() < deadline and os.path.isdir(self.folder):
            for r in self._dead(names):
                del names[r]
            for r, name in list(names.items()):
                try:
                    if self._look({r: name}, "finishing"):
                        del names[r]
                except RankFailed:
                    del names[r]  # (an unreadable post: no point waiting for it)
            if names:
                time.sleep(pause)
                pause = min(_POLL_MAX, pause * 1.5)

    def _await(self, name: str, ranks: Iterable[int], what: str) -> dict[int, Any]:
        """The value every rank of ``ranks`` posted as collective ``name``; `RankFailed`
        naming those that gave up (their ``done``), stayed silent past the timeout, or all
        of them when the job folder is gone."""
        waiting = {r: f"{name}.{_rank(r)}" for r in ranks}
        deadline = time.monotonic() + self.timeout
        got: dict[int, dict[str, Any]] = {}
        pause = _POLL
        while True:
            got.update(self._look({r: n for r, n in waiting.items() if r not in got}, what))
            missing = [r for r in waiting if r not in got]
            if not missing:
                return {r: x["value"] for r, x in got.items()}
            left = self._look({r: f"done.{_rank(r)}" for r in missing}, what)
            if left:  # (a rank posts its part before its done: look again, now)
                got.update(self._look({r: waiting[r] for r in left}, what))
                left = {r: x for r, x in left.items() if r not in got}
            dead = self._dead(r for r in missing if r not in left)
            if left or dead or time.monotonic() > deadline or not os.path.isdir(self.folder):
                break
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 1.5)
        missing = [r for r in waiting if r not in got]
        if not missing:
            return {r: x["value"] for r, x in got.items()}
        self._absent.update(missing)
        if left or dead:
            why = "; ".join([*(f"rank {r} gave up: " + (x["error"]["message"] if x.get("error")
                               else "it had finished this save")
                               for r, x in sorted(left.items())), *dead.values()])
        elif not os.path.isdir(self.folder):
            why = _GONE
        else:
            why = (f"rank(s) {missing} posted nothing within {self.timeout:g} s (a persisting "
                   "process died or is stuck, or a training process never handed this save "
                   "over)")
        raise RankFailed(f"{self._where(what)}: {why}")


def _misshapen(value: Any, key: str) -> str | None:
    """What is wrong with a post whose ``key`` is expected (None: nothing); a ``done``'s
    error is null or ``{"type": ..., "message": ...}``."""
    if not isinstance(value, dict) or key not in value:
        return f"found {type(value).__name__}" + (
            f" with keys {sorted(value)[:5]}" if isinstance(value, dict) else "")
    error = value[key] if key == "error" else None
    if error is not None and not (isinstance(error, dict)
                                  and isinstance(error.get("message"), str)):
        return f"found the error {str(error)[:100]!r}"
    return None


def _rank(r: int) -> str:
    return f"rank{r:05d}"
