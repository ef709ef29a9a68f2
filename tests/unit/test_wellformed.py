"""`unbroken.state.wellformed`: a resealed generation (sizes, hashes and the manifest's checksum
made to agree: a writer's bug, or a forgery) whose optimizer, scheduler or GradScaler state
torch's own classes never hold is refused by ``restore()`` before any live object changes,
and the previous generation is used; ``verify --deep`` names the same problem. Each torch
optimizer's real states, saved and resumed, are never refused (the zoo in
``test_review_optimizer_zoo`` resumes every one of them through these checks)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deep import read, reseal

import unbroken
from unbroken.errors import StateMismatch
from unbroken.state.wellformed import optimizer_state_problems
from unbroken.tools.deep import deep_problems

Tree = dict[str, Any]


def build(seed: int = 0) -> tuple[torch.nn.Module, Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, sched, scaler


def checkpointer(folder: Path, objs: tuple[Any, ...]) -> unbroken.Checkpointer:
    model, opt, sched, scaler = objs
    return unbroken.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched,
                                 scaler=scaler, keep=unbroken.Keep(last=5))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generations of AdamW + StepLR + a CPU GradScaler, one update each."""
    folder = tmp_path_factory.mktemp("wellformed") / "run"
    objs = build()
    model, opt, sched, scaler = objs
    ckpt = checkpointer(folder, objs)
    for step in (1, 2, 3):
        loss = model(torch.randn(5, 3)).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        ckpt.step_done(step, loss=loss)
        ckpt.save()
    ckpt.close()
    return folder


def state_of(objs: tuple[Any, ...]) -> list[Any]:
    model, opt, sched, scaler = objs
    return [model.state_dict(), opt.state_dict(), sched.state_dict(), scaler.state_dict()]


def restored(folder: Path, generation: int | None = None) -> tuple[int, list[Any]]:
    objs = build(seed=1)  # (other values than the run's: what is not restored shows)
    ckpt = checkpointer(folder, objs)
    try:
        step = ckpt.restore(generation=generation)
    finally:
        ckpt.close()
    return step, state_of(objs)


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return type(a) is type(b) and a == b


def _moments(tree: Tree) -> dict[str, Any]:
    return tree["optimizer"]["state"]


# (damage to the decoded tree, words the refusal names)
REFUSED: dict[str, tuple[Callable[[Tree], Any], tuple[str, ...]]] = {
    "a parameter lacking a moment": (lambda t: _moments(t)["0.bias"].pop("exp_avg_sq"),
                                     ("state['0.bias'] lacks ['exp_avg_sq']",)),
    "a moment that is text": (lambda t: _moments(t)["0.bias"].update(exp_avg="x"),
                              ("state['0.bias']['exp_avg'] is 'x'", "a tensor or a number")),
    "a moment of another parameter's shape": (
        lambda t: _moments(t)["0.bias"].update(exp_avg=_moments(t)["1.bias"]["exp_avg"]),
        ("state['0.bias']['exp_avg'] has shape [2]; expected [4]",)),
    "a step that is text": (lambda t: _moments(t)["1.weight"].update(step="2"),
                            ("state['1.weight']['step'] is '2'", "finite scalar")),
    "a nested container as a moment": (lambda t: _moments(t)["1.weight"].update(exp_avg=[1]),
                                       ("state['1.weight']['exp_avg'] is [1]",)),
    "a scheduler epoch that is text": (lambda t: t["scheduler"].update(last_epoch="x"),
                                       ("scheduler 'last_epoch' is 'x'",)),
    "more learning rates than groups": (lambda t: t["scheduler"].update(_last_lr=[0.1] * 3),
                                        ("'_last_lr' has 3 entries; expected at most 1",)),
    "a scale that is text": (lambda t: t["scaler"].update(scale="x"),
                             ("scaler 'scale' is 'x'",)),
    "a growth interval of 0": (lambda t: t["scaler"].update(growth_interval=0),
                               ("scaler 'growth_interval' is 0; expected an integer >= 1",)),
}


def refused_for(folder: Path, words: tuple[str, ...], caplog: pytest.LogCaptureFixture
                ) -> tuple[Any, str]:
    """The newest generation of ``folder`` is named by ``verify --deep`` and refused by
    ``restore()`` with ``words``; generation 2 is restored instead: (its state, the refusal)."""
    _, info, tree, _ = read(folder)
    problems = deep_problems(tree, info.manifest, info.path)
    assert any(all(w in p for w in words) for p in problems), (words, problems)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        step, state = restored(folder)
    assert step == 2
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert rejected and all(w in rejected[0] for w in words), (words, rejected)
    return state, rejected[0]


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_resealed_state_torch_never_holds_is_refused_and_the_previous_generation_used(
        run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str) -> None:
    damage, words = REFUSED[name]
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    _, info, tree, meta = read(folder)
    damage(tree)
    assert reseal(folder, info, tree, meta)  # (the hashes agree: only the content tells)
    state, rejected = refused_for(folder, words, caplog)
    assert "gen-000000003" in rejected
    # what it restored is generation 2 exactly (a copy of the run untouched restores it too)
    pristine = tmp_path / "pristine"
    shutil.copytree(run, pristine)
    assert equal(state, restored(pristine, generation=2)[1])


def test_a_scheduler_setting_of_another_kind_is_refused_naming_it(run: Path, tmp_path: Path
                                                                  ) -> None:
    """gamma 'x' where the live StepLR holds a float: torch would take it and fail at its
    next step; the live objects keep their values."""
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    _, info, tree, meta = read(folder)
    tree["scheduler"]["gamma"] = "x"
    reseal(folder, info, tree, meta)
    objs = build(seed=1)
    before = state_of(objs)
    ckpt = checkpointer(folder, objs)
    with pytest.raises(StateMismatch, match=r"\[scheduler\]: 'gamma' is 'x', where the live "
                                            r"float is 0\.1"):
        ckpt.restore()
    ckpt.close()
    assert equal(state_of(objs), before)


def test_real_states_of_every_judged_torch_optimizer_have_no_problem() -> None:
    """Each torch optimizer, stepped twice with a parameter that gets no gradient (no state)
    and groups of different settings: its name-keyed state is clean; taking one key from one
    parameter's state, or putting text in its place, is named."""
    from unbroken.state.optim import optimizer_state

    torch.manual_seed(0)
    makers: list[Callable[[list[Any]], torch.optim.Optimizer]] = [
        lambda g: torch.optim.Adam(g, amsgrad=True), lambda g: torch.optim.AdamW(g),
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9), lambda g: torch.optim.RMSprop(
            g, momentum=0.5, centered=True), lambda g: torch.optim.Adagrad(g),
        lambda g: torch.optim.Adadelta(g), lambda g: torch.optim.Adamax(g),
        lambda g: torch.optim.NAdam(g), lambda g: torch.optim.RAdam(g),
        lambda g: torch.optim.ASGD(g), lambda g: torch.optim.Rprop(g),
        lambda g: torch.optim.Adafactor(g)]
    for make in makers:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2),
                                    torch.nn.Linear(2, 2))
        idle = list(model[2].parameters())  # (no gradient ever: no state)
        opt = make([{"params": list(model[0].parameters())},
                    {"params": list(model[1].parameters()) + idle, "weight_decay": 0.0}])
        for _ in range(2):
            opt.zero_grad()
            model[1](model[0](torch.randn(5, 3))).pow(2).mean().backward()
            opt.step()
        saved = optimizer_state(model, opt)
        cls = saved["class"]
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        check = lambda s: optimizer_state_problems(cls, s, saved["param_groups"], shapes,  # noqa: E731
                                                   "t", "j")
        assert check(saved["state"]) == [], cls
        entry = saved["state"]["0.weight"]
        key = next(k for k in entry if k != "step")
        text = {**saved["state"], "0.weight": {**entry, key: "x"}}
        assert [p for p in check(text) if f"['{key}'] is 'x'" in p], cls
        # (Adafactor's keys depend on each parameter's dimensions; SGD keeps one key, and a
        # state without it is no state yet)
        if "Adafactor" not in cls and len(entry) > 1:
            lacking = {**saved["state"], "0.weight": {k: v for k, v in entry.items()
                                                      if k != key}}
            assert [p for p in check(lacking) if f"lacks ['{key}']" in p], cls
