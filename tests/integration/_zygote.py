"""A fork server for the integration tests: imports torch and unbroken once, then forks one
real child process per request. Each child is new (it never trained, it restores only from
disk), runs in its own session so a SIGKILL of its group takes its DataLoader workers along,
and costs ~0.1 s instead of the ~3 s an interpreter needs to import torch on two cores.

Protocol: one JSON request per line on stdin {"script" (a .py path or a module name),
"argv", "env", "out", "err", "timeout", optional "pid_first"}; one JSON reply per line on
stdout {"pid", "returncode"} (negative = signal), preceded by {"pid"} with "pid_first"."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time

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


def _child(req: dict) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)
    sys.argv = [req["script"], *req["argv"]]
    code = 0
    try:
        if req["script"].endswith(".py"):
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


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        req = json.loads(line)
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
        # Wait until the child's whole group (e.g. DataLoader workers) has gone.
        while True:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        reply.write(json.dumps({"pid": pid, "returncode": code}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
