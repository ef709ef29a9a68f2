"""Every kind of tensor unbroken cannot store is refused by ``save()`` with a typed error that
names it, in every save mode (the synchronous encoder, the async snapshot, the persisting
process's encoding in the training process), and the Checkpointer saves again once the state
is storable; never torch's own ``RuntimeError`` from deep inside the save."""

from __future__ import annotations

import warnings

import pytest
import torch

import unbroken
from unbroken.errors import UnsupportedValue

with warnings.catch_warnings():  # (prototype and deprecation notices of torch)
    warnings.simplefilter("ignore")
    KINDS = {
        "sparse_coo": (torch.zeros(3, 2).to_sparse(), "layout torch.sparse_coo"),
        "sparse_csr": (torch.zeros(3, 2).to_sparse_csr(), "layout torch.sparse_csr"),
        "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                   "nested tensor"),
        "nested_jagged": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                     layout=torch.jagged), "layout torch.jagged"),
        "quantized": (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
                      "dtype torch.qint8"),
        "meta": (torch.empty(3, 2, device="meta"), "meta tensor"),
        # (torch has no negation of a float8: the lazy bit cannot be resolved)
        "neg_float8": (torch._neg_view(torch.zeros(3, dtype=torch.float8_e4m3fn)),
                       "lazily negated torch.float8_e4m3fn"),
    }


class Extra:
    """An extra whose state holds one odd tensor among many plain ones (so that the async
    snapshot's container plan is in play too)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def state_dict(self) -> dict:
        state = {f"t{i}": torch.full((2,), float(i)) for i in range(20)}
        if self.value is not None:
            state["odd"] = self.value
        return state

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_each_unstorable_tensor_is_refused_typed_and_the_next_save_works(tmp_path, mode):
    extra = Extra()
    model = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model, extras={"extra": extra},
                               async_save=mode) as ckpt:
        step = 0
        for name, (value, said) in KINDS.items():
            step += 1
            ckpt.step_done(step)
            ckpt.save()  # the plain state: saves (and plans the async snapshot)
            ckpt.wait()
            extra.value = value
            step += 1
            ckpt.step_done(step)
            with pytest.raises(UnsupportedValue, match=said) as e:
                ckpt.save()
                ckpt.wait()  # (an encoder's refusal in a background save is raised here)
            assert "odd" in str(e.value), (name, str(e.value))
            extra.value = None
        step += 1
        ckpt.step_done(step)
        ckpt.save()
        assert ckpt.wait() is not None
    assert sorted(p.name for p in (tmp_path / "run").glob("gen-*"))[-1] == f"gen-{step:09d}"
