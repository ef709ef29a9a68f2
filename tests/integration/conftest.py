from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
SCRIPTS = HERE / "scripts"
BUCKET = "unbroken-tests"


@pytest.fixture(scope="session")
def s3():
    """An S3-compatible server on 127.0.0.1 (moto's server mode) with bucket ``BUCKET``, for
    the whole session (moto's state is global to the process): ``env``, what a user would
    export for it, and ``options``, the same as ``storage_options``."""
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": endpoint}
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(BUCKET)
    try:
        yield {"env": env, "options": options}
    finally:
        server.stop()


class _Zygote:
    """Client of _zygote.py (started on first use, shared by the whole session)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_zygote.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def run(self, script: str, argv: list[str], env: dict[str, str],
            timeout: float, started: Any = None) -> subprocess.CompletedProcess[str]:
        """Run one child to its end; ``started(pid)`` is called while it runs (to signal it)."""
        reply, (out, err) = self._request(script, argv, env, timeout, started)
        return subprocess.CompletedProcess([script, *argv], reply["returncode"], out, err)

    def job(self, ranks: int, script: str, argv: list[str], env: dict[str, str],
            timeout: float) -> tuple[int, list[subprocess.CompletedProcess[str]]]:
        """A job of ``ranks`` ranks (see _zygote.py): its exit status, and each rank's
        exit status and outputs."""
        reply, *outputs = self._request(script, argv, env, timeout, None, ranks)
        return reply["returncode"], [
            subprocess.CompletedProcess([script, *argv], code, out, err)
            for code, (out, err) in zip(reply["codes"], outputs, strict=True)]

    def _request(self, script: str, argv: list[str], env: dict[str, str], timeout: float,
                 started: Any, ranks: int | None = None) -> list[Any]:
        """The reply, then the outputs (stdout, stderr) of the child, or of each rank."""
        with tempfile.TemporaryDirectory() as tmp, self.lock:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            assert self.proc.stdin and self.proc.stdout
            self.proc.stdin.write(json.dumps({"script": script, "argv": argv, "env": env,
                                              "out": out, "err": err, "timeout": timeout,
                                              "pid_first": started is not None,
                                              "ranks": ranks}) + "\n")
            self.proc.stdin.flush()
            try:
                if started is not None:
                    started(json.loads(self.proc.stdout.readline())["pid"])
            finally:  # always read the final reply, or the next request reads this one
                reply = json.loads(self.proc.stdout.readline())
            names = [""] if ranks is None else [f".rank{r}" for r in range(ranks)]
            return [reply, *((Path(out + n).read_text(), Path(err + n).read_text())
                             for n in names)]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


_zygote: _Zygote | None = None


def run_script(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
               fresh_interpreter: bool = False, started: Any = None
               ) -> subprocess.CompletedProcess[str]:
    """Run tests/integration/scripts/NAME (or, without ".py", the module NAME as with
    ``python -m``) in a new process of its own session.

    By default the process is forked from a server that has imported torch (see _zygote.py);
    ``fresh_interpreter=True`` starts a whole new Python instead."""
    full_env = {**os.environ, **(env or {})}
    script = str(SCRIPTS / name) if name.endswith(".py") else name
    if fresh_interpreter or os.environ.get("UNBROKEN_TEST_NO_ZYGOTE"):
        cmd = [script] if name.endswith(".py") else ["-m", script]
        proc = subprocess.Popen([sys.executable, *cmd, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=full_env,
                                start_new_session=True)
        if started is not None:
            started(proc.pid)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return _the_zygote().run(script, list(args), full_env, timeout, started)


def _the_zygote() -> _Zygote:
    global _zygote
    if _zygote is None:
        _zygote = _Zygote()
    return _zygote


def zygote_job(ranks: int, script: str, args: list[str], env: dict[str, str],
               timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``script`` as a job of ``ranks`` processes forked from the zygote (see _zygote.py):
    ``env`` added to this process's; the job's exit status, the outputs of the ranks joined
    in their order."""
    code, each = zygote_ranks(ranks, script, args, env, timeout)
    return subprocess.CompletedProcess([script, *args], code, "".join(r.stdout for r in each),
                                       "".join(r.stderr for r in each))


def zygote_ranks(ranks: int, script: str, args: list[str], env: dict[str, str],
                 timeout: float = 240) -> tuple[int, list[subprocess.CompletedProcess[str]]]:
    """`zygote_job`, each rank's exit status and outputs apart."""
    return _the_zygote().job(ranks, script, args, {**os.environ, **env}, timeout)


def pytest_sessionfinish(session, exitstatus):
    if _zygote is not None:
        _zygote.close()


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def script():
    return run_script


def zygote_process(cmd: list[str], env: dict[str, str], log: str, timeout: float) -> int:
    """harness.run_process through the test zygote (``cmd`` is [python, script, *argv] or
    [python, -m, module, *argv]): a
    real new process that restores only from disk, forked from one that has imported torch,
    so that a check's many lives fit in the suite."""
    import unbroken.proof.harness as harness

    assert cmd[0] == sys.executable and (cmd[1].endswith(".py") or cmd[1] == "-m"), cmd
    script, argv = (cmd[2], cmd[3:]) if cmd[1] == "-m" else (cmd[1], cmd[2:])
    r = run_script(script, *argv, env=harness._clean_env(env), timeout=timeout)
    with open(log, "a") as f:
        f.write(r.stdout + r.stderr)
    return r.returncode
