"""One pass of `ResumableLoader`: `_Pass`, the bookkeeping of one ``iter(loader)`` (where it
started, batches handed out, update windows), and `_LoaderIterator`, the iterator over it.
Kept apart from `loader` so that module stays small."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loader import ResumableLoader


_END = object()  # an iterable pass's look-ahead found the end of the stream


class _Pass:
    """One ``iter()`` of the loader: where it started and how many batches it handed out."""

    def __init__(self, epoch: int, start: int, total: int | None, accumulation: int) -> None:
        self.epoch = epoch
        self.start = start  # global samples (or items) consumed when the pass began
        self.total = total  # batches this pass will yield; None until an iterable's end is seen
        self.n = accumulation
        self.yielded = 0
        self.iterator: Iterator[Any] | None = None
        self.ahead: deque[Any] = deque()  # iterable passes: fetched, not yet handed out
        # Iterable passes: sample ids of the last batch, of the open window, of the last
        # completed window (a sampler computes them from positions instead).
        self.batch_ids: list[int] = []
        self.window_ids: list[int] = []
        self.update_ids: list[int] = []

    def completed(self) -> int:
        """Batches of this pass that belong to completed update windows."""
        k = self.yielded
        if self.total is not None and k == self.total:
            return k  # the epoch's last window closes early: windows never span epochs
        return k - k % self.n

    def look_ahead(self) -> None:
        """Iterable passes: before batch ``yielded`` is handed out, fetch what makes its window
        known: the rest of that window (its size: the epoch's last window may be shorter) and,
        when the batch closes a full window, the next batch (whether the epoch ends with it).

        At most ``n`` batches are held (two for ``n == 1``): what the update consumes anyway.
        A sampler knows its pass's length from the start and needs none of this."""
        k = self.yielded
        last = k - k % self.n + self.n - 1  # the window's last batch, were it full
        need = last - k + 1 + (k == last)
        while self.iterator is not None and len(self.ahead) < need:
            item = next(self.iterator, _END)
            if item is _END:
                self.iterator = None  # a finished DataLoader iterator: let its workers go
                self.total = self.yielded + len(self.ahead)
            else:
                self.ahead.append(item)

    def window(self) -> tuple[int, int]:
        """(micro-batches of the current window handed out, size of that window)."""
        k = self.yielded
        if k == 0:
            return 0, self.n if self.total is None else min(self.n, self.total)
        first = (k - 1) // self.n * self.n
        size = self.n if self.total is None else min(self.n, self.total - first)
        return k - first, size


class _LoaderIterator:
    """Iterator over one pass; refuses to continue once superseded."""

    def __init__(self, loader: ResumableLoader, p: _Pass) -> None:
        self._loader = loader
        self._pass = p

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next(self._pass)
