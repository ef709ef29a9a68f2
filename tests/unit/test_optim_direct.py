"""`optimizer_state` builds the name-keyed optimizer state straight from the optimizer's
state and groups when torch's ``state_dict`` would only index them: it must be exactly what
the route through ``state_dict()`` gives (the same keys in the same order, the same objects),
for every optimizer of the zoo, several groups, parameters without state, and ``param_names``;
and it must step aside for an optimizer whose ``state_dict`` is its own or has hooks."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from test_review_optimizer_zoo import OPTIMIZERS, update
from test_review_snapshot_plans import _same

from unbroken.state import optim as O

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _through_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    handle = opt.register_state_dict_post_hook(lambda o, sd: None)  # (no direct route)
    try:
        assert O._direct_state(opt, O.live_group_names(model, opt)) is None
        out = O.optimizer_state(model, opt)
    finally:
        handle.remove()
    # (this route also records which dtypes the optimizer's own state_dict changed: none)
    assert out.pop("own_dtypes") == [], out
    return out


def _identical(a: Any, b: Any) -> None:
    """The same tree: containers, keys and their order alike, the tensors the same objects,
    every other leaf equal (torch's packing copies the groups' dicts, not their values)."""
    _same(a, b, tensors=operator.is_)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_direct_route_is_torchs_state_dict_renamed(name):
    torch.manual_seed(0)
    o = OPTIMIZERS[name](0)
    model, opt = o["model"], o["opt"]
    for s in (0, 1, 2):
        if s:
            update(o, s)
        direct = O.optimizer_state(model, opt)
        assert O._direct_state(opt, O.live_group_names(model, opt)) is not None
        _identical(direct, _through_state_dict(model, opt))
        for v in direct["state"].values():  # the optimizer's own per-parameter dicts
            assert any(v is s for s in opt.state.values())


def test_groups_parameters_without_state_and_param_names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2),
                                torch.nn.Linear(2, 2))
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": named[:2], "lr": 0.1},
                             {"params": named[2:4], "weight_decay": 0.0},
                             {"params": named[4:], "lr": 0.5}])
    # only the second layer and the first bias get gradients: others have no state
    loss = model[1](model[0](torch.randn(5, 3)).detach()).sum() + model[0].bias.sum()
    loss.backward()
    opt.step()
    assert 0 < len(opt.state) < len(named)
    direct = O.optimizer_state(model, opt)
    _identical(direct, _through_state_dict(model, opt))
    assert [g["param_names"] for g in direct["param_groups"]] == [
        [n for n, _ in named[:2]], [n for n, _ in named[2:4]], [n for n, _ in named[4:]]]


def test_an_own_state_dict_or_a_hook_or_a_stray_key_takes_torchs_route():
    model = torch.nn.Linear(3, 2)

    class Own(torch.optim.SGD):
        def state_dict(self) -> dict[str, Any]:
            sd = super().state_dict()
            sd["param_groups"][0]["mine"] = 1
            return sd

    own = Own(model.parameters(), lr=0.1)
    assert O._direct_state(own, O.live_group_names(model, own)) is None
    assert O.optimizer_state(model, own)["param_groups"][0]["mine"] == 1

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.register_state_dict_pre_hook(lambda o: None)
    assert O._direct_state(opt, O.live_group_names(model, opt)) is None

    stray = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stray.state[torch.zeros(1)] = {"x": 1}  # a tensor key in no group: torch refuses it
    assert O._direct_state(stray, O.live_group_names(model, stray)) is None
