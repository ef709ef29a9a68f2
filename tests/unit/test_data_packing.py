"""Packing (bitwise resume mid-document) and the resumable-iterable contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

from unbroken.data import Packer, ResumableLoader, ResumableSampler
from unbroken.data._keyed import TAG_PACK, KeyedPermutation, mix
from unbroken.errors import MissingState, StateMismatch, UpdateBoundaryError


def documents(count: int = 30, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # token = 1000 * doc + position: every token of an epoch is distinct and traceable
    return [1000 * d + np.arange(int(rng.integers(0, 40))) for d in range(count)]


def take(packer: Packer, batches: int) -> list[torch.Tensor]:
    out = []
    for rows in packer:
        out.append(rows)
        if len(out) == batches:
            break
    return out


def test_packing_resumes_bitwise_mid_document() -> None:
    docs = documents()
    reference = take(Packer(docs, 16, batch_size=2, seed=4, eos_id=-1), 40)
    offsets = []
    for k in (1, 5, 13, 22, 39):
        first = Packer(docs, 16, batch_size=2, seed=4, eos_id=-1)
        head = take(first, k)
        state = first.state_dict()
        offsets.append(state["offset"])
        resumed = Packer(docs, 16, batch_size=2, seed=4, eos_id=-1)
        resumed.load_state_dict(state)
        tail = take(resumed, 40 - k)
        assert torch.equal(torch.stack(head + tail), torch.stack(reference)), k
    assert any(offsets), "no resume point fell mid-document"


def test_packed_stream_is_every_document_once_per_epoch_in_order() -> None:
    docs = documents()
    packer = Packer(docs, 16, batch_size=2, seed=4, eos_id=-1)
    stream = torch.cat([r.reshape(-1) for r in take(packer, 60)]).tolist()
    expected: list[int] = []
    for epoch in range(5):
        order = KeyedPermutation(len(docs), mix(TAG_PACK, 4, epoch))(np.arange(len(docs)))
        assert sorted(order.tolist()) == list(range(len(docs)))
        expected += sum((docs[i].tolist() + [-1] for i in order), [])
    assert len(expected) > len(stream) and stream == expected[:len(stream)]
    assert packer.epoch >= 2  # the stream ran across epoch boundaries without a gap


def test_packer_refuses_mid_window_save_and_foreign_state() -> None:
    docs = documents()
    packer = Packer(docs, 16, accumulation=3)
    take(packer, 2)
    with pytest.raises(UpdateBoundaryError, match="after 2 of 3 micro-batches"):
        packer.state_dict()
    take(packer, 3)  # a new iter() replays the unfinished window from the last boundary
    state = packer.state_dict()
    with pytest.raises(StateMismatch, match="seq_len"):
        Packer(docs, 32, accumulation=3).load_state_dict(state)


class Stream(torch.utils.data.IterableDataset):
    """A resumable iterable: epoch `epoch` from item `consumed` on, order from its own state."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.consumed = n, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state["n"] == self.n
        self.epoch, self.consumed = state["epoch"], state["consumed"]

    def __iter__(self) -> Any:
        order = ResumableSampler(self.n, 1, seed=2).indices(self.epoch, self.consumed, self.n)
        return iter(torch.from_numpy(order))


class Plain(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(10))


def epochs(loader: ResumableLoader, until: int, stop: int | None = None) -> list[list[int]]:
    out: list[list[int]] = []
    while loader.epoch < until:
        for batch in loader:
            out.append(batch.tolist())
            if stop is not None and len(out) == stop:
                return out
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_resumable_iterable_continues_mid_epoch_and_at_epoch_end(workers: int) -> None:
    reference = epochs(ResumableLoader(Stream(50), batch_size=8, num_workers=workers), 2)
    assert len(reference) == 14 and sorted(sum(reference[:7], [])) == list(range(50))
    for k in (3, 7, 10):  # mid-epoch, at the last (partial) batch of epoch 0, mid epoch 1
        first = ResumableLoader(Stream(50), batch_size=8, num_workers=workers)
        head = epochs(first, 2, stop=k)
        state = first.state_dict()
        resumed = ResumableLoader(Stream(50), batch_size=8, num_workers=workers)
        resumed.load_state_dict(state)
        assert head + epochs(resumed, 2) == reference, k
        if k == 7:
            assert (state["epoch"], state["consumed"]) == (1, 0)


def test_non_resumable_iterable_is_refused() -> None:
    with pytest.raises(MissingState, match="Plain is an IterableDataset without state_dict"):
        ResumableLoader(Plain(), batch_size=2)
