"""Which committed generations to keep: the last N, every K-th step, the best by a declared
dev metric. Pure selection over *verified* generations; the store does the deleting.

Two generations are never deleted whatever the policy says: the one just committed, and the
newest one that verifies. A generation that fails verification never counts as kept: keeping
it in place of a good one would leave nothing restorable once the good ones are gone."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Keep:
    """Retention policy, validated up front.

    ``last``: keep the newest N verified generations (at least 1). ``every``: also keep every
    generation whose step is a multiple of K. ``best``: also keep the verified generation with
    the best value of a metric declared before training, as ``("val_loss", "min")``; pick it
    on a dev set, never on the test set (NaN ranks last). ``aside``: how many refused or
    abandoned generations to keep in ``aside/`` for inspection (oldest removed first)."""

    last: int = 3
    every: int | None = None
    best: tuple[str, str] | None = None
    aside: int = 2

    def __post_init__(self) -> None:
        if type(self.last) is not int or self.last < 1:
            raise ValueError(f"Keep(last={self.last!r}): keep at least the newest generation")
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ValueError(f"Keep(every={self.every!r}) must be a positive integer or None")
        if self.best is not None:
            if (not isinstance(self.best, tuple) or len(self.best) != 2
                    or not isinstance(self.best[0], str) or self.best[1] not in ("min", "max")):
                raise ValueError(f"Keep(best={self.best!r}) must be (metric_name, 'min'|'max')")
        if type(self.aside) is not int or self.aside < 0:
            raise ValueError(f"Keep(aside={self.aside!r}) must be an integer >= 0")

    def misspelled(self, names: Iterable[str]) -> str | None:
        """A warning when ``names`` (the metrics one ``step_done`` was given) hold one that
        looks like the declared ``best`` metric's name but is not it (a typo there keeps no
        best generation, silently); None otherwise."""
        if self.best is None or self.best[0] in names:
            return None
        near = difflib.get_close_matches(self.best[0], list(names), n=1, cutoff=0.8)
        return None if not near else (
            f"Keep(best={self.best!r}) keeps the generation with the best {self.best[0]!r}, "
            f"but step_done was given {near[0]!r}: no generation records "
            f"{self.best[0]!r}; give the metric the name Keep declares")

    def to_json(self) -> dict[str, Any]:
        return {"last": self.last, "every": self.every,
                "best": list(self.best) if self.best else None, "aside": self.aside}


def _score(value: object, mode: str) -> float | None:
    """Sort key of a metric, smaller is better; ``None`` when it cannot rank (NaN, missing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value) if mode == "min" else -float(value)


def select_kept(generations: Iterable[tuple[int, int, dict[str, Any]]], policy: Keep,
                protect: Iterable[int] = (), good: Callable[[int], bool] | None = None
                ) -> set[int]:
    """The generation numbers to keep from ``(generation, step, metrics)`` of every complete
    generation. ``good(g)`` verifies generation ``g`` (called lazily, newest first, only for
    the generations whose keeping depends on it); ``protect`` is kept unconditionally."""
    ordered = sorted(generations, key=lambda g: (g[0], g[1]))
    is_good = good or (lambda g: True)
    kept = set(protect)
    counted = 0
    for g, _, _ in reversed(ordered):  # the newest verified one comes first: always kept
        if counted == policy.last:
            break
        if is_good(g):
            kept.add(g)
            counted += 1
    if policy.every:
        kept |= {g for g, step, _ in ordered if step % policy.every == 0}
    if policy.best:
        for g in ranked([(g, m) for g, _, m in ordered], policy.best):
            if is_good(g):
                kept.add(g)
                break
    return kept


def ranked(generations: Iterable[tuple[int, Mapping[str, Any]]], best: tuple[str, str]
           ) -> list[int]:
    """The generation numbers of ``(generation, metrics)`` best first by the metric ``best``
    names (``(name, "min"|"max")``; ties: the newest first); those without a value that ranks
    (missing, NaN) left out."""
    name, mode = best
    scored = [(_score(m.get(name), mode), -g) for g, m in generations]
    return [-neg for score, neg in sorted(x for x in scored if x[0] is not None)]
