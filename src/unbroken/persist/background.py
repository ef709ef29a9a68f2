"""The background half of an async save: one worker thread per save, at most one save in
flight; its outcome (the committed generation, or the error) is collected by the training
thread at the next save, at ``wait()`` or at ``close()``. The thread is not a daemon: a script
that ends without ``close()`` still waits for the save in flight at interpreter exit.
A save with a `Pacer` (``persist_share``) is paced until the loop waits for it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .._pacing import Pacer, installed, release_at_exit

log = logging.getLogger("unbroken")


class InFlight:
    """One save persisting in the background."""

    def __init__(self, step: int, fn: Callable[[], Any], pacer: Pacer | None = None,
                 hurry: Callable[[], None] | None = None) -> None:
        """``fn`` runs in the thread, paced by ``pacer``; ``hurry`` (a save persisting
        elsewhere) is called once when the loop starts waiting."""
        self.step = step
        self._fn = fn
        self._pacer = pacer
        self._hurry = hurry
        if pacer is not None or hurry is not None:
            release_at_exit(self)
        self._result: Any = None
        self._error: BaseException | None = None
        # Our own flag, not Thread.is_alive(): a join interrupted by Ctrl-C can leave the
        # thread marked stopped while it still runs (CPython before 3.13).
        self._ended = threading.Event()
        # The thread waits for this before its work: `Thread.start` waits until the new
        # thread runs, which then kept the GIL for its first switch interval (5 ms) while
        # the training thread waited to return from ``save()``.
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"unbroken-save-{step}")
        self._thread.start()
        self._go.set()

    def _run(self) -> None:
        self._go.wait()
        try:
            with installed(self._pacer):
                self._result = self._fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the training thread
            self._error = e
            # said now too: a script that never saves, waits or closes again would not hear it
            log.error("the background part of the save of step %d failed: %s (raised at the "
                      "next save, wait() or close())", self.step, e)
        finally:
            self._ended.set()

    def release(self) -> None:
        """The loop waits for this save (or the interpreter exits): no more pacing."""
        if self._pacer is not None:
            self._pacer.release()
        if self._hurry is not None:
            hurry, self._hurry = self._hurry, None
            hurry()

    @property
    def done(self) -> bool:
        return self._ended.is_set()

    def raised(self, e: BaseException) -> bool:
        """Whether ``e``, raised by `wait`, is the save's own error (not an interrupt of the
        wait, which may come as the save ends)."""
        return self.done and e is self._error

    def wait(self) -> Any:
        """Block until the save ended; its result, or raise its error. An interrupt (Ctrl-C)
        while waiting leaves the save in flight, to be waited for again."""
        self.release()
        self._ended.wait()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
