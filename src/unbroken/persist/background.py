"""The background half of an async save: a job run by the owner's `Worker` thread, at most one
save in flight; its outcome (the committed generation, or the error) is collected by the
training thread at the next save, at ``wait()`` or at ``close()``. The worker is not a daemon:
a script that ends without ``close()`` still waits for the save in flight at interpreter exit.
A save with a `Pacer` (``persist_share``) is paced until the loop waits for it."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._pacing import Pacer, installed, release_at_exit

log = logging.getLogger("unbroken")

_Job = Callable[[], None] | None  # None: the worker stops


class Worker:
    """The thread that runs one owner's background jobs (a Checkpointer's saves), one at a
    time, kept from one job to the next: handing a save over is a queue's ``put`` (~10 us),
    not a thread's start, which waits until the new thread runs (0.4 ms, and 2.3 ms while a
    persisting process keeps both cores busy: in the time ``save()`` blocks the loop). It
    stops once it ended the jobs it was given when ``stop`` is called, when its owner drops
    it, or as the interpreter exits (before it waits for its threads); a job given after
    that runs at once, in the caller's thread (nothing would wait for a thread started
    then)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] | None = None  # the running thread's
        self._thread: threading.Thread | None = None
        self._stops: weakref.finalize | None = None  # (its thread's, if its owner drops it)

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job`` after the ones given before (a thread started if none runs: the
        first job, or after `stop`, or in a forked child)."""
        if _EXITING.is_set():
            job()
            return
        with self._lock:
            if self._jobs is None or self._thread is None or not self._thread.is_alive():
                jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
                # (the thread holds its queue, never the worker: a dropped worker stops it;
                # never a daemon, whichever thread starts it: the exit waits for its job)
                thread = threading.Thread(target=_serve, args=(jobs,), name=self.name,
                                          daemon=False)
                thread.start()
                self._jobs, self._thread = jobs, thread
                self._stops = weakref.finalize(self, jobs.put, None)
                _LIVE.add(self)
            self._jobs.put(job)

    def stop(self, wait: bool = False) -> None:
        """Let the thread end once the jobs given so far ended (a later job starts another);
        ``wait``: until it ended (not from a job of its own)."""
        with self._lock:
            thread, stops = self._thread, self._stops
            self._jobs = self._thread = self._stops = None
        if stops is not None:
            stops()  # (puts the thread's end after its jobs, once)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job  # (not held while idle: it may hold its owner, which then is never dropped)


_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()
_EXITING = threading.Event()  # the interpreter's exit began: jobs run in their caller


def _stop_all() -> None:
    _EXITING.set()
    for worker in list(_LIVE):
        worker.stop()


threading._register_atexit(_stop_all)  # type: ignore[attr-defined]


class InFlight:
    """One save persisting in the background."""

    def __init__(self, step: int, fn: Callable[[], Any], pacer: Pacer | None = None,
                 hurry: Callable[[], None] | None = None, worker: Worker | None = None
                 ) -> None:
        """``fn`` runs in ``worker``'s thread (a new worker's without one), paced by
        ``pacer``; ``hurry`` (a save persisting elsewhere) is called once when the loop starts
        waiting."""
        self.step = step
        self._fn = fn
        self._pacer = pacer
        self._hurry = hurry
        if pacer is not None or hurry is not None:
            release_at_exit(self)
        self._result: Any = None
        self._error: BaseException | None = None
        self._ended = threading.Event()
        (worker or Worker(f"unbroken-save-{step}")).run(self._run)

    def _run(self) -> None:
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
        if self._error is not None:
            raise self._error
        return self._result
