"""What a user hands the Checkpointer, checked before anything is written: its options,
metrics (real numbers, NaN and inf kept), every small part's state (a dict the format can
store, checked once when the Checkpointer is built, not hours in at the first save), extras'
names, and the steps the harness asks to save at."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ._pacing import Pacer
from .dist.sharded import split
from .errors import UnbrokenError, UnsupportedValue
from .state import generation as G
from .state import parts as S
from .state.codec import encode_tree
from .state.rng import RNGStreams

EXTRA_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}", re.ASCII)  # used with fullmatch


def check_options(async_save: object, read_back: object, async_timeout: float,
                  persist_share: float | None, every: object, trace_hash_every: object
                  ) -> bool:
    """The Checkpointer's options that take only some values, checked before anything is
    opened; whether a sync save reads back later (``read_back='background'``)."""
    if async_save not in (False, True, "thread", "process"):
        raise ValueError(f"async_save={async_save!r}: False, True (or 'thread') or 'process'")
    if read_back not in ("sync", "background"):
        raise ValueError(f"read_back={read_back!r}: 'sync' or 'background'")
    later = read_back == "background" and not async_save
    if (async_save or later) and not 0 < async_timeout < math.inf:
        raise ValueError(f"async_timeout={async_timeout!r}: a finite number of seconds > 0")
    if persist_share is not None:
        if not (async_save or later):
            raise ValueError("persist_share paces the background part of a save; "
                             "read_back='sync' leaves none (use read_back='background' "
                             "or an async save)")
        Pacer(persist_share)  # validates it
    if every is not None and (type(every) is not int or every < 1):
        raise ValueError(f"every={every!r}: save every N completed updates, N >= 1, or None")
    if type(trace_hash_every) is not int or trace_hash_every < 1:
        raise ValueError(f"trace_hash_every={trace_hash_every!r}: an int >= 1")
    return later


def steps_from_env(name: str) -> frozenset[int]:
    """Comma-separated step numbers from the environment variable ``name``."""
    value = os.environ.get(name, "")
    try:
        return frozenset(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UnbrokenError(f"${name}={value!r}: expected comma-separated step numbers") from None


def dry_encode(parts: Mapping[str, Any]) -> None:
    """Capture and encode every part once, so that a value the format cannot store (a deque,
    a set) is named with its part and key when the Checkpointer is built, not at the first
    save. Of the model and the optimizer, only what else than tensors they hold is encoded,
    read without calling their ``state_dict()`` (whose hooks may change the live state, as
    a hook narrowing an optimizer's moments does): each module's extra state, each parameter
    group's settings."""
    small = {name: obj for name, obj in parts.items() if name not in (S.MODEL, S.OPTIMIZER)}
    trees = S.capture(small, torch.nn.Module())
    model, optimizer = parts.get(S.MODEL), parts.get(S.OPTIMIZER)
    if isinstance(model, torch.nn.Module):
        trees[S.MODEL] = {f"{prefix}{'.' if prefix else ''}_extra_state": m.get_extra_state()
                          for prefix, m in model.named_modules()
                          if type(m).get_extra_state is not torch.nn.Module.get_extra_state}
    if isinstance(optimizer, torch.optim.Optimizer):
        trees[S.OPTIMIZER] = {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                               for g in optimizer.param_groups]}
    # (DTensors are taken out of the dicts, as a save takes them out for DCP)
    for name, tree in split(trees)[0].items():
        try:
            if name not in (S.MODEL, S.OPTIMIZER):  # (those two: parts of their trees)
                G.check_part_tree(name, tree)
            encode_tree(tree, "")
        except UnsupportedValue as e:
            raise UnsupportedValue(f"part {name!r}: {e}") from None  # (it says what to do)


def same_number(a: float | None, b: float) -> bool:
    """Equal floats, NaN equal to NaN (a stored NaN metric against a new one)."""
    return a == b or (a is not None and math.isnan(a) and math.isnan(b))


def metric(name: str, value: object) -> float:
    """A metric as a float (NaN and inf are kept: an AMP overflow step has a NaN loss), or
    ``UnsupportedValue`` naming it: checked before anything is written."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedValue(f"metric {name!r}: a tensor of {value.numel()} elements; "
                                   "pass one number")
        value = value.detach().item()
    if (isinstance(value, (bool, complex, np.complexfloating))
            or not isinstance(value, (int, float, np.number))):
        raise UnsupportedValue(f"metric {name!r}: {type(value).__name__} {value!r:.40}; "
                               "metrics are real numbers")
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        shown = f"an int of {len(str(value))} digits" if isinstance(value, int) else \
            f"{value!r:.40}"
        raise UnsupportedValue(f"metric {name!r}: {shown} does not fit a float") from None


def parts_of(model: Any, optimizer: Any, scheduler: Any, scaler: Any, data: Any,
             extras: Mapping[str, Any] | None, generators: Mapping[str, Any] | None,
             counters: Any) -> dict[str, Any]:
    """A Checkpointer's parts by name (`state.parts`), each checked to be `Stateful`."""
    parts: dict[str, Any] = {S.MODEL: model}
    for name, obj in ((S.OPTIMIZER, optimizer), (S.SCHEDULER, scheduler),
                      (S.SCALER, scaler), (S.DATA, data)):
        if obj is not None:
            parts[name] = obj
    for name, obj in (extras or {}).items():
        if not isinstance(name, str) or not EXTRA_NAME.fullmatch(name):
            raise ValueError(f"extras name {name!r}: use letters, digits, '_' or '-'")
        if isinstance(obj, S.PerRank):  # (which ones: `per_rank_parts`)
            obj = obj.state
        if not isinstance(obj, S.Stateful):
            raise TypeError(f"extras[{name!r}] needs state_dict() and load_state_dict()")
        parts[S.EXTRA_PREFIX + name] = obj
    for name, obj in parts.items():
        if name != S.MODEL and not isinstance(obj, S.Stateful):
            raise TypeError(f"{name} needs state_dict() and load_state_dict()")
    parts[S.RNG] = RNGStreams(generators or {})
    parts[S.COUNTERS] = counters
    return parts


def per_rank_parts(extras: Mapping[str, Any] | None) -> frozenset[str]:
    """The parts of ``extras`` that each rank of a job holds its own of (`state.parts.PerRank`)."""
    return frozenset(S.EXTRA_PREFIX + name for name, obj in (extras or {}).items()
                     if isinstance(obj, S.PerRank))
