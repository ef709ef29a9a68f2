"""A warm start that leaves part of the model as it is live (``restore(intent="warm_start",
fresh=[...])``): a new head, a layer of another shape, a layer the checkpoint lacks or one
the new model dropped. Which names a pattern means, which live tensors are kept and which
saved ones dropped, and what makes keeping one unsafe."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from itertools import chain
from typing import Any

import torch

from ..errors import StateMismatch
from .livemodel import LiveModel, with_versions
from .names import served_name
from .views import UNINITIALIZED


def check_patterns(fresh: Iterable[str] | None, intent: str) -> tuple[str, ...]:
    """``restore(fresh=...)`` checked before anything is read: glob patterns (strings), for a
    warm start only (a continuation restores every tensor it saved)."""
    if fresh is None:
        return ()
    if isinstance(fresh, (bytes, bytearray)):
        raise ValueError(f"fresh={fresh!r}: a list of glob patterns (str), e.g. ['head.*']")
    patterns = (fresh,) if isinstance(fresh, str) else tuple(fresh)
    if patterns and intent != "warm_start":
        raise ValueError(f"fresh={list(patterns)!r} is for intent='warm_start': a "
                         "continuation restores every saved tensor")
    bad = [p for p in patterns if type(p) is not str or not p]
    if bad:
        raise ValueError(f"fresh={bad!r}: each is a glob pattern of model names, a non-empty "
                         "str (e.g. 'head.*')")
    return patterns


def _matcher(fresh: tuple[str, ...], names: set[str]) -> Callable[[str], bool]:
    """Whether a name is one ``fresh`` means. Names and patterns are compared both as they
    are and as served (without torch.compile's ``_orig_mod.`` segments: a compiled model
    saved, warm-started uncompiled, or back). A pattern that is itself a name (``names``,
    either form) means that name alone: a module key may hold ``[``, which a glob reads as
    a set; any other is a glob (`fnmatchcase`)."""
    forms = [(p, served_name(p)) for p in fresh]
    literal = {f for p, sp in forms if p in names or sp in names for f in (p, sp)}
    globs = [(p, sp) for p, sp in forms if p not in names and sp not in names]

    def matched(name: str) -> bool:
        served = served_name(name)
        return (name in literal or served in literal
                or any(fnmatchcase(name, p) or fnmatchcase(served, sp) for p, sp in globs))
    return matched


def fresh_names(saved: Mapping[str, Any], live: Mapping[str, Any], fresh: tuple[str, ...],
                where: str) -> tuple[dict[str, Any], frozenset[str]]:
    """(The saved model state to load, the live names kept as they are): every name either
    side has that ``fresh`` matches is left out of the load. A pattern that matches no name
    on either side is refused (a misspelt name would load what it meant to keep), and so is
    a kept tensor whose memory a loaded one shares (tied weights, a view: loading the other
    would overwrite it)."""
    names = {*live, *saved}
    names |= {served_name(k) for k in names}
    matched = _matcher(fresh, names)
    unused = [p for p in fresh
              if not any(_matcher((p,), names)(k) for k in (*live, *saved))]
    if unused:
        raise StateMismatch(
            f"{where}: fresh={unused!r} matches no name of the live model or of the "
            f"checkpoint (live names: {_some(list(live))}; saved: {_some(list(saved))}); "
            "name the tensors to keep as the model's state_dict() names them (a name "
            "holding '[' is matched literally when given whole; in a glob write '[[]')")
    kept = frozenset(k for k in live if matched(k))
    _refuse_shared(live, kept, where)
    return {k: v for k, v in saved.items() if not matched(k)}, kept


def load_but_kept(model: Any, state: Mapping[str, Any], walked: LiveModel) -> None:
    """``model.load_state_dict`` for a warm start that keeps some names as they are, of a
    model that loads its own way (hooks, its own method: `LiveModel.loads`). Its own code
    may need every name it lists (a load hook reading its keys, ``spectral_norm``), so each
    kept name is given its live value, strict as any load (an extra state a copy of it: a
    ``set_extra_state`` that clears its state first would clear it); the kept parameters and
    buffers are then put back from copies taken before, bitwise (hooks may transform what
    they save and load). A lazy one, which takes no value of its own, is left out of the
    load instead, which is then not strict: every name it did not load must be one left
    out."""
    live = walked.live_tensors()
    given, lazy = dict(state), set()
    for k, v in live.items():
        if k in state:
            continue
        if isinstance(v, UNINITIALIZED):
            lazy.add(k)
        else:
            given[k] = v if isinstance(v, torch.Tensor) else _copied(v)
    kept = set(live) - set(state)
    named = getattr(model, "named_parameters", None)
    own = (chain(named(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
           if named is not None else ())
    backup = [(t, t.detach().clone()) for name, t in own
              if name in kept and _span(t) is not None]
    try:
        result = model.load_state_dict(with_versions(model, given), strict=not lazy)
    finally:  # (a load that failed midway leaves the kept ones as they were, at least)
        with torch.no_grad():
            for t, before in backup:
                t.copy_(before)
    missing = set(getattr(result, "missing_keys", ())) - lazy
    unexpected = list(getattr(result, "unexpected_keys", ()))
    if lazy and (missing or unexpected):  # (its own code disagreed with its names)
        raise StateMismatch(f"the model's load_state_dict did not take {sorted(missing)[:5]} "
                            f"and refused {unexpected[:5]}, which its state_dict() names")


def _copied(value: Any) -> Any:
    """A copy of a kept module's extra state, for its ``set_extra_state`` (itself where it
    cannot be copied)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 -- a lock, a generator: given as it is
        return value


def _refuse_shared(live: Mapping[str, Any], kept: frozenset[str], where: str) -> None:
    """A kept tensor whose bytes a loaded one's overlap (one tensor under two names, a slice
    or a transpose of a loaded weight): loading the other would change it."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    mine: list[tuple[int, int, int, str]] = []
    for k, t in live.items():
        span = _span(t)
        if span is None:
            continue
        if k in kept:
            mine.append((*span, k))
        else:
            spans.setdefault(span[0], []).append((span[1], span[2], k))
    for storage, lo, hi, k in mine:
        for olo, ohi, other in spans.get(storage, ()):
            if lo < ohi and olo < hi:
                raise StateMismatch(
                    f"{where}: fresh keeps {k!r}, whose memory the live model shares with "
                    f"{other!r} (tied, or a view of it), which the warm start loads: name both "
                    "in fresh, or neither")


def _span(t: Any) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of the memory a live tensor's elements use;
    None for one without memory of its own (empty, meta, lazy, a subclass without storage,
    a module's extra state)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, UNINITIALIZED):
        return None
    try:
        if t.is_meta or not t.numel():
            return None
        size = t.element_size()
        first = int(t.storage_offset()) * size
        extent = 1 + sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True))
        storage = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, ValueError):
        return None
    return (storage, first, first + extent * size) if storage else None


def _some(names: list[str]) -> str:
    """The first few of ``names``, for a message."""
    return ", ".join(map(repr, names[:6])) + (f", ... ({len(names)} in all)"
                                              if len(names) > 6 else "")


def suggested(keys: Iterable[str]) -> list[str]:
    """The ``fresh`` patterns that would keep ``keys``: each one's module, as ``module.*``
    (a mismatched weight's bias goes with it; a ``[`` in it written ``[[]``, as a glob reads
    it), or the name itself at the top level."""
    out: list[str] = []
    for k in keys:
        module, dot, _ = k.rpartition(".")
        pattern = f"{module.replace('[', '[[]')}.*" if dot else k
        if pattern not in out:
            out.append(pattern)
    return out
