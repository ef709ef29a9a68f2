"""What the corruption fuzz watches around each case: a timer, the command line run in-process
with a strict UTF-8 stdout (as a terminal has), the files outside the run, every exception
seen (escaping restore or a command, or refusing a candidate generation), and which files were
read whole."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from .. import picking
from ..errors import UnbrokenError
from ..store.backends.local import LocalFS


class Timeout(BaseException):
    """Raised by the case timer: the case hung."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Timeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _strict_text() -> io.TextIOWrapper:
    """An in-memory stream that refuses what a UTF-8 terminal refuses (a lone surrogate)."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)


def _text(stream: io.TextIOWrapper) -> str:
    buffer = stream.buffer
    assert isinstance(buffer, io.BytesIO)
    return buffer.getvalue().decode("utf-8", "replace")


def run_cli(argv: list[str], probe: Probe) -> tuple[int | None, str, str]:
    from ..cli import main as cli_main
    out, err = _strict_text(), _strict_text()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except Timeout:
            raise
        except BaseException as e:  # noqa: BLE001 -- reported as a failure
            probe.exception(e)
            detail = "".join(traceback.format_exception(e))
            return None, _text(out), f"{type(e).__name__}: {e!r}\n{_text(err)}\n{detail}"
    return code, _text(out), _text(err)


def snapshot(folder: str) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): its mode, and a regular file's hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = oct(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[p] += " " + xxhash.xxh3_64(f.read()).hexdigest()
    return out


class Probe:
    """Records, for the case in progress, every exception seen (by type) and every file read
    or hashed whole through unbroken's file layer (path, bytes)."""

    def __init__(self) -> None:
        self.seen: list[BaseException] = []
        self.reads: list[tuple[str, int]] = []

    def reset(self) -> None:
        self.seen, self.reads = [], []

    def exception(self, e: BaseException) -> None:
        """Record ``e`` once (a refusal re-raised by restore is the same exception)."""
        if not isinstance(e, Timeout) and not any(x is e for x in self.seen):
            self.seen.append(e)

    @property
    def types(self) -> list[str]:
        return [type(e).__name__ for e in self.seen]

    def outside_unbroken_error(self) -> list[str]:
        return sorted({type(e).__name__ for e in self.seen if not isinstance(e, UnbrokenError)})

    def read_whole(self, paths: set[str]) -> list[str]:
        return [f"{p} ({n} bytes)" for p, n in self.reads if p in paths]

    def install(self) -> Callable[[], None]:
        """Wrap the candidate loader of restore and the whole-file reads; returns the undo."""
        probe = self
        undo: list[Callable[[], None]] = []

        def wrap(cls: Any, name: str, after: Callable[[tuple[Any, ...], Any], None],
                 record: bool = False) -> None:
            original = getattr(cls, name, None)
            if original is None:  # renamed: nothing to watch there
                return

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                try:
                    result = original(*args, **kwargs)
                except BaseException as e:
                    if record:  # (file-layer errors are unbroken's to handle, not escapes)
                        probe.exception(e)
                    raise
                after(args, result)
                return result

            setattr(cls, name, wrapped)
            undo.append(lambda: setattr(cls, name, original))

        def read(args: tuple[Any, ...], result: Any) -> None:
            probe.reads.append((os.fspath(args[1]), memoryview(result).nbytes))

        def hashed(args: tuple[Any, ...], result: Any) -> None:
            probe.reads.append((os.fspath(args[1]), result[0]))

        wrap(picking, "_load", lambda args, result: None, record=True)
        wrap(LocalFS, "read_file", read)
        wrap(LocalFS, "hash_file", hashed)
        def uninstall() -> None:
            for u in reversed(undo):
                u()

        return uninstall
