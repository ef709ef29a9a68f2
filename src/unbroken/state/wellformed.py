"""What the states of torch's own optimizers, LR schedulers and GradScaler hold, beyond what
decodes: the rules a restore checks before it changes a live object, and `unbroken verify
--deep` reports (`tools.deep`).

A generation whose files hash right can still hold a state that torch takes without a word
and fails on later, or worse, follows silently: an Adam parameter state without its
``exp_avg_sq`` (a ``KeyError`` at the first step, after the live optimizer was replaced), an
``exp_avg`` of another shape, a string where a tensor goes, a param group's ``maximize: "yes"``
(truthy: a silent gradient ascent) or an ``eps`` its constructor refuses, a scheduler's
``last_epoch`` that is not a number or a StepLR's ``step_size`` of 0. Only a writer's bug or
a forged generation makes one; a restore refuses it as corrupt, like a torn file, and falls
back to the generation before.

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
# Group settings whose range torch's optimizers check when they are built (a resealed value is
# never checked again): (low bound, low inclusive, high bound). Nothing of torch's moves them
# out of it later, but `SCHEDULED` (and a CyclicLR or OneCycleLR given momenta >= 1 by hand,
# which it does not check, for 'momentum' and 'betas').
GROUP_RANGES = {"lr": (0.0, True, None), "initial_lr": (0.0, True, None),
                "weight_decay": (0.0, True, None), "momentum": (0.0, True, None),
                # (torch accepts eps == 0, so a run may legitimately hold it)
                "eps": (0.0, True, None), "betas": (0.0, True, 1.0)}
# Those that torch's LR schedulers move out of their range in a healthy run (a StepLR of
# gamma < 0, a LambdaLR past the end of a linear decay: a negative 'lr'); a restore continues
# such a run, `unbroken verify --deep` reports them.
SCHEDULED = frozenset({"lr"})
# The settings that are flags in every torch 2.13 optimizer that has them: a bool, or also None
# (True here) where None is torch's default (foreach, fused: torch chooses). Text there is
# truthy to torch: a resealed ``maximize: "no"`` climbs the loss.
FLAGS = {"maximize": False, "amsgrad": False, "capturable": False, "differentiable": False,
         "nesterov": False, "decoupled_weight_decay": False, "centered": False,
         "foreach": True, "fused": True}
# Scheduler settings and counters torch keeps as ints, with their least value: StepLR takes
# ``last_epoch % step_size`` (0: ZeroDivisionError; 3.5 decays at other epochs),
# CosineAnnealingWarmRestarts checks T_0 and T_mult when built and divides by T_i, and every
# LRScheduler counts its steps from 0.
SCHEDULER_COUNTS = {"step_size": 1, "T_0": 1, "T_i": 1, "T_mult": 1, "_step_count": 0}
# The flags every LRScheduler of torch 2.13 keeps while it computes (`_initial_mode`,
# `_enable_get_lr_call`): bools.
SCHEDULER_FLAGS = ("_is_initial", "_get_lr_called_within_step")
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
                             json_at: str, complete: bool = True,
                             saved_layout: bool = False) -> list[str]:
    """What a name-keyed per-parameter ``state`` (`unbroken.state.optim`) of torch optimizer
    class ``cls`` holds that its class never does: a value that is neither a tensor nor a
    number (nor None: old SGD states), a state tensor of another shape than torch gives it
    for its parameter (``shapes``: each parameter's shape, or the parameter itself, when
    known; ``saved_layout``: the shapes given as tuples are those the model's tensors were
    saved in, which a module that saves its own way, `_save_to_state_dict`, may have
    transposed or flattened: a tensor that mirrors its parameter then only needs as many
    elements, and factored ones are not judged), a parameter's state that
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
        param: Sequence[int] | None = None
        layout = False  # (only the number of elements is known)
        if type(got) is plain or isinstance(got, plain):
            param = got.shape
        elif isinstance(got, (tuple, list)):
            param, layout = got, saved_layout
        for key, v in entry.items():
            if type(v) is plain or isinstance(v, plain):
                if param is not None and (key in MIRRORS and v.shape != param
                                          or key in _FACTORED and not layout):
                    want = expected_shape(key, param)
                    if want is not None and tuple(v.shape) != want and not (
                            layout and v.numel() == math.prod(want)):
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


def group_problems(cls: object, g: Mapping[str, Any], gi: int, tensor_at: str, json_at: str,
                   out: list[str], scheduled: bool = True) -> None:
    """What param group ``gi`` of an optimizer of class ``cls`` holds that torch's optimizers
    refuse when they are built: a setting of `GROUP_RANGES` out of its range (``scheduled``:
    those of `SCHEDULED` too), and, for a class of torch's own, a flag of `FLAGS` that is not
    a bool (nor None where torch allows it). A value that is no number at all is not judged
    as a range (another optimizer's meaning of the name; a restore has compared its kind with
    the live optimizer's). ``tensor_at`` and ``json_at`` begin the messages, as in
    `optimizer_state_problems`."""
    for key, (low, inclusive, high) in GROUP_RANGES.items():
        value = g.get(key)
        if value is None or not scheduled and key in SCHEDULED:
            continue
        # betas (and Adafactor's eps) are tuples; None inside one means "not used"
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, v in items:
            x = number(v)
            if v is None or (x is None and not isinstance(v, torch.Tensor)):
                continue
            if not (x is not None and math.isfinite(x) and (x >= low if inclusive else x > low)
                    and (high is None or x < high)):
                span = (f"a finite number {'>=' if inclusive else '>'} {low:g}"
                        + (f" and < {high:g}" if high is not None else ""))
                at = "" if i is None else f"[{i}]"
                where = tensor_at if isinstance(v, torch.Tensor) else json_at
                out.append(f"{where}: optimizer param group {gi} {key!r}{at} is {show(v)}; "
                           f"expected {span}, as torch's optimizers accept it")
    if not (isinstance(cls, str) and cls.startswith(TORCH_OPTIM)):
        return
    if "lr" not in g:  # (every torch optimizer's defaults hold it: each group gets one)
        out.append(f"{json_at}: optimizer param group {gi} has no 'lr', which every param "
                   f"group of {cls} holds")
    for key, none in FLAGS.items():
        v = g.get(key, False)
        if not isinstance(v, bool) and not (none and v is None):
            out.append(f"{json_at}: optimizer param group {gi} {key!r} is {show(v)}; "
                       f"expected {'True, False or None' if none else 'True or False'}, as "
                       f"{cls} holds it")


def _same(saved: Any, live: Any) -> bool:
    """Whether a saved setting is the live one, of the same type (3.5 is not 3)."""
    return type(saved) is type(live) and saved == live


def scheduler_problems(state: Any, label: str, groups: int | None, json_at: str,
                       out: list[str], live: Any = None, depth: int = 0) -> None:
    """A torch LR scheduler's state (recognised by its keys: the part holds no class name).
    Every ``LRScheduler`` subclass of torch 2.13 keeps ``last_epoch``, ``base_lrs`` and
    ``_last_lr`` (ReduceLROnPlateau and SequentialLR lack ``base_lrs``, ChainedScheduler also
    ``last_epoch``; the last two nest their schedulers' states in ``_schedulers``).
    ``live``: the live scheduler's state, when there is one: a setting of `SCHEDULER_COUNTS`
    equal to its value is what the run's own code builds (torch does not check a StepLR's
    step_size), never refused."""
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
        # (fewer: groups added by add_param_group after the scheduler was built, which a
        # StepLR steps fine; none: no optimizer is built without a group)
        if not lrs:
            out.append(f"{json_at}: {label} {key!r} has 0 entries; expected at least 1, one "
                       "per optimizer param group")
        elif groups is not None and len(lrs) > groups:
            out.append(f"{json_at}: {label} {key!r} has {len(lrs)} entries; expected at "
                       f"most {groups}, one per optimizer param group")
        for i, v in enumerate(lrs):
            x = number(v)
            # base_lrs are the groups' lrs when the scheduler was built (>= 0: the optimizer
            # checked them); a scheduler's step may make one negative (StepLR's gamma < 0)
            if key == "base_lrs" and (x is None or not math.isfinite(x) or x < 0):
                out.append(f"{json_at}: {label} {key!r}[{i}] is {show(v)}; expected a "
                           "finite learning rate >= 0")
            elif x is None or math.isnan(x):
                out.append(f"{json_at}: {label} {key!r}[{i}] is {show(v)}; expected a "
                           "learning rate (a number, not NaN)")
    if "last_epoch" in state:
        x = number(state["last_epoch"])
        if x is None or not math.isfinite(x) or x < -1:  # torch starts at -1, then steps
            out.append(f"{json_at}: {label} 'last_epoch' is {show(state['last_epoch'])}; "
                       "expected a finite number >= -1")
    live = live if isinstance(live, Mapping) else {}
    for key, low in SCHEDULER_COUNTS.items():
        v = state.get(key, low)
        if (type(v) is not int or v < low) and not (key in live and _same(v, live[key])):
            out.append(f"{json_at}: {label} {key!r} is {show(v)}; expected an integer >= "
                       f"{low}, as torch's schedulers keep it"
                       + (f" (the live scheduler holds {show(live[key])})" if key in live
                          else ""))
    for key in SCHEDULER_FLAGS:
        if key in state and not isinstance(state[key], bool):
            out.append(f"{json_at}: {label} {key!r} is {show(state[key])}; expected True or "
                       "False, as torch's schedulers keep it")
    subs = state.get("_schedulers")
    if subs is not None:
        if not isinstance(subs, (list, tuple)) or depth >= MAX_DEPTH:
            out.append(f"{json_at}: {label} '_schedulers' is {show(subs)}; expected a "
                       "list of the chained schedulers' states")
            return
        lives = live.get("_schedulers")
        for i, sub in enumerate(subs):
            scheduler_problems(sub, f"{label} '_schedulers'[{i}]", groups, json_at, out,
                               lives[i] if isinstance(lives, list) and i < len(lives)
                               else None, depth + 1)


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
