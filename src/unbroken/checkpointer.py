"""The Checkpointer: when to save, what a generation holds, and restore by intent."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from . import fixture
from ._env import SAVE_AT_ENV
from .boundary import Preemption, UpdateWatch
from .dist.alike import check_alike
from .dist.group import Group, background_group, warn_ddp_buckets
from .errors import (
    ReadOnlyRun,
    RunUnreadable,
    SharedFileFailed,
    UnbrokenWarning,
    UpdateBoundaryError,
)
from .inputs import check_options, dry_encode, metric, parts_of, per_rank_parts, steps_from_env
from .persist.background import InFlight, Worker
from .persist.process import ProcessPersister
from .persist.snapshot import SnapshotBuffers
from .persisting import Persisting
from .restoring import Restoring, gc_paused
from .state import parts as S
from .state.identity import Identity
from .state.incremental import HeldFile, Plan
from .state.optim import check_optimizer_params
from .store.backends.killpoints import fault_point
from .store.backends.mounts import filesystem_type, rename_is_atomic
from .store.generations import GenerationInfo
from .store.lock import errno_text
from .store.opening import is_url, location_key, open_store
from .store.retention import Keep
from .trace import TRACE_ENV, TRACE_HASH_ENV, TraceRecorder
from .writer import RunWriter

log = logging.getLogger("unbroken")
ROOT_ENV = "UNBROKEN_ROOT"


class Checkpointer(Persisting, Restoring):
    """Saves complete continuation state at update boundaries and restores it by intent.

    ``root`` is the run folder (one writer at a time). ``model`` and ``optimizer`` are required
    for a continuation; ``scheduler``, ``scaler`` (``torch.amp.GradScaler``), ``data`` (a
    resumable loader or sampler) and ``extras`` (name -> object with ``state_dict()`` /
    ``load_state_dict()``) are captured when given. ``generators`` registers ``torch.Generator``
    and ``numpy.random.Generator`` objects by name; Python, NumPy-global, torch-CPU and every
    initialized CUDA device's RNG are always captured. ``identity`` binds config, tokenizer and
    data; ``every`` saves each N completed updates from ``step_done``; ``keep`` is retention.
    ``trace`` (or ``$UNBROKEN_TRACE``) appends one record per completed update to a JSON-lines
    file: lr, sample ids, batch, loss, gradient norm, and digests of the parameters, RNG
    streams and every state part; the optimizer's (the costliest) every ``trace_hash_every``
    updates and at every restore. ``signals`` (e.g. ``[signal.SIGTERM]``) turn a preemption
    notice into a save at the next update boundary and ``should_stop``; ``stop_deadline``
    bounds the wait. In a job of many ranks (torch.distributed initialized, or
    ``process_group``) a signal received by any one rank stops every rank at the same update:
    they compare notes every ``stop_check_every`` updates (one all-reduce of two integers).

    ``async_save=True``: a save copies the state into reused host buffers at the update
    boundary and returns; the generation is written, verified and committed in the background
    (at most one in flight; its error is raised by the next save, ``wait()`` or ``close()``;
    ``close()`` waits). In a job, the background save talks to the other ranks over a gloo
    group of its own, whose collectives give up after ``async_timeout`` seconds.
    ``async_save="process"``: the snapshot goes to shared memory and a persisting process
    writes it, so a save survives the training process being killed after ``save()``
    returned (`persist.process`). In a job, every rank has one; they commit each generation
    together through files in the run folder (`dist.filegroup`), waiting at most
    ``async_timeout`` seconds for one another (a rank whose training process dies before it
    handed its share over is reported to the others by its persisting process at once).

    ``read_back``, of a synchronous save: ``"background"`` (the default) returns from
    ``save()`` once the generation is committed and durable (written, hashed, fsynced,
    manifest last, renamed); reading it back from the device, verifying it and retention go
    on in the background (``wait()`` blocks for them; a failure raises at the next save,
    ``wait()`` or ``close()``; no older generation is deleted before the new one verified).
    In a job, the read-back then talks to the other ranks over a gloo group of its own, as
    async saves do (``async_timeout``); the save itself, within the process group's
    timeout. ``"sync"``: ``save()`` returns only after all of that, with the generation read
    back and retention applied (twice the I/O inside the call).

    ``persist_share`` (with a background save of any kind): the background work (writing,
    hashing, reading back) keeps its CPU time under that share of one core while the loop
    runs, e.g. 0.2, so a loop that uses every core is slowed about that much while a save
    persists instead of losing a core; the save is durable later. Once the loop waits for it
    (the next save, ``wait()``, ``close()``, the interpreter's exit) it runs at full speed.

    ``next_step_fixture=True`` (one process, local run): the update after each save records
    its sample ids and the digests of the state it produced, for ``unbroken verify --deep
    --factory`` to replay (`fixture`).

    ``incremental=True``: tensors unchanged since the previous generation (a frozen base
    under LoRA, frozen embeddings; found by content digest) are linked from it, not written
    again; every generation still verifies and restores on its own (`state.incremental`).

    ``root`` is a local folder or a URL (``s3://bucket/runs/exp1``, ``gs://...``,
    ``memory://...``): an object store through fsspec, its credentials and endpoint from
    fsspec's configuration and the environment, or ``storage_options`` (`store.opening`);
    ``cache_dir`` keeps what a restore downloaded, by content, for the next (`store.cache`).

    In a process forked from the one that made it (which holds its lock and its save in
    flight), ``save()`` and ``restore()`` raise `StoreLocked`; ``wait()``, ``close()`` do nothing.

    The harness (``unbroken check``) steers an unchanged script through the environment:
    ``$UNBROKEN_ROOT`` replaces ``root``, ``$UNBROKEN_SAVE_AT`` (comma-separated steps) adds
    saves, ``$UNBROKEN_KILL_AT`` kills the process at a named point."""

    def __init__(self, root: str | os.PathLike[str], *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 scaler: Any = None, data: Any = None, extras: Mapping[str, Any] | None = None,
                 generators: Mapping[str, Any] | None = None, identity: Identity | None = None,
                 every: int | None = None, keep: Keep | None = None,
                 trace: str | os.PathLike[str] | None = None, trace_hash_every: int = 10,
                 signals: Iterable[int] = (), stop_deadline: float | None = None,
                 stop_check_every: int = 1, process_group: Any = None,
                 async_save: bool | str = False, async_timeout: float = 600.0,
                 incremental: bool = False, read_back: str = "background",
                 storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None,
                 next_step_fixture: bool = False, persist_share: float | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, DistributedDataParallel):  # names as the module's own, no "module."
            warn_ddp_buckets(model)
            model = model.module
        # With torch.distributed initialized (or ``process_group`` given), this Checkpointer is
        # one rank of a job: every rank builds one on the same folder, rank 0 writes.
        self._group = Group(process_group)
        self._pid = os.getpid()
        later = check_options(async_save, read_back, async_timeout, persist_share, every,
                              trace_hash_every)
        self._persist_share = persist_share
        self._async = bool(async_save)
        self._buffers = SnapshotBuffers()
        self._in_flight: InFlight | None = None
        self._worker = Worker("unbroken-save")  # (its thread starts with the first save)
        # The order and header of each tensor file, used again while its tensors keep their
        # names, dtypes and shapes (one save at a time uses them).
        self._layouts: dict[str, Any] = {}
        self._process = async_save == "process"
        self._read_back_later = later
        self._persister: ProcessPersister | None = None
        self._incremental = bool(incremental)
        self._held: dict[str, list[HeldFile]] = {}  # the newest generation's files, by part
        self.model, self.optimizer, self.data = model, optimizer, data
        self.identity = identity or Identity()
        self.every = every
        self.keep = keep or Keep()
        self._counters = S.Counters(data)
        if optimizer is not None:
            check_optimizer_params(model, optimizer)
        self._parts = parts_of(model, optimizer, scheduler, scaler, data, extras, generators,
                               self._counters)
        self._per_rank = per_rank_parts(extras)
        dry_encode(self._parts)  # a value save cannot store fails now, not hours in
        self._preemption = Preemption(signals, stop_deadline,
                                      stop_check_every)  # validated before the lock

        self._save_at = steps_from_env(SAVE_AT_ENV)
        location = os.environ.get(ROOT_ENV) or root
        if "://" not in str(location):
            self.identity.refuse_inside(str(location))
        check_alike(self._group, {
            # (each rank writes into the staging folder at the leader's path: the same path,
            # whatever it resolves to on each node)
            "run folder (root= or $UNBROKEN_ROOT)": location_key(location),
            "every=": every, "async_save=": "process" if self._process else self._async,
            "read_back=": read_back, "incremental=": self._incremental,
            "signals=": sorted(s.name for s in self._preemption.signals),
            **({"stop_check_every=": stop_check_every} if self._preemption.signals else {}),
            f"${SAVE_AT_ENV}": sorted(self._save_at),
            "parts (optimizer=, scheduler=, scaler=, data=, extras=)": sorted(
                set(self._parts) - {S.RNG, S.COUNTERS}),
            "extras held per rank (PerRank)": sorted(self._per_rank)}, self.identity)
        # An async save's collectives (a read-back later's too) run beside the training loop's:
        # a group of their own, made here, where every rank builds its Checkpointer at the
        # same point. (A save's commit uses it too, after the previous save ended: the two
        # never overlap on it.)
        self._save_group = (background_group(process_group, async_timeout)
                            if (async_save or later) and self._group.active else self._group)
        if self._process and is_url(location):
            raise ValueError(f"async_save='process' writes to a local run folder; {location} "
                             "is on an object store: use async_save=True")
        if next_step_fixture and (self._group.active or is_url(location)):
            raise ValueError("next_step_fixture=True records fixtures of one process in a "
                             "local run folder")
        self._fixture_after: int | None = None  # record the update after this saved step
        self._next_step_fixture = bool(next_step_fixture)
        self._storage_options = storage_options  # a warm start's source is opened alike
        self.store = open_store(location, storage_options, cache_dir)
        self._writer = RunWriter(self.store, self.keep, leader=self._group.leader)
        self.fstype = "object store" if is_url(location) else filesystem_type(self.store.root)
        if self.fstype != "object store" and not rename_is_atomic(self.fstype):
            warnings.warn(f"{self.store.root} is on {self.fstype}: directory rename may not be "
                          "atomic there, so a crash during commit may leave a torn generation "
                          "(it is still detected and refused on load)", UnbrokenWarning,
                          stacklevel=2)
        try:
            self._run, self._run_written, self._ambiguous = self._writer.agreed_run(self._group)
            if self._process:  # started early where it can: it imports torch
                self._persister = ProcessPersister(self.store, self._group.leader,
                                                   async_timeout)
                if self.store.locked or not self._group.leader:  # (else at the first save)
                    self._persister.start()
        except OSError as e:  # (reading the run folder: out of descriptors, an I/O error)
            self._writer.close()
            raise RunUnreadable(f"{self.store.root}: the run folder could not be read "
                                f"({errno_text(e)}: {e.filename or self.store.root}); nothing "
                                "was written; fix the cause, then build the Checkpointer "
                                "again") from None
        except BaseException:
            self._writer.close()  # a Checkpointer that failed to open holds no lock
            raise
        self.incarnation = 0
        self._parent: dict[str, Any] | None = None
        self._origin: dict[str, Any] | None = None
        self._last_saved: int | None = None
        # The metrics step_done was given (loss too) and its step: a save() of that step
        # stores them in the manifest, as a save inside step_done does (Keep(best=...)).
        self._step_metrics: tuple[int, dict[str, float]] = (-1, {})
        self._metric_names: set[str] = set()  # (every name step_done was given)
        self._restored = False  # restore() ran: saving into a used folder is then a continuation
        self._restore_tried = False  # restore() was called (it may have raised)
        self.rejected: list[tuple[str, str]] = []  # (generation path, reason) at the last restore
        trace = os.environ.get(TRACE_ENV) or trace
        if trace and self._group.active:  # one trace per rank, compared rank by rank
            trace = f"{os.fspath(trace)}.rank{self._group.rank}"
        hash_every = int(os.environ.get(TRACE_HASH_ENV) or trace_hash_every)
        self._trace = TraceRecorder(trace, self._parts, hash_every) if trace else None
        self._watch = UpdateWatch(optimizer, data)
        self._watch.boundary(0, self._counters.epoch)
        self._preemption.install()
        self.should_stop = False  # set by step_done after the save a signal asked for

    @property
    def read_only(self) -> ReadOnlyRun | None:
        """Why this Checkpointer cannot save (None: it holds the writer lock). Restoring needs
        no lock, so read-only media still restore; a save raises this."""
        return self._writer.read_only

    @property
    def run_id(self) -> str:
        """The id of the run this folder holds (``RUN.json``); every generation carries it."""
        return self._run.run_id

    def export(self, out: str | os.PathLike[str], *, inputs: Any = None, dtype: str | None = None,
               adapter: Any = None, base_revision: str | None = None,
               generation_config: Any = None) -> dict[str, Any]:
        """Inference export of the live model (`tools.export.export_model`): its weights in
        safetensors under their ``state_dict`` names, this run's identity (without data
        paths) and lineage (run, step, and the generation when this step was saved: a save
        in flight is waited for); no optimizer, data position or RNG. ``inputs``: fixed
        inputs whose outputs are recorded now, for `unbroken.verify_export` after merging,
        casting or moving backends."""
        from .tools.export import export_model  # the tools sit above the checkpointer

        self.wait()  # a save of this step still in flight: the lineage names it once verified
        lineage: dict[str, Any] = {"run_id": self.run_id, "step": self.step}
        if self._last_saved == self.step:
            lineage["generation"] = self.step
        return export_model(self.model, out, identity=self.identity, lineage=lineage,
                            inputs=inputs, dtype=dtype, adapter=adapter,
                            base_revision=base_revision, generation_config=generation_config,
                            run=self.store.root)

    # -- counters ------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Completed updates so far (as last reported by ``step_done`` or restored)."""
        return self._counters.step

    @property
    def epoch(self) -> int:
        return self._counters.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._counters.epoch = value

    # -- saving --------------------------------------------------------------------------------

    def step_done(self, step: int, *, loss: float | torch.Tensor | None = None,
                  batch: Any = None, grad_norm: float | torch.Tensor | None = None,
                  **metrics: float | torch.Tensor) -> bool:
        """Mark the update boundary after update ``step`` (1-based count of completed updates);
        trace it, and save when ``every`` is due or a signal asked to stop (then
        ``should_stop`` becomes True: leave the training loop). ``batch``, ``grad_norm`` and
        the ``metrics`` (e.g. ``val_loss=...``, also stored in the manifest when saving) feed
        the trace. Returns whether a generation was written."""
        # The harness's "kill inside update K": weights updated, nothing recorded or saved.
        fault_point("update-end", self._counters.step + 1)
        self._watch.signal_due()
        if type(step) is not int or step != self._counters.step + 1:
            raise UpdateBoundaryError(
                f"step_done({step!r}) after step {self._counters.step}: call it once per "
                f"completed update with the new count ({self._counters.step + 1})")
        if self.data is not None and getattr(self.data, "at_boundary", True) is False:
            raise UpdateBoundaryError(
                f"step_done({step}) in the middle of an update window of the data loader; "
                "call it after the optimizer step that ends the window")
        # Everything given is checked before anything changes: a bad value leaves the run as
        # it was, whether or not a trace is kept.
        values = {name: metric(name, v) for name, v in metrics.items()}
        loss_value = None if loss is None else metric("loss", loss)
        grad_value = None if grad_norm is None else metric("grad_norm", grad_norm)
        self._preemption.check_handlers()
        if self._trace is not None:
            self._trace.update(step, self._watch.epoch, loss_value, batch, grad_value,
                               self._watch.applied_lrs(), self._watch.steps, values)
        self._counters.step = step
        self._watch.boundary(step, self._counters.epoch)
        if self._fixture_after is not None:
            if self._fixture_after == step - 1:
                fixture.record(self.store.root, step - 1, step,
                               getattr(self.data, "last_update_ids", None),
                               fixture.state_digests(self.model, self.optimizer))
            self._fixture_after = None
        saved = False
        if loss_value is not None:
            values.setdefault("loss", loss_value)
        if self.keep.best is not None and not values.keys() <= self._metric_names:
            # (names not seen yet: a typo of best's? Checked once a name, off the hot path)
            self._metric_names |= values.keys()
            typo = self.keep.misspelled(values)
            if typo:
                warnings.warn(typo, UnbrokenWarning, stacklevel=2)
        self._step_metrics = (step, values)
        stop = self._preemption.agree(self._group, step)
        if stop:  # the boundary came in time: stop_deadline no longer applies to the save
            self._preemption.reached()
        if self.every and step % self.every == 0 or step in self._save_at or stop:
            saved = self._save(step, dict(values)) is not None or self._in_flight is not None
        if stop:
            self.wait()  # the stop save is committed before the loop is told to stop
            self._preemption.done()
            self.should_stop = True
            assert self._preemption.requested is not None
            log.warning("stopping after update %d on %s; generation %d is committed", step,
                        self._preemption.requested.name, step)
            if self._trace is not None:
                self._trace.stopped(step, self._preemption.requested.name)
        fault_point("step-done", step)  # the harness's deterministic "kill after update K"
        return saved

    def save(self, step: int | None = None, *, metrics: Mapping[str, float] | None = None
             ) -> GenerationInfo | None:
        """Write and commit generation ``step`` and return it, durable; reading it back,
        verifying it and retention follow in the background (``read_back="sync"``: before
        it returns; ``async_save``: snapshot the state and return None at once, all the rest
        in the background). ``wait()`` returns the generation once verified. Saving the same
        step again is a no-op when nothing changed since, and supersedes that generation when
        something did (an end-of-epoch scheduler step).

        Without ``step`` (the count ``step_done`` reached), the call must come at an update
        boundary: if ``optimizer.step()`` ran or the data loader handed out a batch since the
        last ``step_done``, it raises `UpdateBoundaryError` (a save from a signal handler lands
        there; use ``signals=`` instead). A ``step`` beyond the last ``step_done`` declares that
        many completed updates (for loops that do not call ``step_done``)."""
        if step is None or step == self._counters.step:
            self._watch.check_boundary(self._counters.step)
        given = {name: metric(name, v) for name, v in (metrics or {}).items()}
        at, values = self._step_metrics
        return self._save(step, {**values, **given} if at == (
            self._counters.step if step is None else step) else given)

    @gc_paused
    def _save(self, step: int | None, values: dict[str, float]) -> GenerationInfo | None:
        self._forked("save")  # (a save of step_done's too: every=, a signal, $UNBROKEN_SAVE_AT)
        step = self._counters.step if step is None else step
        if type(step) is not int or step < 0:
            raise ValueError(f"save(step={step!r}): the completed-update count, an int >= 0")
        if step < self._counters.step:
            raise UpdateBoundaryError(
                f"save({step}) after {self._counters.step} completed updates: a generation holds "
                "the state of the step it is named after; save the current step")
        if self.data is not None and getattr(self.data, "at_boundary", True) is False:
            raise UpdateBoundaryError("save requested in the middle of an update window; "
                                      "save after optimizer.step() completes the window")
        try:
            self.wait()  # at most one save in flight; a failed one raises here
        except SharedFileFailed as e:  # (the state is good: this save writes every file)
            warnings.warn(f"{e}; saving step {step} in full", UnbrokenWarning, stacklevel=3)
        if self._next_step_fixture:
            self._fixture_after = step  # the next update records what it does from here
        again = step == self._last_saved
        if not self._group.active:
            self._prepare_write(step, again)
        if step > self._counters.step:
            # A step beyond the last step_done declares those updates completed: from here
            # on this is their boundary (saving this step again, or retrying a save that
            # failed, is a save at a boundary, not one after updates it did not see)
            self._counters.step = step
            self._watch.boundary(step, self._counters.epoch)
        started = time.monotonic()
        # (An async save copies the parameters at once, into its snapshot or shared memory:
        # they need not be detached.)
        tree = S.capture(self._parts, self.model, detach=not self._async)
        plan = Plan(step, self._held, frozenset(
            n for n, p in self.model.named_parameters() if not p.requires_grad)
        ) if self._incremental else None
        if self._process:
            self._hand_over(step, tree, values, again, started, plan)
            return None
        if not self._async:
            return self._persist(step, tree, values, again, started, plan)
        tree = self._buffers.take(tree)  # nothing the loop does from here on changes it
        log.info("snapshot of step %d (%d tensor bytes) in %.3f s; persisting in the "
                 "background", step, self._buffers.nbytes, time.monotonic() - started)
        self._in_flight = InFlight(step, lambda: self._persist(step, tree, values, again,
                                                               started, plan, snapshot=True),
                                   self._pacer(), worker=self._worker)
        return None
