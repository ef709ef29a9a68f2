"""The Checkpointer: when to save, what a generation holds, and restore by intent."""

from __future__ import annotations

import errno
import functools
import gc
import logging
import os
import re
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import state as S
from ._fs import fault_point, filesystem_type, rename_is_atomic
from ._progress import Progress
from .errors import (
    CorruptCheckpoint,
    NoCheckpoint,
    SaveFailed,
    UnbrokenError,
    UnbrokenWarning,
    UpdateBoundaryError,
)
from .faults import DROP_ENV, drop_parts
from .identity import Identity, check_environment, check_identity, environment
from .manifest import Artifact, Manifest
from .retention import Keep, select_kept
from .rng import RNGStreams
from .store import GenerationInfo, GenerationStore, generation_name
from .trace import TRACE_ENV, TRACE_HASH_ENV, TraceRecorder

log = logging.getLogger("unbroken")
ROOT_ENV = "UNBROKEN_ROOT"
SAVE_AT_ENV = "UNBROKEN_SAVE_AT"


def _steps_from_env(name: str) -> frozenset[int]:
    value = os.environ.get(name, "")
    try:
        return frozenset(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UnbrokenError(f"${name}={value!r}: expected comma-separated step numbers") from None
_EXTRA_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def _errno_name(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0)
    return f" [{name}]" if name else ""


def _gc_paused(fn: Any) -> Any:
    """Pause the cyclic garbage collector during a save or restore: encoding or decoding
    thousands of tensors allocates enough containers to trigger full collections, and each
    one walks every object of the process (importing torch alone makes ~10^6)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper


class Checkpointer:
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
    updates and at every restore.

    The harness (``unbroken check``) steers an unchanged script through the environment:
    ``$UNBROKEN_ROOT`` replaces ``root``, ``$UNBROKEN_SAVE_AT`` (comma-separated steps) adds
    saves, ``$UNBROKEN_KILL_AT`` kills the process at a named point."""

    def __init__(self, root: str | os.PathLike[str], *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 scaler: Any = None, data: Any = None, extras: Mapping[str, Any] | None = None,
                 generators: Mapping[str, Any] | None = None, identity: Identity | None = None,
                 every: int | None = None, keep: Keep | None = None,
                 trace: str | os.PathLike[str] | None = None, trace_hash_every: int = 10) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(f"every={every!r}: save every N completed updates, N >= 1, or None")
        if type(trace_hash_every) is not int or trace_hash_every < 1:
            raise ValueError(f"trace_hash_every={trace_hash_every!r}: an int >= 1")
        self.model, self.optimizer, self.data = model, optimizer, data
        self.identity = identity or Identity()
        self.every = every
        self.keep = keep or Keep()
        self._counters = S.Counters(data)
        if optimizer is not None:
            S.check_optimizer_params(model, optimizer)
        self._parts: dict[str, Any] = {S.MODEL: model}
        for name, obj in ((S.OPTIMIZER, optimizer), (S.SCHEDULER, scheduler),
                          (S.SCALER, scaler), (S.DATA, data)):
            if obj is not None:
                self._parts[name] = obj
        for name, obj in (extras or {}).items():
            if not _EXTRA_NAME.match(name):
                raise ValueError(f"extras name {name!r}: use letters, digits, '_' or '-'")
            if not isinstance(obj, S.Stateful):
                raise TypeError(f"extras[{name!r}] needs state_dict() and load_state_dict()")
            self._parts[S.EXTRA_PREFIX + name] = obj
        for name, obj in self._parts.items():
            if name != S.MODEL and not isinstance(obj, S.Stateful):
                raise TypeError(f"{name} needs state_dict() and load_state_dict()")
        self._parts[S.RNG] = RNGStreams(generators or {})
        self._parts[S.COUNTERS] = self._counters

        self._save_at = _steps_from_env(SAVE_AT_ENV)
        self.store = GenerationStore(os.environ.get(ROOT_ENV) or root)
        self.store.lock()
        self.fstype = filesystem_type(self.store.root)
        if not rename_is_atomic(self.fstype):
            warnings.warn(f"{self.store.root} is on {self.fstype}: directory rename may not be "
                          "atomic there, so a crash during commit may leave a torn generation "
                          "(it is still detected and refused on load)", UnbrokenWarning,
                          stacklevel=2)
        self.run_id = uuid.uuid4().hex
        self.incarnation = 0
        self._parent: dict[str, Any] | None = None
        self._origin: dict[str, Any] | None = None
        self._last_saved: int | None = None
        self.rejected: list[tuple[str, str]] = []  # (generation path, reason) at the last restore
        trace = os.environ.get(TRACE_ENV) or trace
        hash_every = int(os.environ.get(TRACE_HASH_ENV) or trace_hash_every)
        self._trace = TraceRecorder(trace, self._parts, hash_every) if trace else None

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
                  **metrics: float) -> bool:
        """Mark the update boundary after update ``step`` (1-based count of completed updates);
        trace it, and save when ``every`` is due. ``batch`` and ``grad_norm`` only feed the
        trace. Returns whether a generation was written."""
        if type(step) is not int or step != self._counters.step + 1:
            raise UpdateBoundaryError(
                f"step_done({step!r}) after step {self._counters.step}: call it once per "
                f"completed update with the new count ({self._counters.step + 1})")
        if self.data is not None and getattr(self.data, "at_boundary", True) is False:
            raise UpdateBoundaryError(
                f"step_done({step}) in the middle of an update window of the data loader; "
                "call it after the optimizer step that ends the window")
        self._counters.step = step
        if self._trace is not None:
            self._trace.update(step, loss, batch, grad_norm)
        saved = False
        if self.every and step % self.every == 0 or step in self._save_at:
            if loss is not None:
                metrics.setdefault("loss", float(loss.detach() if isinstance(loss, torch.Tensor)
                                                 else loss))
            saved = self.save(step, metrics=metrics) is not None
        fault_point("step-done", step)  # the harness's deterministic "kill after update K"
        return saved

    @_gc_paused
    def save(self, step: int | None = None, *, metrics: Mapping[str, float] | None = None
             ) -> GenerationInfo | None:
        """Write generation ``step`` (default: the current count) synchronously, read it back,
        verify it, then apply retention. Saving the same step twice is a no-op."""
        step = self._counters.step if step is None else step
        if type(step) is not int or step < 0:
            raise ValueError(f"save(step={step!r}): the completed-update count, an int >= 0")
        if step == self._last_saved:
            return None
        if step < self._counters.step:
            raise UpdateBoundaryError(
                f"save({step}) after {self._counters.step} completed updates: a generation holds "
                "the state of the step it is named after; save the current step")
        if self.data is not None and getattr(self.data, "at_boundary", True) is False:
            raise UpdateBoundaryError("save requested in the middle of an update window; "
                                      "save after optimizer.step() completes the window")
        self._counters.step = step
        started = time.monotonic()
        tree = S.capture(self._parts, self.model)
        meta = {"unbroken.run_id": self.run_id, "unbroken.generation": str(step),
                "unbroken.incarnation": str(self.incarnation)}
        artifacts = S.encode_generation(tree, meta)
        total = sum(memoryview(c).nbytes for chunks in artifacts.values() for c in chunks)
        progress = Progress(f"saving {generation_name(step)}", 2 * total)
        artifacts = {name: progress.wrap(chunks) for name, chunks in artifacts.items()}
        fingerprint = self.identity.fingerprint()
        env = {**environment(), "filesystem": self.fstype}

        def make_manifest(written: list[Artifact]) -> Manifest:
            return Manifest(
                generation=step, step=step, run_id=self.run_id, incarnation=self.incarnation,
                artifacts=written, parts=sorted(tree), parent=self._parent, origin=self._origin,
                identity=fingerprint, environment=env, retention=self.keep.to_json(),
                metrics={k: float(v) for k, v in (metrics or {}).items()},
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

        try:
            info = self.store.commit(step, artifacts, make_manifest)
        except OSError as e:
            progress.close()
            raise SaveFailed(
                f"{self.store.root}: saving generation {step} failed: "
                f"{e.strerror or e}{_errno_name(e)} ({e.filename or 'run folder'}); older "
                "generations are "
                "untouched and training may continue; free space or fix the disk before the "
                "next save") from e
        try:
            try:  # read back, streaming: hashes every byte, holds none of them
                self.store.verify(self.store.scan_one(step), advance=progress.advance)
            finally:
                progress.close()
        except CorruptCheckpoint as e:
            try:
                self.store.move_aside(info, "corrupt")
            except OSError as moving:
                raise SaveFailed(f"generation {step} did not read back as written ({e}) and "
                                 f"could not be moved aside ({moving}); restore refuses it, "
                                 "and older generations are untouched") from e
            raise SaveFailed(f"generation {step} did not read back as written ({e}); it was "
                             "moved aside and older generations are untouched") from e
        self._last_saved = step
        self._parent = {"run_id": self.run_id, "generation": step,
                        "incarnation": self.incarnation}
        try:
            self._apply_retention()
        except OSError as e:  # the generation is committed; deleting old ones can wait
            warnings.warn(f"{self.store.root}: retention could not delete an old generation "
                          f"({e}); generation {step} is committed and verified, and retention "
                          "is retried after the next save", UnbrokenWarning, stacklevel=2)
        if self._trace is not None:
            self._trace.saved(step)
        log.info("saved %s (%d bytes) in %.3f s", info.path,
                 info.manifest.total_bytes if info.manifest else 0, time.monotonic() - started)
        return info

    def _apply_retention(self) -> None:
        gens = self.store.scan()
        good = [g for g in gens if g.ok and g.manifest is not None]
        if not good:
            return
        kept = select_kept([(g.generation, g.manifest.step, g.manifest.metrics)  # type: ignore[union-attr]
                            for g in good], self.keep)
        oldest_kept = min(kept)
        for g in gens:
            # Torn leftovers older than everything kept are remains of an interrupted deletion.
            if g.generation not in kept and (g.ok or g.generation < oldest_kept):
                self.store.delete(g)

    # -- restoring -----------------------------------------------------------------------------

    @_gc_paused
    def restore(self, intent: str = "continue", *, generation: int | None = None,
                source: str | os.PathLike[str] | None = None,
                allow: Iterable[str] = ()) -> int:
        """Restore by intent and return the completed-update count to continue from.

        ``"continue"`` (default): everything, from the newest generation that verifies (or
        ``generation``); 0 only when the run folder holds no generation at all. A torn or
        corrupt newer generation is reported and moved aside, and the previous verified one is
        used. Any missing part, identity change or shape mismatch raises before any live object
        changes. ``"warm_start"``: model weights only, from another run folder ``source``; this
        run starts at 0 with a lineage naming its parent. Config or tokenizer changes must be
        named in ``allow``."""
        if intent not in S.INTENTS:
            raise ValueError(f"intent={intent!r}: one of {S.INTENTS}")
        if intent == "warm_start":
            return self._warm_start(source, generation, allow)
        if source is not None:
            raise ValueError("source= is for warm_start; a continuation reads its own run folder")
        scanned = self.store.scan()
        if not scanned:
            self._after_restore(0, None)
            return 0
        info, ready, tree = self._newest_loadable(self.store, scanned, generation, "continue",
                                                  allow)
        manifest = info.manifest
        assert manifest is not None
        parts = drop_parts(self._parts, ready, os.environ.get(DROP_ENV, ""))
        for g in scanned:  # the abandoned branch: never overwritten, never loaded again
            if g.generation > info.generation:
                self.store.move_aside(g, "abandoned" if g.ok else g.status)
        S.apply(ready, parts)
        self.run_id = manifest.run_id
        self.incarnation = 1 + max(g.manifest.incarnation for g in scanned if g.manifest)
        self._origin = manifest.origin
        self._parent = {"run_id": manifest.run_id, "generation": manifest.generation,
                        "incarnation": manifest.incarnation}
        self._last_saved = manifest.step
        log.info("restored %s (step %d)", info.path, manifest.step)
        self._after_restore(manifest.step, info)
        return manifest.step

    def _after_restore(self, step: int, info: GenerationInfo | None) -> None:
        if self._trace is not None:
            self._trace.restored(step, os.path.basename(info.path) if info else None,
                                 [os.path.basename(p) for p, _ in self.rejected])

    def _newest_loadable(self, store: GenerationStore, scanned: list[GenerationInfo],
                         generation: int | None, intent: str, allow: Iterable[str],
                         ) -> tuple[GenerationInfo, dict[str, Any], dict[str, Any]]:
        self.rejected = []
        candidates = [g for g in reversed(scanned)
                      if generation is None or g.generation == generation]
        if not candidates:
            raise NoCheckpoint(f"{store.root}: no generation {generation}; found "
                               f"{[g.generation for g in scanned]}")
        for info in candidates:
            try:
                names = None if intent == "continue" else [S.STATE_FILE, "model.safetensors"]
                progress = Progress(f"loading {os.path.basename(info.path)}",
                                    info.manifest.total_bytes if info.manifest else 0)
                try:
                    files = store.read_verified(info, names, advance=progress.advance)
                finally:
                    progress.close()
                tree, meta = S.decode_generation(
                    files, info.path, None if intent == "continue" else {S.MODEL})
                S.check_stamps(info.manifest, info.path, tree, meta,
                               all_parts=intent == "continue")
            except CorruptCheckpoint as e:
                self.rejected.append((info.path, str(e)))
                log.warning("rejected %s: %s", info.path, e)
                continue
            assert info.manifest is not None
            where = os.path.join(info.path, "MANIFEST.json")
            check_identity(info.manifest.identity, self.identity.fingerprint(), intent=intent,
                           allow=allow, where=where)
            check_environment(info.manifest.environment, environment(), where=where)
            parts = self._parts if intent == "continue" else {S.MODEL: self.model}
            ready = S.validate_parts(tree, parts, self.model, info.path, intent)
            for name, obj in parts.items():
                check = getattr(obj, "validate_state_dict", None)
                if check is not None:
                    check(tree[name], f"{info.path} [{name}]")
            if self.rejected:
                log.warning("using %s after rejecting %d newer generation(s)", info.path,
                            len(self.rejected))
            return info, ready, tree
        raise CorruptCheckpoint(
            f"{store.root}: no generation verifies; refusing to start from scratch:\n" +
            "\n".join(f"  {path}: {why}" for path, why in self.rejected) +
            "\nInspect with `unbroken inspect`; move the folder away to start a new run")

    def _warm_start(self, source: str | os.PathLike[str] | None, generation: int | None,
                    allow: Iterable[str]) -> int:
        if source is None or os.path.realpath(source) == os.path.realpath(self.store.root):
            raise UnbrokenError(
                "warm_start begins a new run: give it its own folder and name the parent, e.g. "
                "Checkpointer('runs/new', ...).restore(intent='warm_start', source='runs/old')")
        if self.store.scan():
            raise UnbrokenError(f"{self.store.root} already holds generations; a warm start "
                                "writes a new run into an empty folder (or use continue)")
        src = GenerationStore(source)
        scanned = src.scan()
        if not scanned:
            raise NoCheckpoint(f"{src.root}: no generation to warm-start from")
        info, ready, _ = self._newest_loadable(src, scanned, generation, "warm_start", allow)
        assert info.manifest is not None
        S.apply(ready, {S.MODEL: self.model})
        self._after_restore(0, None)
        self._origin = {"operation": "warm_start", "source": src.root,
                        "run_id": info.manifest.run_id, "generation": info.generation,
                        "incarnation": info.manifest.incarnation, "allowed": sorted(allow)}
        log.info("warm start from %s; new run %s", info.path, self.run_id)
        return 0

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the run folder's writer lock and close the trace."""
        self.store.unlock()
        if self._trace is not None:
            self._trace.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
