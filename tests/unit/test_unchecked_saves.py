"""Through the Checkpointer (a synchronous save and a process-mode one, which encode their
tensor files themselves with the checks a plan skips left to the file's encoder): a model
whose tensors change in place between saves, so that the same objects keep their dtype and
address but not their shape, contiguity or lazy bits, is saved as it is at each save and
restored bitwise (the restore into a fresh model of the same structure)."""

from __future__ import annotations

from collections.abc import Callable

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
