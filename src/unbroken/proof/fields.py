"""The fields of a trace's records and how two records of one update compare: bitwise, or
within a tolerance that loosens only what numerics move (`equivalence` uses them to find the
first difference, `attribution` to name it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_NUMERIC = ("loss", "grad_norm")
# Compared bitwise at every level: they do not drift with floating-point reduction order.
_ALWAYS_EXACT = ("ids", "batch", "epoch", "opt_steps", "mode")
# Information only: never a divergence.
_INFO = ("buffers",)
# Digests a tolerance leaves alone once the numerics drift (a plateau scheduler keeps the best
# loss, an EMA the weights), compared bitwise while they have not: a scheduler stepped at
# another time, an extra's counter, differ there without any number moving.
_SETTLED_ONLY = ("state.scheduler", "state.extra.")


def _flat(record: Mapping[str, Any]) -> dict[str, Any]:
    """Trace fields as flat names: ids, lr, loss, params, state.optimizer, rng.torch_cpu,
    metrics.val_loss, ..."""
    out = {k: v for k, v in record.items() if k not in (
        "event", "step", "state", "rng", "metrics", "generation", "rejected")}
    out.update({f"state.{k}": v for k, v in (record.get("state") or {}).items()})
    out.update({f"rng.{k}": v for k, v in (record.get("rng") or {}).items()})
    out.update({f"metrics.{k}": v for k, v in (record.get("metrics") or {}).items()})
    return out


def as_float(value: Any) -> float | None:
    if isinstance(value, str):
        try:
            return float.fromhex(value)
        except ValueError:
            return None
    return None


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rtol, atol) for x, y in zip(a, b))
    x, y = as_float(a), as_float(b)
    if x is None or y is None:
        return bool(a == b)
    if x == y:  # (inf and inf: their difference is NaN)
        return True
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= atol + rtol * abs(y)


def _differs(ref: Mapping[str, Any], got: Mapping[str, Any], exact: bool, rtol: float,
             atol: float, settled: bool = False) -> list[str]:
    """The fields of one update that differ (``exact``, or within ``rtol``/``atol``; with a
    tolerance, ``settled``: the state before this update was bitwise the reference's, so
    where every number of this update is bitwise equal too (the parameters, loss, gradient
    norm, rates and metrics), digests that only numerics would move must be equal too)."""
    a, b = _flat(ref), _flat(got)
    settled = settled and all(a[n] == b[n] for n in a if n in b and (
        n in _NUMERIC or n in ("params", "lr") or n.startswith("metrics.")))
    # A field absent on one side (hash cadence, an older trace) is skipped; but a metric is
    # what the script gave step_done, at this update, on one side only: a difference.
    names = [n for n in a if n in b and n not in _INFO]
    once = sorted(n for n in a.keys() ^ b.keys() if n.startswith("metrics."))
    if exact:
        return [n for n in names if a[n] != b[n]] + once
    out = once
    for n in names:
        # (the optimizer's settings digest is not compared: it holds floats that move with
        # the numerics too, LBFGS's prev_loss, an adaptive optimizer's own step sizes)
        if n in _ALWAYS_EXACT or n.startswith("rng.") or n == "state.data":
            if a[n] != b[n]:
                out.append(n)
        elif n in _NUMERIC or n == "lr" or n.startswith("metrics."):
            if not _close(a[n], b[n], rtol, atol):
                out.append(n)
        elif n.startswith(_SETTLED_ONLY) and a[n] != b[n] and settled:
            out.append(n)
        # parameter, optimizer and scaler digests drift with the numerics: not compared;
        # a scheduler's or extra's, only while nothing numeric has moved (`_SETTLED_ONLY`)
    return out


def _loss_rel(ref: Mapping[str, Any], got: Mapping[str, Any]) -> float | None:
    x, y = as_float(got.get("loss")), as_float(ref.get("loss"))
    if x is None or y is None:
        return None
    return abs(x - y) / max(abs(y), 1e-30)


def _state_equal(ref: Mapping[str, Any] | None, got: Mapping[str, Any] | None) -> bool:
    """Whether two records of one update hold bitwise the same state: the parameters and
    every registered part both traced (False when the parameters were not digested there)."""
    if ref is None or got is None or "params" not in ref or "params" not in got:
        return False
    a, b = _flat(ref), _flat(got)
    return all(a[n] == b[n] for n in a if n in b and (n == "params" or n.startswith("state.")))
