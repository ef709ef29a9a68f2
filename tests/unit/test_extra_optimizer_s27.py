"""A second optimizer passed among the extras, attacked (session 27): torch keys its state by
position, and a restore into one built over the same parameters in another order put every
moment onto another parameter, silently. The parameters' names are now saved beside it: a
reordered or changed one is refused before anything changes; the same one resumes bitwise
(Muon for the matrices beside AdamW for the biases, as Muon runs are built); a generation
saved without the names (before) still loads."""

from __future__ import annotations

import pytest
import torch

import unbroken
from unbroken.errors import StateMismatch
from unbroken.state import extraoptim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _optimizers(model: torch.nn.Module, reverse: bool = False):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    adamw = torch.optim.AdamW(vectors[::-1] if reverse else vectors, lr=0.05)
    return torch.optim.Muon(matrices, lr=0.02), adamw


def _train(model, optimizers, steps, ck=None):
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps.start - 1):  # (the batches an earlier incarnation drew)
        torch.randn(8, 6, generator=gen)
    for step in steps:
        model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if ck is not None:
            ck.save(step)


def _checkpointer(root, model, optimizers):
    muon, adamw = optimizers
    return unbroken.Checkpointer(root, model=model, optimizer=muon, extras={"adamw": adamw},
                                 read_back="sync")


def _saved_run(root, steps: range) -> torch.nn.Module:
    """A run trained over ``steps``, saved at each; its model."""
    model = _model()
    optimizers = _optimizers(model)
    with _checkpointer(root, model, optimizers) as ck:
        _train(model, optimizers, steps, ck)
    return model


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def test_the_same_optimizers_resume_bitwise(tmp_path):
    whole = _model()
    _train(whole, _optimizers(whole), range(1, 7))

    _saved_run(tmp_path / "run", range(1, 4))
    resumed = _model()
    optimizers = _optimizers(resumed)
    with _checkpointer(tmp_path / "run", resumed, optimizers) as ck:
        assert ck.restore() == 3
    _train(resumed, optimizers, range(4, 7))
    for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(_bytes(a), _bytes(b)), k


def test_a_reordered_extra_optimizer_is_refused_before_any_change(tmp_path):
    _saved_run(tmp_path / "run", range(1, 3))
    resumed = _model()
    optimizers = _optimizers(resumed, reverse=True)
    with _checkpointer(tmp_path / "run", resumed, optimizers) as ck:
        with pytest.raises(StateMismatch) as raised:
            ck.restore()
    text = str(raised.value)
    assert "[extra.adamw]" in text and "position 0 is '0.bias', live is '2.bias'" in text, text
    assert not optimizers[0].state and not optimizers[1].state  # (nothing restored)


def test_a_generation_saved_without_the_names_loads_as_before(tmp_path, monkeypatch):
    with monkeypatch.context() as m:  # (what a save before session 27 wrote)
        m.setattr("unbroken.state.parts.with_param_names", lambda state, *_: state)
        model = _saved_run(tmp_path / "run", range(1, 3))
    resumed = _model()
    optimizers = _optimizers(resumed)
    with _checkpointer(tmp_path / "run", resumed, optimizers) as ck:
        assert ck.restore() == 2
    saved = model.state_dict()
    assert all(torch.equal(_bytes(v), _bytes(saved[k])) for k, v in resumed.state_dict().items())
    assert extraoptim.PARAM_NAMES not in optimizers[1].state_dict()
