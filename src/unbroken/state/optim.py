"""The model and optimizer by parameter *name*: torch keys optimizer state by position, which
silently mis-maps a reordered or regrouped model. Capture, mapping back onto a live
optimizer (refusing any mismatch), the model's keys, shapes and dtypes, and the hyperparameter
changes a continuation must warn about."""

from __future__ import annotations

import collections
import copy
from collections.abc import Collection, Mapping
from itertools import chain
from typing import Any

import torch

from ..errors import CorruptCheckpoint, StateMismatch, UnsupportedValue, shown
from .livemodel import LiveModel, param_names
from .optimrest import (
    EXTRA,
    OTHER_STATE,
    OWN_DTYPES,
    OWN_DTYPES_READY,
    dtypes_changed,
    extras,
    owned_tree,
    packed,
    refuse_stray,
    saved_own_dtypes,
    saved_rest,
    split_state,
    state_dtypes,
)


def live_group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     names: dict[int, str] | None = None, refuse: str | None = None
                     ) -> list[list[str]]:
    """Each param group's parameters by name. A tensor outside the model gets a made-up
    ``<not in model>...`` name (for a caller that only shows the names); with ``refuse``
    (the end of the message) it is refused instead, as `check_optimizer_params` refuses it
    when the Checkpointer is built: a save would keep its moments but not its value, and a
    restore would put them onto a fresh tensor. (A param group added by add_param_group
    after the build is met only here, at each save and restore.)"""
    names = param_names(model) if names is None else names
    # ("": not in the model, no parameter's name; the fallback is formatted only when
    # needed: ~0.2 us a parameter, in every save)
    out = [[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
    for gi, group in enumerate(out):
        if "" in group:
            if refuse is not None:
                _refuse_outside(optimizer, names, refuse)
            group[:] = [n or f"<not in model>.group{gi}.param{pi}" for pi, n in enumerate(group)]
    return out


def check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that trains tensors outside the model: their moments would be
    saved but their values not, and a resume would silently start them from scratch.
    (The model's one walk names them: ~2 ms for 1,250 layers, ``named_parameters`` ~6.)"""
    _refuse_outside(optimizer, LiveModel(model).param_names(), "")


def _refuse_outside(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                    when: str) -> None:
    """Refuse, naming the first few, the tensors the optimizer trains that ``names`` (the
    model's parameters) lacks; ``when`` ends the message's reason."""
    outside = [f"group {gi} param {pi} {tuple(p.shape)}"
               for gi, g in enumerate(optimizer.param_groups)
               for pi, p in enumerate(g["params"]) if id(p) not in names]
    if outside:
        raise UnsupportedValue(
            f"the optimizer updates tensors that are not parameters of the model "
            f"({', '.join(outside[:3])}){when}; register them on the model (e.g. as an "
            "nn.Parameter attribute) so their values are saved with it")


_ADDED = (" (in a param group added after the Checkpointer was built?); a save would keep "
          "their optimizer state but not their values, and nothing was saved")
_UNSAVED = "; no save holds their values (a restore would start them from scratch)"


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    names: dict[int, str] | None = None) -> dict[str, Any]:
    """The optimizer's state_dict with integer parameter ids replaced by parameter names
    (``names``: `param_names` of ``model``, when known already); what else it holds (state
    under string keys, other top-level entries) beside them (`optimrest`)."""
    if _indexes_only(optimizer):
        direct = _direct_state(optimizer, live_group_names(model, optimizer, names, _ADDED))
        if direct is not None:
            return direct
    before = state_dtypes(optimizer) if not _indexes_only(optimizer) else None
    try:
        sd = optimizer.state_dict()  # (its pre-hooks run before the groups are named)
    except KeyError:  # (torch's own fails so on state of a tensor in no group: said typed)
        refuse_stray(optimizer)
        raise
    state, groups = packed(sd)
    group_names = live_group_names(model, optimizer, names, _ADDED)
    by_index: dict[int, str] = {}
    for saved_group, group in zip(groups, group_names):
        by_index.update(zip(saved_group["params"], group))
    named, other = split_state(state, by_index)
    out: dict[str, Any] = {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "state": named,
        "param_groups": [{**g, "params": group} for g, group in zip(groups, group_names)],
    }
    if other:
        out[OTHER_STATE] = other
    extra = extras(sd)
    if extra:
        out[EXTRA] = extra
    if before is not None:  # (the optimizer's own state_dict ran: which dtypes it chose)
        out[OWN_DTYPES] = sorted([by_index[i], key]
                                 for i, key in dtypes_changed(optimizer, before, state))
    return out


def _direct_state(optimizer: torch.optim.Optimizer, group_names: list[list[str]]
                  ) -> dict[str, Any] | None:
    """What `optimizer_state` makes of ``optimizer.state_dict()``, made straight from the
    optimizer's state and groups when ``state_dict`` would only index them (torch's own
    method, no hooks, every state key a parameter of a group): the same dicts, in the same
    order, without the index round trip (~1 ms at 2,500 parameters, in every save). None
    otherwise."""
    if not _indexes_only(optimizer):
        return None
    # (torch indexes a parameter where first met: the first name wins, laid last)
    ids = list(map(id, chain.from_iterable(g["params"] for g in optimizer.param_groups)))
    by_id = dict(zip(reversed(ids), reversed(list(chain.from_iterable(group_names)))))
    try:
        state = dict(zip(map(by_id.__getitem__, map(id, optimizer.state)),
                         optimizer.state.values()))
    except KeyError:  # a state key in no group: torch's own method says what it makes of it
        return None
    return {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "state": state,
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                         for g, names in zip(optimizer.param_groups, group_names)],
    }


_STATE_DICT = torch.optim.Optimizer.state_dict
_LOAD_STATE_DICT = torch.optim.Optimizer.load_state_dict


def _indexes_only(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.state_dict()`` only indexes its state and groups: torch's own
    method (not overridden by its class, nor patched on the instance), without hooks."""
    return (type(optimizer).state_dict is _STATE_DICT
            and not optimizer._optimizer_state_dict_pre_hooks
            and not optimizer._optimizer_state_dict_post_hooks
            and "state_dict" not in optimizer.__dict__)


def _loads_only(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.load_state_dict()`` is torch's own (not overridden by its class,
    nor patched on the instance), without hooks: it only casts each value to its parameter's
    dtype and device (`_identity_cast`) and sets the state and groups."""
    return (type(optimizer).load_state_dict is _LOAD_STATE_DICT
            and not optimizer._optimizer_load_state_dict_pre_hooks
            and not optimizer._optimizer_load_state_dict_post_hooks
            and "load_state_dict" not in optimizer.__dict__)


def optimizer_state_to_torch(saved: Mapping[str, Any], model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer, where: str,
                             names: dict[int, str] | None = None) -> dict[str, Any]:
    """Map a name-keyed optimizer state onto the live optimizer, refusing any mismatch
    (``names``: `param_names` of ``model``, when known already)."""
    try:
        groups, state = saved["param_groups"], saved["state"]
        saved_names = [list(g["params"]) for g in groups]
        if not isinstance(state, Mapping) or not all(isinstance(e, Mapping)
                                                     for e in state.values()):
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise CorruptCheckpoint(
            f"{where}: optimizer state lacks 'param_groups' or 'state'") from None
    live_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved.get("class", live_class) != live_class:
        raise StateMismatch(f"{where}: saved by {saved['class']}, the live optimizer is "
                            f"{live_class}; build the optimizer of the saved run, or warm_start")
    for gi, (saved_group, live_group) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(saved_group, Mapping) or set(saved_group) != set(live_group):
            got = set(saved_group) if isinstance(saved_group, Mapping) else saved_group
            raise StateMismatch(f"{where}: param group {gi} has settings {sorted(got)}, the "
                                f"live optimizer's has {sorted(live_group)}")
        for key, live in live_group.items():
            # (a generation that verifies holds what the run had: a kind the live optimizer
            # cannot take is a change of configuration, not corruption to fall back from)
            if key != "params" and not _same_kind(saved_group[key], live):
                raise StateMismatch(
                    f"{where}: param group {gi} {key!r} is {shown(saved_group[key])}, where "
                    f"the live optimizer holds a {type(live).__name__} ({shown(live)}); build "
                    "the optimizer as in the saved run")
    other, extra = saved_rest(saved, where)
    live_names = live_group_names(model, optimizer, names, _UNSAVED)
    if saved_names != live_names:
        added = (f" The saved run had {len(saved_names)} param groups, the live optimizer "
                 f"{len(live_names)}: a group the saved run added (add_param_group, as "
                 "progressive unfreezing does) must be added again before restore()."
                 if len(saved_names) > len(live_names) else "")
        raise StateMismatch(
            f"{where}: optimizer parameter groups differ from the live optimizer: saved "
            f"{first_diff(saved_names, live_names)}. Parameters were renamed, reordered or "
            f"regrouped;{added} build the model and optimizer as in the saved run, or "
            "warm_start")
    # Per-parameter state shapes are the optimizer's business (Adafactor keeps factored
    # rows, LBFGS flat vectors); the names map onto parameters whose shapes validate_model
    # has checked against the saved model.
    index: dict[str, int] = {}
    n = 0  # torch numbers parameters in group order, each distinct parameter once
    for group in live_names:
        for name in group:
            if name not in index:
                index[name] = n
                n += 1
    unknown = set(state) - set(index)
    if unknown:
        raise StateMismatch(f"{where}: optimizer state for parameters {sorted(unknown)[:5]} "
                            "that the live optimizer does not hold")
    positional: dict[Any, Any] = {index[k]: v for k, v in state.items()}
    if other:  # (string keys: torch's load keeps them as they are, apart from its indices)
        positional.update(other)
    ready = {"state": positional,
             "param_groups": [{**g, "params": [index[x] for x in g["params"]]} for g in groups],
             **extra}  # (for the optimizer's own load_state_dict or hooks, which read them)
    pairs = saved_own_dtypes(saved, where)
    if pairs is not None:
        ready[OWN_DTYPES_READY] = {(index[name], key) for name, key in pairs if name in index}
    return ready


def _same_kind(saved: Any, live: Any) -> bool:
    """Whether a saved hyperparameter has the kind of value the live optimizer holds there
    (torch's load_state_dict takes anything: a None learning rate fails only at the step)."""
    if isinstance(live, (bool, str)) or live is None:
        # a setting (LBFGS's line_search_fn: None or "strong_wolfe"; foreach: None or a bool)
        # that the run may have switched: restored as saved, with a warning
        return saved is None or isinstance(saved, (bool, str))
    if isinstance(live, (int, float, torch.Tensor)):
        return (isinstance(saved, (int, float, torch.Tensor)) and not isinstance(saved, bool)
                and (not isinstance(saved, torch.Tensor) or saved.numel() == 1)
                # (an int no float can hold: torch and schedulers compute with it as one)
                and (not isinstance(saved, int) or abs(saved) < 1 << 1000))
    if isinstance(live, (tuple, list)):
        return (isinstance(saved, (tuple, list)) and len(saved) == len(live)
                and all(_same_kind(a, b) for a, b in zip(saved, live)))
    return True


def first_diff(saved: list[list[str]], live: list[list[str]]) -> str:
    """Where two lists of param groups' names first differ, in words."""
    if len(saved) != len(live):
        return f"{len(saved)} groups, live {len(live)}"
    for gi, (a, b) in enumerate(zip(saved, live)):
        if a != b:
            for pi in range(max(len(a), len(b))):
                x = a[pi] if pi < len(a) else "<none>"
                y = b[pi] if pi < len(b) else "<none>"
                if x != y:
                    return f"group {gi} position {pi} is {x!r}, live is {y!r}"
    return "same names"


def load_optimizer_state(optimizer: torch.optim.Optimizer, ready: Mapping[str, Any],
                         mapped: Any = None) -> None:
    """``optimizer.load_state_dict(ready)`` (torch's positional form), without its per-value
    casting where every value already has the dtype and device it would be cast to: then
    that cast is the identity, and skipping it saves ~15 µs a tensor (0.12 s for 10,000).
    Anything else (a subclass that saves or loads its own way or a method patched on the
    instance, hooks, GPU or mixed-dtype state, fused or capturable steps, state under keys
    that are no parameter) goes through ``load_state_dict``.

    With ``mapped`` (`applying.Copier`) saved tensors that view mapped files (see
    `applying.apply`) are copied into the live state tensor of the same shape and dtype (or
    a new one), so the optimizer never keeps a view of a file; the others are adopted as
    they are."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in ready["param_groups"] for i in g["params"]]
    by_id = dict(zip(saved_ids, params, strict=False))
    exact = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    # Torch's own state_dict and load_state_dict alone: the saved dtypes are the run's, and
    # only torch's cast to the parameter's dtype would change them (else the optimizer's own
    # code or hooks decide what dtype each value is saved and loaded in: `_uncast` below).
    # The values the optimizer's own state_dict saved in another dtype than it held them
    # (None: not recorded, or torch's own state_dict saved them all as they were held)
    chosen: set[tuple[Any, Any]] | None = ready.get(OWN_DTYPES_READY)
    if OWN_DTYPES_READY in ready:
        ready = {k: v for k, v in ready.items() if k != OWN_DTYPES_READY}
    own = _indexes_only(optimizer) and _loads_only(optimizer)
    fast = (own and len(ready["param_groups"]) == len(optimizer.param_groups)
            and all(i in by_id and _identity_cast(by_id[i], values, exact)
                    for i, values in ready["state"].items()))
    if not fast:
        if mapped is not None:  # torch keeps what it is given: copies, not views of files
            def keep(t: torch.Tensor) -> torch.Tensor:
                return _owned(None, t, mapped)  # type: ignore[no-any-return]
            ready = {k: v if k == "param_groups" else owned_tree(v, keep)
                     for k, v in ready.items()}
            mapped.finish()  # torch may cast (copy) them: their bytes must be in first
        optimizer.load_state_dict(dict(ready))
        # (torch's own load: each value it cast is set back, but those whose saved dtype the
        # optimizer's own state_dict chose; where that was not recorded, none)
        known = _indexes_only(optimizer) or chosen is not None
        _uncast(optimizer, ready, by_id, _loads_only(optimizer) and known, chosen or set())
        return
    state: dict[Any, Any] = {}
    for i, values in ready["state"].items():
        if mapped is None:  # (nothing views a file: every value is adopted as it is)
            state[by_id[i]] = dict(values)
            continue
        live = optimizer.state.get(by_id[i], {})
        state[by_id[i]] = {k: _owned(live.get(k), v, mapped) for k, v in values.items()}
    groups = []
    memo: dict[int, Any] = {}  # (one for all groups, as torch's deepcopy of them all)
    for live, saved in zip(optimizer.param_groups, ready["param_groups"], strict=True):
        # torch's copy of the saved groups, but for their parameter indices, which the live
        # parameters replace (a deepcopy of 10,000 ints costs ~5 ms); the keys keep their order
        group = {k: live["params"] if k == "params" else copy.deepcopy(v, memo)
                 for k, v in saved.items()}
        if "param_names" in live and "param_names" not in group:
            group["param_names"] = live["param_names"]
        groups.append(group)
    optimizer.__setstate__({"state": collections.defaultdict(dict, state),
                            "param_groups": groups})


def _owned(live: Any, saved: Any, mapped: Any) -> Any:
    """``saved``, or when it views a mapped file a tensor of this process's own holding its
    value: the live one when it has the same shape, dtype and device (copied into), else a
    new one."""
    if mapped is None or not isinstance(saved, torch.Tensor) or not mapped.holds(saved):
        return saved
    if (isinstance(live, torch.Tensor) and live.shape == saved.shape
            and live.dtype == saved.dtype and live.device == saved.device):
        return mapped.copy(saved, live)
    return mapped.copy(saved, None)


def _identity_cast(param: torch.Tensor, values: Mapping[str, Any], exact: bool) -> bool:
    """Whether ``values`` can be adopted for ``param`` as they are (``exact``: a fused or
    capturable group, where torch keeps ``step`` in float32). torch's load casts every value
    but ``step`` to the parameter's dtype; a continuation keeps the saved dtypes, as the run
    had them (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu`` are float32 for a float64 or
    bfloat16 parameter: cast, the next update differs)."""
    if not param.is_cpu or not param.is_floating_point():
        return False
    for key, v in values.items():
        if not isinstance(v, torch.Tensor):
            if isinstance(v, (dict, list, tuple)):
                return False  # nested containers: torch casts inside them
            continue
        if not v.is_cpu:
            return False
        if key == "step" and exact and v.dtype != torch.float32:
            return False
    return True


# The per-parameter values torch's own optimizer classes keep in float32 whatever their
# parameter's dtype (their ``step`` aside): torch's load casts them to the parameter's.
_FLOAT32_KEPT = {torch.optim.NAdam: frozenset({"mu_product"}),
                 torch.optim.ASGD: frozenset({"eta", "mu"})}


def _uncast(optimizer: torch.optim.Optimizer, ready: Mapping[str, Any],
            by_id: Mapping[int, torch.Tensor], own: bool,
            chosen: Collection[tuple[Any, Any]] = ()) -> None:
    """After ``load_state_dict``: each value torch cast from its saved dtype to its floating
    parameter's (see `_identity_cast`) is the saved value again, on the device torch put it
    on. ``own``: torch's own load ran and the saved dtypes are the ones the optimizer held
    (`load_optimizer_state`); else the optimizer's code or hooks chose the dtypes (a hook that
    saves bfloat16 moments and loads them as float32 is not undone), and only the values a
    torch class keeps in float32 for any parameter, saved so, are set back
    (`_FLOAT32_KEPT`). ``chosen``: (index, key) of values whose saved dtype the optimizer's
    own ``state_dict`` chose: never set back."""
    kept = next((keys for cls, keys in _FLOAT32_KEPT.items() if isinstance(optimizer, cls)),
                frozenset())
    if not own and not kept:
        return
    for i, values in ready["state"].items():
        param = by_id.get(i)
        live = optimizer.state.get(param) if param is not None else None
        if live is None or not param.is_floating_point():  # type: ignore[union-attr]
            continue
        for key, v in values.items():
            now = live.get(key)
            if (key != "step" and (i, key) not in chosen and isinstance(v, torch.Tensor)
                    and isinstance(now, torch.Tensor)
                    and v.dtype != now.dtype and now.dtype == param.dtype  # type: ignore[union-attr]
                    and (own or key in kept and v.dtype == torch.float32)):
                live[key] = v.to(device=now.device)
