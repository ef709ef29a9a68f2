"""What the states of torch's own optimizers, LR schedulers and GradScaler hold, beyond what
decodes: the rules a restore checks before it changes a live object, and `unbroken verify
--deep` reports (`tools.deep`).

A generation whose files hash right can still hold a state that torch takes without a word
and fails on later, or worse, follows silently: an Adam parameter state without its
``exp_avg_sq`` (a ``KeyError`` at the first step, after the live optimizer was replaced), an
``exp_avg`` of another shape, a string where a tensor goes, a scheduler's ``last_epoch`` that
is not a number. Only a writer's bug or a forged generation makes one; a restore refuses it
as corrupt, like a torn file, and falls back to the generation before.

Each rule holds for every state torch's own classes make (checked in torch 2.13), and only
those are judged: an optimizer or scheduler of anyone else keeps its state its own way."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import shown

TORCH_OPTIM = "torch.optim."  # the module prefix of the classes whose layouts are known here
# Per-parameter state that torch's own optimizers keep elementwise, with the parameter's shape
# exactly (Adam, AdamW, Adamax, NAdam, RAdam, SGD, RMSprop, Adagrad, Adadelta, ASGD, Rprop,
# SparseAdam, Muon; Adafactor's ``variance`` of 0-d and 1-d parameters).
MIRRORS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                     "square_avg", "grad_avg", "acc_delta", "sum", "ax", "exp_inf", "prev",
                     "step_size", "variance"})
# LBFGS keeps lists and flat vectors, for its first parameter only: none of the rules below.
_OWN_LAYOUT = frozenset({"LBFGS"})
# Adafactor's keys depend on each parameter's number of dimensions (``row_var`` and
# ``col_var``, or ``variance``); every other class gives each parameter of a group the same
# keys (its settings decide which: ``max_exp_avg_sq`` with ``amsgrad``).
_KEYS_VARY = frozenset({"Adafactor"})
_FACTORED = frozenset({"row_var", "col_var"})  # (Adafactor's, see `expected_shape`)
SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
               "_growth_tracker")  # torch.amp.GradScaler.state_dict() when enabled
MAX_DEPTH = 64


def expected_shape(key: str, param: Sequence[int]) -> tuple[int, ...] | None:
    """The shape torch's optimizers give state ``key`` of a parameter of shape ``param``;
    None where it is not fixed by the parameter (scalars, LBFGS's flat vectors, ...)."""
    if key in MIRRORS:
        return tuple(param)
    if key == "row_var" and len(param) > 1:  # Adafactor's factored second moment
        return (*param[:-1], 1)
    if key == "col_var" and len(param) > 1:
        return (*param[:-2], 1, param[-1])
    return None


def judges(cls: object) -> bool:
    """Whether `optimizer_state_problems` judges the state of optimizer class ``cls`` (its
    module and name, as the optimizer part records them)."""
    return _kind(cls) != ""


def _kind(cls: object) -> str:
    """The class name of a torch optimizer whose layout is known here; "" for any other."""
    kind = cls.rsplit(".", 1)[-1] if isinstance(cls, str) and cls.startswith(TORCH_OPTIM) else ""
    return "" if kind in _OWN_LAYOUT else kind


def optimizer_state_problems(cls: object, state: Mapping[str, Any], groups: Sequence[Any],
                             shapes: Mapping[str, Any] | None, tensor_at: str,
                             json_at: str, complete: bool = True) -> list[str]:
    """What a name-keyed per-parameter ``state`` (`unbroken.state.optim`) of torch optimizer
    class ``cls`` holds that its class never does: a value that is neither a tensor nor a
    number (nor None: old SGD states), a state tensor of another shape than torch gives it
    for its parameter (``shapes``: each parameter's shape, or the parameter itself, when
    known), a parameter's state that
    lacks a key the others of its group hold. Any other class: nothing is judged.
    ``tensor_at`` and ``json_at`` begin the messages of tensors and of the other values;
    ``complete``: ``state`` holds every value (not so where sharded tensors are left out:
    then the keys each parameter holds are not judged)."""
    kind = _kind(cls)
    if not kind:
        return []
    out: list[str] = []
    group_of: dict[Any, int] = {}
    for gi, g in enumerate(groups):
        params = g.get("params") if isinstance(g, Mapping) else None
        for p in params if isinstance(params, list) else ():
            if isinstance(p, str):
                group_of.setdefault(p, gi)
    # (10,000 small tensors are common: the values are looked at by the cheapest test first)
    first: dict[int | None, Any] = {}  # each group's first keys
    varied: set[int | None] = set()  # groups whose parameters hold different keys
    plain = torch.Tensor
    for name, entry in state.items():
        if type(entry) is not dict and not isinstance(entry, Mapping) or not entry:
            continue  # (not a mapping: told apart by the callers; empty: no state yet)
        got = shapes.get(name) if shapes is not None else None
        param = (got.shape if type(got) is plain or isinstance(got, plain)
                 else got if isinstance(got, (tuple, list)) else None)
        for key, v in entry.items():
            if type(v) is plain or isinstance(v, plain):
                if param is not None and (key in MIRRORS and v.shape != param
                                          or key in _FACTORED and key not in MIRRORS):
                    want = expected_shape(key, param)
                    if want is not None and tuple(v.shape) != want:
                        out.append(f"{tensor_at}: optimizer state[{name!r}][{key!r}] has "
                                   f"shape {list(v.shape)}; expected {list(want)}, as {cls} "
                                   f"keeps it for parameter {name!r} of shape {list(param)}")
            elif key == "step" and number(v) is None:  # (its bounds: `unbroken verify --deep`)
                out.append(f"{json_at}: optimizer state[{name!r}]['step'] is {show(v)}; "
                           "expected a finite scalar >= 0")
            elif v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
                out.append(f"{json_at}: optimizer state[{name!r}][{key!r}] is {show(v)}; "
                           f"expected a tensor or a number, as {cls} keeps its per-parameter "
                           "state")
        group = group_of.get(name)
        keys = first.get(group)
        if keys is None:
            first[group] = entry.keys()
        elif keys != entry.keys():
            varied.add(group)
    if complete and kind not in _KEYS_VARY:
        for group in varied:
            entries = [(name, entry) for name, entry in state.items()
                       if isinstance(entry, Mapping) and entry and group_of.get(name) == group]
            every = frozenset().union(*(entry.keys() for _, entry in entries))
            for name, entry in entries:
                lacks = sorted(map(str, every - entry.keys()))
                if lacks:
                    out.append(f"{json_at}: optimizer state[{name!r}] lacks {lacks}, which "
                               f"the other parameters of its param group hold; {cls} "
                               "gives every parameter of a group the same state")
    return out


def scheduler_problems(state: Any, label: str, groups: int | None, json_at: str,
                       out: list[str], depth: int = 0) -> None:
    """A torch LR scheduler's state (recognised by its keys: the part holds no class name).
    Every ``LRScheduler`` subclass of torch 2.13 keeps ``last_epoch``, ``base_lrs`` and
    ``_last_lr`` (ReduceLROnPlateau and SequentialLR lack ``base_lrs``, ChainedScheduler also
    ``last_epoch``; the last two nest their schedulers' states in ``_schedulers``)."""
    if not isinstance(state, Mapping):
        out.append(f"{json_at}: {label} state is a {type(state).__name__}; expected a "
                   "mapping")
        return
    if not any(k in state for k in ("base_lrs", "_last_lr", "last_epoch", "_schedulers")):
        return  # a scheduler of the user's own: its keys are its business
    if "base_lrs" in state:
        lacks = [k for k in ("last_epoch", "_last_lr") if k not in state]
        if lacks:
            out.append(f"{json_at}: {label} state has 'base_lrs' but lacks {lacks}, which "
                       "every torch LR scheduler with base_lrs holds")
    for key in ("base_lrs", "_last_lr"):
        if key not in state:
            continue
        lrs = state[key]
        if not isinstance(lrs, (list, tuple)):
            out.append(f"{json_at}: {label} {key!r} is {show(lrs)}; expected a list of "
                       "learning rates, one per optimizer param group")
            continue
        # (fewer: groups added by add_param_group after the scheduler was built)
        if groups is not None and len(lrs) > groups:
            out.append(f"{json_at}: {label} {key!r} has {len(lrs)} entries; expected at "
                       f"most {groups}, one per optimizer param group")
        for i, v in enumerate(lrs):
            x = number(v)
            if x is None or not math.isfinite(x) or x < 0:
                out.append(f"{json_at}: {label} {key!r}[{i}] is {show(v)}; expected a "
                           "finite learning rate >= 0")
    if "last_epoch" in state:
        x = number(state["last_epoch"])
        if x is None or not math.isfinite(x) or x < -1:  # torch starts at -1, then steps
            out.append(f"{json_at}: {label} 'last_epoch' is {show(state['last_epoch'])}; "
                       "expected a finite number >= -1")
    subs = state.get("_schedulers")
    if subs is not None:
        if not isinstance(subs, (list, tuple)) or depth >= MAX_DEPTH:
            out.append(f"{json_at}: {label} '_schedulers' is {show(subs)}; expected a "
                       "list of the chained schedulers' states")
            return
        for i, sub in enumerate(subs):
            scheduler_problems(sub, f"{label} '_schedulers'[{i}]", groups, json_at, out,
                               depth + 1)


def scaler_problems(state: Any, json_at: str, out: list[str]) -> None:
    """torch.amp.GradScaler's state: empty when disabled, else all of `SCALER_KEYS`
    (``load_state_dict`` reads each one), a positive finite scale and factors, and integer
    counters."""
    if not isinstance(state, Mapping):
        out.append(f"{json_at}: scaler state is a {type(state).__name__}; expected a "
                   "mapping")
        return
    if not any(k in state for k in SCALER_KEYS):
        return  # disabled (empty), or a scaler of the user's own
    lacks = [k for k in SCALER_KEYS if k not in state]
    if lacks:
        out.append(f"{json_at}: scaler state lacks {lacks}; GradScaler.load_state_dict "
                   "reads every one of them")
    for key in ("scale", "growth_factor", "backoff_factor"):
        if key in state:
            x = number(state[key])
            if x is None or not math.isfinite(x) or x <= 0:
                out.append(f"{json_at}: scaler {key!r} is {show(state[key])}; expected a "
                           "finite number > 0")
    for key, low in (("growth_interval", 1), ("_growth_tracker", 0)):
        if key in state:
            v = state[key]
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low:
                out.append(f"{json_at}: scaler {key!r} is {show(v)}; expected an integer "
                           f">= {low}")


def number(v: Any) -> float | None:
    """``v`` as a float (inf or NaN included) if it is a real number or a one-element real
    tensor; None otherwise. An int too large for a float is an infinity."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex() or v.dtype == torch.bool:
            return None
        return float(v.reshape(()).to(torch.float64))
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        return float(v)
    except OverflowError:
        return -math.inf if isinstance(v, int) and v < 0 else math.inf


def show(v: Any) -> str:
    """A value for a message: a tensor by its shape (and its value when it has one)."""
    if isinstance(v, torch.Tensor):
        if v.numel() == 1:
            return f"tensor({shown(v.reshape(()).item())}) of shape {list(v.shape)}"
        return f"a tensor of shape {list(v.shape)}"
    return shown(v)
