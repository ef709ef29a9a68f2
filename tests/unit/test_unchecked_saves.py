"""Through the Checkpointer (a synchronous save and a process-mode one, which encode their
tensor files themselves with the checks a plan skips left to the file's encoder): a model
whose tensors change in place between saves, so that the same objects keep their dtype and
address but not their shape, contiguity or lazy bits, is saved as it is at each save and
restored bitwise (the restore into a fresh model of the same structure)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import unbroken

LAYERS = 24  # (enough tensors of each shape for a plan, and for a stack of each stretch)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(LAYERS))
        self.big = torch.nn.Parameter(torch.randn(130, 130))  # (a file chunk of its own)
        for i in range(3):  # (a stretch too short to stack: a memmove each)
            self.register_buffer(f"odd{i}", torch.randn(7))


def _data_swap(t: torch.Tensor, new: torch.Tensor) -> None:
    """``t``'s data replaced in place (the same object), as ``p.data = ...`` does."""
    t.data = new


# Each change keeps the tensor object, its dtype and its data's first address.
CHANGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "reshaped": lambda t: t.detach().reshape(-1) if t.dim() > 1 else t.detach()[None],
    "transposed": lambda t: t.detach().t() if t.dim() == 2 else t.detach().flip(0),
    "negative_view": lambda t: torch._neg_view(t.detach()),
    "expanded": lambda t: t.detach().reshape(-1)[:1].expand(t.shape),
}
WHERE = {"stacked": "layers.3.weight", "stacked_first": "layers.0.weight",
         "short": "odd1", "own": "big"}


@pytest.mark.parametrize("mode", [False, "process"])
@pytest.mark.parametrize("where", sorted(WHERE))
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_tensor_changed_in_place_is_saved_as_it_is(tmp_path, mode, where, change):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=mode)
    try:
        ck.save(1)
        ck.save(2)  # (planned now)
        target = model.get_parameter(WHERE[where]) if where != "short" else getattr(
            model, WHERE[where])
        _data_swap(target, CHANGES[change](target))
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ck.save(3)
        with torch.no_grad():  # (what the loop does right after save() returns)
            for v in model.state_dict().values():
                if 0 not in v.stride():  # (an expanded tensor cannot be written in place)
                    v.add_(1)
        ck.save(4)
        ck.wait()
    finally:
        ck.close()
    restored = Net()
    # the changed tensor has its new shape in the saved generation: the fresh model takes it
    target = restored.get_parameter(WHERE[where]) if where != "short" else getattr(
        restored, WHERE[where])
    target.data = torch.empty_like(expected[WHERE[where]])
    ck = unbroken.Checkpointer(tmp_path / "run", model=restored,
                               optimizer=torch.optim.SGD(restored.parameters(), lr=0.1))
    try:
        assert ck.restore(generation=3) == 3
        for k, v in restored.state_dict().items():
            want = expected[k]
            assert v.shape == want.shape and torch.equal(v, want), k
    finally:
        ck.close()


class _Extra:
    """An extra part: a mapping of 20 small tensors (planned from the second save), and, when
    ``bad``, a value no save can store (a set: an async snapshot copies it, the encoder
    refuses it)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = {f"w{i}": torch.randn(4, 4, generator=g) for i in range(20)}
        self.bad = False

    def state_dict(self) -> dict:
        return {"a": self.a, **({"z": {1, 2}} if self.bad else {})}

    def load_state_dict(self, sd: dict) -> None:
        self.a = sd["a"]


@pytest.mark.parametrize("mode", [False, True, "process"])
@pytest.mark.parametrize("size", [8, 32])  # (fewer and more bytes than the planned shape)
def test_a_save_refused_after_a_planned_tensor_changed_leaves_no_stale_plan(
        tmp_path, mode, size):
    """Found by the review of this change: a thread-mode save refused after its plan took
    the snapshot's buffers unchecked (a tensor of another shape) left them recorded as
    checked; the next save wrote the old shape and read past the new buffer (a generation
    that verified, holding the wrong bytes)."""
    extra = _Extra()
    ck = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2),
                               extras={"ex": extra}, async_save=mode)
    try:
        ck.save(1)
        ck.save(2)
        ck.wait()
        extra.a["w3"] = torch.arange(float(size))
        extra.bad = True
        with pytest.raises(unbroken.errors.UnsupportedValue):
            ck.save(3)
            ck.wait()
        extra.bad = False
        ck.save(4)
        ck.wait()
    finally:
        ck.close()
    again = _Extra()
    ck = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2),
                               extras={"ex": again})
    try:
        assert ck.restore(generation=4) == 4
    finally:
        ck.close()
    for k, want in extra.a.items():
        assert again.a[k].shape == want.shape and torch.equal(again.a[k], want), k


# What a storage resized under its tensor is refused as: freed (0 bytes) or shrunk (fewer).
_UNHELD = {0: "holds no memory", 8: "reaches .* bytes of its storage, which holds 8"}


def _freed_then_saved(tmp_path: Any, model: torch.nn.Module, mode: Any, planned: bool,
                      storage: torch.Tensor, named: str, size: int = 0) -> None:
    """Saves of ``model`` (two first, if ``planned``: its plans made and used) while the
    storage of ``storage`` is resized to ``size`` bytes (freed, or shrunk below what its
    tensors reach: refused, naming ``named``), then once it holds its values again (saved,
    and its values kept)."""
    ck = unbroken.Checkpointer(tmp_path / "run", model=model, async_save=mode)
    try:
        if planned:
            ck.save(1)
            ck.save(2)
            ck.wait()
        kept = storage.detach().clone()
        storage.untyped_storage().resize_(size)
        with pytest.raises(unbroken.errors.UnsupportedValue,
                           match=f"{named}.*{_UNHELD[size]}"):
            ck.save(3)
            ck.wait()
        storage.untyped_storage().resize_(kept.nbytes)
        with torch.no_grad():
            storage.copy_(kept)
        ck.save(4)
        assert ck.wait().generation == 4
        assert torch.equal(storage.detach(), kept)
    finally:
        ck.close()


@pytest.mark.parametrize("mode", [False, True, "process"])
@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("size", sorted(_UNHELD))
def test_a_tensor_whose_storage_was_freed_is_refused_not_read_from_address_0(
        tmp_path, mode, planned, size):
    """A parameter whose storage was freed (``untyped_storage().resize_(0)``, as FSDP does)
    keeps its shape: its bytes were read from address 0 and the process died (SIGSEGV).
    One whose storage was shrunk (``resize_(8)``) had another allocation's bytes saved as its
    values. Its save is refused, naming it; the next save of real values goes on."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    _freed_then_saved(tmp_path, model, mode, planned, model[1].weight, r"1\.weight", size)


@pytest.mark.parametrize("mode", [False, True, "process"])
@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("size", sorted(_UNHELD))
def test_a_view_into_a_freed_flat_storage_is_refused_not_read_past_address_0(
        tmp_path, mode, planned, size):
    """FSDP's original parameters are views into one flat parameter, whose storage it frees:
    such a view's address is its offset's bytes, not 0, and it was read there (SIGSEGV) by
    every save mode. Its save is refused, naming it; the next save of real values goes on."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(12)])
    # (each weight a view of the flat storage, none at its start: no address is 0)
    flat = torch.cat([torch.zeros(8), *[m.weight.detach().reshape(-1) for m in model]])
    for i, m in enumerate(model):
        m.weight.data = flat[8 + 16 * i:8 + 16 * (i + 1)].view(4, 4)
    _freed_then_saved(tmp_path, model, mode, planned, flat, r"\.weight", size)
    assert all(m.weight.data_ptr() == flat.data_ptr() + 4 * (8 + 16 * i)
               for i, m in enumerate(model))  # (still views of it, with its values)
