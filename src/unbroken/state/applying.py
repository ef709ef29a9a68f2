"""Validated state into the live objects, all or nothing (`apply`): the small parts first,
put back from a copy if one refuses, then the optimizer and the model, whose saved tensors are
copied into the live ones (from mapped files where the restore mapped them)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..errors import CorruptCheckpoint, StateMismatch, UnbrokenError, UnsupportedValue
from .fresh import load_but_kept
from .livemodel import LiveModel, with_versions
from .optim import load_optimizer_state
from .parts import EXTRA_PREFIX, MODEL, OPTIMIZER, RNG, Stateful


class Copier(Protocol):
    """Copies saved tensors that are views into mapped files (`store.backends._mapped`)."""

    def copy(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor: ...

    def holds(self, t: torch.Tensor) -> bool: ...

    def maps(self) -> bool: ...

    def release(self, t: torch.Tensor) -> None: ...

    def finish(self) -> None: ...

    def verify_unhashed(self, drop: bool = False) -> None: ...


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
                if mapped is not None:  # (its own code reads the saved tensors: verified first)
                    mapped.verify_unhashed()
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
            # (too large to have copies)
            changed = " and ".join(p for p in big if p in [*done, name])
            are, them = ("are", "them") if " and " in changed else ("is", "it")
            if name in big and isinstance(e, CorruptCheckpoint):  # (a mapped file changed)
                raise CorruptCheckpoint(
                    f"part {name!r}: {e}; the {changed} {are} partly restored now: "
                    f"build {them} anew (restart) before restoring again, which refuses the "
                    "file by its hash if it changed and uses the previous verified "
                    "generation") from e
            if name in big and isinstance(e, OSError):  # reading the verified file failed
                raise UnbrokenError(
                    f"part {name!r}: reading the saved state into the live objects failed "
                    f"({e}); the {changed} {are} partly restored now: build {them} "
                    "anew (restart) before restoring again") from e
            if name in big:  # (its own load_state_dict may have copied some tensors)
                before = " (the optimizer was restored already)" if OPTIMIZER in done else ""
                raise StateMismatch(
                    f"part {name!r}: {type(obj).__name__}.load_state_dict refused the saved "
                    f"state ({_said(e)}){before}; the {changed} may be partly "
                    f"restored now: build {them} anew (restart) before restoring again") from e
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
