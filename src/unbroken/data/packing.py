"""`Packer`: variable-length token documents packed into fixed-length rows, resumable bit for bit.

The packed stream is the concatenation of the documents in a per-epoch keyed order (the
same bijection as `ResumableSampler`), each followed by ``eos_id`` when given, cut into rows
of ``seq_len`` tokens. Rows run across document and epoch boundaries: no token is dropped or
padded. Because the stream is a pure function of (seed, epoch), the packer's state is a
cursor — epoch, documents fully consumed, and the offset into the current document whose
tail carries over into the next row — and the partial row at a save is *reconstructed* from
it on resume instead of being stored ("deterministic reconstruction"). O(1) state, O(1)
resume, no buffer in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import StateMismatch, UnbrokenError, UpdateBoundaryError, shown
from ._checks import INT64_MAX, DamagedDataState, any_int, counted, flag, integer, located
from ._keyed import TAG_PACK, KeyedPermutation, mix
from .sampler import STATE_VERSION


class Packer:
    """Iterate batches of packed rows (``LongTensor[batch_size, seq_len]``), forever.

    Args:
        documents: map-style source; ``documents[i]`` is a 1-D sequence of token ids (list,
            NumPy array or tensor). ``len(documents)`` documents per epoch.
        seq_len: tokens per row (use L+1 when inputs and shifted labels come from one row).
        batch_size: rows per batch.
        seed, shuffle: document order per epoch (keyed bijection of (seed, epoch)).
        eos_id: token appended after every document, or None.
        accumulation: batches per optimizer update; `state_dict` is refused mid-window.
            Saved with the cursor: a resume with another one is refused (`StateMismatch`).

    The iterator is endless (the stream continues into the next epoch); stop at your step
    budget. `epoch` is the epoch of the next token. Use it in the main process: it computes
    rows on demand, so what it handed out is what the training loop consumed.
    """

    def __init__(
        self,
        documents: Sequence[Any],
        seq_len: int,
        *,
        batch_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        eos_id: int | None = None,
        accumulation: int = 1,
    ) -> None:
        if len(documents) < 1 or not all(map(counted, (seq_len, batch_size, accumulation))):
            raise ValueError("Packer: need at least one document, and seq_len, batch_size, "
                             f"accumulation ints in [1, 2**63), got {seq_len!r}, "
                             f"{batch_size!r}, {accumulation!r}")
        seq_len, batch_size, accumulation = int(seq_len), int(batch_size), int(accumulation)
        self.documents = documents
        self.num_documents = len(documents)
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.accumulation = int(accumulation)
        self._saved = (0, 0, 0)  # cursor (epoch, documents, offset) at the last boundary
        self._live = self._saved  # cursor after the last batch handed out
        self._in_window = 0  # batches of the current update window handed out
        self._generation = 0
        self._perm: tuple[int, KeyedPermutation] | None = None
        self.last_batch_ids: list[int] = []
        """Document indices that contributed to the last batch, in stream order."""

    def _document(self, epoch: int, number: int) -> tuple[int, np.ndarray]:
        if self.shuffle:
            if self._perm is None or self._perm[0] != epoch:
                key = mix(TAG_PACK, self.seed, epoch)
                self._perm = (epoch, KeyedPermutation(self.num_documents, key))
            index = int(self._perm[1](np.array([number]))[0])
        else:
            index = number
        doc = self.documents[index]
        tokens = doc.numpy() if isinstance(doc, torch.Tensor) else np.asarray(doc)
        tokens = tokens.reshape(-1).astype(np.int64, copy=False)
        if self.eos_id is not None:
            tokens = np.append(tokens, np.int64(self.eos_id))
        return index, tokens

    def _batch(self, cursor: tuple[int, int, int]
               ) -> tuple[torch.Tensor, tuple[int, int, int], list[int]]:
        epoch, number, offset = cursor
        need = self.batch_size * self.seq_len
        out = np.empty(need, dtype=np.int64)
        ids: list[int] = []
        filled, empty_run = 0, 0
        while filled < need:
            index, tokens = self._document(epoch, number)
            if offset and offset >= len(tokens):
                # Only a restored cursor can start past its document (the packer moves on
                # once a document is done): refuse it before any of its tokens goes out.
                raise DamagedDataState(
                    f"packer state: offset={offset} points past the end of document {number} "
                    f"of epoch {epoch} (dataset index {index}: {len(tokens)} tokens"
                    f"{' with eos' if self.eos_id is not None else ''}); a run saves an offset "
                    "inside its document, or 0, so the generation is damaged or the documents "
                    "changed since it was saved: restore an earlier generation "
                    "(restore(generation=...)), or the documents it was saved with")
            take = min(len(tokens) - offset, need - filled)
            if take > 0:
                out[filled:filled + take] = tokens[offset:offset + take]
                filled += take
                offset += take
                empty_run = 0
                if not ids or ids[-1] != index:
                    ids.append(index)
            else:
                empty_run += 1
                # (shuffled, an epoch may end and the next begin with empty documents: only
                # 2n in a row hold a whole epoch, every document once)
                if empty_run > 2 * self.num_documents:
                    raise UnbrokenError("Packer: every document is empty and eos_id is None: "
                                        "there are no tokens to pack")
            if offset >= len(tokens):  # document done: the next one, in the next epoch at the end
                number, offset = number + 1, 0
                if number == self.num_documents:
                    epoch, number = epoch + 1, 0
        rows = torch.from_numpy(out.reshape(self.batch_size, self.seq_len))
        return rows, (epoch, number, offset), ids

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Batches from the last update boundary on (an unfinished window is replayed)."""
        self._generation += 1
        self._live, self._in_window = self._saved, 0
        return self._run(self._generation)

    def _run(self, generation: int) -> Iterator[torch.Tensor]:
        while True:
            if generation != self._generation:
                raise UnbrokenError("this Packer iterator was superseded by a newer iter() or "
                                    "load_state_dict(); iterate the packer again")
            rows, self._live, self.last_batch_ids = self._batch(self._live)
            self._in_window += 1
            if self._in_window == self.accumulation:
                self._saved, self._in_window = self._live, 0
            yield rows

    @property
    def epoch(self) -> int:
        """Epoch of the next token after the last completed update."""
        return self._saved[0]

    @property
    def at_boundary(self) -> bool:
        """True when every batch handed out belongs to a completed update window."""
        return self._in_window == 0

    def state_dict(self) -> dict[str, Any]:
        """Cursor at the last update boundary plus the constants it is valid with."""
        if self._in_window:
            raise UpdateBoundaryError(
                f"save requested after {self._in_window} of {self.accumulation} micro-batches "
                f"of the update window; save at an update boundary")
        epoch, documents, offset = self._saved
        return {"version": STATE_VERSION, "kind": "packer", "epoch": epoch,
                "documents": documents, "offset": offset, **self._constants(),
                "accumulation": self.accumulation}

    def _constants(self) -> dict[str, Any]:
        return {"num_documents": self.num_documents, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
                "eos_id": self.eos_id}

    def validate_state_dict(self, state: Mapping[str, Any], where: str = "data") -> None:
        """Check a saved state without changing anything."""
        try:
            self._check(state)
        except StateMismatch as e:
            raise located(e, where) from None

    def _check(self, state: Mapping[str, Any]) -> tuple[int, int, int]:
        if not isinstance(state, Mapping) or state.get("kind") != "packer":
            raise StateMismatch("data state was not written by a Packer (kind != 'packer')")
        where = "packer state"
        if "version" in state:
            version = integer(state, "version", where, 1)
            if version != STATE_VERSION:
                raise StateMismatch(f"{where}: version {version} is not supported (this "
                                    f"unbroken reads version {STATE_VERSION})")
        for key, live in self._constants().items():
            # exact types first: 4.0 == 4 and True == 1 would pass the comparison below
            saved: Any = (flag(state, key, where) if type(live) is bool
                          else any_int(state, key, where, optional=key == "eos_id")
                          if key in ("seed", "eos_id") else integer(state, key, where, 1))
            if saved != live:
                raise StateMismatch(f"{where}: saved {key}={shown(saved)}, live {key}={live!r}; "
                                    f"the packed stream would differ from the interrupted run's")
        if "accumulation" in state:  # (a generation saved before it was recorded lacks it)
            saved = integer(state, "accumulation", where, 1)
            if saved != self.accumulation:
                raise StateMismatch(f"{where}: saved accumulation={saved}, live accumulation="
                                    f"{self.accumulation}: update windows (and so the "
                                    "learning-rate schedule per token) would shift; keep it")
        # An epoch one below int64's top: the rollovers after it must still fit the counters.
        epoch = integer(state, "epoch", where, 0, INT64_MAX - 1)
        documents = integer(state, "documents", where, 0, self.num_documents - 1)
        # The offset's upper bound is the document's length, known once it is read: `_batch`
        # checks it then, before any token of the restored cursor is handed out.
        offset = integer(state, "offset", where, 0)
        return epoch, documents, offset

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor; a different document set, seq_len, batch size, seed, order or
        eos raises `StateMismatch`."""
        cursor = self._check(state)
        self._generation += 1
        self._saved = self._live = cursor
        self._in_window = 0
