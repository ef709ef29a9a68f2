"""The reliability suites in their CI size: `python -m unbroken.torture crash` (>= 30 SIGKILLs of
a real training run, restarted until it completes) and `corrupt` (>= 300 mutated
generations), each in its own process, with every figure asserted. Each suite is also run
against a deliberately broken implementation, which it must fail (a test of the test).

The long versions (200 kills, 1,000 cases) and their figures are in RELIABILITY.md."""

from __future__ import annotations

import json

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
                              "episodes_equal", "final_equal", "kills_by_kind")})
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


def test_corruption_fuzz_one_case_reruns_alone():
    _, whole = _run("corrupt", "--cases", "40", "--seed", "9")
    _, one = _run("corrupt", "--cases", "1", "--seed", "9", "--case", "17")
    assert one["cases"] == 1 and one["ok"]
    assert one["case_log"] == [whole["case_log"][17]]


def test_corruption_fuzz_catches_a_loader_that_skips_hashes():
    code, r = _run("corrupt", "--cases", "60", "--seed", "1", "--sabotage", "skip-hash")
    assert code == 1 and not r["ok"]
    assert any("WRONG DATA" in " ".join(x["failures"]) for x in r["failures"])


@pytest.mark.parametrize("args", [["crash", "--kills", "0"], ["crash", "--kinds", "nope"],
                                  ["corrupt", "--cases", "0"], ["bogus"]])
def test_usage_errors_exit_2(args):
    r = run_script(TORTURE, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
