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

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

NOT_CAPTURED = "state the Checkpointer does not capture"
_NUMERIC = ("loss", "grad_norm")
# Compared bitwise at every level: they do not drift with floating-point reduction order.
_ALWAYS_EXACT = ("ids", "batch", "epoch", "opt_steps", "mode")
# Information only: never a divergence.
_INFO = ("buffers",)
# When several registered parts differ at a restore, the one named first explains the most: a
# weights-only resume is above all a lost optimizer (seed 000's momentum example).
_PRIORITY = ("optimizer", "scheduler", "scaler", "data position", "rng", "extra", "model")
# Relative loss difference at the first update after a resume below which it may be
# numerical noise (a drift); above it, a jump: fp32 nondeterminism starts near 1e-7.
DRIFT_THRESHOLD = 1e-6
# What numerical nondeterminism moves; a difference anywhere else is different state.
_DRIFTS = frozenset({"loss", "grad_norm", "params", "state.optimizer", "state.scaler"})
# Digests a tolerance leaves alone once the numerics drift (a plateau scheduler keeps the best
# loss, an EMA the weights), compared bitwise while they have not: a scheduler stepped at
# another time, an extra's counter, differ there without any number moving.
_SETTLED_ONLY = ("state.scheduler", "state.extra.")


@dataclass
class Divergence:
    """Where two traces first differ."""

    step: int
    field: str
    state_part: str
    # "jump": missing or wrong state at a resume; "drift": numerical nondeterminism growing
    # from tiny differences; "irreproducible": the runs differ before the interruption, so
    # the script itself is not deterministic (an unseeded stream, a nondeterministic kernel).
    kind: str
    # other differing fields/parts at that step
    also: list[str] = dataclass_field(default_factory=list)
    expected: Any = None
    found: Any = None
    # what else could explain it and how to tell ("": nothing to add)
    hint: str = ""


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


def _flat(record: Mapping[str, Any]) -> dict[str, Any]:
    """Trace fields as flat names: ids, lr, loss, params, state.optimizer, rng.torch_cpu,
    metrics.val_loss, ..."""
    out = {k: v for k, v in record.items() if k not in (
        "event", "step", "state", "rng", "metrics", "generation", "rejected")}
    out.update({f"state.{k}": v for k, v in (record.get("state") or {}).items()})
    out.update({f"rng.{k}": v for k, v in (record.get("rng") or {}).items()})
    out.update({f"metrics.{k}": v for k, v in (record.get("metrics") or {}).items()})
    return out


def part_of_state(name: str) -> str:
    """The registered part a restore-time digest belongs to."""
    if name.startswith("rng."):
        return f"rng ({name[4:]})"
    if name.startswith("state."):
        key = name[6:]
        return {"optimizer-meta": "optimizer", "data": "data position"}.get(
            key, key.replace("extra.", "extra "))
    return "model" if name == "params" else name


def _rank(part: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(_PRIORITY) if part.startswith(p)), len(_PRIORITY)), part


def _registered(record: Mapping[str, Any], part: str) -> bool:
    return part in (record.get("state") or {})


def _changed_after_restore(diff: list[str], got: Mapping[str, Any],
                           before: Mapping[str, Any] | None) -> str | None:
    """The part a user must fix when every registered part was restored equal but the first
    differing update shows ``diff`` (``before``: the resumed run's previous update; see the
    module doc, rule 2); None: rule 3."""
    names = set(diff)

    def has(*prefixes: str) -> str | None:
        return next((n for n in diff if n.startswith(prefixes)), None)

    if names & {"ids", "epoch", "state.data"}:
        return "data position"
    if "batch" in names:
        return "data position (the batch differs)"
    if (got.get("opt_steps") == 0 and before is not None and "params" in got
            and got["params"] != before.get("params")):
        return ("optimizer (the registered optimizer took no step but the weights changed: "
                "another optimizer, built after restore(), trains the model)")
    if "state.scheduler" in names:
        return "scheduler"
    if "lr" in names:
        return ("optimizer (its learning rate was set after restore(); the scheduler came "
                "back equal)" if _registered(got, "scheduler") else
                "scheduler (not registered: pass a torch LR scheduler as scheduler=; a rate "
                f"set by hand, after restore() or from a global, is {NOT_CAPTURED})")
    if "state.scaler" in names:
        return "scaler"
    if "opt_steps" in names:
        return ("optimizer steps (the registered GradScaler came back equal: a guard "
                f"deciding from {NOT_CAPTURED} skipped or ran optimizer.step())"
                if _registered(got, "scaler") else
                "scaler (a GradScaler that is not registered: pass scaler=; or a guard "
                f"deciding from {NOT_CAPTURED} skipped or ran optimizer.step())")
    if "state.optimizer-meta" in names:
        return "optimizer (recreated, or its hyperparameters changed after restore())"
    if "mode" in names:
        return f"{NOT_CAPTURED}: the model's train/eval mode (call model.train() after restore)"
    stream = has("rng.")
    if stream:
        return f"rng ({stream[4:]}: reseeded or drawn from after restore())"
    extra = has("state.extra.")
    if extra and not names & {"loss", "params", "grad_norm"}:  # else a consequence of those
        return f"extra {extra[len('state.extra.'):]}"
    if "state.optimizer" in names and not names & {"loss", "params", "grad_norm"}:
        return "optimizer"
    return None


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
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= atol + rtol * abs(y)


def _differs(ref: Mapping[str, Any], got: Mapping[str, Any], exact: bool, rtol: float,
             atol: float, settled: bool = False) -> list[str]:
    """The fields of one update that differ (``exact``, or within ``rtol``/``atol``; with a
    tolerance, ``settled``: the parameters and loss are still bitwise the reference's here
    and the state before this update was, so digests that only numerics would move must be
    equal too)."""
    a, b = _flat(ref), _flat(got)
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


@dataclass
class _Resume:
    """What a resume brought back, against the interrupted process at the same step."""

    step: int
    differs: list[str]  # registered parts whose digest right after the restore differs
    buffers_lost: bool  # non-persistent buffers differ (never saved: a cache, or lost state)
    digests: list[str] = dataclass_field(default_factory=list)  # those digests, by name


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
        diff = _differs(ref, got, exact, rtol, atol, settled and all(
            ref.get(n) == got.get(n) for n in ("params", "loss")))
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


def _state_equal(ref: Mapping[str, Any] | None, got: Mapping[str, Any] | None) -> bool:
    """Whether two records of one update hold bitwise the same state: the parameters and
    every registered part both traced (False when the parameters were not digested there)."""
    if ref is None or got is None or "params" not in ref or "params" not in got:
        return False
    a, b = _flat(ref), _flat(got)
    return all(a[n] == b[n] for n in a if n in b and (n == "params" or n.startswith("state.")))


def _uncaptured_hint(step: int, last: int) -> str:
    """What else a difference after bitwise-equal updates may be (nondeterminism starting
    there), and how to tell."""
    return (f"every update before {step} matched bitwise, so this did not grow from tiny "
            "values: something the process keeps outside the Checkpointer changed it (a "
            "counter or schedule in a Python global restarts with the process), unless the "
            f"script is nondeterministic from update {step} on (the clock, an unseeded "
            "stream, a nondeterministic kernel). To tell, run `unbroken check --at "
            f"{last} --phase after-commit -- CMD`: it runs to the end before its only "
            "interruption, so a difference there is reported as irreproducible "
            "(nondeterminism), and none means state not captured")


def _divergence(step: int, diff: list[str], ref: Mapping[str, Any], got: Mapping[str, Any],
                before: Mapping[str, Any] | None, resume: _Resume | None,
                exact: bool, settled: bool, last: int) -> Divergence:
    """Name the first difference: which part explains it, and what kind it is (``settled``:
    the update before it held bitwise the reference's state; ``last``: the final update)."""
    resumed_from = resume.step if resume else None
    restore_differs = resume.differs if resume else []
    lead = diff[0]
    hint = ""
    rel = _loss_rel(ref, got)
    at_resume = resumed_from is not None and step == resumed_from + 1
    if resumed_from is None:  # before any interruption: the script is not deterministic
        kind = "irreproducible"
    else:
        # Numerical nondeterminism moves the loss, gradients, parameters and the optimizer
        # and scaler state built from them; anything else differing means different state.
        # Compared bitwise, anything differing at the very update after a resume is a jump:
        # nondeterminism does not wait for a resume to start (it shows before the kill as
        # "irreproducible"); state acting on the update (a gradient multiplier, a guard) may
        # leave that update's loss equal and move only the weights. Later on, compared
        # bitwise after an update whose state was bitwise equal, nothing tiny was there to
        # grow: the difference is made by the process itself (a global that restarts with it).
        # (Under a tolerance, a large difference right after a bitwise-equal update did not
        # grow either: tiny values do not become a 1e-3 difference in one update.)
        jump = bool(restore_differs) or any(n not in _DRIFTS for n in diff) or (
            exact and (at_resume or settled)) or (
            (at_resume or settled) and rel is not None and rel > DRIFT_THRESHOLD)
        kind = "jump" if jump else "drift"
    if restore_differs:
        part = restore_differs[0]
    elif kind == "irreproducible":
        part = "the script (nondeterministic before any interruption)"
    elif kind == "drift":
        part = "numerics"
    else:
        # (after a bitwise-equal update, every field of this one tells what changed, the
        # digests a tolerance leaves alone too: a hyperparameter set after restore())
        named = _changed_after_restore(
            _differs(ref, got, True, 0, 0) if settled and not exact else diff, got, before)
        if named is None and resume is not None and resume.buffers_lost:
            named = (f"{NOT_CAPTURED}: non-persistent buffers, never saved, differ after the "
                     "restore (register_buffer(..., persistent=True) if they are state)")
        part = named or f"{NOT_CAPTURED} (first differs: {lead})"
        if named is None and exact:
            hint = _uncaptured_hint(step, last)
            if at_resume and "params" in diff:  # (no digest between a restore and an update)
                hint = ("the restore brought every registered part back equal, so the script "
                        "may have changed one after restore() (loaded other weights into the "
                        "model, reinitialized a layer); else " + hint)
    also = sorted((d for d in ({part_of_state(n) if n.startswith(("rng.", "state.")) else n
                                for n in diff} | set(restore_differs[1:]))
                   if not _names(part, d)), key=_rank)
    return Divergence(step, lead, part, kind, also, _flat(ref).get(lead), _flat(got).get(lead),
                      hint)


def _names(part: str, field: str) -> bool:
    """Whether the part a divergence is blamed on is ``field`` (shown once, not again among
    the other differences): itself, a stream named with its explanation ("rng (python: ...)"),
    or the first differing field of state not captured."""
    return (part == field or field.endswith(")") and part.startswith(field[:-1] + ":")
            or part.endswith(f"(first differs: {field})"))
