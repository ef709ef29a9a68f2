"""A value the format cannot store is refused when the Checkpointer is built, naming its part
and key (the README's promise), in the model and optimizer too: a module's extra state, a
parameter group's setting. Before, these were found at the first save (with ``every=1000``, a
thousand updates in; in thread mode only at the save after). Neither's ``state_dict()`` is
called to build: an optimizer's post-hook that narrows its moments changes the live state
(test_optim_attacked_s26.py)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken.errors import UnsupportedValue


class _ExtraDeque(torch.nn.Linear):
    def get_extra_state(self) -> Any:
        return {"d": collections.deque([1])}

    def set_extra_state(self, state: Any) -> None:
        pass


def _case(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _ExtraDeque(2, 1) if name == "extra state" else torch.nn.Linear(2, 1)
    if name == "param group":
        return model, torch.optim.SGD([{"params": model.parameters(),
                                        "h": collections.deque([1])}], lr=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("async_save", [False, True, "process"])
@pytest.mark.parametrize("case, said", [
    ("extra state", "part 'model': _extra_state.d: value of type collections.deque"),
    ("param group", "part 'optimizer': param_groups.0.h: value of type collections.deque"),
])
def test_an_unstorable_model_or_optimizer_value_is_refused_when_built(
        tmp_path: Path, case: str, said: str, async_save: object) -> None:
    model, opt = _case(case)
    with pytest.raises(UnsupportedValue) as caught:
        unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=1000,
                              async_save=async_save)
    assert said in str(caught.value)
    assert not list((tmp_path / "run").glob("gen-*"))


def test_a_trained_model_and_optimizer_build_and_save_as_before(tmp_path: Path) -> None:
    """Their tensors are left out of the check (a large model's are not copied to build)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(1)
    assert (tmp_path / "run" / "gen-000000001").is_dir()
