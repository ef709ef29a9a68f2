"""Review of three speed changes: the one-walk `LiveModel` (and the ``_foreach_copy_`` restore
it enables), the encoder that records each tensor's kind and address for the tensor file
(with a per-Checkpointer layout memo), and the optimizer fast load that no longer deep-copies
the ``params`` index lists.

Every test here is differential: a save and restore through ``unbroken.Checkpointer`` against
the slow reference (``model.state_dict()`` / ``model.load_state_dict`` /
``optimizer.load_state_dict``, and a fresh ``encode_safetensors`` without kinds, addresses or
layout), bit for bit, and then a couple of training steps of both. Each ``# DEFECT`` test
failed on the revision under review (expected vs actual in its comment); src was changed while
the review ran (07:46 UTC) and they all pass on it, so they are kept as regression tests, not
``xfail``."""

from __future__ import annotations

import copy
import json
import os
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

import unbroken
from unbroken.errors import StateMismatch, UnbrokenWarning
from unbroken.state import parts as S
from unbroken.state.codec import encode_tree, encode_tree_for_file
from unbroken.state.decoding import decode_tree
from unbroken.state.livemodel import LiveModel, param_names
from unbroken.state.tensorfile import encode_safetensors
from unbroken.state.tensorread import decode_safetensors

pytestmark = pytest.mark.filterwarnings("ignore")
# UNBROKEN_PROPERTY_SCALE=10 runs ten times as many examples (a deeper search, minutes).
_SCALE = float(os.environ.get("UNBROKEN_PROPERTY_SCALE", "0.6"))


def _n(examples: int) -> int:
    return max(5, round(examples * _SCALE))


_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


# -- comparison helpers -----------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg()
    flat = torch.empty(t.numel(), dtype=t.dtype)  # (1-D, stride 1 whatever t's strides)
    flat.copy_(t.reshape(-1))
    return flat.view(torch.uint8)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and (a.numel() == 0 or torch.equal(_bits(a), _bits(b))))


def _same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of two state trees, key order and container types included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and _same_tensor(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def _model_state(model: nn.Module) -> dict[str, Any]:
    """Everything that is the model's state: its state_dict, and every parameter and buffer
    (non-persistent ones included) by name."""
    return {"sd": dict(model.state_dict()),
            "params": {k: v for k, v in model.named_parameters(remove_duplicate=False)},
            "buffers": {k: v for k, v in model.named_buffers(remove_duplicate=False)}}


def _same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    _same(sa["param_groups"], sb["param_groups"], "param_groups")
    assert [list(g) for g in a.param_groups] == [list(g) for g in b.param_groups]
    _same(dict(sa["state"]), dict(sb["state"]), "state")


def _save(folder: str, model: nn.Module, opt: Any = None, extras: Any = None,
          step: int = 1) -> None:
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, extras=extras or {}) as c:
        c.save(step)


def _restore(folder: str, model: nn.Module, opt: Any = None, extras: Any = None) -> int:
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, extras=extras or {}) as c:
        return c.restore()


# -- a generated class of models ---------------------------------------------------------------


class _Buffers(nn.Module):
    """Persistent, non-persistent and None buffers, a None parameter, int and bool buffers
    that forward() changes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kept", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.register_buffer("gone", None)
        self.register_parameter("absent", None)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("flag", torch.tensor([True, False]))
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
            self.kept.mul_(0.5).add_(1)
            self.flag.logical_not_()
        return x * self.w + self.kept


class _Extra(nn.Linear):
    """State beyond parameters and buffers: get/set_extra_state (the walk must defer to the
    model). As a tensor: a dict of extra state never restores (see
    test_a_module_whose_extra_state_is_a_dict_restores)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.count = 0
        self.tag = torch.zeros(2)

    def get_extra_state(self) -> torch.Tensor:
        return torch.cat([torch.tensor([float(self.count)]), self.tag])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.count = int(state[0])
        self.tag = state[1:].clone()


class _DictExtra(nn.Linear):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.count = 0

    def get_extra_state(self) -> dict[str, Any]:
        return {"count": self.count}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class _Sym(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class _OwnStateDict(nn.Linear):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().state_dict(*args, **kwargs)


class _OwnSave(nn.Linear):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)


class _OwnLoad(nn.Linear):
    def _load_from_state_dict(self, *args: Any) -> None:
        super()._load_from_state_dict(*args)


class _OwnModules(nn.Linear):
    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().named_modules(*args, **kwargs)


_OVERRIDES = {"state_dict": _OwnStateDict, "_save_to_state_dict": _OwnSave,
              "_load_from_state_dict": _OwnLoad, "named_modules": _OwnModules}


def _hook(m: nn.Module, api: str) -> None:
    """A hook through each public and private API (no-ops, but for 'mutating_load')."""
    if api == "sd_pre":
        m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: None)
    elif api == "sd_post":
        m.register_state_dict_post_hook(lambda mod, sd, prefix, meta: None)
    elif api == "sd_private":
        m._register_state_dict_hook(lambda mod, sd, prefix, meta: None)
    elif api == "load_pre":
        m.register_load_state_dict_pre_hook(lambda mod, *a: None)
    elif api == "load_pre_private":
        m._register_load_state_dict_pre_hook(lambda sd, prefix, *a: None)
    elif api == "load_post":
        m.register_load_state_dict_post_hook(lambda mod, keys: None)
    elif api == "mutating_load":  # a load hook that changes the parameters it loaded
        def scale(mod: nn.Module, keys: Any) -> None:
            with torch.no_grad():
                mod.weight.add_(0.5)
        m.register_load_state_dict_post_hook(scale)


_HOOKS = ["sd_pre", "sd_post", "sd_private", "load_pre", "load_pre_private", "load_post",
          "mutating_load"]
_LEAVES = ["linear", "conv_cl", "bn", "buffers", "param", "none", "moduledict", "modulelist",
           "paramlist", "paramdict", "parametrized", "weight_norm", "weight_norm_new",
           "spectral_new", "spectral_old", "extra", "hooked", "override", "frozen", "bf16",
           "f64"]


# The leaves that keep a model on the copy path (`LiveModel.loads`).
_PLAIN = ["linear", "conv_cl", "buffers", "param", "none", "modulelist", "paramlist",
          "paramdict", "parametrized", "weight_norm", "spectral_new", "frozen", "bf16", "f64"]


@st.composite
def _tree(draw: st.DrawFn, depth: int = 0, plain: bool = False
          ) -> list[tuple[str, Any, int | None]]:
    items = []
    for _ in range(draw(st.integers(0 if depth else 1, 4))):
        kind = draw(st.sampled_from((_PLAIN if plain else _LEAVES)
                                    + (["nested"] if depth < 2 else [])))
        if kind == "nested":
            arg: Any = draw(_tree(depth + 1, plain))
        elif kind == "hooked":
            arg = draw(st.sampled_from(_HOOKS))
        elif kind == "override":
            arg = draw(st.sampled_from(sorted(_OVERRIDES)))
        elif kind == "linear":
            arg = draw(st.booleans())
        else:
            arg = None
        share = draw(st.none() | st.integers(0, 20))
        items.append((kind, arg, share))
    return items


class _NamedParamsRoot(nn.Module):
    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().named_parameters(*args, **kwargs)


class _LoadRoot(nn.Module):
    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().load_state_dict(*args, **kwargs)


class _ParamsRoot(nn.Module):
    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return super().parameters(recurse)


class _DDPLike(nn.Module):
    """A wrapper as DistributedDataParallel is: the model under ``module.``."""

    def __init__(self, module: nn.Module, strip: bool) -> None:
        super().__init__()
        self.module = module
        if strip:  # keys without the wrapper's prefix, as consume_prefix_in_state_dict_if_present
            def strip_hook(mod: nn.Module, sd: Any, prefix: str, meta: Any) -> None:
                for k in list(sd):
                    if k.startswith(prefix + "module."):
                        sd[prefix + k[len(prefix) + 7:]] = sd.pop(k)

            def add_hook(sd: Any, prefix: str, *a: Any) -> None:
                for k in list(sd):
                    if k.startswith(prefix) and not k.startswith(prefix + "module."):
                        sd[prefix + "module." + k[len(prefix):]] = sd.pop(k)
            self._register_state_dict_hook(strip_hook)
            self._register_load_state_dict_pre_hook(add_hook)


class _OptimizedLike(nn.Module):
    """torch.compile's OptimizedModule, without compiling: ``_orig_mod`` and attribute
    delegation."""

    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._orig_mod = mod

    def __getattr__(self, name: str) -> Any:
        if name == "_orig_mod":
            return self._modules["_orig_mod"]
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


_ROOTS = {"plain": nn.Module, "named_parameters": _NamedParamsRoot, "load_state_dict": _LoadRoot,
          "parameters": _ParamsRoot}


def _build(recipe: dict[str, Any], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    made: list[nn.Module] = []

    def level(items: list[Any], root: nn.Module) -> nn.Module:
        for i, (kind, arg, share) in enumerate(items):
            child: nn.Module | None
            if kind == "param":
                root.register_parameter(f"p{i}", nn.Parameter(torch.randn(3)))
                continue
            if share is not None and made and kind != "none":
                child = made[share % len(made)]
                root.add_module(f"m{i}", child)
                continue
            if kind == "nested":
                child = level(arg, nn.Module())
            elif kind == "linear":
                child = nn.Linear(3, 3, bias=arg)
            elif kind == "conv_cl":
                child = nn.Conv2d(3, 3, 2).to(memory_format=torch.channels_last)
            elif kind == "bn":
                child = nn.BatchNorm1d(3)
            elif kind == "buffers":
                child = _Buffers()
            elif kind == "moduledict":
                child = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.BatchNorm1d(3)})
            elif kind == "modulelist":
                child = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3, bias=False)])
            elif kind == "paramlist":
                child = nn.ParameterList([nn.Parameter(torch.randn(3)),
                                          nn.Parameter(torch.randn(2, 3))])
            elif kind == "paramdict":
                child = nn.ParameterDict({"x": nn.Parameter(torch.randn(3)),
                                          "y": nn.Parameter(torch.randn(1))})
            elif kind == "parametrized":
                child = nn.Linear(3, 3)
                parametrize.register_parametrization(child, "weight", _Sym())
            elif kind == "weight_norm":
                child = torch.nn.utils.weight_norm(nn.Linear(3, 3))
            elif kind == "weight_norm_new":
                child = torch.nn.utils.parametrizations.weight_norm(nn.Linear(3, 3))
            elif kind == "spectral_new":
                child = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(3, 3))
            elif kind == "spectral_old":
                child = torch.nn.utils.spectral_norm(nn.Linear(3, 3))
            elif kind == "extra":
                child = _Extra(3, 3)
            elif kind == "hooked":
                child = nn.Linear(3, 3)
                _hook(child, arg)
            elif kind == "override":
                child = _OVERRIDES[arg](3, 3)
            elif kind == "frozen":
                child = nn.Linear(3, 3).requires_grad_(False)
            elif kind == "bf16":
                child = nn.Linear(3, 3).to(torch.bfloat16)
            elif kind == "f64":
                child = nn.Linear(3, 3).to(torch.float64)
            else:
                child = None
            root.add_module(f"m{i}", child)
            if child is not None:
                made.append(child)
        return root

    root = level(recipe["tree"], _ROOTS[recipe["root"]]())
    if recipe["tie"]:
        plain = [m for m in made if type(m) is nn.Linear and "weight" in m._parameters
                 and m.weight.dtype == torch.float32 and m.weight.requires_grad]
        distinct = list({id(m): m for m in plain}.values())
        if len(distinct) > 1:
            distinct[1].weight = distinct[0].weight  # one parameter under two names
    if recipe["wrap"] in ("ddp", "ddp_strip"):
        root = _DDPLike(root, recipe["wrap"] == "ddp_strip")
    elif recipe["wrap"] == "optimized":
        root = _OptimizedLike(root)
    elif recipe["wrap"] == "hooked_root":  # a load hook on the root that changes a buffer
        root.register_buffer("loads", torch.zeros(()))

        def count(mod: nn.Module, keys: Any) -> None:
            mod.loads.add_(1)
        root.register_load_state_dict_post_hook(count)
    return root


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(())
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total = total + m(x.to(m.weight.dtype)).float().square().mean()
            if isinstance(m, _Extra):
                m.count += 1
                m.tag = m.tag + 1
        elif isinstance(m, nn.Conv2d):
            total = total + m(x.reshape(2, 3, 1, 1).expand(2, 3, 3, 3)).square().mean()
        elif isinstance(m, nn.BatchNorm1d):
            total = total + m(x).square().mean()
        elif isinstance(m, _Buffers):
            total = total + m(x).square().mean()
    for p in model.parameters():
        total = total + 1e-3 * p.square().sum()
    return total


def _make_optimizer(model: nn.Module, recipe: dict[str, Any]) -> torch.optim.Optimizer:
    kind, grouping = recipe["opt"], recipe["groups"]
    params = list(model.parameters())
    Opt = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    options: dict[str, Any] = ({"lr": 0.05, "momentum": 0.9} if kind == "sgd"
                               else {"lr": 0.01, "betas": (0.8, 0.95)})
    if grouping == "named":
        return Opt(model.named_parameters(), **options)
    if grouping == "split" and len(params) > 1:
        half = len(params) // 2
        return Opt([{"params": params[:half], "lr": torch.tensor(0.02),
                     "meta": {"a": [1, (2, 3)], "b": None, "c": "x"}, "nested": [[1], [2, 3]]},
                    {"params": params[half:], "tag": "head"}], **options)
    return Opt(params, **options)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _loss(model, torch.randn(2, 3, generator=g)).backward()
        opt.step()
        opt.zero_grad()


@st.composite
def _recipes(draw: st.DrawFn) -> dict[str, Any]:
    plain = draw(st.booleans())  # half of them all on the copy path
    return {"tree": draw(_tree(plain=plain)), "tie": draw(st.booleans()),
            "root": "plain" if plain else draw(st.sampled_from(sorted(_ROOTS))),
            "wrap": draw(st.sampled_from(["none", "ddp", "optimized"] + (
                [] if plain else ["ddp_strip", "hooked_root"]))),
            "opt": draw(st.sampled_from(["sgd", "adamw"])),
            "groups": draw(st.sampled_from(["one", "named", "split"]))}


@settings(max_examples=_n(45), **_SETTINGS)
@given(_recipes())
def test_generated_models_restore_as_load_state_dict_and_train_alike(recipe):
    original = _build(recipe, 0)
    if not any(p.requires_grad for p in original.parameters()):
        return
    opt = _make_optimizer(original, recipe)
    _train(original, opt, 2, seed=10)
    walked = LiveModel(original)
    event(f"lists={walked.lists} loads={walked.loads}")
    # the walk is what state_dict(), state_dict(keep_vars=True), named_parameters give
    _same(dict(walked.state_dict()), dict(original.state_dict()), "walk")
    assert walked.param_names() == param_names(original)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        _save(d, original, opt, step=2)
        restored = _build(recipe, 1)
        ropt = _make_optimizer(restored, recipe)
        assert _restore(d, restored, ropt) == 2
    reference = _build(recipe, 1)
    refopt = _make_optimizer(reference, recipe)
    reference.load_state_dict(original.state_dict())
    refopt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _same(_model_state(restored), _model_state(reference), "after restore")
    _same_optimizer(ropt, refopt)
    mutating = "mutating_load" in repr(recipe["tree"]) or recipe["wrap"] == "hooked_root"
    _train(restored, ropt, 2, seed=11)
    _train(reference, refopt, 2, seed=11)
    _same(_model_state(restored), _model_state(reference), "after training")
    _same_optimizer(ropt, refopt)
    if not mutating:  # the uninterrupted run: the same parameters and persistent state
        _train(original, opt, 2, seed=11)
        _same(dict(restored.state_dict()), dict(original.state_dict()), "vs uninterrupted")


@st.composite
def _changed_recipes(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model and the same one with a module added, removed or replaced (nothing shared or
    tied: a name tied to a saved one is filled from it by design, see `validate_model`)."""
    def unshared(items: list[Any]) -> list[Any]:
        return [(k, unshared(a) if k == "nested" else a, None) for k, a, _ in items]

    plain = draw(st.booleans())
    tree = unshared(draw(_tree(plain=plain)))
    how = draw(st.sampled_from(["add", "remove", "replace", "flip_bias"]))
    changed = list(tree)
    i = draw(st.integers(0, len(tree) - 1))
    if how == "add":
        changed.insert(i, ("linear", True, None))
    elif how == "remove":
        del changed[i]
    elif how == "replace":
        changed[i] = (draw(st.sampled_from(_PLAIN)), False, None)
    else:
        changed[i] = ("linear", not (tree[i][0] == "linear" and tree[i][1]), None)
    base = {"tie": False, "root": "plain", "wrap": "none", "opt": "sgd", "groups": "one"}
    return {**base, "tree": tree}, {**base, "tree": changed}


@settings(max_examples=_n(20), **_SETTINGS)
@given(_changed_recipes())
def test_a_changed_model_is_refused_where_load_state_dict_refuses_it(recipes):
    saved, live = recipes
    original = _build(saved, 0)
    reference = _build(live, 1)
    if not reference.state_dict():  # (see test_a_model_without_tensors_restores)
        return
    try:
        reference.load_state_dict(original.state_dict())
        # (torch ignores saved keys under a child set to None and casts dtypes; a
        # continuation refuses both, by design)
        a, b = original.state_dict(), reference.state_dict()
        refused = set(a) != set(b) or any(a[k].dtype != b[k].dtype for k in a)
    except RuntimeError:
        refused = True
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        _save(d, original)
        restored = _build(live, 1)
        if refused:
            with pytest.raises(StateMismatch):
                _restore(d, restored)
            _same(_model_state(restored), _model_state(_build(live, 1)))  # nothing changed
        else:
            _restore(d, restored)
            _same(_model_state(restored), _model_state(reference))


def test_a_scripted_model_restores_as_load_state_dict(tmp_path):
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return torch.jit.script(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))

    original = make(0)
    _save(str(tmp_path / "run"), original)
    restored, reference = make(1), make(1)
    _restore(str(tmp_path / "run"), restored)
    reference.load_state_dict(original.state_dict())
    _same(dict(restored.state_dict()), dict(reference.state_dict()))


def test_differently_tied_parameters_are_refused_or_warned_of(tmp_path):
    """Saved untied, restored into a model that ties the two weights (load_state_dict copies
    both in order, the last one winning: a silent loss): refused, naming both keys. Saved
    tied into a model that holds them apart: both get the value, with a warning (session
    27; `test_modelcheck_attacked_s27`)."""
    def make(seed: int, tie: bool) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False),
                          nn.Linear(3, 3, bias=False))
        if tie:
            m[2].weight = m[0].weight
        return m

    match = "'0.weight' and '2.weight' as one tensor"
    _save(str(tmp_path / "untied"), make(0, False))
    with pytest.raises(StateMismatch, match=match):
        _restore(str(tmp_path / "untied"), make(1, True))
    original = make(0, True)
    _save(str(tmp_path / "tied"), original)
    restored, reference = make(1, False), make(1, False)
    with pytest.warns(UnbrokenWarning, match=match):
        _restore(str(tmp_path / "tied"), restored)
    reference.load_state_dict(original.state_dict())
    _same(_model_state(restored), _model_state(reference))


def test_a_large_model_restored_through_mapped_files_equals_load_state_dict(tmp_path):
    """Model files of 32 MiB or more are mapped and copied from (`_copy_into`'s other arm)."""
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(2900, 2900), nn.Linear(2900, 3, bias=False))
        m[1].weight = nn.Parameter(torch.randn(3, 2900).t().contiguous().t())  # (3, 2900)
        return m

    original = make(0)
    opt = torch.optim.SGD(original.parameters(), lr=0.1)
    _save(str(tmp_path / "run"), original, opt)
    restored = make(1)
    _restore(str(tmp_path / "run"), restored, torch.optim.SGD(restored.parameters(), lr=0.1))
    _same(dict(restored.state_dict()), dict(original.state_dict()))


# -- defects: the walk goes stale, or misses what load_state_dict honours ----------------------


class _Swapper:
    """An extra (restored before the model) that changes the model as it loads: replaces a
    parameter, replaces a submodule, or registers a load hook on the model."""

    def __init__(self, model: nn.Module, how: str) -> None:
        self.model, self.how, self.calls = model, how, []

    def state_dict(self) -> dict[str, Any]:
        return {"how": self.how}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        m = self.model
        if self.how == "parameter":  # e.g. re-tying weights, or a reset that makes new ones
            m[0].weight = nn.Parameter(torch.zeros_like(m[0].weight))
        elif self.how == "submodule":
            m[1] = nn.Linear(3, 3)
        elif self.how == "load_hook":
            m.register_load_state_dict_post_hook(lambda mod, keys: self.calls.append(1))


# DEFECT (fixed in src during the review):
# the walk `picking._load` makes for validation (`pick.walked`) is reused by
# `applying.apply`, which restores the extras first. An extra whose load_state_dict replaces a
# model parameter or submodule (or registers a load hook on the model) leaves the walk
# stale: `_copy_into` fills the old, detached tensors and the model keeps the extra's new
# (unrestored) ones; the hook is never called. model.load_state_dict at that point (the
# reference, and the behaviour before LiveModel) restores the saved values / runs the hook.
@pytest.mark.parametrize("how", ["parameter", "submodule", "load_hook"])
def test_an_extra_that_changes_the_model_while_loading_still_gets_the_saved_weights(
        tmp_path, how):
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    original = make(0)
    _save(str(tmp_path / "run"), original, extras={"swap": _Swapper(original, how)})
    restored = make(1)
    swap = _Swapper(restored, how)
    _restore(str(tmp_path / "run"), restored, extras={"swap": swap})
    _same(dict(restored.state_dict()), dict(original.state_dict()), "restored weights")
    if how == "load_hook":
        assert swap.calls == [1], "the model's load hook was not called"


class _Filter(nn.Module):
    """A complex kernel kept as a lazy conjugate (``fft(x).conj()``), or a neg-bit view of
    one (``.conj().imag``), or a conjugate complex parameter."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        z = torch.fft.fft(torch.randn(4))
        if kind == "conj_buffer":
            self.register_buffer("kernel", z.conj())
        elif kind == "neg_buffer":
            self.register_buffer("kernel", z.conj().imag)
        else:
            self.kernel = nn.Parameter(z.conj())


# DEFECT (fixed in src during the review):
# `applying._copy_into` restores a model whose live tensors include a lazy conjugate or
# negative view (a buffer made by ``.conj()``, ``.conj().imag``) with
# ``torch._foreach_copy_``, which refuses such tensors ("fallback doesn't currently support
# mutable TensorLists with conjugate inputs"); the restore raises StateMismatch ("load_state_dict
# refused the saved state") where model.load_state_dict (param.copy_) restores it exactly.
@pytest.mark.parametrize("kind", ["conj_buffer", "neg_buffer", "conj_parameter"])
def test_a_model_with_lazy_conjugate_or_negative_tensors_restores(tmp_path, kind):
    torch.manual_seed(0)
    original = _Filter(kind)
    _save(str(tmp_path / "run"), original)
    torch.manual_seed(1)
    restored, reference = _Filter(kind), _Filter(kind)
    reference.load_state_dict(original.state_dict())
    _restore(str(tmp_path / "run"), restored)
    _same(_model_state(restored), _model_state(reference))


def _patch_scale(m: nn.Linear) -> None:
    """Instance-level (not class-level) overrides, as libraries patch modules they quantize:
    the module saves and loads an extra ``scale`` beside its tensors."""
    m.scale = torch.ones(1)
    save, load = m._save_to_state_dict, m._load_from_state_dict

    def save_to(destination: Any, prefix: str, keep_vars: bool) -> None:
        save(destination, prefix, keep_vars)
        destination[prefix + "scale"] = m.scale

    def load_from(state_dict: Any, prefix: str, *args: Any) -> None:
        if prefix + "scale" in state_dict:
            m.scale = state_dict.pop(prefix + "scale").clone()
        load(state_dict, prefix, *args)

    m._save_to_state_dict = save_to  # type: ignore[method-assign]
    m._load_from_state_dict = load_from  # type: ignore[method-assign]


# DEFECT (fixed in src during the review):
# `LiveModel` decides `lists`/`loads` from each module's *class* (`kinds` cache keyed
# by type(m)), but torch calls the instance's attributes (``module.state_dict(...)``,
# ``module._save_to_state_dict``, ``module._load_from_state_dict``). A module whose methods are
# patched on the instance is walked as a plain one: capture drops what its
# ``_save_to_state_dict`` adds (model.state_dict() has the key, the saved state does not).
def test_an_instance_patched_module_is_captured_as_state_dict_lists_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    _patch_scale(model[1])
    captured = S.capture({S.MODEL: model}, model)[S.MODEL]
    assert list(captured) == list(model.state_dict())


# DEFECT (fixed in src during the review):
# the same, on restore: the instance's ``_load_from_state_dict`` is never called (the
# copy path runs), so what it restores (``scale``) keeps the fresh model's value, where
# model.load_state_dict(original.state_dict()) restores it.
def test_an_instance_patched_module_is_restored_as_load_state_dict_restores_it(tmp_path):
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    _patch_scale(original[1])
    original[1].scale = torch.full((1,), 7.0)
    _save(str(tmp_path / "run"), original)
    restored = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    _patch_scale(restored[1])
    _restore(str(tmp_path / "run"), restored)
    assert torch.equal(restored[1].scale, original[1].scale)


# DEFECT (fixed in src during the review):
# `applying._copy_into` calls ``torch._foreach_copy_([], [])`` for a model on the copy
# path that has no persistent tensor (nn.ReLU(), nn.Identity(), a model whose only buffers
# are non-persistent), which raises "Tensor list must have at least one tensor."; the restore
# fails with StateMismatch where model.load_state_dict({}) succeeds.
@pytest.mark.parametrize("make", [nn.ReLU, lambda: nn.Sequential(nn.Identity(), nn.Dropout())],
                         ids=["relu", "sequential"])
def test_a_model_without_tensors_restores(tmp_path, make):
    model = make()
    _save(str(tmp_path / "run"), model, step=3)
    make().load_state_dict(model.state_dict())  # the reference
    assert _restore(str(tmp_path / "run"), make()) == 3


class _Runaway(Exception):
    pass


class _CountingModules(dict):
    """A module's ``_modules``, counting the walks over it (a runaway walk is stopped)."""

    calls = 0

    def items(self) -> Any:  # type: ignore[override]
        _CountingModules.calls += 1
        if _CountingModules.calls > 2000:
            raise _Runaway
        return super().items()


class _Owned(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.owner = owner  # a back-reference to the parent: registered as a submodule (a cycle)


# DEFECT (fixed in src during the review):
# a module graph with a cycle (a child keeping its parent as an attribute, a common
# mistake) makes model.state_dict() raise RecursionError at once; `LiveModel`'s stack walk
# has no depth bound or visited check, so capture loops forever, its key strings growing
# (3 GB in 2.4 s here, stopped by a 3 GB ulimit; unbounded otherwise). Expected: an error
# (RecursionError as state_dict, or a clear refusal) after a bounded walk.
def test_a_cyclic_module_graph_fails_like_state_dict_instead_of_walking_forever(tmp_path):
    root = nn.Module()
    root.w = nn.Parameter(torch.ones(1))
    root.child = _Owned(root)
    object.__setattr__(root.child, "_modules", _CountingModules(root.child._modules))
    _CountingModules.calls = 0
    with pytest.raises(RecursionError):
        root.state_dict()  # the reference, within the count
    _CountingModules.calls = 0
    with pytest.raises(Exception) as raised:
        _save(str(tmp_path / "run"), root)
    assert not isinstance(raised.value, _Runaway), "the walk was still going after 2,000 visits"


# DEFECT (fixed in src during the review; probably older than these changes, found by the
# generated models): a module whose
# get_extra_state returns a dict (the usual case: TransformerEngine, torchao, user counters)
# saves, but its generation is refused as *corrupt* on restore: `modelcheck.validate_model` loops
# over `walked.live_tensors()` (= state_dict(), extra state included) and evaluates
# ``tuple(t.shape)`` of the dict (AttributeError -> "saved state does not validate"), so the
# run can never be continued. model.load_state_dict(original.state_dict()) restores it.
def test_a_module_whose_extra_state_is_a_dict_restores(tmp_path):
    original = nn.Sequential(_DictExtra(2, 2))
    original[0].count = 5
    _save(str(tmp_path / "run"), original)
    restored = nn.Sequential(_DictExtra(2, 2))
    _restore(str(tmp_path / "run"), restored)
    assert restored[0].count == 5


class _SetOnly(nn.Linear):
    """Overrides set_extra_state only: torch's load_state_dict (strict) then requires an
    ``_extra_state`` key and calls set_extra_state with it."""

    def set_extra_state(self, state: Any) -> None:
        self.seen = state


# DEFECT (fixed in src during the review; minor):
# with set_extra_state overridden (and get_extra_state not), the
# reference model.load_state_dict refuses the state ("Missing key(s): 0._extra_state"),
# but `LiveModel.loads` does not look at set_extra_state, so the copy path restores silently
# and set_extra_state is never called: restore should go through load_state_dict
# (and refuse, as the unwalked restore did).
def test_a_module_with_only_set_extra_state_is_loaded_by_load_state_dict(tmp_path):
    original = nn.Sequential(_SetOnly(2, 2))
    _save(str(tmp_path / "run"), original)
    with pytest.raises(RuntimeError):
        nn.Sequential(_SetOnly(2, 2)).load_state_dict(original.state_dict())  # the reference
    with pytest.raises(StateMismatch):
        _restore(str(tmp_path / "run"), nn.Sequential(_SetOnly(2, 2)))


class _Cached(nn.Parameter):
    """A parameter that keeps a derived copy (as a cast or transposed cache), dropped whenever
    a value is copied into it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.Tensor.copy_:
            args[0].__dict__.pop("cache", None)
        return super().__torch_function__(func, types, args, kwargs or {})


class _UsesCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _Cached(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if "cache" not in w.__dict__:
            w.__dict__["cache"] = w.detach().to(torch.float16)
        return x * w.__dict__["cache"].float()


# DEFECT (fixed in src during the review; tensor subclasses):
# the copy path calls ``torch._foreach_copy_``, not each tensor's
# ``copy_``, so a Parameter subclass that reacts to copy_ (``__torch_function__``; tensor
# subclasses of quantization libraries do it in ``__torch_dispatch__``) is bypassed: here its
# cache is not dropped, and the restored model computes with the pre-restore weights, where
# after model.load_state_dict it computes with the restored ones.
def test_a_parameter_subclass_sees_the_restore_as_load_state_dict_shows_it(tmp_path):
    torch.manual_seed(0)
    original = _UsesCache()
    _save(str(tmp_path / "run"), original)
    x = torch.ones(3)
    outputs = []
    for load in ("reference", "unbroken"):
        torch.manual_seed(1)
        m = _UsesCache()
        m(x)  # (a forward before the restore: a sanity check, a warm-up)
        if load == "reference":
            m.load_state_dict(original.state_dict())
        else:
            _restore(str(tmp_path / "run"), m)
        outputs.append(m(x))
    assert torch.equal(outputs[0], outputs[1])


# -- the encoder: kinds, addresses, ties and the layout memo ----------------------------------

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.float8_e4m3fnuz, torch.uint16, torch.uint32, torch.uint64]
_NEGATABLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.complex64, torch.complex128}
_VIEWS = ["slice", "t", "conj", "neg", "imag", "expand", "empty", "scalar", "step", "as_bytes",
          "column"]


def _base(g: torch.Generator, dtype: torch.dtype, n: int) -> torch.Tensor:
    if dtype.is_complex:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype)
    if dtype == torch.bool:
        return torch.randn(n, generator=g) > 0
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.randint(0, 60000, (n,), generator=g).to(dtype)
    return (torch.randn(n, generator=g) * 10).to(dtype)


def _view(b: torch.Tensor, op: str) -> torch.Tensor:
    if op == "slice":
        return b[1:]
    if op == "t":
        return b.reshape(-1, 2).t() if b.numel() % 2 == 0 else b[::2]
    if op == "conj":
        return b.conj()
    if op == "neg":
        return torch._neg_view(b) if b.dtype in _NEGATABLE else b
    if op == "imag":
        return b.conj().imag if b.dtype in (torch.complex64, torch.complex128) else b
    if op == "expand":
        return b[:1].expand(3) if b.numel() else b
    if op == "empty":
        return b[2:2]
    if op == "scalar":
        return b[0] if b.numel() else b
    if op == "step":
        return b[::3]
    if op == "as_bytes":
        return b.view(torch.uint8) if b.dim() and b.is_contiguous() and not (
            b.is_conj() or b.is_neg()) else b
    return b.reshape(-1, 1)


@st.composite
def _tensor_trees(draw: st.DrawFn) -> Any:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    bases: list[torch.Tensor] = []
    leaves: dict[str, Any] = {}
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["new", "view", "same", "big"]))
        if kind in ("view", "same") and bases:
            b = draw(st.sampled_from(bases))
            t = b if kind == "same" else _view(b, draw(st.sampled_from(_VIEWS)))
        else:
            dtype = draw(st.sampled_from(_DTYPES))
            n = 20000 if kind == "big" else draw(st.sampled_from([0, 1, 2, 4, 6, 20, 17]))
            t = _base(g, dtype, n)
            if dtype in (torch.float32, torch.float64) and draw(st.booleans()):
                t.requires_grad_(True)  # a leaf that requires grad ...
                if draw(st.booleans()):
                    t = t * 1  # ... or a non-leaf
            bases.append(t)
        leaves[f"k{i}"] = t
    if draw(st.booleans()):
        items = list(leaves.items())
        first, last = items[0][1], items[-1][1]
        return {"a": dict(items[::2]), "b": [v for _, v in items[1::2]],
                "c": ({"x": first}, "s", None), "d": {3: last},
                # keys that collide with a path ("b.0"), the reserved name, non-ASCII
                "b.0": last, "__metadata__": first, "ключ": last}
    return leaves


def _joined(chunks: Any) -> bytes:
    return b"".join(bytes(c) for c in chunks)


@settings(max_examples=_n(120), **_SETTINGS)
@given(_tensor_trees())
def test_the_recorded_kinds_and_addresses_give_a_fresh_encoding_bytes(tree):
    meta = {"unbroken.part": "x"}
    enc = encode_tree_for_file(tree)
    layout: dict[str, Any] = {}
    fast = _joined(encode_safetensors(enc.tensors, meta, prepared=True, layout=layout,
                                      kinds=enc.kinds, ptrs=enc.ptrs))
    assert fast == _joined(encode_safetensors(enc.tensors, meta))
    _, tensors = encode_tree(tree)  # the encoder without the file's extras
    assert fast == _joined(encode_safetensors(tensors, meta))
    again = encode_tree_for_file(tree)  # a second save, through the layout memo
    assert fast == _joined(encode_safetensors(again.tensors, meta, prepared=True, layout=layout,
                                              kinds=again.kinds, ptrs=again.ptrs))
    for data in (fast, bytearray(fast)):  # parsed, and viewed in place
        found, _ = decode_safetensors(memoryview(data) if isinstance(data, bytearray)
                                      else data, "file")
        _same(tree, decode_tree(enc.skeleton, found))


@settings(max_examples=_n(40), **_SETTINGS)
@given(st.lists(st.sampled_from(_DTYPES[:12]), min_size=1, max_size=6),
       st.lists(st.integers(0, 2 ** 31), min_size=2, max_size=4))
def test_the_layout_memo_keeps_the_bytes_of_a_fresh_encoding_as_tensors_change(dtypes, seeds):
    """Between saves the tensors are replaced (new memory, other values, other strides) while
    their keys, dtypes and shapes stay: the memo's order and header must still give the bytes
    of a fresh encoding."""
    layout: dict[str, Any] = {}
    for round_, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        tree = {}
        for i, dt in enumerate(dtypes):
            t = _base(g, dt, 24).reshape(4, 6)
            if round_ % 2:
                t = t.t().contiguous().t()  # same shape, another stride
            tree[f"t{i}"] = t
        enc = encode_tree_for_file(tree)
        fast = _joined(encode_safetensors(enc.tensors, {}, prepared=True, layout=layout,
                                          kinds=enc.kinds, ptrs=enc.ptrs))
        assert fast == _joined(encode_safetensors(encode_tree(tree)[1]))


class _Holder:
    """An extra whose state_dict returns whatever tree it holds now."""

    def __init__(self, tree: Any) -> None:
        self.tree, self.loaded = tree, None

    def state_dict(self) -> Any:
        return self.tree

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


def _detached(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if isinstance(tree, dict):
        return {k: _detached(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detached(v) for v in tree)
    return tree


def _file_is_fresh_encoding(gen: str, part: str, tree: Any) -> None:
    with open(os.path.join(gen, "state.json"), "rb") as f:
        meta = json.load(f)["meta"]
    _, tensors = encode_tree(tree)
    expected = _joined(encode_safetensors(tensors, {**meta, "unbroken.part": part}))
    with open(os.path.join(gen, f"{part}.safetensors"), "rb") as f:
        assert f.read() == expected, gen


@settings(max_examples=_n(12), **_SETTINGS)
@given(_tensor_trees(), st.integers(0, 2 ** 31))
def test_saves_whose_tensors_are_replaced_between_them_write_fresh_bytes_and_restore(
        tree, seed):
    """Through the Checkpointer (its layout memo): the same extra saved three times, its
    tensors replaced in place, by new ones of the same kind, and one tensor object saved in
    two parts (the model's weight in an extra too); every file holds a fresh encoding's bytes
    and each part restores bitwise."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 3)
    extra = _Holder(tree)
    shared = _Holder({"w": model.weight, "again": model.weight})
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        with unbroken.Checkpointer(d, model=model, extras={"t": extra, "s": shared}) as c:
            for step in (1, 2, 3):
                if step == 2:  # new tensors of the same kinds (freed memory reused)
                    extra.tree = copy.deepcopy(_detached(tree))  # (views stay views)
                if step == 3:
                    with torch.no_grad():
                        model.weight.add_(1)
                c.step_done(step)
                c.save()
                gen = os.path.join(d, f"gen-{step:09d}")
                _file_is_fresh_encoding(gen, "extra.t", extra.tree)
                _file_is_fresh_encoding(gen, "extra.s", shared.tree)
                _file_is_fresh_encoding(gen, "model", model.state_dict())
        back, back_shared = _Holder({}), _Holder({})
        restored = nn.Linear(3, 3)
        assert _restore(d, restored, extras={"t": back, "s": back_shared}) == 3
    _same(extra.tree, back.loaded, "extra")
    _same({"w": model.weight.detach(), "again": model.weight.detach()}, back_shared.loaded)
    _same(dict(restored.state_dict()), dict(model.state_dict()))


# -- the optimizer fast load: param groups ------------------------------------------------------


@st.composite
def _group_configs(draw: st.DrawFn) -> dict[str, Any]:
    extras = draw(st.lists(st.sampled_from(["nested", "tensor_lr", "str", "tuple", "none",
                                            "shared_tensor", "param_names"]),
                           max_size=4, unique=True))
    return {"groups": draw(st.integers(1, 3)), "extras": extras,
            "opt": draw(st.sampled_from(["sgd", "adamw", "adam_amsgrad", "rmsprop"])),
            "dup": draw(st.booleans())}


def _grouped_optimizer(model: nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    n = cfg["groups"]
    chunks = [named[i::n] for i in range(n)]
    lr = torch.tensor(0.03)
    groups = []
    for gi, chunk in enumerate(chunks):
        group: dict[str, Any] = {}
        if "param_names" in cfg["extras"]:
            group["params"] = [(k, p) for k, p in chunk]
        else:
            group["params"] = [p for _, p in chunk]
            if cfg["dup"] and gi == 0:
                group["params"] = group["params"] + group["params"][:1]  # (torch warns)
        if "nested" in cfg["extras"]:
            group["meta"] = {"a": [1, [2, {"b": 3}]], "c": {"d": (4, 5)}}
        if "tensor_lr" in cfg["extras"] and cfg["opt"] != "rmsprop":
            group["lr"] = torch.tensor(0.01 * (gi + 1))
        if "shared_tensor" in cfg["extras"] and cfg["opt"] != "rmsprop":
            group["lr"] = lr  # one tensor object in every group
        if "str" in cfg["extras"]:
            group["name"] = f"group{gi}"
        if "tuple" in cfg["extras"]:
            group["window"] = (gi, "x", 2.5)
        if "none" in cfg["extras"]:
            group["clip"] = None
        groups.append(group)
    kind = cfg["opt"]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(groups, lr=0.01, amsgrad=True)
    return torch.optim.RMSprop(groups, lr=0.01, centered=True)


@settings(max_examples=_n(30), **_SETTINGS)
@given(_group_configs())
def test_param_groups_restore_as_optimizer_load_state_dict_leaves_them(cfg):
    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2, bias=False))
        return m, _grouped_optimizer(m, cfg)

    def step(m: nn.Module, o: torch.optim.Optimizer, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(2):
            m(torch.randn(5, 3, generator=g)).square().mean().backward()
            o.step()
            o.zero_grad()

    model, opt = make(0)
    step(model, opt, 3)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        _save(d, model, opt)
        restored, ropt = make(1)
        _restore(d, restored, ropt)
    reference, refopt = make(1)
    reference.load_state_dict(model.state_dict())
    refopt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _same_optimizer(ropt, refopt)
    # the groups train the live parameters, and share values between groups (one lr tensor
    # object) exactly where torch's deepcopy of the saved groups shares them
    live = {id(p) for p in restored.parameters()}
    assert all(id(p) in live for g in ropt.param_groups for p in g["params"])

    def sharing(o: torch.optim.Optimizer) -> list[tuple[int, int, str]]:
        gs = o.param_groups
        return [(i, j, k) for i in range(len(gs)) for j in range(i + 1, len(gs))
                for k in gs[i] if k != "params" and k in gs[j]
                and isinstance(gs[i][k], (torch.Tensor, list, dict)) and gs[i][k] is gs[j][k]]
    assert sharing(ropt) == sharing(refopt)
    step(restored, ropt, 4)
    step(reference, refopt, 4)
    step(model, opt, 4)
    _same(dict(restored.state_dict()), dict(reference.state_dict()))
    _same(dict(restored.state_dict()), dict(model.state_dict()))
    _same_optimizer(ropt, refopt)
