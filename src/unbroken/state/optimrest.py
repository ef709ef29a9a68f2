"""What an optimizer's ``state_dict()`` holds besides each parameter's state and the param
groups, which the name-keyed optimizer part (`optim`) keeps beside them:

- ``extra``: its other top-level entries (a subclass's ``sd["scale"] = ...``, a state-dict
  post-hook's additions), handed back to the optimizer's own ``load_state_dict``, which reads
  them (torch's own ignores them);
- ``other_state``: per-key state that belongs to no parameter (``optimizer.state["global"]``),
  which torch's ``state_dict`` and ``load_state_dict`` carry as they are.

Both are left out when empty, so that every optimizer of torch's own saves exactly as before,
and a generation without them (older ones) loads as before. Their values are encoded like
any state (a value the codec cannot store is refused, typed, at the save)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint, UnsupportedValue, shown

EXTRA = "extra"
OTHER_STATE = "other_state"
# Where the optimizer's own ``state_dict`` (a subclass's or a hook's) runs: the values it saved
# in another dtype than the optimizer holds them (a bfloat16 copy of float32 moments), as
# [parameter name, key] pairs (an empty list: none). A restore keeps torch's cast for those
# and sets every other value back to its saved dtype (`optim`); a generation without the
# list (saved before it was recorded) keeps torch's cast for all of them.
OWN_DTYPES = "own_dtypes"
# (how `optimizer_state_to_torch` hands the pairs, by torch's parameter index, to
# `load_optimizer_state`, which drops the key before the optimizer's own load sees the dict)
OWN_DTYPES_READY = "__unbroken.own_dtypes__"
_TORCH_KEYS = ("state", "param_groups")  # what torch's own state_dict() returns, no more


def packed(sd: Any) -> tuple[Mapping[Any, Any], list[Any]]:
    """(``state``, ``param_groups``) of what an optimizer's ``state_dict()`` returned; a
    subclass's that lacks them is refused (typed: a bare KeyError tells the user nothing)."""
    try:
        state, groups = sd["state"], sd["param_groups"]
        if isinstance(state, Mapping) and isinstance(groups, list):
            return state, groups
    except (KeyError, TypeError):
        pass
    kinds = sorted(map(str, sd)) if isinstance(sd, Mapping) else type(sd).__name__
    raise UnsupportedValue(f"the optimizer's state_dict() returned {shown(kinds)}; expected "
                           "a dict with 'state' (a dict) and 'param_groups' (a list), as "
                           "torch.optim.Optimizer.state_dict() returns; return those from it")


def extras(sd: Mapping[Any, Any]) -> dict[Any, Any]:
    """A state_dict's top-level entries besides torch's own two (most often none)."""
    if len(sd) == 2:  # (the common case, at no cost: exactly torch's two)
        return {}
    return {k: v for k, v in sd.items() if k not in _TORCH_KEYS}


def split_state(state: Mapping[Any, Any], by_index: Mapping[int, str]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(each parameter's state by its name, the state under string keys that are no
    parameter) of a state_dict's ``state``. Any other key is refused: an int that indexes no
    parameter (a restore would read it as one's index), a tuple, ..."""
    named: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, entry in state.items():
        name = by_index.get(key) if type(key) is int else None  # (0.0 == 0: ints only)
        if name is not None:
            named[name] = entry
        elif type(key) is str:
            other[key] = entry
        else:
            raise UnsupportedValue(
                f"optimizer state key {shown(key)} (a {type(key).__name__}) is neither a "
                "parameter of its param groups nor a string; unbroken keys the state by "
                "parameter name, and keeps other state only under string keys: store it as "
                "optimizer.state['<name>'] (or on a parameter's state)")
    return named, other


def refuse_stray(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, typed, optimizer state kept for a tensor that no param group lists: torch's own
    ``state_dict()`` fails on it with a bare KeyError (it numbers the groups' parameters
    only). Nothing if there is none."""
    listed = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for key in optimizer.state:
        if isinstance(key, torch.Tensor) and id(key) not in listed:
            raise UnsupportedValue(
                f"the optimizer holds state for a tensor of shape {list(key.shape)} that none "
                "of its param groups lists; torch's state_dict() cannot number it: add the "
                "tensor to a param group, or delete its state (del optimizer.state[tensor])")


def saved_rest(saved: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[Any, Any]]:
    """(other state, extra entries) of a saved name-keyed optimizer part, checked (a save
    writes string keys, never torch's own two): both empty for a generation without them."""
    other, extra = saved.get(OTHER_STATE, {}), saved.get(EXTRA, {})
    if not isinstance(other, Mapping) or not all(type(k) is str for k in other):
        raise CorruptCheckpoint(f"{where}: optimizer {OTHER_STATE!r} is {shown(other, 80)}; "
                                "expected a mapping of string keys (a save writes no other)")
    if not isinstance(extra, Mapping) or any(k in extra for k in _TORCH_KEYS):
        raise CorruptCheckpoint(f"{where}: optimizer {EXTRA!r} is {shown(extra, 80)}; "
                                "expected a mapping without 'state' or 'param_groups' (a save "
                                "writes no other)")
    return dict(other), dict(extra)


def owned_tree(value: Any, own: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor in it (in dicts, lists and tuples, as the codec stores them)
    replaced by ``own(tensor)``: an optimizer keeps what its ``load_state_dict`` is given, and
    must not keep a view of a mapped file."""
    if isinstance(value, torch.Tensor):
        return own(value)
    if isinstance(value, dict):  # (dict, OrderedDict, Counter: the mappings the codec keeps)
        return type(value)((k, owned_tree(v, own)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(owned_tree(v, own) for v in value)
    return value


def state_dtypes(optimizer: torch.optim.Optimizer) -> dict[tuple[int, Any], torch.dtype]:
    """The dtype of each tensor the optimizer holds, by (id of its parameter, key): taken
    before its own ``state_dict`` runs (a hook may replace the values it is handed, which
    are the optimizer's own per-parameter dicts)."""
    return {(id(p), k): v.dtype for p, values in optimizer.state.items()
            if isinstance(values, Mapping) for k, v in values.items()
            if isinstance(v, torch.Tensor)}


def dtypes_changed(optimizer: torch.optim.Optimizer, before: Mapping[tuple[int, Any], Any],
                   state: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """The (torch index, key) of each tensor in ``state`` (what ``optimizer.state_dict()``
    returned) whose dtype differs from the one the optimizer held (``before``: `state_dtypes`
    taken before that call)."""
    params: dict[int, torch.Tensor] = {}  # torch's index of each parameter (its state_dict's)
    seen: set[int] = set()
    start = 0
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"], start):
            if id(p) not in seen:
                seen.add(id(p))
                params[i] = p
        start += len(group["params"])
    out = []
    for i, values in state.items():
        if i not in params or not isinstance(values, Mapping):
            continue
        for key, v in values.items():
            held = before.get((id(params[i]), key))
            if isinstance(v, torch.Tensor) and held is not None and v.dtype != held:
                out.append((i, key))
    return out


def saved_own_dtypes(saved: Mapping[str, Any], where: str) -> list[tuple[str, Any]] | None:
    """The `OWN_DTYPES` pairs of a saved optimizer part (None: not recorded)."""
    pairs = saved.get(OWN_DTYPES)
    if pairs is None:
        return None
    if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) is str
            and type(p[1]) in (str, int) for p in pairs):
        raise CorruptCheckpoint(f"{where}: optimizer {OWN_DTYPES!r} is {shown(pairs, 80)}; "
                                "expected a list of [parameter name, key] pairs (a save writes "
                                "no other)")
    return [(name, key) for name, key in pairs]
