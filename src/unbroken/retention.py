"""Which committed generations to keep: the last N, every K-th step, the best by a declared
dev metric. Pure selection; the store does the deleting, newest-verified first excluded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Keep:
    """Retention policy, validated up front.

    ``last``: keep the newest N generations (at least 1). ``every``: also keep every generation
    whose step is a multiple of K. ``best``: also keep the generation with the best value of a
    metric declared before training, as ``("val_loss", "min")``; pick it on a dev set, never on
    the test set."""

    last: int = 3
    every: int | None = None
    best: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if type(self.last) is not int or self.last < 1:
            raise ValueError(f"Keep(last={self.last!r}): keep at least the newest generation")
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ValueError(f"Keep(every={self.every!r}) must be a positive integer or None")
        if self.best is not None:
            if (not isinstance(self.best, tuple) or len(self.best) != 2
                    or not isinstance(self.best[0], str) or self.best[1] not in ("min", "max")):
                raise ValueError(f"Keep(best={self.best!r}) must be (metric_name, 'min'|'max')")

    def to_json(self) -> dict[str, Any]:
        return {"last": self.last, "every": self.every,
                "best": list(self.best) if self.best else None}


def select_kept(generations: list[tuple[int, int, dict[str, float]]], policy: Keep) -> set[int]:
    """Return the generation numbers to keep from ``(generation, step, metrics)`` of every
    verified generation. The newest is always kept, whatever the policy says."""
    if not generations:
        return set()
    ordered = sorted(generations, key=lambda g: (g[0], g[1]))
    kept = {g for g, _, _ in ordered[-policy.last:]}
    if policy.every:
        kept |= {g for g, step, _ in ordered if step % policy.every == 0}
    if policy.best:
        name, mode = policy.best
        scored = [(m[name], g) for g, _, m in ordered
                  if isinstance(m.get(name), (int, float)) and not math.isnan(m[name])]
        if scored:
            kept.add((min if mode == "min" else max)(scored)[1])
    kept.add(ordered[-1][0])
    return kept
