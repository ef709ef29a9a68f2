"""The settings a continuation restores over the live ones: each hyperparameter the run's
script now sets otherwise is silently replaced by the saved value, so every change is said."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import shown

# Param-group fields a learning-rate scheduler moves at every step: their live value in a
# freshly built run is the schedule's start, not a choice of the user. The base values the
# scheduler keeps (initial_lr, max_lr, base_momentum, ...) are compared instead.
_SCHEDULED = frozenset({"lr", "momentum", "betas"})


def param_group_changes(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                        scheduled: bool = False) -> list[str]:
    """Each hyperparameter (param-group field) whose live value differs from the saved one:
    a continuation silently restores the saved value, so the change must at least be said.
    ``scheduled``: a scheduler drives the rates (see ``_SCHEDULED``)."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    skip = {"params", *(_SCHEDULED if scheduled else ())}
    out = []
    for gi, (old, live) in enumerate(zip(groups or [], optimizer.param_groups)):
        if not isinstance(old, Mapping):
            continue
        for key in sorted(k for k in live if k not in skip and k in old):
            a, b = old[key], live[key]
            if not _same(a, b):
                out.append(f"optimizer param group {gi} {key!r}: saved {shown(_plain(a))}, "
                           f"live {shown(_plain(b))}")
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return list(value) if isinstance(value, tuple) else value


# The keys of torch's schedulers' state that move as the schedule runs (or that hold the
# user's own objects): a freshly built scheduler differs there from any saved one by design.
# Every other key is the schedule's configuration (gamma, T_max, milestones, total_steps...).
# ``base_lrs`` is the groups' ``initial_lr``, which `param_group_changes` names already.
_PROGRESS = frozenset({
    "last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial",
    "T_cur", "T_i", "best", "num_bad_epochs", "cooldown_counter", "lr_lambdas",
    "_scale_fn_ref", "_scale_fn_custom", "_schedulers", "base_lrs"})
_TORCH_SCHEDULERS = frozenset({"torch.optim.lr_scheduler", "torch.optim.swa_utils"})


def scheduler_changes(saved: Any, scheduler: Any, name: str = "scheduler") -> list[str]:
    """Each setting of a torch scheduler (and of those it chains) whose live value differs
    from the saved one, which a continuation restores silently. Only torch's own schedulers
    are compared: which keys of another scheduler's state are settings is not known."""
    if type(scheduler).__module__ not in _TORCH_SCHEDULERS or not isinstance(saved, Mapping):
        return []
    live = scheduler.state_dict()
    out = []
    for key in sorted(k for k in live if isinstance(k, str) and k not in _PROGRESS
                      and k in saved):
        a, b = saved[key], live[key]
        if not _same(a, b):
            out.append(f"{name} {key!r}: saved {shown(_plain(a))}, live {shown(_plain(b))}")
    inner, got = getattr(scheduler, "_schedulers", None), saved.get("_schedulers")
    if isinstance(inner, (list, tuple)) and isinstance(got, list) and len(got) == len(inner):
        for i, (s, g) in enumerate(zip(inner, got)):
            out += scheduler_changes(g, s, f"{name} {i} ({type(s).__name__})")
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal settings: tensors by value, tuples as lists, containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = _plain(a), _plain(b)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- an object whose == raises: not the same
        return False


def live_settings(optimizer: Any, scheduler: Any) -> tuple[list[dict[str, Any]], Any]:
    """What `param_group_changes` and `scheduler_changes` compare with, as it is now: the
    optimizer's hyperparameters by group and the scheduler's state (copies; best effort, for
    the warnings only: what cannot be copied is left out)."""
    try:
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in getattr(optimizer, "param_groups", [])]
    except Exception:  # noqa: BLE001 -- an odd hyperparameter: the warnings may be off
        groups = []
    try:
        state = getattr(scheduler, "state_dict", None)
        saved = copy.deepcopy(state()) if callable(state) else None
    except Exception:  # noqa: BLE001 -- (apply refuses such a state itself, typed)
        saved = None
    return groups, saved


def put_back_settings(optimizer: Any, scheduler: Any,
                      settings: tuple[list[dict[str, Any]], Any]) -> None:
    """Set the optimizer's hyperparameters and the scheduler's state back to `live_settings`'
    ``settings`` (after a restore that loaded some of a generation it then refused; best
    effort: the next generation's load sets them all anyway)."""
    groups, state = settings
    for group, before in zip(getattr(optimizer, "param_groups", []), groups, strict=False):
        group.update(copy.deepcopy(before))
    if state is not None:
        try:
            scheduler.load_state_dict(copy.deepcopy(state))
        except Exception:  # noqa: BLE001 -- (only the warnings compare with it)
            pass
