"""Compare an interrupted-and-resumed run's trace with the uninterrupted one.

The report names the first step and field that differ, the state part **a user must fix**,
every other part that also differs at that step, and whether the difference is a **jump** at
a resume (missing or wrong state) or a **drift** growing from tiny values (numerical
nondeterminism). Compared bitwise, a difference after an update whose state was bitwise equal
had nothing tiny to grow from: a jump however late, made by state the process keeps itself,
unless the script turns nondeterministic there (the report says how to tell). Levels: exact
(bitwise, the default), a tolerance (rtol/atol on loss, grad norm, metrics and learning rate;
digests of numerically drifting state are then not compared), or exact for the first
``exact_steps`` updates after a resume and the tolerance after that. A run may be resumed
several times (a chain of interruptions): each difference is explained from the resume before
it.

How a part is named, in order:

1. A registered part whose digest right after the restore differs from what the interrupted
   process had at that step was not restored: that part.
2. Otherwise every registered part came back equal, and the first field that differs at the
   first differing update says what changed *after* the restore: the data (ids, epoch), the
   learning rate the optimizer applied (the scheduler, or one that is not registered), the
   optimizer steps taken (the GradScaler, registered or not), the optimizer's hyperparameters
   or step counts (the optimizer: recreated or edited), the model's train/eval mode, an RNG
   stream (reseeded or drawn from after ``restore()``), an extra.
3. Otherwise only numbers the script computes differ (loss, gradient norm, metrics,
   parameters): state the Checkpointer does not capture (a Python global, an unregistered
   generator or model, an EMA), with the first field.

Non-persistent buffers (caches a model rebuilds, such as a rotary-embedding table built on
first use) are never saved: a difference there is reported as a note, never as divergence."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

from .attribution import Divergence, _divergence, _rank, _Resume, part_of_state
from .fields import _differs, _state_equal, as_float


@dataclass
class Comparison:
    """The verdict for one interrupted-and-resumed run against the reference."""

    verdict: str  # "equivalent" | "diverged" | "untested"
    resumed_from: int | None  # the last resume (None: never resumed)
    steps: int
    first_divergence: Divergence | None
    restore_differs: list[str]  # parts whose digest right after the resume before it differs
    loss: list[tuple[int, float]]  # (step, loss) of the interrupted-and-resumed run
    loss_diff: list[tuple[int, float]]  # (step, |loss - reference loss|)
    resumes: list[int] = dataclass_field(default_factory=list)  # every resume, in order
    notes: list[str] = dataclass_field(default_factory=list)  # information, not divergence

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


def _restore_checks(segments: list[list[dict[str, Any]]], ref_updates: Mapping[int, Any]
                    ) -> list[_Resume]:
    """Each resume, compared with the interrupted process's own record at its step, so that
    numerical drift before the kill (on nondeterministic hardware) is not mistaken for lost
    state."""
    out = []
    for i in range(1, len(segments)):
        restore = next((r for r in segments[i] if r["event"] == "restore"), None)
        if restore is None:
            continue
        step = restore["step"]
        saved_at = stitch(segments[:i])[0].get(step) or ref_updates.get(step)
        differs: list[str] = []
        digests: list[str] = []
        lost = False
        if saved_at is not None and step > 0:
            digests = [n for n in _differs(saved_at, restore, True, 0, 0)
                       if n.startswith(("rng.", "state.", "params"))]
            differs = sorted({part_of_state(n) for n in digests}, key=_rank)
            lost = ("buffers" in saved_at and "buffers" in restore
                    and saved_at["buffers"] != restore["buffers"])
        out.append(_Resume(step, differs, lost, digests))
    return out


def compare(reference: list[dict[str, Any]], segments: list[list[dict[str, Any]]], *,
            rtol: float = 0.0, atol: float = 0.0, exact_steps: int | None = None) -> Comparison:
    """Compare the reference trace with a run made of one or more process ``segments``."""
    ref_updates, _ = stitch([reference])
    got_updates, _ = stitch(segments)
    checks = _restore_checks(segments, ref_updates)
    resumes = [c.step for c in checks]
    tolerant = rtol > 0 or atol > 0
    loss: list[tuple[int, float]] = []
    loss_diff: list[tuple[int, float]] = []
    notes: dict[str, str] = {}
    # Streams that differed before any resume while nothing they feed did: never seeded, so
    # noise in every later record too; naming one as the cause of a later divergence would
    # blame a stream the script may not even use (its note says to seed it).
    unseeded: set[str] = set()
    first: Divergence | None = None
    steps = sorted(ref_updates)
    for step in steps:
        got = got_updates.get(step)
        ref = ref_updates[step]
        if got is None:
            first = first or Divergence(step, "missing", "run", "jump",
                                        expected="an update record", found=None)
            continue
        x, y = as_float(got.get("loss")), as_float(ref.get("loss"))
        if x is not None and y is not None:
            loss.append((step, x))
            loss_diff.append((step, abs(x - y)))
        if "buffers" in ref and "buffers" in got and ref["buffers"] != got["buffers"]:
            notes.setdefault("buffers", f"non-persistent buffers differ from update {step} on "
                             "(never saved: fine for a cache the model rebuilds; a buffer that "
                             "is state must be persistent): information, not a divergence")
        if first is not None:
            continue
        before = [c for c in checks if c.step < step]
        resume = before[-1] if before else None
        resumed_from = resume.step if resume else None
        exact = not tolerant or (exact_steps is not None and resumed_from is not None
                                 and resumed_from < step <= resumed_from + exact_steps)
        settled = _state_equal(ref_updates.get(step - 1), got_updates.get(step - 1))
        diff = _differs(ref, got, exact, rtol, atol, settled)
        if resume is not None and step == resume.step + 1 and not exact:
            # What the restore did not bring back bit for bit is lost state under any
            # tolerance: the restore copies what was saved, no numerics between (a tolerance
            # compares no digest that drifts: an extra that did not load showed nowhere)
            diff = sorted({*diff, *resume.digests})
        lost = set(resume.differs) if resume else set()
        if diff and all(n.startswith("rng.") and part_of_state(n) not in lost
                        and (resume is None or n in unseeded) for n in diff):
            # A stream nothing traced depends on that differed before any resume (unseeded):
            # said, but it is a divergence only once something it feeds differs. (A stream
            # the restore did not bring back is lost state, whatever it feeds; one restored
            # equal that differs after the resume was drawn from or reseeded after restore():
            # the saved state differs from the uninterrupted run's, whatever it feeds.)
            for n in diff:
                notes.setdefault(n, f"{n} differs from update {step} on while nothing it feeds "
                                 "does (seed every stream the script uses)")
                if resume is None:
                    unseeded.add(n)
            continue
        diff = [n for n in diff if n not in unseeded] or diff
        if diff:
            if resume is not None and len(resume.differs) > 1:
                # (streams found unseeded before any resume differ at every restore: one that
                # matters comes first)
                noise = {part_of_state(n) for n in unseeded}
                resume = replace(resume, differs=sorted(
                    resume.differs, key=lambda p: (_rank(p)[0], p in noise, p)))
            first = _divergence(step, diff, ref, got, got_updates.get(step - 1), resume, exact,
                                settled, steps[-1])
    extra = [s for s in sorted(got_updates) if s > max(steps, default=0)]
    if first is None and extra:
        first = Divergence(extra[0], "extra", "run", "jump", expected=None,
                           found=f"{len(extra)} more update(s) than the uninterrupted run")
    exercised = [s for s in resumes if s > 0]
    if not exercised:
        verdict = "untested" if first is None else "diverged"
    else:
        verdict = "equivalent" if first is None else "diverged"
    last = resumes[-1] if resumes else None
    at_first = ([c.differs for c in checks if first is not None and c.step < first.step]
                or [[]])[-1]
    restore_differs = at_first if first is not None else next(
        (c.differs for c in reversed(checks) if c.differs), [])
    return Comparison(verdict, last, len(steps), first, restore_differs, loss, loss_diff,
                      resumes, list(notes.values()))
