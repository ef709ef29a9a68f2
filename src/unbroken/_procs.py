"""The processes of a job, from ``/proc``: a launcher (torchrun), its ranks (each in a session
of its own) and their DataLoader workers. A process group cannot hold them all, since torchrun
starts every rank with ``start_new_session``, so the harness and the fault points follow the
parent links instead."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

PERSISTER_OF_ENV = "UNBROKEN_PERSISTER_OF"  # set in a persisting process: its writer's pid
Process = tuple[int, int]  # (pid, start time in clock ticks): a pid is reused, the pair not


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after "pid (comm) " (state, parent, group, ... the
    start time at index 19); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields if len(fields) > 19 else None


def _started(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks; None when it cannot be read."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _launched_by(pid: int) -> bool:
    """Whether ``pid`` runs torchrun (``torchrun ...``, ``python -m torch.distributed.run``
    or the older ``torch.distributed.launch``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")[:8]  # (the interpreter, its options, the launcher)
    except OSError:
        return False
    return any(os.path.basename(a) == b"torchrun"
               or (a == b"-m" and args[i + 1:i + 2] in ([b"torch.distributed.run"],
                                                        [b"torch.distributed.launch"]))
               for i, a in enumerate(args))


def _launcher() -> Process | None:
    """The torchrun that started this process, when its parent is one (a rank; a forked
    DataLoader worker inherits its rank's), or its writer's (a rank's persisting process)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    parent = os.getppid()
    if os.environ.get(PERSISTER_OF_ENV) == str(parent):
        fields = _stat(parent)
        parent = int(fields[1]) if fields is not None else -1
    started = _started(parent)
    return (parent, started) if started is not None and _launched_by(parent) else None


# Taken at import, while the launcher lives: once it dies its ranks are handed to a reaper
# (init, a container's, a subreaper), which ``getppid()`` then names, and killing the reaper's
# tree kills every process under it. A parent that is not torchrun (the launcher died before
# the import; a script started by a process under torchrun) is never taken for the job's.
_LAUNCHER = _launcher()
_held: list[socket.socket] = []  # the job's killer name, held until this process dies


def _table() -> dict[int, tuple[int, int, str, int]]:
    """pid -> (parent pid, process group, state, start time) of every process we can read."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            out[int(entry)] = (int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return out


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the process group (workers included)."""
    return any(g == pgid and state != "Z" for _, g, state, _ in _table().values())


def tree(root: int) -> set[Process]:
    """``root`` and every living descendant of it."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, state, _) in table.items():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in table and table[pid][2] != "Z":
            found.add((pid, table[pid][3]))
            todo.extend(children.get(pid, []))
    return found


def _sigkill(process: Process, group: bool = False) -> None:
    """SIGKILL ``process`` (with ``group``: the process group it leads) only if it is still
    the process that was listed: its pid is pinned by a pidfd first, then its start time
    checked, so a pid reused since the listing (milliseconds old) is never signalled."""
    pid, start = process
    fd: int | None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone
    except OSError:  # no pidfd here (a kernel before 5.3, a seccomp filter): checked, then
        fd = None  # signalled by pid
    try:
        if _started(pid) != start:
            return  # another process has that pid now
        if group:
            os.killpg(pid, signal.SIGKILL)
        elif fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if fd is not None:
            os.close(fd)


def kill(processes: set[Process]) -> set[Process]:
    """SIGKILL those of ``processes`` still alive (the same process: same start time); returns
    them."""
    table = _table()
    alive = {(pid, start) for pid, start in processes
             if pid in table and table[pid][3] == start and table[pid][2] != "Z"}
    for process in sorted(alive, key=lambda p: p[0] == os.getpid()):  # this one last
        _sigkill(process)
    return alive


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every descendant, this process last if it is among them.

    A process that leads its own group (a rank torchrun started in a session of its own) is
    killed with its whole group, so a DataLoader worker it forked after the listing dies with
    it instead of living on as an orphan (one held a test's output pipes until its timeout).
    Nothing is stopped on the way: two ranks killing the job at once must not freeze each
    other (`kill_job` lets one kill at a time)."""
    me = os.getpid()
    mine = os.getpgid(0)
    table = _table()
    done: set[Process] = set()
    inside = any(pid == me for pid, _ in tree(root))  # (the root may die before the end)
    for _ in range(100):
        found = {p for p in tree(root) if p[0] != me} - done
        if not found:
            break
        for process in found:
            pid = process[0]
            group = table[pid][1] if pid in table else 0
            _sigkill(process, group == pid and group != mine)
        done |= found
        table = _table()
    if inside:  # this process and its group: its own workers, or (a worker) its rank's
        if mine == me or any(pid == mine for pid, _ in done):
            os.killpg(mine, signal.SIGKILL)  # (one forked after the listing too)
        os.kill(me, signal.SIGKILL)


def kill_job() -> None:
    """SIGKILL the whole job this process belongs to, as a lost machine would end it: under
    torchrun (``$TORCHELASTIC_RUN_ID``) the launcher and everything it started; otherwise
    this process's group when it leads one (its DataLoader workers), and this process.

    Nothing may stop it halfway: a DataLoader's SIGCHLD handler raises when it sees a worker
    killed (it did, leaving the job stopped and the killer exiting normally), so that
    handler is set aside first, and an exception from any other handler starts over."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        try:
            _kill_job()
        except BaseException:  # noqa: BLE001 -- a signal handler's exception: kill on
            continue


def _kill_job() -> None:
    owner = os.environ.get(PERSISTER_OF_ENV, "")
    if _LAUNCHER is not None and _started(_LAUNCHER[0]) == _LAUNCHER[1]:
        # (a rank's persisting process too: the launcher first, whose tree holds this one,
        # else the other ranks would be stopped by torchrun, not killed)
        if _be_the_killer(_LAUNCHER):
            kill_tree(_LAUNCHER[0])
    if owner.isdecimal() and int(owner) == os.getppid():
        # the persisting process of a writer (`persist.process`): the machine dies, the
        # writer with it (this process is among its descendants)
        kill_tree(int(owner))
    # Not the whole tree here: a persisting process (its own session) outlives its writer,
    # as it would a crash of the writer alone.
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _be_the_killer(launcher: Process) -> bool:
    """Wait until this process is the job's only killer (True), or until another killer has
    killed the launcher (False: only this process and its workers are left to kill).

    Two ranks that kill each other at the same moment die before either reaches the launcher
    (it was left alive so, in a test); one killer at a time kills everything. The name is an
    abstract socket, released by the kernel when its holder dies, so a killer killed from
    outside halfway hands over to the next."""
    if _held:  # taken by this process's own try that an exception cut short
        return _started(launcher[0]) == launcher[1]
    name = f"\0unbroken-kill-job-{launcher[0]}-{launcher[1]}"
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
        except OSError:  # another rank holds it and kills this one soon
            sock.close()
            if _started(launcher[0]) != launcher[1]:
                return False
            time.sleep(0.001)
            continue
        _held.append(sock)
        # (a killer that held the name before may have killed the launcher meanwhile, and
        # its pid may be another process's by now)
        return _started(launcher[0]) == launcher[1]
