"""A Checkpointer encodes its tree whole, without looking through it for DTensors first,
until a save meets one (`saving.encode_share`): that save and every later one take the
sharded leaves out and save them through DCP, in every save mode, and they restore bitwise.
A DTensor where only dicts are looked through (inside a list) is refused, typed."""

from __future__ import annotations

import pytest
import torch

import unbroken
from unbroken.errors import UnsupportedValue
from unbroken.saving import _SHARDED

dist = pytest.importorskip("torch.distributed")


@pytest.fixture()
def one_rank():
    """A gloo process group of one rank, for this test alone."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no gloo backend in this torch build")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.full_tensor().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                for v in opt.state[p].values()]
    return out


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_the_first_save_that_meets_a_dtensor_splits_and_restores_bitwise(one_rank, tmp_path,
                                                                         mode) -> None:
    model, opt = _sharded_model()
    _train(model, opt, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=mode) as ck:
        assert not ck._layouts.get(_SHARDED)
        ck.save(1)
        ck.wait()
        assert ck._layouts.get(_SHARDED) is True  # (every later save splits first)
        _train(model, opt, 1)
        ck.save(2)
        ck.wait()
        saved = _values(model, opt)
    model2, opt2 = _sharded_model()
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ck2:
        assert ck2.restore() == 2
    got = _values(model2, opt2)
    assert len(got) == len(saved) > 40
    for a, b in zip(got, saved):
        assert torch.equal(a, b)


def test_a_plain_tree_never_marks_its_checkpointer(tmp_path) -> None:
    import torch.distributed.tensor  # noqa: F401 -- a DTensor could exist: no shortcut by import

    model = torch.nn.Linear(3, 3)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ck:
        ck.save(1)
        assert not ck._layouts.get(_SHARDED)


class _Holder:
    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict[str, object]:
        return {"held": self.value}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.value = state["held"]


def test_a_dtensor_inside_a_list_is_refused_typed(one_rank, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dt = distribute_tensor(torch.arange(6.0), init_device_mesh("cpu", (1,)), [Replicate()])
    model = torch.nn.Linear(3, 3)
    # (refused when the Checkpointer is built: every part is encoded once then)
    with pytest.raises(UnsupportedValue,
                       match=r"part 'extra\.holder': held\.0: a DTensor.*not inside a list"):
        unbroken.Checkpointer(tmp_path / "run", model=model, extras={"holder": _Holder([dt])})
    # (and at a save, when it comes later: the save takes the dicts' DTensors out, then
    # refuses the one it cannot)
    holder = _Holder({"d": dt})
    with unbroken.Checkpointer(tmp_path / "run", model=model, extras={"holder": holder}) as ck:
        holder.value = [dt]
        with pytest.raises(UnsupportedValue,
                           match=r"part 'extra\.holder': held\.0: a DTensor.*not inside a"):
            ck.save(1)


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_a_dtensor_in_a_parts_dict_is_accepted_when_built_and_restored_bitwise(
        one_rank, tmp_path, mode) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    saved = {"a": distribute_tensor(torch.arange(6.0), mesh, [Replicate()]),
             "nested": {"b": distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])},
             "plain": torch.ones(3)}
    model = torch.nn.Linear(3, 3)
    with unbroken.Checkpointer(tmp_path / "run", model=model, extras={"holder": _Holder(saved)},
                               async_save=mode) as ck:
        ck.save(1)
        ck.wait()
    fresh = {"a": distribute_tensor(torch.zeros(6), mesh, [Replicate()]),
             "nested": {"b": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])},
             "plain": torch.zeros(3)}
    holder = _Holder(fresh)
    with unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(3, 3),
                               extras={"holder": holder}) as ck:
        assert ck.restore() == 1
    got = holder.value
    assert torch.equal(got["a"].full_tensor(), saved["a"].full_tensor())
    assert torch.equal(got["nested"]["b"].full_tensor(), saved["nested"]["b"].full_tensor())
    assert torch.equal(got["plain"], saved["plain"])
