"""The per-update trace: one JSON line per completed update (and per restore and save).

An ``update`` record holds the step, the learning rate of each parameter group *used by this
update*, the sample ids it consumed, a digest of the batch, the loss as the float's exact hex,
the gradient norm when given, and content digests of the parameters and of every state part
(optimizer, scheduler, scaler, data cursor, extras, each RNG stream). Two traces are compared
field by field by `unbroken.equivalence`. Lines are flushed as written, so a SIGKILL loses at
most a torn last line, which `read_trace` ignores."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import IO, Any

import torch

from .errors import CorruptCheckpoint

TRACE_ENV = "UNBROKEN_TRACE"


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
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a trace file. A torn last line (the writer was killed mid-write) is
    ignored; a malformed line anywhere else raises `CorruptCheckpoint`."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):  # no newline after it: a torn final write
                break
            raise CorruptCheckpoint(f"{path}:{number}: not a JSON trace record") from None
        if not isinstance(record, dict) or "event" not in record or "step" not in record:
            raise CorruptCheckpoint(f"{path}:{number}: not a trace record (needs event, step)")
        records.append(record)
    return records
