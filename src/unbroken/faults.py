"""Deliberate defects, for demonstrations and for testing checkers (never set in normal use).

``$UNBROKEN_FAULT_DROP`` makes a continuation restore everything except the named parts
(comma-separated: optimizer, scheduler, scaler, data, rng, rng.<stream>,
rng.generators.<name>, extra.<name>, or weights_only; ``part@R`` drops it on rank R of a job
only). A normal restore still refuses a
checkpoint that lacks a part with `MissingState`: this switch only leaves live parts as they
are."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .errors import UnbrokenError
from .state import parts as S

DROP_ENV = "UNBROKEN_FAULT_DROP"
log = logging.getLogger("unbroken")


def drop_parts(parts: Mapping[str, Any], ready: dict[str, Any], spec: str, rank: int = 0
               ) -> dict[str, Any]:
    """The parts to apply, minus those named in ``spec`` (for this ``rank``). A dropped RNG
    stream keeps its live state (``ready`` is edited accordingly)."""
    parts = dict(parts)
    names = []
    for entry in (n.strip() for n in spec.split(",")):
        name, _, on = entry.partition("@")
        if on and not on.isdigit():
            raise UnbrokenError(f"${DROP_ENV}: {entry!r}: expected PART or PART@RANK")
        if name and (not on or int(on) == rank):
            names.append(name)
    if "weights_only" in names:
        names += [n for n in parts if n not in (S.MODEL, S.COUNTERS, S.RNG)] + [S.RNG]
    for name in names:
        if name == "weights_only":
            continue
        if name.startswith(S.RNG + "."):
            ready[S.RNG] = _keep_live_stream(parts[S.RNG], ready[S.RNG], name[len(S.RNG) + 1:])
        elif name in parts and name not in (S.MODEL, S.COUNTERS):
            del parts[name]
        else:
            raise UnbrokenError(f"${DROP_ENV}: cannot drop {name!r}; choose from "
                                f"{sorted(set(parts) - {S.MODEL, S.COUNTERS})}, "
                                "rng.<stream> or weights_only")
    if names:
        log.warning("fault injection: restoring without %s", ", ".join(sorted(set(names))))
    return parts


# Entries of the RNG part that are no stream of their own (a count, the registered ones')
_NOT_STREAMS = frozenset({"cuda_device_count", "generators"})


def _keep_live_stream(streams: Any, saved: Mapping[str, Any], stream: str) -> dict[str, Any]:
    live = streams.state_dict()
    rng = dict(saved)
    gens = live.get("generators") or {}
    if stream.startswith("generators.") and stream[len("generators."):] in gens:
        gen = stream[len("generators."):]
        rng["generators"] = {**rng.get("generators", {}), gen: gens[gen]}
    elif stream in live and stream not in _NOT_STREAMS:
        rng[stream] = live[stream]
    else:
        names = [*(k for k in sorted(live) if k not in _NOT_STREAMS),
                 *(f"generators.{g}" for g in sorted(gens))]
        raise UnbrokenError(f"${DROP_ENV}: no RNG stream {stream!r}; streams: {names}")
    return rng
