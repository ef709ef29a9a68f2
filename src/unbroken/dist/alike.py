"""What every rank of a job must build its Checkpointer with alike, compared when it is built.

A save is collective: ranks that save at different steps (``every=``), exchange stop requests
at different updates (``signals=``, ``stop_check_every=``) or save in different modes
(``async_save=``, ``read_back=``, ``incremental=``) wait on each other, or on the training
loop's own collectives, until the process group's timeout. An `Identity` that differs on a
rank is worse: the generation records rank 0's, and every resume of that rank is refused.
One small all-gather, where every rank builds its Checkpointer, refuses all of these on every
rank, naming the setting and each rank's value, before anything is opened."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import IdentityMismatch, UnbrokenError, UnsupportedSetup
from ..state.identity import Identity
from .commit import describe, rebuild
from .group import Group


def check_alike(group: Group, settings: Mapping[str, Any], identity: Identity | None = None,
                call: str = "build every rank's Checkpointer") -> None:
    """Refuse, on every rank, ``settings`` (JSON-able, by the name a message shows: "every=",
    "$UNBROKEN_SAVE_AT") or an ``identity`` that differ across the ranks of ``group``
    (``call``: what the message asks to do alike): collective; every rank calls it at the
    same point."""
    if not group.active:
        return
    mine: dict[str, Any] = {"settings": dict(settings), "identity": {}}
    try:  # (a path that cannot be hashed on this rank fails every rank, named)
        if identity is not None:
            mine["identity"] = {field: [entry.get("kind"), entry.get("hash"),
                                        entry.get("summary"), entry.get("value")]
                                for field, entry in identity.fingerprint().items()}
    except (UnbrokenError, OSError) as e:
        mine = {"error": describe(e)}
    # (named by the call: ranks building a Checkpointer and calling restore() are told so)
    everyone = group.all_gather(mine, f"comparing the ranks' settings to {call}")
    for rank, theirs in enumerate(everyone):
        if "error" in theirs:
            raise rebuild(theirs["error"], rank)
    first = everyone[0]
    for name, value in first["settings"].items():
        if any(theirs["settings"].get(name) != value for theirs in everyone):
            raise UnsupportedSetup(
                f"{name} differs across the ranks of the job ({_by_rank(everyone, name)}); "
                f"{call} with the same {name} (the ranks save, stop and restore together: "
                "ranks that differ here would wait on each other until the process group's "
                "timeout, or go on from different states); nothing was done")
    for field in sorted(set().union(*(theirs["identity"] for theirs in everyone))):
        entries = [theirs["identity"].get(field) for theirs in everyone]
        odd = [r for r, entry in enumerate(entries)
               if (entry and entry[:2]) != (entries[0] and entries[0][:2])]
        if odd:
            raise IdentityMismatch(
                f"Identity differs across the ranks of the job in {field}: rank 0 has "
                f"{_shown(entries[0])}, rank {odd[0]} {_shown(entries[odd[0]])}"
                f"{_keys_differ(entries[0], entries[odd[0]])}"
                f"{f' (and {len(odd) - 1} more rank(s))' if len(odd) > 1 else ''}; give "
                f"every rank the same Identity (a generation records rank 0's, and every "
                "resume of a rank with another would be refused); nothing was done")


def _by_rank(everyone: list[dict[str, Any]], name: str) -> str:
    """``every=`` -> "2 on ranks 0, 2; 3 on rank 1"."""
    ranks: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone):
        ranks.setdefault(repr(theirs["settings"].get(name)), []).append(rank)
    return "; ".join(f"{value} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"
                     for value, r in ranks.items())


def _keys_differ(a: list[Any] | None, b: list[Any] | None) -> str:
    """The keys of two mappings (a config) whose values differ, named (values kept whole)."""
    if not (a and b and isinstance(a[3], dict) and isinstance(b[3], dict)):
        return ""
    keys = sorted(k for k in a[3].keys() | b[3].keys() if a[3].get(k) != b[3].get(k))
    return f", differing in key(s) {keys[:8]}" if keys else ""


def _shown(entry: list[Any] | None) -> str:
    return "none" if not entry else f"{entry[2] or entry[0]} (xxh3 {str(entry[1])[:12]})"
