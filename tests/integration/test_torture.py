"""The reliability suites in their CI size: `python -m unbroken.torture crash` (>= 30 SIGKILLs of
a real training run, restarted until it completes, with generations rotting and scripts
starting without restore() between lives) and `corrupt` (>= 300 mutated generations), each in
its own process, with every figure asserted. Each suite is also run against deliberately
broken implementations, which it must fail (a test of the test).

The long versions (200 kills, 1,000 cases) and their figures are in RELIABILITY.md."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_script

TORTURE = "unbroken.torture"


def _run(*args: str, timeout: float = 240) -> tuple[int, dict]:
    r = run_script(TORTURE, *args, "--json", timeout=timeout)
    assert r.stdout.strip(), f"no output (exit {r.returncode}): {r.stderr[-3000:]}"
    return r.returncode, json.loads(r.stdout)


def _show(capsys, title: str, figures: dict) -> None:
    """Print the suite's figures into the CI log, captured or not."""
    with capsys.disabled():
        print(f"\n{title}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


def test_crash_torture_30_kills(capsys):
    code, f = _run("crash", "--kills", "30", "--seed", "1")
    _show(capsys, "crash torture (seed 1)", {
        k: f.get(k) for k in ("kills", "recoveries", "torn_seen", "torn_refused",
                              "corrupt_seen", "corrupt_refused", "generations_lost",
                              "torn_or_corrupt_loaded", "wrong_state_restored", "episodes",
                              "episodes_equal", "final_equal", "kills_by_kind", "rots",
                              "rots_refused", "no_restore_starts", "no_restore_refused")})
    summary = {k: v for k, v in f.items() if k != "kills_log"}
    assert code == 0 and f["ok"], json.dumps(summary, indent=1)
    assert f["failures"] == []
    assert f["kills"] >= 30 and f["recoveries"] == f["kills"]
    assert f["generations_lost"] == 0
    assert f["torn_or_corrupt_loaded"] == 0 and f["wrong_state_restored"] == 0
    assert f["torn_refused"] == f["torn_seen"] and f["corrupt_refused"] == f["corrupt_seen"]
    assert f["final_equal"] and f["episodes_equal"] == f["episodes"] >= 2
    # Every kind of kill was used, and kills landed inside saves, commits and retention.
    assert all(f["kills_by_kind"][k] > 0 for k in ("op", "timer", "point")), f["kills_by_kind"]
    phases = " ".join(f["kills_by_phase"])
    for where in ("save", "commit", "retention"):
        assert where in phases, f["kills_by_phase"]
    assert f["staging_debris_seen"] > 0  # some kills interrupted a save mid-way
    # Between lives: newer generations rotted (lost by the disk) and were never loaded; starts
    # without restore() were refused with the folder unchanged; aside/ holds only what a rot
    # or a refusal explains.
    assert f["rots"] > 0 and f["rots_refused"] == f["rots"]
    assert f["no_restore_starts"] > 0 and f["no_restore_refused"] == f["no_restore_starts"]
    assert f["no_restore_changed"] == 0 and f["aside_unexplained"] == 0
    assert f["aside_explained"] > 0


def _assert_recovered(f: dict) -> None:
    summary = {k: v for k, v in f.items() if k != "kills_log"}
    assert f["ok"] and f["failures"] == [], json.dumps(summary, indent=1)
    assert f["recoveries"] == f["kills"] and f["generations_lost"] == 0
    assert f["torn_or_corrupt_loaded"] == 0 and f["wrong_state_restored"] == 0
    assert f["final_equal"] and f["episodes_equal"] == f["episodes"]


def test_crash_torture_with_async_saves_in_a_thread(capsys):
    """Kills while saves persist in a background thread: a save in flight dies with its
    process, the restore falls back to the last committed one, nothing torn is loaded."""
    code, f = _run("crash", "--kills", "20", "--seed", "2", "--async-save", "thread")
    _show(capsys, "crash torture, async thread (seed 2)", {
        k: f.get(k) for k in ("kills", "kills_in_flight", "committed_in_flight",
                              "kills_after_save_returned", "generations_reported")})
    assert code == 0
    _assert_recovered(f)
    assert f["kills_in_flight"] > 0  # kills landed while a save was persisting


def test_crash_torture_with_a_persisting_process_saves_on_failure(capsys):
    """async_save="process": the training process SIGKILLed right after save() returned
    still gets that generation committed (verified, retention applied) by its persisting
    process, in every trial; kills inside the persisting process (a lost machine) leave a
    verified generation or none; every finished run equals the uninterrupted one. The saves
    are paced (``persist_share``): a persisting process whose writer died goes on at full
    speed, and one hurried by the next save does too."""
    code, f = _run("crash", "--kills", "8", "--seed", "4", "--async-save", "process",
                   "--persist-share", "0.2", "--kinds", "point", "--points",
                   "step-done,artifact-1-written,step-done,after-rename")
    _show(capsys, "crash torture, async process (seed 4)", {
        k: f.get(k) for k in ("kills", "kills_after_save_returned",
                              "committed_after_save_returned", "kills_in_flight",
                              "committed_in_flight", "kills_by_phase")})
    assert code == 0
    _assert_recovered(f)
    assert f["kills_after_save_returned"] >= 3
    assert f["committed_after_save_returned"] == f["kills_after_save_returned"]
    # and kills inside the persisting process's save, which take its writer with it
    assert any(p.startswith(("save", "commit")) for p in f["kills_by_phase"]), f


def test_crash_torture_is_reproducible_from_its_seed():
    """Numbered-I/O and named-point kills (no timers): the same seed, the same kills, landing
    in the same places with the same generations on disk after each."""
    runs = [_run("crash", "--kills", "10", "--seed", "7", "--kinds", "op,point")
            for _ in range(2)]
    assert all(code == 0 and f["ok"] for code, f in runs)
    (_, a), (_, b) = runs
    assert a["kills_log"] == b["kills_log"] and len(a["kills_log"]) >= 10


def test_crash_torture_catches_retention_before_commit():
    """Deleting old generations before writing the new one (Accelerate's bug) must fail."""
    code, f = _run("crash", "--kills", "30", "--seed", "3", "--sabotage", "retention-first")
    assert code == 1 and not f["ok"]
    assert f["generations_lost"] > 0, f["failures"]


@pytest.mark.parametrize("sabotage, figure", [("skip-hash", "torn_or_corrupt_loaded"),
                                              ("first-save-unchecked", "no_restore_changed")])
def test_crash_torture_catches_rot_and_unrestored_saves(sabotage, figure):
    """A loader that skips hashes loads the rotten generation; a first save without restore()
    that goes ahead changes the used folder: both must fail."""
    code, f = _run("crash", "--kills", "10", "--seed", "1", "--sabotage", sabotage)
    assert code == 1 and not f["ok"]
    assert f[figure] > 0, f["failures"]


def test_corruption_fuzz_300_cases(capsys):
    code, r = _run("corrupt", "--cases", "300", "--seed", "1")
    _show(capsys, "corruption fuzz (seed 1)", {
        k: r.get(k) for k in ("cases", "refused", "fell_back", "loaded", "failed")})
    failures = "\n".join(f"case {x['case']} {x['kind']}: {x['mutation']}: {x['failures']}"
                         for x in r["failures"])
    assert code == 0 and r["ok"], failures
    assert r["cases"] == 300 and r["failed"] == 0
    assert r["refused"] + r["fell_back"] + r["loaded"] == 300
    # every mutation kind was drawn, and most cases needed the refusal or the fallback
    assert all(row["cases"] > 0 for row in r["by_kind"].values()), r["by_kind"]
    assert r["refused"] > 0 and r["fell_back"] > r["loaded"]
    assert r["by_kind"]["every-generation"]["refused"] == r["by_kind"]["every-generation"]["cases"]
    # nothing but UnbrokenError escaped; foreign generations were refused as such
    assert r["exceptions_outside_unbroken_error"] == []
    assert r["exception_types"].get("ForeignGeneration", 0) > 0


def test_corruption_fuzz_through_the_one_pass_restore(capsys):
    """Every model and optimizer file read straight into the live tensors and hashed as it
    arrives (`store.backends._streamed`): a corruption found after some tensors took its
    bytes must still end in a refusal or in the older generation's exact state."""
    code, r = _run("corrupt", "--cases", "60", "--seed", "2", "--map-all")
    _show(capsys, "corruption fuzz, one-pass restore (seed 2)", {
        k: r.get(k) for k in ("cases", "refused", "fell_back", "loaded", "failed")})
    failures = "\n".join(f"case {x['case']} {x['kind']}: {x['mutation']}: {x['failures']}"
                         for x in r["failures"])
    assert code == 0 and r["ok"] and r["failed"] == 0, failures
    assert r["by_kind"]["flip-tensor-data"]["fell_back"] > 0, r["by_kind"]["flip-tensor-data"]
    assert r["exceptions_outside_unbroken_error"] == []


def test_corruption_fuzz_one_case_reruns_alone():
    _, whole = _run("corrupt", "--cases", "40", "--seed", "9")
    _, one = _run("corrupt", "--cases", "1", "--seed", "9", "--case", "17")
    assert one["cases"] == 1 and one["ok"]

    def same(entry: dict) -> dict:
        # The detail quotes paths, hashes and run ids, which differ from run to run (each run
        # trains its base anew, in its own folder): compare its kind (error or generation).
        return {**entry, "detail": re.split(r"[:,]", entry["detail"])[0]}

    assert [same(e) for e in one["case_log"]] == [same(whole["case_log"][17])]


@pytest.mark.parametrize("sabotage, kind, says", [
    ("skip-hash", None, "WRONG DATA"),
    ("accept-foreign", "foreign-generation", "FOREIGN"),
    ("no-size-limits", "oversized-part", "read whole")])
def test_corruption_fuzz_catches_broken_loaders(sabotage, kind, says):
    """Loading without re-hashing, continuing from another run's generation, reading an
    oversized state.json: each must fail the fuzz, in the mutations made for it."""
    code, r = _run("corrupt", "--cases", "60", "--seed", "1", "--sabotage", sabotage)
    assert code == 1 and not r["ok"]
    assert any(says in " ".join(x["failures"]) and kind in (None, x["kind"])
               for x in r["failures"]), r["failures"]


@pytest.mark.parametrize("args", [["crash", "--kills", "0"], ["crash", "--kinds", "nope"],
                                  ["crash", "--events", "nope"], ["corrupt", "--cases", "0"],
                                  ["bogus"]])
def test_usage_errors_exit_2(args):
    r = run_script(TORTURE, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
