"""The saved model against the live one, attacked (session 27).

Tied tensors: a model saved with two separate tensors and restored
into one that holds them as one (tied weights, one module shared under two names) loaded
both values into the one tensor, the last one winning, silently. Now refused before any
live object changes, naming both keys; a continuation of a run whose saved tensors were
tied into a model that holds them apart is warned of. Tied on both sides, and a warm start from
tied weights into separate ones, still load.

Expanded buffers (stride 0, as position-id tables are registered): every restore failed
inside torch's copy, after the optimizer was restored. One holding its saved value is left
as it is; one whose saved value differs is refused before anything live changes."""

from __future__ import annotations

import pytest
import torch

import unbroken
from unbroken.errors import StateMismatch, UnbrokenWarning


class LM(torch.nn.Module):
    """An embedding, a body and an output head, the head tied to the embedding or not; the
    norm ``n2`` is ``n1`` under a second name when ``shared``."""

    def __init__(self, tied: bool, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.n1 = torch.nn.BatchNorm1d(4, affine=False)
        self.n2 = self.n1 if shared else torch.nn.BatchNorm1d(4, affine=False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.n2(self.n1(self.body(self.emb(x)))))


def _saved(root, model: LM) -> None:
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, read_back="sync") as ck:
        for step in (1, 2):
            model(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.head.weight.mul_(-1.5)  # (tied or not: emb and head differ when untied)
            ck.save(step)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _restore(root, model: LM) -> int:
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    with unbroken.Checkpointer(root, model=model, optimizer=opt) as ck:
        return ck.restore()


@pytest.mark.parametrize("live", [dict(tied=True), dict(tied=False, shared=True)],
                         ids=["tied-head", "shared-norm"])
def test_separate_values_into_one_live_tensor_are_refused(tmp_path, live):
    _saved(tmp_path / "run", LM(tied=False))
    model = LM(**live)
    before = _state(model)
    with pytest.raises(StateMismatch) as raised:
        _restore(tmp_path / "run", model)
    text = str(raised.value)
    pair = ("'emb.weight' and 'head.weight'" if live["tied"]
            else "'n1.running_mean' and 'n2.running_mean'")
    assert pair in text and "as one tensor" in text and "build the model" in text, text
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # (nothing changed)


def test_tied_saved_into_a_model_that_holds_them_apart_warns(tmp_path):
    """Both get the saved value; a script may tie them again after restoring (at its first
    forward), so this is said, not refused."""
    _saved(tmp_path / "run", LM(tied=True))
    model = LM(tied=False)
    with pytest.warns(UnbrokenWarning, match="'emb.weight' and 'head.weight' as one tensor"):
        assert _restore(tmp_path / "run", model) == 2
    assert torch.equal(model.emb.weight, model.head.weight)


def test_tied_on_both_sides_and_warm_start_load(tmp_path):
    saved = LM(tied=True)
    _saved(tmp_path / "run", saved)
    model = LM(tied=True)
    assert _restore(tmp_path / "run", model) == 2
    assert model.head.weight is model.emb.weight
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())

    apart = LM(tied=False)  # a new run from the tied weights: both names get them
    opt = torch.optim.SGD(apart.body.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "new", model=apart, optimizer=opt) as ck:
        ck.restore(intent="warm_start", source=tmp_path / "run")
    assert torch.equal(apart.head.weight, saved.emb.weight)
    assert torch.equal(apart.emb.weight, saved.emb.weight)


class Positions(torch.nn.Module):
    """A linear layer and an expanded buffer (a table of positions broadcast to a batch)."""

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)
        self.register_buffer("pos", (torch.arange(3.0) + start).expand(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos)


def _train(model, opt, steps, ck=None, gen=None):
    gen = gen or torch.Generator().manual_seed(5)
    for step in steps:
        model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if ck is not None:
            ck.save(step)
    return gen


def test_an_expanded_buffer_holding_its_value_resumes_bitwise(tmp_path):
    whole = Positions()
    opt = torch.optim.Adam(whole.parameters(), lr=0.1)
    _train(whole, opt, range(1, 6))

    model = Positions()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               generators={"data": (gen := torch.Generator().manual_seed(5))},
                               read_back="sync") as ck:
        _train(model, opt, range(1, 4), ck, gen)
    resumed = Positions()
    opt = torch.optim.Adam(resumed.parameters(), lr=0.1)
    gen = torch.Generator()
    with unbroken.Checkpointer(tmp_path / "run", model=resumed, optimizer=opt,
                               generators={"data": gen}) as ck:
        assert ck.restore() == 3
    _train(resumed, opt, range(4, 6), gen=gen)
    assert resumed.pos.stride() == (0, 1)  # (still the expanded view it was built as)
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k].reshape(-1).view(torch.uint8),
                           v.reshape(-1).view(torch.uint8)), k


def test_an_expanded_buffer_of_another_value_is_refused_before_any_change(tmp_path):
    model = Positions()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               read_back="sync") as ck:
        _train(model, opt, range(1, 3), ck)
    other = Positions(start=1.0)
    opt = torch.optim.Adam(other.parameters(), lr=0.1)
    before = _state(other)
    with unbroken.Checkpointer(tmp_path / "run", model=other, optimizer=opt) as ck:
        with pytest.raises(StateMismatch, match="'pos' is an expanded view .* strides "
                                                r"\(0, 1\)"):
            ck.restore()
    assert not opt.state  # (the optimizer untouched)
    assert all(torch.equal(before[k], v) for k, v in _state(other).items())


def test_a_changed_shape_or_dtype_names_the_remedy(tmp_path):
    _saved(tmp_path / "run", LM(tied=False))
    model = LM(tied=False).double()
    with pytest.raises(StateMismatch, match=r"'emb.weight': expected \(10, 4\) torch.float64 "
                                            r"\(live model\), found \(10, 4\) torch.float32; "
                                            "build the model as in the saved run"):
        _restore(tmp_path / "run", model)


def test_a_warm_start_into_tied_names_of_different_values_warns_and_keeps_the_last(tmp_path):
    saved = LM(tied=False)
    _saved(tmp_path / "run", saved)
    model = LM(tied=True)
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "new", model=model, optimizer=opt) as ck:
        with pytest.warns(UnbrokenWarning, match="keeps the value of 'head.weight'"):
            ck.restore(intent="warm_start", source=tmp_path / "run")
    assert torch.equal(model.emb.weight, saved.head.weight)


class Bits(torch.nn.Module):
    """A buffer and a view of its memory as another dtype: two tensors, not one tied."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("scale", torch.tensor([1.5, -2.0]))
        self.register_buffer("scale_bits", self.scale.view(torch.int32))


def test_views_of_one_memory_as_other_dtypes_are_not_a_tie(tmp_path):
    model = Bits()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               read_back="sync") as ck:
        ck.save(1)
    other = Bits()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=other, optimizer=opt) as ck:
        assert ck.restore() == 1
    assert torch.equal(other.scale, model.scale)
