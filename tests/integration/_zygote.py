"""A fork server for the integration tests: imports torch and unbroken once, then forks one
real child process per request. Each child is new (it never trained, it restores only from
disk), runs in its own session so a SIGKILL of its group takes its DataLoader workers along,
and costs ~0.1 s instead of the ~3 s an interpreter needs to import torch on two cores.

Protocol: one JSON request per line on stdin {"script" (a .py path or a module name),
"argv", "env", "out", "err", "timeout", optional "pid_first", optional "ranks"}; one JSON
reply per line on stdout {"returncode"} (negative = signal; a job's adds "codes", each
rank's), preceded by {"pid"} with "pid_first".

With "ranks": n, the script runs as a job of n ranks, each a child of its own (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set; ``MASTER_ADDR`` and ``MASTER_PORT``
come with "env"), its output in "out".rank<r> and "err".rank<r>; torch's threads as torchrun
sets them (``OMP_NUM_THREADS``, 1 by default where there are several ranks). As torchrun's
agent does, the first rank to fail ends the others (SIGTERM, SIGKILL 5 s later); the reply's
"returncode" is 0, or that first failure's. What torchrun adds, a launcher process and
``TORCHELASTIC_*`` (by which a fault point takes the whole job down, `unbroken._procs`), it
has not: jobs that kill a rank run under torchrun."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from typing import Any

import numpy  # noqa: F401  (imported once here so children start fast)
import torch  # noqa: F401

import unbroken

# The package imports its names when first used (PEP 562): import them all here, once.
for _name in unbroken.__all__:
    getattr(unbroken, _name)
import unbroken.cli  # noqa: E402,F401
import unbroken.proof.harness  # noqa: E402,F401

# The first optimizer built in a process imports torch._dynamo (~2 s); build one here, before
# any fork. Constructing it runs no kernels, so no thread pool exists yet to break fork().
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _child(req: dict, rank: int | None = None) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(req["env"])
    out, err = req["out"], req["err"]
    if rank is not None:  # (a rank of a job: see the protocol above)
        n = str(req["ranks"])
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": n,
                           "LOCAL_WORLD_SIZE": n})
        if req["ranks"] > 1:  # (torchrun's default, for more than one rank)
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "OMP_NUM_THREADS" in os.environ:  # (OpenMP read it when this server imported torch)
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        out, err = f"{out}.rank{rank}", f"{err}.rank{rank}"
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)
    sys.argv = [req["script"], *req["argv"]]
    code = 0
    try:
        if req["script"].endswith(".py"):
            # (as `python script.py` does: the script's folder first on the path)
            sys.path.insert(0, os.path.dirname(os.path.abspath(req["script"])))
            runpy.run_path(req["script"], run_name="__main__")
        else:
            runpy.run_module(req["script"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _gone(pid: int) -> None:
    """Wait until the whole group of child ``pid`` (e.g. DataLoader workers) has gone."""
    while True:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _one(req: dict, reply: Any) -> int:
    pid = os.fork()
    if pid == 0:
        _child(req)
    if req.get("pid_first"):  # the client wants to signal the child while it runs
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
        time.sleep(0.01)
    _gone(pid)
    return _code(status)


def _job(req: dict) -> dict:
    """The ranks of a job, each forked; the first to fail ends the others (torchrun's way).
    The reply: the job's exit status and each rank's."""
    pids = []
    for rank in range(req["ranks"]):
        pid = os.fork()
        if pid == 0:
            _child(req, rank)
        pids.append(pid)
    codes: dict[int, int] = {}
    failed: int | None = None
    stop_at = time.monotonic() + req["timeout"]
    kill_at: float | None = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = _code(status)
                if codes[pid] != 0 and failed is None:
                    failed = codes[pid]
                    kill_at = time.monotonic() + 5
                    _signal(pids, codes, signal.SIGTERM)
        if time.monotonic() > stop_at or (kill_at is not None and time.monotonic() > kill_at):
            _signal(pids, codes, signal.SIGKILL)
        time.sleep(0.01)
    for pid in pids:
        _gone(pid)
    return {"returncode": 0 if failed is None else failed, "codes": [codes[p] for p in pids]}


def _signal(pids: list[int], ended: dict[int, int], sig: int) -> None:
    for pid in pids:
        if pid not in ended:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        req = json.loads(line)
        done = _job(req) if req.get("ranks") else {"returncode": _one(req, reply)}
        reply.write(json.dumps(done) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
