"""`unbroken.fork_rng()`: an evaluation between updates (after ``step_done``, where saves land)
that draws from the global streams (a shuffled loader, dropout left on, sampling) leaves them
as it found them, so a run resumed from a generation saved at that boundary continues bitwise
as the uninterrupted one; without it, it does not (the case the Accelerate review found)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _evaluate(model: torch.nn.Module) -> None:
    """Draws from every global stream, as evaluations do."""
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(8, 1).repeat(1, 4))
    for (x,) in torch.utils.data.DataLoader(data, batch_size=4, shuffle=True):
        model(x)  # (dropout left on: draws)
    random.random()
    np.random.rand()


def _train(run: Path, steps: range, isolated: bool, objects=None):
    model, opt = objects or _objects()
    ckpt = unbroken.Checkpointer(run, model=model, optimizer=opt, every=2)
    ckpt.restore()
    for step in steps:
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step)
        if step % 2 == 0:
            with unbroken.fork_rng() if isolated else contextlib.nullcontext():
                _evaluate(model)
    ckpt.close()
    return model


@pytest.mark.parametrize("isolated", [True, False])
def test_an_evaluation_after_step_done_resumes_bitwise_only_inside_fork_rng(
        tmp_path: Path, isolated: bool) -> None:
    whole = _train(tmp_path / "whole", range(1, 7), isolated)
    _train(tmp_path / "cut", range(1, 5), isolated)  # saved at 4, then the process ends
    resumed = _train(tmp_path / "cut", range(5, 7), isolated)
    same = all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                 resumed.state_dict().values()))
    assert same is isolated


def test_fork_rng_puts_every_stream_back_even_on_an_error() -> None:
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(ValueError), unbroken.fork_rng():
        torch.rand(3), random.random(), np.random.rand()
        raise ValueError
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
