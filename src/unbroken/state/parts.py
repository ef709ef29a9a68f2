"""Named state parts -> one state tree per generation, and back (the model and optimizer by
parameter name: see `optim`).

A part is anything with ``state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol);
the model and optimizer get special handling so that optimizer state is keyed by parameter
*name* (torch maps it by position, which silently mis-maps a reordered model). Loading is split
into ``validate_*`` (reads only) and `applying.apply` so that nothing live changes until the whole
generation has been checked. The tree's files are `generation`'s."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.nn.parameter import is_lazy

from ..errors import (
    CorruptCheckpoint,
    MissingState,
    StateMismatch,
    UnbrokenError,
    UnsupportedValue,
    shown,
)
from .extraoptim import checked_param_names, with_param_names
from .livemodel import LiveModel
from .modelcheck import validate_model
from .optim import optimizer_state, optimizer_state_to_torch
from .wellformed import (
    TORCH_OPTIM,
    group_problems,
    number,
    optimizer_state_problems,
    scaler_problems,
    scheduler_problems,
    show,
)

# State keys: the part names of a generation (and the stem of their tensor files).
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
DATA = "data"
RNG = "rng"
COUNTERS = "counters"
EXTRA_PREFIX = "extra."
SCHEDULER_CLASS = "unbroken.class"  # beside a scheduler's state: its class (`scheduler_class`)
STATE_FILE = "state.json"
STATE_SCHEMA = "unbroken.state/1"
MORE_FILES = "more_files"  # state.json: a part's stable files (incremental saves)
MAX_STATE_BYTES = 256 * 1024 * 1024

INTENTS = ("continue", "warm_start")


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state can be captured and restored (torchdata's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class PerRank:
    """An extra whose state each rank of a data-parallel job holds its own of (a framework's
    per-rank logged values, a rank's own iterator): ``Checkpointer(extras={"name":
    PerRank(obj)})``. It is stored in each rank's own files beside that rank's random
    streams and restored by each rank from its own, and never compared across the ranks as
    the replicas are (a plain extra that differs across ranks is refused at save). A rank
    that the saving job did not have restores rank 0's (said). In a job of one process it is
    an extra like any other."""

    __slots__ = ("state",)

    def __init__(self, state: Stateful) -> None:
        if not isinstance(state, Stateful):
            raise TypeError(f"PerRank needs an object with state_dict() and load_state_dict(), "
                            f"got {type(state).__name__}")
        self.state = state


_INT64 = range(-(1 << 63), 1 << 63)  # the counters a save writes and a restore reads


class Counters:
    """Completed updates and epoch. The epoch lives here only when no data part owns it."""

    def __init__(self, data: Any) -> None:
        self.step = 0
        self._epoch = 0
        self._data = data

    @property
    def epoch(self) -> int:
        return int(getattr(self._data, "epoch", self._epoch))

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self._data is not None and hasattr(self._data, "epoch"):
            raise UnbrokenError("the data part owns the epoch; do not set it on the Checkpointer")
        self._epoch = int(value)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "epoch": self.epoch}
        for name, value in state.items():  # what validate_state_dict accepts, nothing else
            if value not in _INT64:
                raise UnsupportedValue(f"counters: {name} {shown(value)} is outside int64; a "
                                       "restore could not read it back")
        return state

    @staticmethod
    def validate_state_dict(saved: Mapping[str, Any], where: str) -> None:
        step, epoch = saved.get("step"), saved.get("epoch")
        # (bounded before any message shows them: str() of an int past 4300 digits raises)
        if (type(step) is not int or type(epoch) is not int or step not in _INT64
                or epoch not in _INT64):
            raise CorruptCheckpoint(f"{where}: counters need integer 'step' and 'epoch' (int64)")

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.step = saved["step"]
        if self._data is None or not hasattr(self._data, "epoch"):
            self._epoch = saved["epoch"]


# -- capture and restore of every part ---------------------------------------------------------


def capture(parts: Mapping[str, Any], model: torch.nn.Module, detach: bool = True
            ) -> dict[str, Any]:
    """One tree per part. ``parts`` maps part names to live objects (or, for counters and
    rng, to already-captured trees). ``detach=False``: the model's parameters as they are,
    for a caller that copies every tensor at once (`LiveModel.state_dict`)."""
    tree: dict[str, Any] = {}
    walked = LiveModel(model) if MODEL in parts or OPTIMIZER in parts else None
    for name, obj in parts.items():
        if name == MODEL and walked is not None and obj is model:
            tree[name] = walked.state_dict(detach)
        elif name == OPTIMIZER:
            tree[name] = optimizer_state(model, obj, walked.param_names() if walked else None)
        elif name == SCHEDULER and isinstance(obj, Stateful):
            state = obj.state_dict()
            tree[name] = ({**state, SCHEDULER_CLASS: scheduler_class(obj)}
                          if isinstance(state, Mapping) else state)
        elif name.startswith(EXTRA_PREFIX) and isinstance(obj, torch.optim.Optimizer):
            tree[name] = with_param_names(obj.state_dict(), model, obj,
                                          walked.param_names() if walked else None)
        elif isinstance(obj, Stateful):
            tree[name] = obj.state_dict()
        else:
            tree[name] = obj
    return tree


def validate_parts(saved: Mapping[str, Any], parts: Mapping[str, Any], model: torch.nn.Module,
                   where: str, intent: str = "continue", walked: LiveModel | None = None,
                   fresh: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check every part the run has against the saved tree; return what ``apply`` needs
    (the optimizer state already mapped to torch's positional form). Reads only.
    ``walked``: ``model``'s walk, made for this restore (given to ``apply`` too).
    ``fresh``: a warm start's model names left as they are (`modelcheck.keep_fresh`)."""
    missing = [p for p in parts if p not in saved]
    if missing:
        raise MissingState(
            f"{where}: the checkpoint has no {', '.join(map(repr, missing))} state, which this "
            "run has; a continuation needs every part (use warm_start to begin a new run from "
            "the weights)")
    extra = [p for p in saved if p not in parts]
    if extra:
        raise StateMismatch(
            f"{where}: the checkpoint holds {', '.join(map(repr, extra))} state but this run "
            "has no such part; pass it to the Checkpointer so the run continues as saved")
    ready = dict(saved)
    if SCHEDULER in parts and isinstance(saved[SCHEDULER], Mapping) and (
            SCHEDULER_CLASS in saved[SCHEDULER]):  # (generations since 12-02)
        state = saved[SCHEDULER]
        kind, live_kind = state[SCHEDULER_CLASS], scheduler_class(parts[SCHEDULER])
        if kind != live_kind:  # (another schedule may take the same keys)
            raise StateMismatch(f"{where}: the scheduler was a {str(kind)[:300]}, the live "
                                f"one is a {live_kind}; build the scheduler of the saved run, "
                                "or warm_start")
        ready[SCHEDULER] = {k: v for k, v in state.items() if k != SCHEDULER_CLASS}
    # A state torch's own classes never hold is corrupt (the generation refused, an older one
    # used), whatever the live objects are: first, before any comparison with them would
    # blame the run's settings for it (a forged or miswritten generation)
    if walked is None:
        walked = LiveModel(model)
    _refuse_malformed(saved, ready, parts, where, walked)
    for name, obj in parts.items():
        if name == MODEL:
            ready[name] = validate_model(saved[name], obj, f"{where} [{name}]",
                                         dtypes=intent == "continue",
                                         live=walked.live_tensors() if obj is model else None,
                                         fresh=fresh)
        elif name == OPTIMIZER:
            ready[name] = optimizer_state_to_torch(saved[name], model, obj, f"{where} [{name}]",
                                                   walked.param_names())
        elif isinstance(obj, Stateful) and not isinstance(saved[name], Mapping):
            raise CorruptCheckpoint(f"{where}: part {name!r} is not a mapping")
        elif name.startswith(EXTRA_PREFIX) and isinstance(obj, torch.optim.Optimizer):
            ready[name] = checked_param_names(saved[name], model, obj, f"{where} [{name}]",
                                              walked.param_names())
        elif name in (SCHEDULER, SCALER):
            state = ready[name]
            live, got = set(obj.state_dict()), set(state)
            if live - got:
                raise MissingState(f"{where}: {name} state lacks {sorted(live - got)}; it was "
                                   f"written by a different {type(obj).__name__} configuration")
            if name == SCALER and got - live:  # (a disabled GradScaler has no state at all)
                raise StateMismatch(f"{where}: the saved {name} state holds "
                                    f"{sorted(map(str, got - live))}, which the live "
                                    f"{type(obj).__name__} has not (is it disabled?); build it "
                                    "as in the saved run")
    for name in (SCHEDULER, SCALER):  # (after: a value no run holds is corrupt, not changed)
        obj = parts.get(name)
        if isinstance(obj, Stateful) and type(obj).__module__.startswith("torch."):
            _same_kinds(ready[name], obj.state_dict(), f"{where} [{name}]")
    return ready


def _same_kinds(saved: Mapping[str, Any], live: Mapping[str, Any], where: str) -> None:
    """A scheduler or scaler setting that the live object holds as a number and the saved
    state as something else (a string, a list): torch would take it, and fail or compute
    nonsense at the next step."""
    for key, value in live.items():
        got = saved.get(key)
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and got is not None and number(got) is None):
            raise StateMismatch(f"{where}: {key!r} is {show(got)}, where the live "
                                f"{type(value).__name__} is {show(value)}; build it as in the "
                                "saved run")


def _param_shapes(ready: Mapping[str, Any], parts: Mapping[str, Any],
                  walked: LiveModel | None = None) -> dict[str, Any] | None:
    """What each parameter's optimizer state must fit: the shape of the saved model tensor
    of that name, as a layout (a module that saves its own way may store a parameter
    transposed or flattened: `optimizer_state_problems` with ``saved_layout``), or the live
    parameter itself where it holds as many elements (then the state must mirror it
    exactly); None without a model part. (A live parameter of another size is the model's
    mismatch, which the model's check names; an uninitialized lazy one has no shape yet.)
    ``walked``: the live model's walk, whose parameters are read where it lists them as
    ``named_parameters`` does (10,000 small tensors: torch's generators cost ~2 ms)."""
    saved = ready.get(MODEL) if MODEL in parts else None
    if not isinstance(saved, Mapping):
        return None
    plain = torch.Tensor
    shapes: dict[str, Any] = {k: v.shape for k, v in saved.items()
                              if type(v) is plain or isinstance(v, plain)}
    live = parts[MODEL]
    if walked is not None and walked.model is live and walked.lists:
        ids = walked.names  # (every parameter's id: the walk's tensors are its buffers too)
        pairs: Any = ((n, t) for n, t in walked.tensors.items() if id(t) in ids)
    elif isinstance(live, torch.nn.Module):
        pairs = live.named_parameters(remove_duplicate=False)
    else:
        return shapes
    for name, p in pairs:
        layout = shapes.get(name)
        if layout is not None and not is_lazy(p) and (
                layout == p.shape or math.prod(layout) == p.numel()):
            shapes[name] = p
    return shapes


def _refuse_malformed(saved: Mapping[str, Any], ready: Mapping[str, Any],
                      parts: Mapping[str, Any], where: str,
                      walked: LiveModel | None = None) -> None:
    """Refuse, as corrupt, a torch optimizer, LR scheduler or GradScaler state that torch's
    own classes never hold (`wellformed`): a writer's bug or a forged generation, which
    torch would load and fail on (or follow silently) at the next step."""
    problems: list[str] = []
    state_json = os.path.join(where, STATE_FILE)
    opt = saved.get(OPTIMIZER) if OPTIMIZER in parts else None
    groups = None
    if (isinstance(opt, Mapping) and isinstance(opt.get("state"), Mapping)
            and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, Mapping) for g in opt["param_groups"])):
        # (another layout: optimizer_state_to_torch refuses it, naming what it found)
        cls, at = opt.get("class"), f"{where} [{OPTIMIZER}]"
        groups = len(opt["param_groups"])
        json_at = f"{state_json} [{OPTIMIZER}]"  # (its values other than tensors)
        shapes = _param_shapes(ready, parts, walked)
        problems += optimizer_state_problems(cls, opt["state"], opt["param_groups"], shapes,
                                             at, json_at, saved_layout=True)
        if isinstance(cls, str) and cls.startswith(TORCH_OPTIM):  # (others: their business)
            for gi, group in enumerate(opt["param_groups"]):  # (a negative lr: see SCHEDULED)
                group_problems(cls, group, gi, at, json_at, problems, scheduled=False)
    if SCHEDULER in parts and isinstance(parts[SCHEDULER], Stateful):
        scheduler_problems(ready[SCHEDULER], "scheduler", groups,
                           f"{state_json} [{SCHEDULER}]", problems, parts[SCHEDULER].state_dict())
    if SCALER in parts and isinstance(parts[SCALER], Stateful):
        scaler_problems(ready[SCALER], f"{state_json} [{SCALER}]", problems)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CorruptCheckpoint("; ".join(problems[:3]) + more + "; torch's own classes never "
                                "hold such a state: the generation is refused")


def scheduler_class(scheduler: Any) -> str:
    """A scheduler's class, with those of the schedulers it chains (SequentialLR,
    ChainedScheduler), as the scheduler part records it beside its state."""
    kind = type(scheduler)
    name = f"{kind.__module__}.{kind.__qualname__}"
    inner = getattr(scheduler, "_schedulers", None)
    if isinstance(inner, (list, tuple)):
        name += "[" + ", ".join(scheduler_class(s) for s in inner) + "]"
    return name
