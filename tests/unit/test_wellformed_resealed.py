"""A generation edited and then *resealed* (sizes, hashes and the manifest's checksum made to
agree: only its content can tell) whose optimizer param groups or LR scheduler hold what
torch's own classes never hold is refused by ``restore()`` naming state.json, the part, the
key, the value and what torch holds there, and the previous generation is restored bit for
bit; ``verify --deep`` names the same problem (one shared check, `wellformed`). What torch's
classes do hold (a negative learning rate after a StepLR of gamma -1, a step_size the run's
own code gave) is restored as saved."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deep import read, reseal
from test_wellformed import build, checkpointer, equal, refused_for, restored, run, state_of

Tree = dict[str, Any]

__all__ = ["run"]  # (the fixture: three generations of AdamW + StepLR(step_size=2))


def _group(t: Tree) -> dict[str, Any]:
    return t["optimizer"]["param_groups"][0]


# (damage to the decoded tree of the newest generation, words its refusal names)
REFUSED: dict[str, tuple[Callable[[Tree], Any], tuple[str, ...]]] = {
    # text where torch keeps a flag: truthy to torch, a silent gradient ascent
    "maximize 'yes'": (lambda t: _group(t).update(maximize="yes"),
                       ("optimizer param group 0 'maximize' is 'yes'", "True or False")),
    "fused 'x'": (lambda t: _group(t).update(fused="x"),
                  ("optimizer param group 0 'fused' is 'x'", "True, False or None")),
    "foreach 'x'": (lambda t: _group(t).update(foreach="x"),
                    ("optimizer param group 0 'foreach' is 'x'", "True, False or None")),
    "decoupled_weight_decay 'no'": (
        lambda t: _group(t).update(decoupled_weight_decay="no"),
        ("'decoupled_weight_decay' is 'no'", "True or False")),
    # hyperparameters torch's constructor rejects (verify --deep's check, shared)
    "eps -1": (lambda t: _group(t).update(eps=-1.0),
               ("optimizer param group 0 'eps' is -1.0", "expected a finite number >= 0")),
    "weight_decay -5": (lambda t: _group(t).update(weight_decay=-5.0),
                        ("'weight_decay' is -5.0", ">= 0")),
    "betas [2, 0.999]": (lambda t: _group(t).update(betas=[2.0, 0.999]),
                         ("'betas'[0] is 2.0", ">= 0 and < 1")),
    # scheduler values torch's own classes never hold
    "step_size 0": (lambda t: t["scheduler"].update(step_size=0),
                    ("scheduler 'step_size' is 0", "an integer >= 1")),
    "step_size 3.5": (lambda t: t["scheduler"].update(step_size=3.5),
                      ("scheduler 'step_size' is 3.5", "an integer >= 1")),
    "_step_count -1": (lambda t: t["scheduler"].update(_step_count=-1),
                       ("scheduler '_step_count' is -1", "an integer >= 0")),
    "base_lrs []": (lambda t: t["scheduler"].update(base_lrs=[]),
                    ("scheduler 'base_lrs' has 0 entries", "expected at least 1")),
    "_is_initial 'x'": (lambda t: t["scheduler"].update(_is_initial="x"),
                        ("scheduler '_is_initial' is 'x'", "True or False")),
}


def _train(ckpt: Any, model: Any, opt: Any, sched: Any, steps: int) -> None:
    """``steps`` updates, each saved."""
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        sched.step()
        ckpt.step_done(step)
        ckpt.save()


def _resealed(run: Path, tmp_path: Path, damage: Callable[[Tree], Any]) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    _, info, tree, meta = read(folder)
    damage(tree)
    assert reseal(folder, info, tree, meta)  # (the hashes agree: only the content tells)
    return folder


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_resealed_value_torch_never_holds_is_refused_and_the_previous_generation_restored(
        run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str) -> None:
    damage, words = REFUSED[name]
    folder = _resealed(run, tmp_path, damage)
    state, rejected = refused_for(folder, words, caplog)  # (verify --deep names it alike)
    part = "scheduler" if "scheduler" in words[0] else "optimizer"
    assert f"gen-000000003/state.json [{part}]" in rejected, rejected
    if name == "step_size 0":  # (and what the live one holds)
        assert "the live scheduler holds 2" in rejected, rejected
    pristine = tmp_path / "pristine"  # generation 2, bit for bit
    shutil.copytree(run, pristine)
    assert equal(state, restored(pristine, generation=2)[1])


@pytest.mark.parametrize("key, value", [("gamma", -1.0), ("last_epoch", 2**62),
                                        ("lr", -1e-3), ("foreach", True), ("fused", False)])
def test_a_resealed_value_torch_does_hold_is_restored(run: Path, tmp_path: Path, key: str,
                                                      value: Any) -> None:
    """A StepLR takes gamma -1 (and its steps then make the learning rate negative: the lr
    of a healthy run); last_epoch is an int of any size; foreach and fused may be None."""
    target = "scheduler" if key in ("gamma", "last_epoch") else "group"
    folder = _resealed(run, tmp_path, lambda t: (t["scheduler"] if target == "scheduler"
                                                 else _group(t)).update({key: value}))
    step, (_, opt, sched, _) = restored(folder)
    assert step == 3
    assert (sched if target == "scheduler" else opt["param_groups"][0])[key] == value


def test_a_run_whose_steplr_made_the_learning_rate_negative_continues(tmp_path: Path) -> None:
    """StepLR(gamma=-1) flips the sign of the lr every step_size steps: torch holds a
    negative lr and ``_last_lr``, so the run's own generations restore exactly."""
    def make() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=-1.0)
        return model, opt, sched, torch.amp.GradScaler("cpu")

    folder = tmp_path / "run"
    objs = make()
    model, opt, sched, _ = objs
    with checkpointer(folder, objs) as ckpt:
        _train(ckpt, model, opt, sched, 3)
    assert opt.param_groups[0]["lr"] < 0 and sched.get_last_lr()[0] < 0
    again = make()
    with checkpointer(folder, again) as ckpt:
        assert ckpt.restore() == 3
    assert equal(state_of(again), state_of(objs))


def test_a_step_size_the_runs_own_code_gives_is_restored(tmp_path: Path) -> None:
    """torch's StepLR takes step_size 2.5 (it decays where last_epoch % 2.5 == 0): what the
    live scheduler holds as well is never refused as corrupt."""
    def make() -> tuple[Any, ...]:
        objs = build()
        sched = torch.optim.lr_scheduler.StepLR(objs[1], step_size=2.5)  # type: ignore[arg-type]
        return objs[0], objs[1], sched, objs[3]

    folder = tmp_path / "run"
    objs = make()
    model, opt, sched, _ = objs
    with checkpointer(folder, objs) as ckpt:
        _train(ckpt, model, opt, sched, 2)
    again = make()
    with checkpointer(folder, again) as ckpt:
        assert ckpt.restore() == 2
    assert equal(state_of(again), state_of(objs))


def test_every_flag_of_torchs_optimizers_is_a_bool_or_none_where_its_default_is() -> None:
    """`FLAGS` agrees with the signatures of torch's optimizers: a name listed there is a
    flag (default False or True, or None where None is allowed) in every class that has it."""
    import inspect

    from unbroken.state.wellformed import FLAGS

    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            continue
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.name in FLAGS:
                assert isinstance(p.default, bool) or FLAGS[p.name] and p.default is None, (
                    name, p.name, p.default)
            elif isinstance(p.default, bool):
                pytest.fail(f"{name}({p.name}={p.default}) is a flag FLAGS lacks")
