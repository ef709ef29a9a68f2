"""A progress bar for saves and loads that take more than a second (stderr, terminals only,
or wherever ``$UNBROKEN_PROGRESS=1`` asks for it; ``0`` silences it)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

from ._table import human_size

DELAY = 1.0  # seconds before a bar appears: quick saves stay silent
INTERVAL = 0.1


class Progress:
    """Counts bytes of one save or load and draws a bar once it has run for ``DELAY``."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream or sys.stderr
        wanted = os.environ.get("UNBROKEN_PROGRESS")
        self.enabled = wanted == "1" or (wanted != "0" and _isatty(self.stream))
        self.started = time.monotonic()
        self._drawn_at = 0.0
        self._shown = False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self.started >= DELAY and now - self._drawn_at >= INTERVAL:
            self._draw(now)

    def wrap(self, chunks: Iterable[memoryview | bytes]) -> Iterator[memoryview | bytes]:
        """Yield ``chunks`` unchanged, counting them as they are consumed."""
        for chunk in chunks:
            yield chunk
            self.advance(memoryview(chunk).nbytes)

    def close(self) -> None:
        if self._shown:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        rate = self.done / max(now - self.started, 1e-9)
        bar = "#" * int(frac * 24)
        self.stream.write(f"\runbroken: {self.label} [{bar:<24}] {frac:4.0%} "
                          f"{human_size(self.done)}/{human_size(self.total)} "
                          f"{human_size(int(rate))}/s ")
        self.stream.flush()
        self._drawn_at, self._shown = now, True


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
