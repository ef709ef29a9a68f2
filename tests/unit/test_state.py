"""State parts against live objects: optimizers of every kind, schedulers with unusual state,
and restores that must change nothing when they fail."""

from __future__ import annotations

import collections

import pytest
import torch

import unbroken
from unbroken.errors import StateMismatch, UnsupportedValue, UpdateBoundaryError
from unbroken.state import parts as parts_module


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def steps(model, opt, n=3, closure=False):
    for _ in range(n):
        x = torch.randn(6, 4)

        def loss_fn():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        if closure:
            opt.step(loss_fn)
        else:
            loss_fn()
            opt.step()


@pytest.mark.parametrize("make,closure", [
    (lambda p: torch.optim.Adafactor(p, lr=1e-2), False),  # factored row/column state
    (lambda p: torch.optim.LBFGS(p, lr=0.1, history_size=3), True),  # flat vectors
    (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=False), False),
    (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True), False),
], ids=["adafactor", "lbfgs", "adam-amsgrad", "sgd-nesterov"])
def test_optimizers_with_unusual_state_resume_bitwise(tmp_path, make, closure):
    model = net()
    opt = make(model.parameters())
    steps(model, opt, closure=closure)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(3)
    model2 = net()
    opt2 = make(model2.parameters())
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ckpt:
        assert ckpt.restore() == 3
    torch.manual_seed(5)
    steps(model, opt, 2, closure)
    torch.manual_seed(5)
    steps(model2, opt2, 2, closure)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_optimizer_training_tensors_outside_the_model_is_refused(tmp_path):
    model = net()
    loose = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.Adam([*model.parameters(), loose])
    with pytest.raises(UnsupportedValue, match="not parameters of the model"):
        unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt)
    # nothing was locked by the refused Checkpointer
    unbroken.Checkpointer(tmp_path / "run", model=model).close()


def test_another_optimizer_class_is_refused(tmp_path):
    model = net()
    opt = torch.optim.Adam(model.parameters())
    steps(model, opt)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(3)
    model2 = net()
    opt2 = torch.optim.AdamW(model2.parameters())
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ckpt:
        with pytest.raises(StateMismatch, match="AdamW"):
            ckpt.restore()


def test_a_failing_scheduler_load_changes_nothing(tmp_path, monkeypatch):
    """SequentialLR with three stages restored into one with two: the scheduler refuses
    while loading; the optimizer, scheduler and RNG must be as before the restore. (The
    recorded classes, which tell the two apart before loading, are made to agree here: this
    is about a load that fails.)"""
    monkeypatch.setattr(parts_module, "scheduler_class", lambda s: "one class")
    def build(stages):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        inner = [torch.optim.lr_scheduler.ConstantLR(opt, 0.5, total_iters=2)
                 for _ in range(stages)]
        sched = torch.optim.lr_scheduler.SequentialLR(opt, inner, milestones=[2, 4][:stages - 1])
        return model, opt, sched

    model, opt, sched = build(3)
    steps(model, opt)
    sched.step()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               scheduler=sched) as ckpt:
        ckpt.save(3)
    model2, opt2, sched2 = build(2)
    steps(model2, opt2, 1)
    before_opt = {k: v.clone() for k, v in opt2.state[next(model2.parameters())].items()}
    before_lr = [g["lr"] for g in opt2.param_groups]
    before_sched = sched2.state_dict()
    before_rng = torch.get_rng_state()
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               scheduler=sched2) as ckpt:
        with pytest.raises(StateMismatch, match="nothing was changed"):
            ckpt.restore()
    after = opt2.state[next(model2.parameters())]
    assert all(torch.equal(before_opt[k], after[k]) for k in before_opt)
    assert [g["lr"] for g in opt2.param_groups] == before_lr
    assert str(sched2.state_dict()) == str(before_sched)
    assert torch.equal(torch.get_rng_state(), before_rng)


def test_multistep_milestones_keep_their_counter_type(tmp_path):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               scheduler=sched) as ckpt:
        ckpt.save(0)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[7], gamma=0.5)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt2,
                               scheduler=sched2) as ckpt:
        ckpt.restore()
    for _ in range(5):
        opt.step(), sched.step(), opt2.step(), sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr() == [0.025]
    assert isinstance(sched2.milestones, collections.Counter)  # not a plain dict


def test_saving_a_past_step_is_refused(tmp_path):
    model = net()
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        for step in range(1, 6):
            ckpt.step_done(step)
        with pytest.raises(UpdateBoundaryError, match="save\\(3\\)"):
            ckpt.save(3)


def test_a_model_refusing_its_state_after_the_optimizer_took_its_own_says_so(tmp_path):
    """The optimizer is loaded before the model and is too large to copy first: when the
    model's own load then refuses, the error says the optimizer was restored already (not
    "nothing was changed"), and the optimizer holds the saved state, as said."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps(model, opt)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(3)
    saved = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    model2 = net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)

    def refuse(*args, **kwargs):
        raise RuntimeError("this module refuses")

    model2.register_load_state_dict_pre_hook(refuse)
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ckpt:
        with pytest.raises(StateMismatch, match="optimizer was restored already") as raised:
            ckpt.restore()
    assert "nothing was changed" not in str(raised.value)
    after = opt2.state[next(model2.parameters())]
    assert all(torch.equal(saved[k], after[k]) for k in saved)
