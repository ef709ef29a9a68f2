"""A continuation restores the saved schedule over the one the script now builds: a torch
scheduler's setting changed in the script (gamma, T_max, milestones, a chained scheduler's
own) is said, once, naming the setting and both values; an unchanged schedule, whatever its
progress, says nothing; a scheduler of the user's own class is not compared."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from test_review_optimizer_zoo import SCHEDULERS, update

import unbroken
from unbroken.errors import UnbrokenWarning

L = torch.optim.lr_scheduler


def _schedule_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnbrokenWarning)
            and "saved schedule" in str(w.message)]


def _resume(tmp_path, build, steps: int = 3) -> tuple[dict[str, Any], list[str]]:
    """``build(0)`` trained ``steps`` updates and saved; ``build(1)`` restored from it: the
    restored objects and the schedule warnings said."""
    torch.manual_seed(0)
    o = build(0)
    parts = {"model": o["model"], "optimizer": o["opt"], "scheduler": o["sched"]}
    ckpt = unbroken.Checkpointer(tmp_path / "run", **parts)
    ckpt.restore()
    for s in range(1, steps + 1):
        update(o, s)
        ckpt.step_done(s)
    ckpt.save()
    ckpt.close()
    torch.manual_seed(1)
    o2 = build(1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=o2["model"], optimizer=o2["opt"],
                                 scheduler=o2["sched"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.restore() == steps
    ckpt.close()
    return o2, _schedule_warnings(caught)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_an_unchanged_schedule_says_nothing(tmp_path, name):
    _, said = _resume(tmp_path, SCHEDULERS[name])
    assert said == []


def _built(make) -> Any:
    def build(at: int) -> dict[str, Any]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                    torch.nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return {"model": model, "opt": opt, "sched": make(opt, at)}
    return build


def test_a_changed_setting_is_named_with_both_values_and_the_saved_one_restored(tmp_path):
    o, said = _resume(tmp_path, _built(lambda o, at: L.StepLR(o, step_size=[2, 5][at],
                                                              gamma=[0.5, 0.1][at])))
    assert len(said) == 2, said
    assert "scheduler 'gamma': saved 0.5, live 0.1" in said[0]
    assert "scheduler 'step_size': saved 2, live 5" in said[1]
    assert "set it on the scheduler after restore()" in said[0]
    assert o["sched"].gamma == 0.5 and o["sched"].step_size == 2  # restored as saved


def test_a_chained_schedulers_change_names_which_one(tmp_path):
    def make(o, at):
        return L.SequentialLR(o, [L.LinearLR(o, 0.2, total_iters=2),
                                  L.CosineAnnealingLR(o, T_max=[10, 20][at])], [2])
    _, said = _resume(tmp_path, _built(make))
    assert len(said) == 1, said
    assert "scheduler 1 (CosineAnnealingLR) 'T_max': saved 10, live 20" in said[0]


def test_milestones_and_plateau_settings(tmp_path):
    _, said = _resume(tmp_path, _built(lambda o, at: L.MultiStepLR(o, [[2, 4], [3, 6]][at])))
    assert len(said) == 1 and "'milestones'" in said[0], said
    _, said = _resume(tmp_path / "b", _built(lambda o, at: L.ReduceLROnPlateau(
        o, patience=[1, 3][at])))
    assert len(said) == 1 and "'patience': saved 1, live 3" in said[0], said


def test_a_scheduler_of_the_users_own_class_is_not_compared(tmp_path):
    class Mine(L.LRScheduler):
        def __init__(self, opt, k: float) -> None:
            self.k = k
            super().__init__(opt)

        def get_lr(self) -> list[float]:
            return [self.k * b for b in self.base_lrs]

    _, said = _resume(tmp_path, _built(lambda o, at: Mine(o, [0.5, 0.1][at])))
    assert said == []
