"""A torch optimizer passed among the extras (a second optimizer: AdamW for the biases and
norms beside Muon for the matrices) is saved by its own ``state_dict``, whose state torch
keys by position. The names of the parameters each position held are saved beside it, so a
restore into an optimizer whose parameters are in another order, or are others, is refused,
naming the first difference, instead of putting moments onto the wrong parameters (the
Checkpointer's own optimizer is saved by name: `optim`). A generation saved without them
(before session 27) is loaded as it was."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint, StateMismatch
from .optim import first_diff, live_group_names

PARAM_NAMES = "unbroken.param_names"


def with_param_names(state: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     names: dict[int, str] | None) -> Any:
    """``optimizer.state_dict()`` (``state``) and, beside it, each param group's parameters by
    their names in ``model`` (a tensor outside the model by its group and position)."""
    if not isinstance(state, Mapping):
        return state
    return {**state, PARAM_NAMES: live_group_names(model, optimizer, names)}


def checked_param_names(saved: Any, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, where: str,
                        names: dict[int, str] | None) -> Any:
    """The saved state for ``optimizer.load_state_dict``, after its parameters' names were
    compared with the live optimizer's (`StateMismatch` naming the first difference)."""
    if not isinstance(saved, Mapping) or PARAM_NAMES not in saved:
        return saved
    recorded = saved[PARAM_NAMES]
    if not (isinstance(recorded, list) and all(
            isinstance(g, list) and all(isinstance(n, str) for n in g) for g in recorded)):
        raise CorruptCheckpoint(f"{where}: {PARAM_NAMES!r} is not a list of lists of names")
    live = live_group_names(model, optimizer, names)
    if recorded != live:
        raise StateMismatch(
            f"{where}: this optimizer's parameters differ from the saved run's: saved "
            f"{first_diff(recorded, live)}; its state is kept by position, so it would land "
            "on other parameters. Build it over the parameters of the saved run, in their "
            "order (or warm_start)")
    return {k: v for k, v in saved.items() if k != PARAM_NAMES}
