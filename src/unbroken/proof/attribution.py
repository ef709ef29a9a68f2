"""Which state part a difference between two traces is blamed on, and what kind of
difference it is (a jump, a drift, irreproducible): the rules in `equivalence`'s module doc."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from .fields import _differs, _flat, _loss_rel

NOT_CAPTURED = "state the Checkpointer does not capture"
# When several registered parts differ at a restore, the one named first explains the most: a
# weights-only resume is above all a lost optimizer (seed 000's momentum example).
_PRIORITY = ("optimizer", "scheduler", "scaler", "data position", "rng", "extra", "model")
# Relative loss difference at the first update after a resume below which it may be
# numerical noise (a drift); above it, a jump: fp32 nondeterminism starts near 1e-7.
DRIFT_THRESHOLD = 1e-6
# What numerical nondeterminism moves; a difference anywhere else is different state.
_DRIFTS = frozenset({"loss", "grad_norm", "params", "state.optimizer", "state.scaler"})


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
        return (f"rng ({stream[4:]}: reseeded, or drawn from after restore() or between "
                "updates, as an evaluation after step_done does: wrap that in "
                "unbroken.fork_rng())")
    extra = has("state.extra.")
    if extra and not names & {"loss", "params", "grad_norm"}:  # else a consequence of those
        return f"extra {extra[len('state.extra.'):]}"
    if "state.optimizer" in names and not names & {"loss", "params", "grad_norm"}:
        return "optimizer"
    return None


@dataclass
class _Resume:
    """What a resume brought back, against the interrupted process at the same step."""

    step: int
    differs: list[str]  # registered parts whose digest right after the restore differs
    buffers_lost: bool  # non-persistent buffers differ (never saved: a cache, or lost state)
    digests: list[str] = dataclass_field(default_factory=list)  # those digests, by name


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
        # digests a tolerance leaves alone too: a hyperparameter set after restore(); but a
        # scheduler's, where numbers moved, may only follow them: a plateau's best loss)
        fields = diff
        if settled and not exact:
            fields = _differs(ref, got, True, 0, 0)
            if any(n in _DRIFTS or n.startswith("metrics.") for n in fields):
                fields = [n for n in fields if n != "state.scheduler"]
        named = _changed_after_restore(fields, got, before)
        if named is None and resume is not None and resume.buffers_lost:
            named = (f"{NOT_CAPTURED}: non-persistent buffers, never saved, differ after the "
                     "restore (register_buffer(..., persistent=True) if they are state)")
        part = named or f"{NOT_CAPTURED} (first differs: {lead})"
        if named is None and settled and not exact:
            hint = ("the update before it matched bitwise, and one update's rounding rarely "
                    "moves the loss this much, unless the tolerance is tighter than the "
                    "precision trained in (bfloat16 rounds near 1e-3)")
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
