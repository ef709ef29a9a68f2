"""Defects an outside review of the restore's own ways of loading found (twenty-sixth session):
a versioned module's upgrade run on current state, a large model file with extra state, a
quantization-aware model refused, a lazy module's save. Each resume is compared, bit for bit,
with the uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.ao.quantization as tq

import unbroken
from unbroken import picking
from unbroken.errors import UnsupportedValue
from unbroken.store.generations import GenerationStore


class _Versioned(torch.nn.Module):
    """A module whose layout changed at version 2: a state without a version (the oldest
    layout) stores its weight transposed, and its load upgrades it (as torch's own modules do
    with ``_version``)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing,
                              unexpected, errors):  # type: ignore[no-untyped-def]
        if local_metadata.get("version") is None or local_metadata["version"] < 2:
            key = prefix + "weight"
            state_dict[key] = state_dict[key].reshape(5, 3).t().contiguous()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing,
                                      unexpected, errors)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int,
           width: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, width, generator=g)).square().mean().backward()
        opt.step()


def _resumed_equals_uninterrupted(tmp_path, build, width: int, **options) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model, opt = build()
    _train(model, opt, 2, 1, width)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               **options) as ckpt:
        ckpt.save(2)
    _train(model, opt, 2, 2, width)
    torch.manual_seed(5)  # (the resumed objects start elsewhere)
    model2, opt2 = build()
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               **options) as ckpt:
        assert ckpt.restore() == 2
    _train(model2, opt2, 2, 2, width)
    live, resumed = model.state_dict(), model2.state_dict()
    assert live.keys() == resumed.keys()
    for k, v in live.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == resumed[k].dtype and torch.equal(v, resumed[k]), k
        else:  # (a module's extra state)
            assert v.keys() == resumed[k].keys(), k
            assert all(torch.equal(x, resumed[k][n]) if isinstance(x, torch.Tensor)
                       else x == resumed[k][n] for n, x in v.items()), k


def test_a_versioned_module_is_not_upgraded_from_its_current_layout(tmp_path) -> None:
    """Before: the model's own load received the state without each module's version, took
    it as the oldest layout and transposed the current weight (silently)."""
    def build():  # type: ignore[no-untyped-def]
        model = torch.nn.Sequential(_Versioned(), torch.nn.Tanh(), _Versioned())
        model[2].weight = torch.nn.Parameter(torch.randn(3, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    _resumed_equals_uninterrupted(tmp_path, build, 5)


def test_an_observer_keeps_its_settings(tmp_path) -> None:
    """Before: a MinMaxObserver (version 3) came back with its default eps: its load took the
    saved state as version 1, which had no eps."""
    obs = tq.MinMaxObserver(eps=1e-3)
    obs(torch.randn(8))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), obs)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.save(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), tq.MinMaxObserver())
    with unbroken.Checkpointer(tmp_path / "run", model=fresh) as ckpt:
        ckpt.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


class _Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.seen = torch.zeros(3)

    def get_extra_state(self):  # type: ignore[no-untyped-def]
        return {"n": self.n, "seen": self.seen}

    def set_extra_state(self, state) -> None:  # type: ignore[no-untyped-def]
        self.n, self.seen = state["n"], state["seen"].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        self.seen += x.detach().mean()
        return x


@pytest.mark.parametrize("optimizer", [True, False])
def test_a_mapped_model_file_with_extra_state_restores(tmp_path, monkeypatch, optimizer) -> None:
    """Before: from a model file large enough to be mapped (32 MiB; lowered here), the restore
    released every saved value as a tensor, the extra state too: AttributeError, reported as
    "nothing was changed" after the weights had been loaded."""
    monkeypatch.setattr(picking, "_MAP_MIN", 1 << 16)

    def build():  # type: ignore[no-untyped-def]
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), _Counter(), torch.nn.Linear(512, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    if optimizer:
        _resumed_equals_uninterrupted(tmp_path, build, 64)
        return
    model, _ = build()
    model(torch.randn(2, 64))
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.save(1)
    fresh, _ = build()
    with unbroken.Checkpointer(tmp_path / "run", model=fresh) as ckpt:
        assert ckpt.restore() == 1
    assert fresh[1].n == 1 and torch.equal(fresh[1].seen, model[1].seen)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items()
               if isinstance(v, torch.Tensor))


def test_quantization_aware_training_resumes(tmp_path) -> None:
    """Before: refused (StateMismatch on '...weight_fake_quant.scale': a fresh per-channel
    fake quantizer holds one element until its first forward or load, which resizes it)."""
    def build():  # type: ignore[no-untyped-def]
        model = torch.nn.Sequential(tq.QuantStub(), torch.nn.Linear(8, 4), torch.nn.ReLU(),
                                    tq.DeQuantStub())
        model.train()
        model.qconfig = tq.get_default_qat_qconfig("x86")
        model = tq.prepare_qat(model)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    _resumed_equals_uninterrupted(tmp_path, build, 8)


def test_a_batchnorm_of_another_width_is_still_refused_before_loading(tmp_path) -> None:
    """The shape check is relaxed for torch's quantization modules only: a BatchNorm (which
    loads its own way too) of another width is refused before anything changes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.save(1)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    other[1] = torch.nn.BatchNorm1d(6)
    other[0] = torch.nn.Linear(4, 6)
    before = copy.deepcopy(other.state_dict())
    with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
        with pytest.raises(unbroken.StateMismatch, match="expected"):
            ckpt.restore()
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("async_save", [False, True])
def test_saving_an_unrun_lazy_module_is_refused_by_name(tmp_path, async_save) -> None:
    """Before: a bare ValueError from torch (``data_ptr`` of an uninitialized parameter)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LazyLinear(3))
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, async_save=async_save)
    try:
        ckpt.restore()
        with pytest.raises(UnsupportedValue, match=r"1\.weight.*lazy module.*forward pass"):
            ckpt.save(0)
            ckpt.wait()
        model(torch.randn(1, 2))  # materialized: it saves
        ckpt.save(1)
        ckpt.wait()
    finally:
        ckpt.close()
    assert [g.generation for g in GenerationStore(tmp_path / "run").scan()] == [1]
