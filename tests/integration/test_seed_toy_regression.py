"""Seed 000's experiment: 12 uninterrupted steps equal 5 steps + save + restore in a fresh
process + 7 steps, bitwise; weights-only and cleared momentum follow other trajectories."""

from __future__ import annotations

import signal

import pytest
from conftest import read_log, run_script

TOY = "unbroken._toy"


def steps(log: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in log if e["event"] == "step"}


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted run, shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("ref")
    r = run_script(TOY, "--run", str(tmp / "run"), "--log", str(tmp / "log"))
    assert r.returncode == 0, r.stderr
    return steps(read_log(tmp / "log"))


def test_resume_in_fresh_process_equals_uninterrupted(tmp_path, script, ref):
    log = tmp_path / "run.jsonl"
    run = str(tmp_path / "run")
    # Whole new interpreters here (the other tests fork from a server that imported torch).
    r = script(TOY, "--run", run, "--log", str(log), "--stop-after", "5",
               fresh_interpreter=True)
    assert r.returncode == 0, r.stderr
    r = script(TOY, "--run", run, "--log", str(log), fresh_interpreter=True)
    assert r.returncode == 0, r.stderr
    events = read_log(log)
    restored = [e for e in events if e["event"] == "restored"]
    assert [e["step"] for e in restored] == [0, 5]
    # The state right after the restore equals the uninterrupted run's state after step 5.
    assert {k: v for k, v in restored[1].items() if k != "event"} == \
        {k: v for k, v in ref[5].items() if k != "event"}
    got = steps(events)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == ref[step], f"step {step} differs"


def test_defective_resumes_diverge(tmp_path, script, ref):
    for defect in ("weights_only", "clear_momentum"):
        run = str(tmp_path / defect)
        log = tmp_path / f"{defect}.jsonl"
        assert script(TOY, "--run", run, "--log", str(log),
                      "--stop-after", "5").returncode == 0
        r = script(TOY, "--run", run, "--log", str(log), "--defect", defect)
        assert r.returncode == 0, r.stderr
        got = steps(read_log(log))
        assert got[6]["weight"] != ref[6]["weight"], defect
        assert got[12]["weight"] != ref[12]["weight"], defect
        if defect == "weights_only":
            # New optimizer, scheduler and RNG: each of them differs from the reference.
            assert got[6]["lr"] != ref[6]["lr"]
            assert got[6]["rng"] != ref[6]["rng"]


def test_changed_data_revision_is_refused(tmp_path, script):
    run = str(tmp_path / "run")
    log = str(tmp_path / "log.jsonl")
    assert script(TOY, "--run", run, "--log", log,
                  "--stop-after", "5").returncode == 0
    r = script(TOY, "--run", run, "--log", log, "--data-revision", "toy-v2")
    assert r.returncode != 0 and r.returncode != -signal.SIGKILL
    assert "IdentityMismatch" in r.stderr and "data" in r.stderr
    assert "toy-v1" in r.stderr and "toy-v2" in r.stderr
