"""The settings a continuation restores over the live ones: each hyperparameter the run's
script now sets otherwise is silently replaced by the saved value, so every change is said."""

from __future__ import annotations

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
            same = (torch.equal(a, b) if isinstance(a, torch.Tensor) and
                    isinstance(b, torch.Tensor) else _plain(a) == _plain(b))
            if not same:
                out.append(f"optimizer param group {gi} {key!r}: saved {shown(_plain(a))}, "
                           f"live {shown(_plain(b))}")
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return list(value) if isinstance(value, tuple) else value
