"""The live model's tensors by name and each parameter's first name, from one walk of its
modules. A save captured ``state_dict()`` and named the optimizer's parameters, a restore
listed the live tensors to validate, checked how each module loads and listed them again to
fill them: four walks of every module, ~15 ms for 1,250 layers. This walk gives all of it,
and says when a module's own code or hooks make ``state_dict()`` the only faithful source."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

_MODULE = torch.nn.Module
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
# Methods through which a module lists or loads its state, or its children, its own way when
# patched on the instance (as libraries patch the modules they quantize).
_OWN_WAYS = frozenset({"state_dict", "_save_to_state_dict", "get_extra_state", "set_extra_state",
                       "_load_from_state_dict", "load_state_dict", "named_modules",
                       "named_parameters", "_named_members"})
# The attributes of a module the walk reads, from its __dict__ where they are (`_Attributes`).
_FIELDS = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
           "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
           "_load_state_dict_post_hooks")
# Deeper than this, ``state_dict()``'s recursion is refused by Python (its default limit):
# a module holding its parent as a child nests without end.
_MAX_DEPTH = 900


class LiveModel:
    """One walk of ``model``'s modules, in ``state_dict``'s order (each module's parameters,
    its persistent buffers, then its children, a shared module under each of its names).

    ``lists``: ``state_dict()`` would return exactly ``tensors`` (detached): no module
    overrides how it lists its state or children (in its class or on the instance), keeps
    extra state, or has state-dict hooks. ``loads``: besides, ``load_state_dict`` would only
    copy each saved tensor into its live one: no module overrides how it loads, none has load
    hooks (FSDP2 has), and every tensor is a plain tensor or parameter (a subclass may watch
    its ``copy_``).
    ``tensors``: name -> the parameter or buffer itself (not detached; read, never kept).
    ``names``: id(parameter) -> its first name, as ``named_parameters`` lists them (tied
    parameters keep one name).

    The walk describes the model as it was walked: it is made for one save or one restore,
    during which the model's structure does not change."""

    __slots__ = ("model", "lists", "loads", "plain", "tensors", "names")
    lists: bool
    loads: bool

    def __init__(self, model: Any) -> None:  # (a Module; anything else is asked)
        self.model = model
        # (an OrderedDict, as state_dict() gives: the async save takes it as it is)
        self.tensors: dict[str, torch.Tensor] = OrderedDict()
        self.names: dict[int, str] = {}
        self.plain = True  # every tensor a plain tensor or parameter (no subclass)
        if not isinstance(model, _MODULE):  # (a Stateful of the user's: its own methods)
            self.lists = self.loads = False
            return
        kind = type(model)
        self.lists = (kind.state_dict is _MODULE.state_dict
                      and kind.named_parameters is _MODULE.named_parameters
                      and kind._named_members is _MODULE._named_members)
        self.loads = kind.load_state_dict is _MODULE.load_state_dict
        loads = self.loads
        try:
            self._walk(model, True)
        except KeyError:  # a module keeping them elsewhere (a traced one: __getattr__)
            self.tensors, self.names, self.loads, self.plain = OrderedDict(), {}, loads, True
            try:
                self._walk(model, False)
            except KeyError:  # a module without nn.Module's attributes (its __init__ not run)
                self._own_way()

    def _walk(self, model: Any, by_dict: bool) -> None:
        """Walk ``model``'s modules, reading each one's attributes from its ``__dict__``,
        where nn.Module keeps them (``by_dict``: ~0.3 us a module not spent on attribute
        lookups; a module whose class defines one of them is read by attribute), or by
        attribute; a KeyError if a module has one nowhere."""
        # What each class of module does its own way, found once per class: (lists its
        # state and its children, loads it, keeps its attributes in its __dict__ alone).
        kinds: dict[type, tuple[bool, bool, bool]] = {}
        tensors, names = self.tensors, self.names
        stack: list[tuple[Any, str, int]] = [(model, "", 0)]
        pop = stack.pop
        while stack:
            m, prefix, depth = pop()
            kind = type(m)
            plain = kinds.get(kind)
            if plain is None:
                plain = kinds[kind] = (
                    kind.state_dict is _MODULE.state_dict
                    and kind._save_to_state_dict is _MODULE._save_to_state_dict
                    and kind.get_extra_state is _MODULE.get_extra_state
                    and kind.named_modules is _MODULE.named_modules,
                    kind._load_from_state_dict is _MODULE._load_from_state_dict
                    and kind.set_extra_state is _MODULE.set_extra_state,
                    by_dict and not any(hasattr(kind, name) for name in _FIELDS))
            d = m.__dict__
            f = d if plain[2] else _Attributes(m)
            if (not plain[0] or f["_state_dict_hooks"] or f["_state_dict_pre_hooks"]
                    # (the 9 names looked up in the module's ~25 attributes, not the reverse)
                    or not d.keys().isdisjoint(_OWN_WAYS) or depth > _MAX_DEPTH):
                # Its state or its children are listed its own way (a method of its class
                # or patched on it, a hook), or the modules nest past what state_dict's
                # recursion reaches (a module holding its parent): torch's own calls are
                # the source.
                self._own_way()
                return
            if (not plain[1] or f["_load_state_dict_pre_hooks"]
                    or f["_load_state_dict_post_hooks"]):
                self.loads = False
            params = f["_parameters"]
            if params:
                for name, p in params.items():
                    if p is not None:
                        key = prefix + name
                        tensors[key] = p
                        names.setdefault(id(p), key)
                        if type(p) not in _PLAIN:  # (a subclass may watch its copy_)
                            self.loads = self.plain = False
            buffers = f["_buffers"]
            if buffers:
                transient = f["_non_persistent_buffers_set"]
                for name, b in buffers.items():
                    if b is not None and name not in transient:
                        tensors[prefix + name] = b
                        if type(b) not in _PLAIN:
                            self.loads = self.plain = False
            children = f["_modules"]
            if children:  # (reversed onto the stack: the first child is walked next)
                depth += 1
                stack.extend([(c, f"{prefix}{n}.", depth)
                              for n, c in reversed(children.items()) if c is not None])

    def _own_way(self) -> None:
        """The model lists its state its own way: ``state_dict()`` is the only source."""
        self.lists = self.loads = False
        self.tensors, self.names = {}, {}

    def state_dict(self, detach: bool = True) -> dict[str, Any]:
        """``model.state_dict()``: from the walk where that is the same, else the model's.
        ``detach=False``: the walk's own tensors, not detached (~1 us a tensor), nor copied
        into a new dict, for a caller that copies them at once and keeps nothing (the async
        snapshot), once per walk; all detached when one is a subclass (``state_dict()`` gives
        a Parameter subclass as a plain tensor, which a snapshot's buffer is reused for)."""
        if not self.lists:
            return self.model.state_dict()
        if not detach and self.plain:
            return self.tensors
        return OrderedDict([(k, t.detach()) for k, t in self.tensors.items()])

    def live_tensors(self) -> dict[str, Any]:
        """``model.state_dict(keep_vars=True)`` where the walk is that (the tensors
        themselves, to read or fill), else ``model.state_dict()``."""
        return self.tensors if self.lists else self.model.state_dict()

    def param_names(self) -> dict[int, str]:
        """id(parameter) -> its first name in the model (`optim.param_names`)."""
        return self.names if self.lists else param_names(self.model)


class _Attributes:
    """A module's attributes by name, for a module that keeps them elsewhere than in its
    ``__dict__`` (a traced module serves them through ``__getattr__``; a class may define
    one): ``KeyError`` where the module has none."""

    __slots__ = ("module",)

    def __init__(self, module: Any) -> None:
        self.module = module

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self.module, name)
        except AttributeError:
            raise KeyError(name) from None


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in the model (tied parameters keep one name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def with_versions(module: object, state: Mapping[str, Any]) -> Any:
    """``state`` as ``module.state_dict()`` returns it, with the version of each module
    (``_metadata``), for the module's own ``load_state_dict``: a module whose
    ``_load_from_state_dict`` upgrades an older layout (``_version`` 2 and later; observers,
    old checkpoints) reads its version there, and without one treats the state as the oldest
    layout, rewriting state that is current. The versions are the live modules': generations
    do not record them, and a continuation runs the code that saved it. ``state`` as it is
    when ``module`` is no module."""
    if not isinstance(module, torch.nn.Module):
        return state
    out: OrderedDict[str, Any] = OrderedDict(state)
    out._metadata = OrderedDict(  # type: ignore[attr-defined]
        (name, {"version": m._version})
        for name, m in module.named_modules(remove_duplicate=False))
    return out
