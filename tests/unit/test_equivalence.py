"""Trace comparison: stitching process segments, first divergence and its attribution, and
the jump / drift / irreproducible classification under exact and tolerance levels."""

from __future__ import annotations

import copy
import random

from unbroken.proof.equivalence import compare, stitch
from unbroken.trace import read_trace

STEPS, RESUME = 20, 8


def run_records(noise: float = 0.0, lose: str | None = None, seed: int = 0) -> list[dict]:
    """A synthetic but realistic trace: loss decays, digests change every update. ``noise``
    adds a relative error growing with each update after the resume (numerical drift)."""
    rng = random.Random(seed)
    recs = [{"event": "restore", "step": 0, "params": "p0", "state": {"optimizer": "o0"},
             "rng": {"torch_cpu": "r0"}}]
    for s in range(1, STEPS + 1):
        loss = 2.0 / s
        if noise and s > RESUME:
            loss *= 1 + noise * (s - RESUME) * (1 + rng.random())
        drifting = noise and s > RESUME
        recs.append({"event": "update", "step": s, "lr": [(0.1 / s).hex()],
                     "ids": [2 * s, 2 * s + 1], "batch": f"b{s}", "loss": loss.hex(),
                     "grad_norm": (1.0 / s).hex(),
                     "params": f"p{s}" + ("~" if drifting else ""),
                     "state": {"optimizer": f"o{s}" + ("~" if drifting else ""),
                               "scheduler": f"s{s}", "data": f"d{s}"},
                     "rng": {"torch_cpu": f"r{s}", "python": f"y{s}"}})
    return recs


def segments(records: list[dict], restore: dict | None = None) -> list[list[dict]]:
    """Split a run into a killed process (updates up to RESUME + 2) and a resumed one."""
    first = [r for r in records if r["event"] == "restore" or r["step"] <= RESUME + 2]
    at = next(r for r in records if r["event"] == "update" and r["step"] == RESUME)
    resumed = dict(at, event="restore", **(restore or {}))
    rest = [r for r in records if r["event"] == "update" and r["step"] > RESUME]
    return [first, [resumed, *rest]]


def test_identical_runs_are_equivalent_and_stitching_replaces_replayed_updates():
    ref = run_records()
    got = segments(run_records())
    got[0][-1] = dict(got[0][-1], loss="0x1p+5")  # the killed process's update RESUME+2 ...
    updates, restores = stitch(got)  # ... is replayed by the resumed process
    assert sorted(updates) == list(range(1, STEPS + 1))
    assert updates[RESUME + 2]["loss"] == ref[RESUME + 2]["loss"]
    result = compare(ref, got)
    assert result.verdict == "equivalent" and result.resumed_from == RESUME
    assert result.first_divergence is None and result.restore_differs == []
    assert [d for _, d in result.loss_diff] == [0.0] * STEPS


def test_single_process_run_is_untested():
    assert compare(run_records(), [run_records()]).verdict == "untested"


def test_missing_optimizer_is_a_jump_attributed_to_the_optimizer():
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update" and r["step"] > RESUME:
            r["loss"] = (float.fromhex(r["loss"]) * 1.3).hex()
            r["state"]["optimizer"] += "!"
            r["params"] += "!"
    got = segments(bad, restore={"state": {"optimizer": "fresh", "scheduler": f"s{RESUME}",
                                           "data": f"d{RESUME}"}})
    result = compare(ref, got)
    d = result.first_divergence
    assert result.verdict == "diverged" and result.restore_differs == ["optimizer"]
    assert (d.step, d.state_part, d.kind) == (RESUME + 1, "optimizer", "jump")
    assert "loss" in d.also and "params" in d.also


def test_wrong_data_position_names_the_cursor():
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update" and r["step"] > RESUME:
            r["ids"] = [0, 1]
    d = compare(ref, segments(bad)).first_divergence
    assert (d.step, d.field, d.state_part, d.kind) == (RESUME + 1, "ids", "data position", "jump")
    assert d.expected == [2 * RESUME + 2, 2 * RESUME + 3] and d.found == [0, 1]


def test_injected_tiny_noise_is_drift_under_tolerance_and_exact_mode():
    ref = run_records()
    noisy = segments(run_records(noise=1e-7))
    # Exact level: bitwise, a difference at the very update after a resume is a jump (missing
    # state can move a loss by as little as noise does) ...
    d = compare(ref, noisy).first_divergence
    assert d.kind == "jump" and d.step == RESUME + 1
    # ... and so is the same noise starting later, after an update whose state matched
    # bitwise: nothing tiny was there to drift from (state kept outside the Checkpointer, or
    # nondeterminism starting there: the hint says how to tell)
    late = run_records(noise=1e-7)
    exact = {x["step"]: x for x in ref if x["event"] == "update"}
    for r in late:
        if r["event"] == "update" and r["step"] == RESUME + 1:
            r.update(copy.deepcopy(exact[r["step"]]))
    d = compare(ref, segments(late)).first_divergence
    assert d.kind == "jump" and d.step == RESUME + 2
    assert d.state_part.startswith("state the Checkpointer does not capture") and d.hint
    # A tolerance wider than the noise accepts it (digests of drifting state are not compared)
    result = compare(ref, noisy, rtol=1e-4)
    assert result.verdict == "equivalent"
    # ... a tolerance tighter than the noise reports it, as drift, not as missing state.
    d = compare(ref, noisy, rtol=1e-9).first_divergence
    assert d.kind == "drift" and d.field == "loss" and d.state_part == "numerics"


def test_exact_steps_then_tolerance():
    ref = run_records()
    noisy = segments(run_records(noise=1e-7))
    # Exact for the first 3 updates after the resume: the drift at RESUME+1 is reported ...
    d = compare(ref, noisy, rtol=1e-4, exact_steps=3).first_divergence
    assert d is not None and d.step == RESUME + 1
    # ... while a run that matches exactly right after the resume and drifts later passes.
    late = run_records(noise=1e-7)
    for r in late:
        if r["event"] == "update" and RESUME < r["step"] <= RESUME + 3:
            exact = next(x for x in ref if x.get("step") == r["step"] and x["event"] == "update")
            r.update(copy.deepcopy(exact))
    assert compare(ref, segments(late), rtol=1e-4, exact_steps=3).verdict == "equivalent"


def test_rng_is_compared_exactly_even_under_tolerance():
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update" and r["step"] > RESUME:
            r["rng"]["python"] = "other"
            r["batch"] += "~"  # what the stream feeds differs too
    d = compare(ref, segments(bad), rtol=0.1).first_divergence
    assert d.kind == "jump" and "rng (python)" in d.also


def test_a_stream_that_feeds_nothing_is_a_note_not_a_divergence():
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update":
            r["rng"]["python"] = f"unseeded{r['step']}"  # unseeded, never drawn from
    result = compare(ref, segments(bad))
    assert result.verdict == "equivalent"
    assert any("rng.python differs from update 1" in n for n in result.notes)


def test_an_unseeded_stream_is_never_blamed_for_a_later_divergence():
    """Python's stream is never seeded (it differs from update 1 on, while nothing it feeds
    does); after the resume, state the Checkpointer does not capture moves the loss. The
    cause is that state, not the stream the script may not even use; the stream stays a
    note, and is not listed again among the other differences."""
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update":
            r["rng"]["python"] = f"unseeded{r['step']}"
            if r["step"] > RESUME:
                r["loss"] = (float.fromhex(r["loss"]) * 1.3).hex()
                r["params"] += "!"
    result = compare(ref, segments(bad))
    d = result.first_divergence
    assert result.verdict == "diverged" and (d.step, d.kind) == (RESUME + 1, "jump")
    assert d.field == "loss" and d.state_part.endswith("(first differs: loss)")
    assert not [a for a in d.also if "rng" in a or a == "loss"], d.also
    assert any("rng.python differs from update 1" in n for n in result.notes)


def test_a_stream_that_differs_only_after_the_resume_is_still_blamed():
    """Reseeded (or drawn from) after restore(): equal before the kill, so not unseeded."""
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update" and r["step"] > RESUME:
            r["rng"]["python"] = "reseeded"
            r["loss"] = (float.fromhex(r["loss"]) * 1.3).hex()
    d = compare(ref, segments(bad)).first_divergence
    assert d.state_part.startswith("rng (python: reseeded")
    assert "rng (python)" not in d.also and "loss" in d.also


def test_difference_before_the_resume_is_irreproducible():
    ref = run_records()
    bad = copy.deepcopy(run_records())
    bad[3]["rng"]["python"] = "unseeded"
    bad[3]["loss"] = "0x1p+3"
    d = compare(ref, segments(bad)).first_divergence
    assert d.kind == "irreproducible" and d.step == 3


def test_read_trace_ignores_a_torn_last_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"event":"update","step":1}\n{"event":"upd')
    assert read_trace(p) == [{"event": "update", "step": 1}]


def test_updates_beyond_the_reference_are_a_divergence():
    ref = run_records()
    longer = run_records()
    for s in (STEPS + 1, STEPS + 2):
        longer.append(dict(longer[-1], step=s))
    d = compare(ref, segments(longer)).first_divergence
    assert d is not None and d.field == "extra" and d.step == STEPS + 1


def test_restore_is_judged_against_the_killed_process_own_state():
    """On nondeterministic hardware the killed run had already drifted from the reference
    before the kill; a perfect restore of *its* state is drift, not missing state."""
    ref = run_records()
    drifting = run_records(noise=1e-7)
    for r in drifting:  # drift from the start, in every digest it moves
        if r["event"] == "update":
            r["params"] += "~"
            r["state"]["optimizer"] += "~"
    got = segments(drifting)  # the resumed record copies the killed run's state at RESUME
    result = compare(ref, got, rtol=1e-4)
    assert result.restore_differs == [] and result.verdict == "equivalent"


def test_state_acting_on_the_update_is_a_jump_not_a_drift():
    """A gradient multiplier in a Python global leaves the first update's loss equal and
    moves only the weights: bitwise, at the update after the resume, that is a jump."""
    ref = run_records()
    bad = copy.deepcopy(run_records())
    for r in bad:
        if r["event"] == "update" and r["step"] > RESUME:
            r["params"] += "*"
    d = compare(ref, segments(bad)).first_divergence
    assert d.kind == "jump" and d.step == RESUME + 1
    assert d.state_part == "state the Checkpointer does not capture (first differs: params)"


def test_non_persistent_buffers_lost_at_a_restore_are_named_when_the_run_diverges():
    ref = run_records()
    for r in ref:
        r["buffers"] = f"b{r['step']}"
    bad = copy.deepcopy(ref)
    for r in bad:
        if r["event"] == "update" and r["step"] > RESUME:
            r["loss"] = (float.fromhex(r["loss"]) * 1.5).hex()
            r["buffers"] = "rebuilt"
    got = segments(bad, restore={"buffers": "rebuilt"})
    d = compare(ref, got).first_divergence
    assert "non-persistent buffers, never saved, differ after the restore" in d.state_part
    # ... while the same buffers differing under an equal run are only a note.
    fine = copy.deepcopy(ref)
    for r in fine:
        if r["event"] == "update" and r["step"] > RESUME:
            r["buffers"] = "rebuilt"
    result = compare(ref, segments(fine, restore={"buffers": "rebuilt"}))
    assert result.verdict == "equivalent" and "non-persistent buffers" in result.notes[0]


def _with_extra(records: list[dict], value: str = "c") -> list[dict]:
    """Each record's state with a registered extra (a curriculum counter) and the optimizer's
    settings, both unchanged by numerics."""
    out = copy.deepcopy(records)
    for r in out:
        if r["event"] != "restore" or r["step"]:
            r.setdefault("state", {}).update({"extra.cur": f"{value}{r['step']}",
                                              "optimizer-meta": "m"})
    return out


def test_under_a_tolerance_an_extra_the_restore_lost_still_diverges():
    """Session 28: a tolerance skips the digests that drift (parameters, optimizer moments,
    the optimizer's settings digest, which holds floats such as LBFGS's prev_loss) but an
    extra that did not load is different state under any tolerance (it was equivalent)."""
    ref = _with_extra(run_records(noise=1e-9))
    lost = _with_extra(run_records(noise=1e-9))
    got = segments(lost, restore={"state": {"optimizer": f"o{RESUME}", "scheduler":
                                            f"s{RESUME}", "data": f"d{RESUME}",
                                            "extra.cur": "c0", "optimizer-meta": "m"}})
    result = compare(ref, got, rtol=1e-4)
    assert result.verdict == "diverged" and result.restore_differs == ["extra cur"]
    assert (result.first_divergence.step, result.first_divergence.field) == (
        RESUME + 1, "state.extra.cur")
    drifting = _with_extra(run_records(noise=1e-9))
    for r in drifting:  # LBFGS's prev_loss in the settings digest: it moves with numerics
        if r["event"] == "update" and r["step"] > RESUME:
            r["state"]["optimizer-meta"] = f"m{r['step']}"
    assert compare(ref, segments(drifting), rtol=1e-4).verdict == "equivalent"
    # the same runs with nothing lost stay equivalent under the tolerance
    assert compare(ref, segments(_with_extra(run_records(noise=1e-9))),
                   rtol=1e-4).verdict == "equivalent"


def test_a_stream_restored_equal_and_drawn_from_after_the_resume_diverges():
    """Session 28: a seeded, saved stream drawn from after restore() (np.random.rand())
    changes the saved state though nothing traced depends on it: the resumed run's final
    generation is not the uninterrupted run's, so the check may not say equivalent (it did,
    advising to seed a stream that was seeded)."""
    ref = run_records()
    got = copy.deepcopy(run_records())
    for r in got:
        if r["event"] == "update" and r["step"] > RESUME:
            r["rng"]["python"] += "!"
    result = compare(ref, segments(got))
    d = result.first_divergence
    assert result.verdict == "diverged" and result.restore_differs == []
    assert (d.step, d.field) == (RESUME + 1, "rng.python")
    assert d.state_part.startswith("rng (python: reseeded, or drawn from after restore() or "
                                   "between updates")


def test_weights_changed_right_after_the_restore_suggest_the_script_changed_them():
    """Session 28: weights loaded after restore() were only blamed on a Python global."""
    ref = run_records()
    got = copy.deepcopy(run_records())
    for r in got:
        if r["event"] == "update" and r["step"] > RESUME:
            r["params"] += "!"
            r["loss"] = (float.fromhex(r["loss"]) * 1.5).hex()
    d = compare(ref, segments(got)).first_divergence
    assert d is not None and d.step == RESUME + 1
    assert "may have changed one after restore() (loaded other weights" in d.hint
