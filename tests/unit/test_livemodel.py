"""`LiveModel` walks a model once and gives what ``state_dict()``, ``state_dict(keep_vars=True)``
and ``named_parameters(remove_duplicate=False)`` give, for any tree of modules: shared modules,
tied and missing parameters, non-persistent buffers; and it says so only when no module lists
or loads its state its own way (then those calls are the source)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import parametrize

from unbroken.state.livemodel import LiveModel, param_names


class _Buffers(torch.nn.Module):
    """A persistent and a non-persistent buffer, and a parameter set to None."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kept", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.register_parameter("absent", None)
        self.w = torch.nn.Parameter(torch.randn(2))


class _Extra(torch.nn.Linear):
    def get_extra_state(self) -> dict[str, int]:
        return {"calls": 1}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


class _Renamed(torch.nn.Linear):
    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        return {"renamed": self.weight.detach()}


class _Double(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * 2


class _Symmetric(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _reference_loads(model: torch.nn.Module) -> bool:
    """What a restore may copy into: the check it made per module before `LiveModel`."""
    base = torch.nn.Module
    if type(model).load_state_dict is not base.load_state_dict:
        return False
    for m in model.modules():
        kind = type(m)
        if (kind._load_from_state_dict is not base._load_from_state_dict
                or kind.state_dict is not base.state_dict
                or kind._save_to_state_dict is not base._save_to_state_dict
                or kind.get_extra_state is not base.get_extra_state
                or m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks
                or m._state_dict_hooks or m._state_dict_pre_hooks):
            return False
    return True


_LEAVES = ["linear", "bn", "buffers", "double", "extra", "renamed", "hooked", "param",
           "parametrized", "none"]


@st.composite
def _models(draw: st.DrawFn, depth: int = 0) -> torch.nn.Module:
    """A random tree of modules, some shared and some tied."""
    root = torch.nn.Module()
    made: list[torch.nn.Module] = []
    for i in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(_LEAVES + (["nested"] if depth < 2 else [])))
        child: torch.nn.Module | None
        if kind == "nested":
            child = draw(_models(depth + 1))
        elif kind == "linear":
            child = torch.nn.Linear(2, 2, bias=draw(st.booleans()))
        elif kind == "bn":
            child = torch.nn.BatchNorm1d(2)
        elif kind == "buffers":
            child = _Buffers()
        elif kind == "double":
            child = _Double()
        elif kind == "extra":
            child = _Extra(2, 2)
        elif kind == "renamed":
            child = _Renamed(2, 2)
        elif kind == "hooked":
            child = torch.nn.Linear(2, 2)
            which = draw(st.sampled_from(["post", "pre", "load"]))
            if which == "post":
                child.register_state_dict_post_hook(lambda *a: None)
            elif which == "pre":
                child.register_state_dict_pre_hook(lambda *a: None)
            else:
                child.register_load_state_dict_post_hook(lambda *a: None)
        elif kind == "param":
            root.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(3)))
            continue
        elif kind == "parametrized":
            child = torch.nn.Linear(3, 3)
            parametrize.register_parametrization(child, "weight", _Symmetric())
        else:
            child = None
        if child is not None and made and draw(st.booleans()):
            child = draw(st.sampled_from(made))  # a module shared under two names
        root.add_module(f"m{i}", child)
        if child is not None:
            made.append(child)
    linears = [m for m in made if type(m) is torch.nn.Linear]
    if len(linears) > 1 and draw(st.booleans()):
        linears[1].weight = linears[0].weight  # tied: one parameter under two names
    return root


@settings(max_examples=120, deadline=None, database=None)
@given(_models())
def test_the_walk_gives_what_state_dict_and_named_parameters_give(model):
    walked = LiveModel(model)
    expected = model.state_dict()
    got = walked.state_dict()
    assert list(got) == list(expected)
    for (key, a), b in zip(expected.items(), got.values()):
        assert type(a) is type(b), key
        if isinstance(a, torch.Tensor):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape, key
            assert a.dtype == b.dtype and not b.requires_grad, key
        else:
            assert a == b, key  # (extra state: from the model's own call)
    live = walked.live_tensors()
    assert list(live) == list(expected)
    if walked.lists:
        kept = model.state_dict(keep_vars=True)
        assert all(live[k] is kept[k] for k in kept)  # the tensors themselves
    assert walked.param_names() == param_names(model)
    assert walked.loads == _reference_loads(model)


def test_a_model_that_lists_its_state_its_own_way_is_asked():
    model = torch.nn.Sequential(_Renamed(2, 2))
    walked = LiveModel(model)
    assert not walked.lists and not walked.loads
    assert list(walked.state_dict()) == list(model.state_dict())


def test_a_stateful_that_is_no_module_is_asked():
    class Stateful:
        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"x": torch.ones(1)}

    walked = LiveModel(Stateful())  # type: ignore[arg-type]
    assert not walked.lists and not walked.loads
    assert list(walked.state_dict()) == ["x"]


def test_a_module_without_one_of_nn_modules_attributes_is_asked():
    """The walk reads each module's attributes from its ``__dict__``: a module missing one
    there (a load hook dict lost, as in a module restored from an old pickle by hand) makes
    the model's own ``state_dict()`` the source, not a ``KeyError``."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    del model[1].__dict__["_load_state_dict_post_hooks"]
    walked = LiveModel(model)
    assert not walked.lists and not walked.loads and walked.tensors == {}
    assert list(walked.state_dict()) == list(model.state_dict())
    assert walked.param_names() == param_names(model)


def test_a_traced_module_is_walked_through_its_attributes():
    """A traced module keeps its parameters, buffers and children outside its ``__dict__``
    (``__getattr__`` serves them): the walk reads them by attribute, and still lists its
    state itself."""
    model = torch.jit.trace(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                                torch.nn.Linear(4, 2)).eval(), torch.randn(2, 3))
    assert "_parameters" not in vars(model)
    walked = LiveModel(model)
    assert walked.lists
    kept = model.state_dict(keep_vars=True)
    assert list(walked.tensors) == list(kept)
    assert all(walked.tensors[k] is kept[k] for k in kept)
    assert walked.param_names() == param_names(model)
