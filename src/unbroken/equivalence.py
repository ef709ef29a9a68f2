"""Compare an interrupted-and-resumed run's trace with the uninterrupted one.

The report names the first step and field that differ, the state part that explains it, every
other part that also differs at that step, and whether the difference is a **jump** at the
resume step (missing or wrong state) or a **drift** growing from tiny values (numerical
nondeterminism). Levels: exact (bitwise, the default), a tolerance (rtol/atol on loss, grad
norm and learning rate; digests of numerically drifting state are then not compared), or exact
for the first ``exact_steps`` updates after the resume and the tolerance after that."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field
from typing import Any

# Which state part explains a difference in each trace field.
PART_OF_FIELD = {"ids": "data position", "batch": "data", "lr": "scheduler",
                 "loss": "numerics", "grad_norm": "numerics", "params": "model"}
PART_OF_STATE = {"optimizer": "optimizer", "optimizer-meta": "optimizer",
                 "scheduler": "scheduler", "scaler": "scaler",
                 "data": "data position", "model": "model"}
_NUMERIC = ("loss", "grad_norm")
# Compared bitwise at every level: they do not drift with floating-point reduction order.
_ALWAYS_EXACT = ("ids", "batch")
# When several parts differ at the resume point, the one named first explains the most: a
# weights-only resume is above all a lost optimizer (seed 000's momentum example).
_PRIORITY = ("optimizer", "scheduler", "scaler", "data position", "rng", "extra", "model")
DRIFT_THRESHOLD = 1e-4  # relative loss difference below which a first difference is "tiny"
# What numerical nondeterminism moves; a difference anywhere else is different state.
_DRIFTS = frozenset({"loss", "grad_norm", "params", "state.optimizer", "state.scaler"})


@dataclass
class Divergence:
    """Where two traces first differ."""

    step: int
    field: str
    state_part: str
    # "jump": missing or wrong state at the resume; "drift": numerical nondeterminism growing
    # from tiny differences; "irreproducible": the runs differ before the interruption, so
    # the script itself is not deterministic (an unseeded stream, a nondeterministic kernel).
    kind: str
    # other differing fields/parts at that step
    also: list[str] = dataclass_field(default_factory=list)
    expected: Any = None
    found: Any = None


@dataclass
class Comparison:
    """The verdict for one resumed run against the reference."""

    verdict: str  # "equivalent" | "diverged" | "untested"
    resumed_from: int | None
    steps: int
    first_divergence: Divergence | None
    restore_differs: list[str]  # state parts whose digest at the resume point differs
    loss: list[tuple[int, float]]  # (step, loss) of the interrupted-and-resumed run
    loss_diff: list[tuple[int, float]]  # (step, |loss - reference loss|)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stitch(segments: Iterable[list[dict[str, Any]]]) -> tuple[dict[int, dict[str, Any]],
                                                               list[dict[str, Any]]]:
    """Merge the traces of successive processes of one run: a restore to step s discards the
    earlier process's updates after s (they are replayed). Returns (updates by step, restores)."""
    updates: dict[int, dict[str, Any]] = {}
    restores: list[dict[str, Any]] = []
    for records in segments:
        for r in records:
            if r["event"] == "restore":
                restores.append(r)
                for s in [s for s in updates if s > r["step"]]:
                    del updates[s]
            elif r["event"] == "update":
                updates[r["step"]] = r
    return updates, restores


def _flat(record: Mapping[str, Any]) -> dict[str, Any]:
    """Trace fields as flat names: ids, lr, loss, params, state.optimizer, rng.torch_cpu, ..."""
    out = {k: v for k, v in record.items() if k not in ("event", "step", "state", "rng",
                                                         "generation", "rejected")}
    out.update({f"state.{k}": v for k, v in (record.get("state") or {}).items()})
    out.update({f"rng.{k}": v for k, v in (record.get("rng") or {}).items()})
    return out


def _part(name: str) -> str:
    if name.startswith("rng."):
        return f"rng ({name[4:]})"
    if name.startswith("state."):
        key = name[6:]
        return PART_OF_STATE.get(key, key.replace("extra.", "extra "))
    return PART_OF_FIELD.get(name, name)


def _rank(part: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(_PRIORITY) if part.startswith(p)), len(_PRIORITY)), part


def _as_float(value: Any) -> float | None:
    if isinstance(value, str):
        try:
            return float.fromhex(value)
        except ValueError:
            return None
    return None


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rtol, atol) for x, y in zip(a, b))
    x, y = _as_float(a), _as_float(b)
    if x is None or y is None:
        return bool(a == b)
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= atol + rtol * abs(y)


def _differs(ref: Mapping[str, Any], got: Mapping[str, Any], exact: bool, rtol: float,
             atol: float) -> list[str]:
    a, b = _flat(ref), _flat(got)
    names = [n for n in a if n in b]  # a field absent on one side (hash cadence) is skipped
    if exact:
        return [n for n in names if a[n] != b[n]]
    out = []
    for n in names:
        if n in _ALWAYS_EXACT or n.startswith("rng.") or n == "state.data":
            if a[n] != b[n]:
                out.append(n)
        elif n in _NUMERIC or n == "lr":
            if not _close(a[n], b[n], rtol, atol):
                out.append(n)
        # parameter, optimizer and scaler digests drift with the numerics: not compared
    return out


def _loss_rel(ref: Mapping[str, Any], got: Mapping[str, Any]) -> float | None:
    x, y = _as_float(got.get("loss")), _as_float(ref.get("loss"))
    if x is None or y is None:
        return None
    return abs(x - y) / max(abs(y), 1e-30)


def compare(reference: list[dict[str, Any]], segments: list[list[dict[str, Any]]], *,
            rtol: float = 0.0, atol: float = 0.0, exact_steps: int | None = None) -> Comparison:
    """Compare the reference trace with a run made of one or more process ``segments``."""
    ref_updates, _ = stitch([reference])
    got_updates, restores = stitch(segments)
    resumes = [r for r in restores[1:]] if restores else []
    resumed_from = resumes[-1]["step"] if resumes else None
    tolerant = rtol > 0 or atol > 0
    loss: list[tuple[int, float]] = []
    loss_diff: list[tuple[int, float]] = []
    restore_differs: list[str] = []
    if resumes:
        # Did the restore bring back what the interrupted process had at that step? Compared
        # with that process's own record, so that numerical drift before the kill (on
        # nondeterministic hardware) is not mistaken for lost state.
        r = resumes[-1]
        saved_at = stitch(segments[:-1])[0].get(r["step"]) if len(segments) > 1 else None
        ref_at = saved_at or ref_updates.get(r["step"])
        if ref_at is not None:
            restore_differs = sorted({_part(n) for n in _differs(ref_at, r, True, 0, 0)
                                      if n.startswith(("rng.", "state.", "params"))}, key=_rank)
    first: Divergence | None = None
    steps = sorted(ref_updates)
    for step in steps:
        got = got_updates.get(step)
        ref = ref_updates[step]
        if got is None:
            first = first or Divergence(step, "missing", "run", "jump",
                                        expected="an update record", found=None)
            continue
        x, y = _as_float(got.get("loss")), _as_float(ref.get("loss"))
        if x is not None and y is not None:
            loss.append((step, x))
            loss_diff.append((step, abs(x - y)))
        if first is not None:
            continue
        exact = not tolerant or (exact_steps is not None and resumed_from is not None
                                 and resumed_from < step <= resumed_from + exact_steps)
        diff = _differs(ref, got, exact, rtol, atol)
        if not diff:
            continue
        at_resume = resumed_from is not None and step == resumed_from + 1
        rel = _loss_rel(ref, got)
        # Numerical nondeterminism moves the loss, gradients, parameters and the optimizer
        # and scaler state built from them; anything else differing means different state.
        jump = bool(restore_differs) or any(n not in _DRIFTS for n in diff) or (
            rel is not None and rel > DRIFT_THRESHOLD and at_resume)
        # State that already differed at the resume point explains whatever diverges later.
        parts = restore_differs if resumed_from is not None and step > resumed_from else []
        lead = diff[0]
        part = parts[0] if parts else _part(lead)
        also = sorted(({_part(n) for n in diff} | set(parts)) - {part}, key=_rank)
        kind = "jump" if jump else "drift"
        if resumed_from is not None and step <= resumed_from:
            kind = "irreproducible"
        first = Divergence(step, lead, part, kind, also,
                           _flat(ref).get(lead), _flat(got).get(lead))
    extra = [s for s in sorted(got_updates) if s > max(steps, default=0)]
    if first is None and extra:
        first = Divergence(extra[0], "extra", "run", "jump", expected=None,
                           found=f"{len(extra)} more update(s) than the uninterrupted run")
    if resumed_from is None or resumed_from == 0:
        verdict = "untested" if first is None else "diverged"
    else:
        verdict = "equivalent" if first is None else "diverged"
    return Comparison(verdict, resumed_from, len(steps), first, restore_differs, loss, loss_diff)
