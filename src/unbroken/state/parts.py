"""Named state parts -> one state tree per generation, and back (the model and optimizer by
parameter name: see `optim`).

A part is anything with ``state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol);
the model and optimizer get special handling so that optimizer state is keyed by parameter
*name* (torch maps it by position, which silently mis-maps a reordered model). Loading is split
into ``validate_*`` (reads only) and ``apply`` so that nothing live changes until the whole
generation has been checked. The tree's files are `generation`'s."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import (
    CorruptCheckpoint,
    MissingState,
    StateMismatch,
    UnbrokenError,
    UnsupportedValue,
    shown,
)
from .extraoptim import checked_param_names, with_param_names
from .fresh import load_but_kept
from .livemodel import LiveModel, with_versions
from .modelcheck import validate_model
from .optim import load_optimizer_state, optimizer_state, optimizer_state_to_torch
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
    _refuse_malformed(saved, ready, parts, where)
    if walked is None:
        walked = LiveModel(model)
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


def _refuse_malformed(saved: Mapping[str, Any], ready: Mapping[str, Any],
                      parts: Mapping[str, Any], where: str) -> None:
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
        model = ready.get(MODEL) if MODEL in parts else None  # (its tensors: their shapes)
        cls, at = opt.get("class"), f"{where} [{OPTIMIZER}]"
        groups = len(opt["param_groups"])
        json_at = f"{state_json} [{OPTIMIZER}]"  # (its values other than tensors)
        problems += optimizer_state_problems(
            cls, opt["state"], opt["param_groups"],
            model if isinstance(model, Mapping) else None, at, json_at)
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


class Copier(Protocol):
    """Copies saved tensors that are views into mapped files (`store.backends._mapped`)."""

    def copy(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor: ...

    def holds(self, t: torch.Tensor) -> bool: ...

    def maps(self) -> bool: ...

    def release(self, t: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


def apply(ready: Mapping[str, Any], parts: Mapping[str, Any],
          mapped: Copier | None = None, walked: LiveModel | None = None,
          fresh: bool = False) -> None:
    """Load validated state into the live objects, all or nothing.

    The small parts (extras, scheduler, scaler, data, RNG, counters) go first: their
    ``load_state_dict`` can still refuse in ways no validation foresees, and if one does, those
    already loaded are put back from a copy. The optimizer and the model, fully validated and
    too large to copy, go last. With ``mapped``, the model's and optimizer's saved tensors
    are views into mapped files: each is copied into the live tensor (or a new one) by
    ``mapped.copy``; none is kept. ``walked``: the model's walk made for this restore
    (`validate_parts`), which the model's structure still is. ``fresh``: a warm start that
    keeps some of the model as it is (`state.fresh`): the live names the saved model state
    lacks are left out of the load, untouched."""
    if mapped is not None and not mapped.maps():
        mapped = None  # (no file was mapped: the copies need none of its bookkeeping)
    big = (OPTIMIZER, MODEL)
    order = sorted((p for p in parts if p not in big),
                   key=lambda p: not p.startswith(EXTRA_PREFIX)) + [p for p in big if p in parts]
    backup = {n: _own(parts[n].state_dict(), n) for n in order
              if n not in big and isinstance(parts[n], Stateful)}
    again = MODEL in parts or OPTIMIZER in parts  # (the RNG streams are set again at the end)
    done: list[str] = []
    for name in order:
        obj = parts[name]
        if not isinstance(obj, Stateful):
            continue
        try:
            if name == MODEL and (walked is None or walked.model is not obj
                                  or any(p.startswith(EXTRA_PREFIX) for p in done)):
                # (an extra's load_state_dict may have changed the model since it was walked)
                walked = LiveModel(obj)
            if name == MODEL and walked is not None and walked.loads:
                _copy_into(walked, ready[name], mapped)
            elif name == OPTIMIZER:
                load_optimizer_state(obj, ready[name], mapped)  # type: ignore[arg-type]
            elif name == MODEL and fresh:
                load_but_kept(obj, ready[name], walked or LiveModel(obj))
            elif name in big:
                obj.load_state_dict(with_versions(obj, ready[name]))
                if name == MODEL and mapped is not None:
                    for t in ready[name].values():  # copied by load_state_dict
                        if isinstance(t, torch.Tensor):  # (not a module's extra state)
                            mapped.release(t)
            else:  # (a small part keeps what it is given: its own copy, not views of a
                # file's buffer, which it could not resize)
                load = obj.load_state_dict
                if name == RNG and again:  # (spawn counts cannot be put back: set last)
                    load = getattr(obj, "load_streams", load)
                state = _own(ready[name], name)
                load(with_versions(obj, state) if isinstance(state, Mapping) else state)
            if name in big and mapped is not None:
                mapped.finish()  # large tensors are read in the background
        except Exception as e:
            for prev in reversed([*done, name]):
                if prev in backup:
                    try:
                        parts[prev].load_state_dict(backup[prev])
                    except Exception:  # noqa: BLE001 - best effort; the error below says why
                        pass
            changed = [p for p in big if p in [*done, name]]  # (too large to have copies)
            if name in big and isinstance(e, OSError):  # reading the verified file failed
                raise UnbrokenError(
                    f"part {name!r}: reading the saved state into the live objects failed "
                    f"({e}); the {' and '.join(changed)} are partly restored now: build them "
                    "anew (restart) before restoring again") from e
            if name in big:  # (its own load_state_dict may have copied some tensors)
                before = " (the optimizer was restored already)" if OPTIMIZER in done else ""
                raise StateMismatch(
                    f"part {name!r}: {type(obj).__name__}.load_state_dict refused the saved "
                    f"state ({_said(e)}){before}; the {' and '.join(changed)} may be partly "
                    "restored now: build them anew (restart) before restoring again") from e
            raise StateMismatch(f"part {name!r}: {type(obj).__name__}.load_state_dict refused "
                                f"the saved state ({_said(e)}); nothing was changed") from e
        done.append(name)
    if again and RNG in done:
        # The streams again, last: a load hook of the model (a smoke-test forward) may have
        # drawn from them since (set first, they fail before any large part changes).
        parts[RNG].load_state_dict(ready[RNG])


def _own(tree: Any, part: str) -> Any:
    """A copy of a small part's state that shares no memory with it: each tensor detached
    and cloned (a deepcopy refuses one in an autograd graph, and a view of a file's buffer
    cannot be resized), the rest deep-copied."""
    memo: dict[int, Any] = {}
    stack, seen = [tree], 0
    while stack and seen < 1_000_000:  # (the tensors, for the memo: containers only)
        node = stack.pop()
        seen += 1
        if isinstance(node, torch.Tensor):
            copied = node.detach().clone()  # (a leaf keeps its requires_grad, a parameter
            if isinstance(node, torch.nn.Parameter):  # its class)
                copied = torch.nn.Parameter(copied, requires_grad=node.requires_grad)
            elif node.requires_grad and node.is_leaf:
                copied.requires_grad_(True)
            memo[id(node)] = copied
        elif isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    try:
        return copy.deepcopy(tree, memo)
    except Exception as e:  # noqa: BLE001 -- a lock, a generator, an open file: typed
        raise UnsupportedValue(f"part {part!r}: its state cannot be copied ({type(e).__name__}"
                               f": {e!s:.200}); return tensors, numbers, strings, bytes, "
                               "lists, tuples or dicts from state_dict()") from None


def _copy_into(walked: LiveModel, saved: Mapping[str, torch.Tensor],
               mapped: Copier | None = None) -> None:
    """``model.load_state_dict(saved)`` for a model that `LiveModel.loads`, whose keys,
    shapes and dtypes `validate_model` already checked (``mapped.copy`` when given). Without
    ``nn.Module.load_state_dict``'s per-child scan of every key, which is quadratic in the
    number of children (2 s for 1,250 layers of a Sequential)."""
    pairs = walked.tensors
    if len(saved) < len(pairs):  # (a warm start keeping some names as they are: `fresh`)
        pairs = {k: t for k, t in pairs.items() if k in saved}
    if not pairs:  # (a model without state: nothing to copy, and no list for _foreach_copy_)
        return
    with torch.no_grad():
        if mapped is None:  # (one call for all: a Python loop of copy_ costs ~1 us a tensor)
            dst, src = list(pairs.values()), [saved[name] for name in pairs]
            try:
                torch._foreach_copy_(dst, src)
            except RuntimeError:  # (it refuses lazy conjugate or negative views: each copy_)
                for d, s in zip(dst, src, strict=True):
                    d.copy_(s)
            return
        for name, live in pairs.items():
            mapped.copy(saved[name], live)


def _said(e: BaseException) -> str:
    """An error of a part's own code, for a message: a KeyError's text alone is its key."""
    return f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, IndexError)) else str(e)
