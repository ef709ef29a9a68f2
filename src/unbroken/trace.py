"""The per-update trace: one JSON line per completed update (and per restore and save).

An ``update`` record holds the step and epoch, the learning rate of each parameter group *the
optimizer step of this update used* (read by a step hook), how many optimizer steps ran (0:
skipped by the GradScaler), the sample ids it consumed, a digest of the batch, the loss as the
float's exact hex, the gradient norm and the metrics given to ``step_done``, and content
digests of what a generation saves (parameters and persistent buffers, every state part,
each RNG stream); and, as information only, of the non-persistent buffers and the modules'
train/eval mode. Two traces are compared
field by field by `unbroken.proof.equivalence`. Lines are flushed as written, so a SIGKILL loses at
most a torn last line, which `read_trace` ignores."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import IO, Any

import torch

from .errors import CorruptCheckpoint, UnsupportedValue
from .state import parts as S
from .state._digest import digest_modules, digest_optimizer, digest_tree
from .state.rng import rng_digests

TRACE_ENV = "UNBROKEN_TRACE"
TRACE_HASH_ENV = "UNBROKEN_TRACE_HASH_EVERY"  # the harness sets 1: every digest at every update
# Hyperparameters and step counts of the optimizer, digested at every update; the moment
# buffers (the "optimizer" digest) only every ``hash_every`` updates and at restores.
OPTIMIZER_META = "optimizer-meta"


def float_hex(value: float | torch.Tensor | None) -> str | None:
    """Exact text of a float (``float.hex``), so traces compare bitwise."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item() if value.dtype != torch.float64 else \
            value.detach().item()
    return float(value).hex()


class Tracer:
    """Appends trace records to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # (A save's record is written by the thread that verified it, beside the loop's.)
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        # A writer killed mid-line left a torn record: start ours on a line of its own.
        if self._file.tell() > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a trace file. A torn last line (the writer was killed mid-write) is
    ignored; a malformed line anywhere else raises `CorruptCheckpoint`."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise CorruptCheckpoint(f"{path}: not UTF-8 text at byte {e.start}; a trace is "
                                "written as UTF-8 JSON lines") from None
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            # A torn write: the writer was killed mid-line (the last line, or a line a
            # later process of the same run followed with its own records).
            if number == len(lines) or _next_is_restore(lines, number):
                continue
            raise CorruptCheckpoint(f"{path}:{number}: not a JSON trace record") from None
        if not isinstance(record, dict) or "event" not in record or "step" not in record:
            raise CorruptCheckpoint(f"{path}:{number}: not a trace record (needs event, step)")
        wrong = _malformed(record)
        if wrong:
            raise CorruptCheckpoint(f"{path}:{number}: {wrong}; not as unbroken writes a trace "
                                    "record")
        records.append(record)
    return records


# The fields a comparison reads, and the types unbroken writes them in (absent: not read).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "lr": (list,), "opt_steps": (int,), "ids": (list, type(None)),
    "batch": (str, type(None)), "loss": (str, type(None)), "grad_norm": (str, type(None)),
    "metrics": (dict,), "params": (str,), "buffers": (str, type(None)), "mode": (str,),
    "state": (dict,), "rng": (dict,)}


def _malformed(record: Mapping[str, Any]) -> str:
    """What a trace record holds of another type than unbroken writes ("" if nothing): a
    comparison would fail on it deep inside, or compare nothing."""
    step, event = record["step"], record["event"]
    if type(step) is not int or step < 0:
        return f"step is {str(step)[:40]!r}, not a count of updates"
    if not isinstance(event, str):
        return f"event is {str(event)[:40]!r}, not a name"
    for key, kinds in _FIELD_TYPES.items():
        value = record.get(key, kinds[0]())
        if type(value) not in kinds or isinstance(value, dict) and not all(
                isinstance(k, str) and isinstance(v, (str, type(None)))
                for k, v in value.items()):
            return f"{key} is {str(value)[:60]!r}"
    return ""


class TraceRecorder:
    """The trace of one Checkpointer: a record per completed update, restore and save.

    ``parts`` are the Checkpointer's live parts (model, optimizer, ..., rng, counters). The
    digest of the optimizer's moment buffers, the costliest, is taken every ``hash_every``
    updates and at restores; its hyperparameters and step counts at every update."""

    def __init__(self, path: str | os.PathLike[str], parts: Mapping[str, Any],
                 hash_every: int) -> None:
        self._out = Tracer(path)
        self._parts = parts
        self._hash_every = hash_every
        # Walking the module tree costs more than hashing a small model: do it once.
        self._modules = list(parts[S.MODEL].modules())

    def digests(self, optimizer: bool = True) -> dict[str, Any]:
        """Content digests of what a generation saves (parameters and persistent buffers,
        every state part, each RNG stream); apart, as information only, the non-persistent
        buffers (caches a model rebuilds, never saved) and the train/eval mode of the model."""
        state = {}
        for name, obj in self._parts.items():
            if name == S.OPTIMIZER:
                state[OPTIMIZER_META] = digest_optimizer(obj, moments=False)
                if optimizer:
                    state[name] = digest_optimizer(obj)
            elif name not in (S.MODEL, S.COUNTERS, S.RNG):
                state[name] = digest_tree(obj.state_dict())
        params, buffers, mode = digest_modules(self._modules)
        return {"params": params, "buffers": buffers, "mode": mode, "state": state,
                "rng": rng_digests(self._parts[S.RNG].state_dict())}

    def update(self, step: int, epoch: int, loss: Any, batch: Any, grad_norm: Any,
               lrs: list[float], opt_steps: int, metrics: Mapping[str, Any]) -> None:
        """One completed update: ``lrs`` are the rates its optimizer step used, ``opt_steps``
        how many times ``optimizer.step()`` ran (0: the GradScaler skipped it)."""
        ids = getattr(self._parts.get(S.DATA), "last_update_ids", None)
        try:
            batch_digest = digest_tree(batch) if batch is not None else None
        except TypeError as e:
            raise UnsupportedValue(f"step_done(batch=...): {e}; pass tensors, arrays, numbers, "
                                   "strings or lists and dicts of them") from None
        self._out.write({
            "event": "update", "step": step, "epoch": epoch, "lr": [v.hex() for v in lrs],
            "opt_steps": opt_steps, "ids": list(ids) if ids is not None else None,
            "batch": batch_digest,
            "loss": float_hex(loss), "grad_norm": float_hex(grad_norm),
            "metrics": {k: float_hex(v) for k, v in metrics.items()},
            **self.digests(optimizer=step % self._hash_every == 0)})

    def restored(self, step: int, generation: str | None, rejected: list[str]) -> None:
        self._out.write({"event": "restore", "step": step, "generation": generation,
                         "rejected": rejected, **self.digests()})

    def saved(self, step: int) -> None:
        """Generation ``step`` committed and read back (written once it is verified: by the
        thread that verified it, after the updates the loop did meanwhile)."""
        self._out.write({"event": "save", "step": step})

    def stopped(self, step: int, signal_name: str) -> None:
        """A stop requested by a signal, after the save of ``step``."""
        self._out.write({"event": "stop", "step": step, "signal": signal_name})

    def close(self) -> None:
        self._out.close()


def _next_is_restore(lines: list[str], number: int) -> bool:
    following = next((x for x in lines[number:] if x), "")
    return following.startswith('{"event":"restore"')
