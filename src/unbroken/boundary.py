"""Where a training run is between two updates, and the safe way to stop it.

`UpdateWatch` follows the optimizer through step hooks: how many times ``optimizer.step()``
ran since the last update boundary (``step_done``), and the learning rate each parameter group
*used* in the update (read just before the step, so a scheduler stepped later, or never,
cannot make the trace lie about it). A ``save()`` outside ``step_done`` is allowed only where
nothing moved since the last boundary: no optimizer step, no batch handed out.

`Preemption` takes the signals a scheduler sends before it stops a job (SIGTERM, SLURM's
SIGUSR1): the handler only records the request; the next ``step_done`` saves and reports that
the run should stop. A run that does not reach a boundary within the stated deadline is ended
with the signal's default action (the previous generation stays the newest)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from ._env import SIGNAL_AT_ENV
from .errors import UnbrokenError, UpdateBoundaryError
from .state._digest import digest_tree

log = logging.getLogger("unbroken")
_GRACE = 5.0  # seconds a main thread stuck outside Python gets to run the ending handler


class UpdateWatch:
    """Optimizer steps and learning rates of the update in progress (see module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, data: Any) -> None:
        self._optimizer = optimizer
        self._data = data
        self.steps = 0  # optimizer.step() calls since the last boundary
        self.lrs: list[float] | None = None  # rates of the last step of this update
        self.epoch = 0  # the epoch of the update in progress
        self._start_lrs: list[float] = []
        self._mark: tuple[Any, ...] = ()
        self._signal_at = _signal_at()
        self._update = 0  # the update in progress (for the harness's signal)
        self._handles = []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self.lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.signal_due()

    def signal_due(self) -> None:
        """The harness's "a signal lands inside update K": at its optimizer step, or at its
        end (``step_done``) when the GradScaler skipped the step."""
        if self._signal_at is not None and self._update >= self._signal_at:
            self._signal_at = None
            os.kill(os.getpid(), signal.SIGTERM)

    def _current_lrs(self) -> list[float]:
        opt = self._optimizer
        return [float(g["lr"]) for g in opt.param_groups] if opt is not None else []

    def applied_lrs(self) -> list[float]:
        """The rates this update's optimizer step used; if it took none (a step the
        GradScaler skipped), the rates it would have used: those at the update's start."""
        return self.lrs if self.lrs is not None else self._start_lrs

    def _position(self) -> Any:
        data = self._data
        if data is None:
            return None
        if hasattr(data, "consumed") and hasattr(data, "epoch"):
            return (data.epoch, data.consumed, getattr(data, "at_boundary", True),
                    getattr(data, "handed_out", None))
        try:
            return digest_tree(data.state_dict())
        except (UnbrokenError, TypeError):
            return None  # mid-window (the loader refuses) or undigestable: at_boundary decides

    def boundary(self, step: int, epoch: int) -> None:
        """Mark an update boundary (``step_done``, a restore, the start). ``epoch`` is the
        epoch the next update's data comes from (a loader rolls over as it hands out an
        epoch's last batch: read afterwards, that update would count in the next epoch)."""
        self.steps = 0
        self.lrs = None
        self._start_lrs = self._current_lrs()
        self.epoch = epoch
        self._update = step + 1
        self._mark = (self._position(),)

    def check_boundary(self, step: int) -> None:
        """Raise `UpdateBoundaryError` unless nothing moved since the last boundary."""
        moved = []
        if self.steps:
            moved.append(f"optimizer.step() ran {self.steps} time(s)")
        position = self._position()
        if (position,) != self._mark and not _empty_rollover(self._mark[0], position):
            moved.append("the data loader handed out batches")
        if moved:
            raise UpdateBoundaryError(
                f"save() at the boundary of update {step} (step_done, a restore, or a save that "
                f"declared it), but since then {' and '.join(moved)}: the "
                "generation would mix this update's weights with the previous update's "
                "counters, scheduler or data position. Save from step_done (every=N), or at "
                "an update boundary; to stop on a signal, pass signals= to the Checkpointer "
                "and stop when ckpt.should_stop")

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _empty_rollover(before: Any, after: Any) -> bool:
    """Whether the data position moved from ``before`` to ``after`` (``_position`` tuples) only
    by ending epochs that handed nothing out: an iterable stream's empty pass rolls the cursor
    over to the next epoch's start outside any update, and that is still an update boundary.
    Only a loader that counts the batches it hands out (``handed_out``) tells this apart from
    a whole epoch trained without ``step_done``; for any other data part a move is a move."""
    if not (isinstance(before, tuple) and isinstance(after, tuple)
            and len(before) == len(after) == 4):
        return False
    epoch0, _, boundary0, handed0 = before
    epoch1, consumed1, boundary1, handed1 = after
    return (handed0 is not None and handed0 == handed1 and boundary0 and boundary1
            and consumed1 == 0 and epoch1 > epoch0)


def _signal_at() -> int | None:
    value = os.environ.get(SIGNAL_AT_ENV)
    try:
        return int(value) if value else None
    except ValueError:
        raise UnbrokenError(f"${SIGNAL_AT_ENV}={value!r}: expected an update number") from None


class Preemption:
    """Record stop requests from ``signals``; `due` tells ``step_done`` to save and stop."""

    def __init__(self, signals: Iterable[int | signal.Signals], deadline: float | None,
                 check_every: int = 1) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if deadline is not None and not deadline > 0:
            raise ValueError(f"stop_deadline={deadline!r}: seconds > 0, or None")
        if type(check_every) is not int or check_every < 1:
            raise ValueError(f"stop_check_every={check_every!r}: an int >= 1")
        self.check_every = check_every
        self.deadline = deadline
        self.requested: signal.Signals | None = None
        self.requested_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}
        self._timer: threading.Timer | None = None
        # The timer thread and the main thread decide under this lock which came first: the
        # deadline (``_expired``) or the update boundary (``_reached``); never both.
        self._race = threading.Lock()
        self._expired = False
        self._reached = False
        self._warned: set[signal.Signals] = set()
        if self.signals and threading.current_thread() is not threading.main_thread():
            raise UnbrokenError("signals= needs the Checkpointer to be built in the main thread "
                                "(Python delivers signals there)")

    def install(self) -> None:
        """Take the signals (once the Checkpointer is otherwise built)."""
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        # (It takes no lock: it runs in the main thread, maybe inside `reached`'s hold.)
        if self._expired:  # (main thread) the deadline passed: end as the signal would have
            _end(signum)
            return
        if self.requested is not None:
            return
        self.requested = signal.Signals(signum)
        self.requested_at = time.monotonic()
        log.warning("%s received: saving at the next update boundary, then stopping",
                    self.requested.name)
        if self.deadline is not None:
            self._timer = threading.Timer(self.deadline, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def _give_up(self) -> None:
        """(timer thread) No update boundary within the deadline: end as the signal would
        have. Only the main thread may reset a handler, so the signal is sent again and the
        handler ends the process; a main thread stuck outside Python cannot run it, and is
        then killed outright after a grace period. Does nothing once the boundary was
        reached (`reached`): a timer that fires while the main thread cancels it is too late."""
        assert self.requested is not None
        with self._race:
            if self._reached:
                return
            self._expired = True
        log.error("no update boundary within %g s of %s: stopping without a save (the "
                  "previous generation is the newest)", self.deadline, self.requested.name)
        os.kill(os.getpid(), self.requested)
        time.sleep(_GRACE)
        os.kill(os.getpid(), signal.SIGKILL)

    def check_handlers(self) -> None:
        """Warn (once) when the script replaced a handler after the Checkpointer took the
        signal: its requests would then never reach ``step_done``."""
        for s in self.signals:
            if signal.getsignal(s) != self._handler and s not in self._warned:
                self._warned.add(s)
                log.warning("%s was given a handler of the script's own after the Checkpointer "
                            "took it: signals=%s no longer stops the run at an update "
                            "boundary (set the script's handler before building the "
                            "Checkpointer, or drop it)", s.name, s.name)

    @property
    def due(self) -> bool:
        return self.requested is not None

    def agree(self, group: Any, step: int) -> bool:
        """Whether to save and stop after update ``step``. In a job, only what the ranks
        agreed: every ``check_every`` updates they exchange the signal number (0: none), one
        small all-reduce, and all of them stop at that update when any rank had a request; a
        request that arrives between two exchanges (or during one) waits for the next, so no
        rank ever stops alone."""
        if not (group.active and self.signals):
            return self.due
        if step % self.check_every:
            return False
        mine = int(self.requested or 0)  # read once: a signal may land during the exchange
        signum = group.max_int(mine, "agreeing on a stop request")
        if signum and self.requested is None:
            self.requested = signal.Signals(signum)
            self.requested_at = time.monotonic()
            log.warning("%s received by another rank: saving now, then stopping",
                        self.requested.name)
        return bool(signum)

    def reached(self) -> None:
        """(main thread) The update boundary that stops the run is here, its stop save about to
        begin: the deadline no longer applies, however long the save takes (in any save mode;
        the deadline bounds the wait for a boundary, not the save). Unless the deadline came
        first: then the process ends here, as the signal would have ended it."""
        with self._race:
            expired = self._expired
            self._reached = not expired
        if expired:
            assert self.requested is not None
            _end(self.requested)
        self.done()

    def done(self) -> None:
        """The stop save is committed: the deadline no longer applies."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.done()
        for s, previous in self._previous.items():
            try:
                signal.signal(s, previous)
            except (ValueError, TypeError):
                pass
        self._previous = {}


def _end(signum: int) -> None:
    """(main thread) End the process with ``signum``'s default action."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
