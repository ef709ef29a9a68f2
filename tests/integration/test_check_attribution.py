"""`unbroken check` with its default kill points on a realistic script with one resume bug
injected at a time (tests/integration/scripts/resume_bugs.py): every bug is caught, and the
report names the part a user must fix. Processes are forked from the test zygote (real, new
processes that restore only from disk) so that fifteen checks fit in the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, run_script, zygote_process

import unbroken.proof.harness as harness
from unbroken.proof.harness import format_report, run_check

SCRIPT = SCRIPTS / "resume_bugs.py"
NOT_CAPTURED = "state the Checkpointer does not capture"
# bug -> how the report must begin to name the part to fix
EXPECT = {
    "scheduler-unregistered": "scheduler (not registered",
    "scheduler-stepped-twice": "scheduler",
    "scheduler-recreated": "scheduler",
    "per-epoch-scheduler": "scheduler",
    "scaler-unregistered": "scaler (a GradScaler that is not registered",
    "reseed-after-restore": "rng (torch_cpu",
    "generator-reseeded": "rng (gen:noise",
    "optimizer-recreated": "optimizer (the registered optimizer took no step",
    "weight-decay-changed": "optimizer (recreated, or its hyperparameters changed",
    "eval-left-on": f"{NOT_CAPTURED}: the model's train/eval mode",
    "python-global": f"{NOT_CAPTURED} (first differs: loss)",
    "generator-unregistered": f"{NOT_CAPTURED} (first differs: loss)",
    "ema-unregistered": f"{NOT_CAPTURED} (first differs: metrics.ema_val)",
    "data-unregistered": "data position",
    "extra-overwritten": "extra ema",
    # (a later resume in the last epoch ends the run at once: the divergence the earlier
    # lives show is the verdict, not "untested", session 28)
    "epoch-skipped": "data position",
}


@pytest.fixture
def zygote_check(monkeypatch):
    monkeypatch.setattr(harness, "run_process", zygote_process)

    def check(tmp: Path, *argv: str, **kw: Any):
        return run_check([sys.executable, str(SCRIPT), *argv], str(tmp), **kw)

    return check


def test_the_correct_script_is_equivalent_at_every_default_place(zygote_check, tmp_path):
    report = zygote_check(tmp_path, "--bug", "none")
    text = format_report(report, str(tmp_path))
    assert report.verdict == "equivalent", text
    places = " | ".join(report.covered)
    for place in ("first update of the run", "last update of epoch 0, saved there",
                  "last update of epoch 1, saved there", "inside the save at 5",
                  "the update after the save at 5", "the first update after a resume",
                  "killed after its optimizer step", "the final update"):
        assert place in places, (place, places)


@pytest.mark.parametrize("bug", sorted(EXPECT))
def test_each_injected_bug_is_caught_and_named(zygote_check, tmp_path, bug):
    report = zygote_check(tmp_path, "--bug", bug)
    text = format_report(report, str(tmp_path))
    assert report.verdict == "diverged", text
    d = report.cases[0].comparison.first_divergence
    assert d.state_part.startswith(EXPECT[bug]), text
    if bug == "per-epoch-scheduler":  # found at the epoch edge
        assert d.step in (13, 25), text


def test_sigterm_phase_stops_cleanly_and_resumes_equivalently(zygote_check, tmp_path):
    report = zygote_check(tmp_path, "--bug", "none", "--signals", phases=["sigterm"])
    assert report.verdict == "equivalent", format_report(report, str(tmp_path))
    assert all(k.kill.phase == "sigterm" and k.reached for k in report.cases[0].kills)


def test_sigterm_phase_reports_a_script_without_a_handler(zygote_check, tmp_path):
    report = zygote_check(tmp_path, "--bug", "none", phases=["sigterm"])
    assert report.verdict == "error"
    assert "pass signals=(signal.SIGTERM,)" in report.cases[0].note


def test_a_signal_handler_that_saves_mid_update_is_refused(tmp_path):
    """The common pattern ckpt.save() in a SIGTERM handler lands between optimizer.step() and
    step_done: refused with UpdateBoundaryError instead of a silently inconsistent generation."""
    code = f"""
import signal, torch, unbroken
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = unbroken.Checkpointer({str(tmp_path / 'run')!r}, model=model, optimizer=opt)
ckpt.restore()
signal.signal(signal.SIGTERM, lambda *a: ckpt.save())
for step in range(1, 4):
    model(torch.ones(2)).sum().backward()
    opt.step()
    if step == 3:
        signal.raise_signal(signal.SIGTERM)
    ckpt.step_done(step)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "UpdateBoundaryError" in r.stderr, r.stderr
    assert "optimizer.step() ran 1 time(s)" in r.stderr
    assert not list((tmp_path / "run").glob("gen-*"))  # the handler never wrote one


def test_a_lazily_grown_non_persistent_buffer_is_a_note_not_a_divergence(zygote_check,
                                                                          tmp_path):
    report = zygote_check(tmp_path, "--bug", "none", "--rotary")
    text = format_report(report, str(tmp_path))
    assert report.verdict == "equivalent", text
    assert "non-persistent buffers differ" in text  # said, as information


@pytest.mark.parametrize("accumulation", [1, 3])
def test_sigterm_at_random_moments_stops_cleanly_and_resumes_bitwise(tmp_path, accumulation):
    """Real SIGTERMs sent from outside at random moments (mid-accumulation included), ten
    times per setting: the run saves at the next update boundary, exits 0, and the resumed
    run is bitwise equal to the uninterrupted one at every update."""
    import random
    import time

    from unbroken.proof.equivalence import compare
    from unbroken.trace import read_trace

    args = ["--signals", "--accumulation", str(accumulation)]
    ref_trace = tmp_path / "reference.jsonl"
    r = run_script(SCRIPT.name, "--run", str(tmp_path / "ref"), *args,
                   env={"UNBROKEN_TRACE": str(ref_trace)})
    assert r.returncode == 0, r.stderr
    reference = read_trace(ref_trace)
    updates = sum(x["event"] == "update" for x in reference)
    rng = random.Random(accumulation)
    stopped_at = []
    for n in range(10):
        run, first, second = (tmp_path / f"run{n}", tmp_path / f"{n}-a.jsonl",
                              tmp_path / f"{n}-b.jsonl")
        # The moment is drawn from the run's progress, not the clock, so that a loaded
        # machine cannot push every signal past the end: after a random update, and then a
        # random few milliseconds into the next one (mid-accumulation when it has several).
        after, pause = rng.randint(1, updates - 3), rng.uniform(0.0, 0.03)

        def send_later(pid: int, after: int = after, pause: float = pause,
                       trace: Path = first) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                text = trace.read_text() if trace.exists() else ""
                if text.count('"event":"update"') >= after:
                    break
                time.sleep(0.002)
            time.sleep(pause)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # it finished first

        r = run_script(SCRIPT.name, "--run", str(run), *args, started=send_later,
                       env={"UNBROKEN_TRACE": str(first)})
        killed = read_trace(first)
        stops = [x["step"] for x in killed if x["event"] == "stop"]
        done = sum(x["event"] == "update" for x in killed) == updates
        # stopped cleanly, or finished first (a loaded machine can hold the signal past the
        # last update: landing after close(), it ends the process as SIGTERM does)
        assert r.returncode == 0 or done and not stops and r.returncode == -signal.SIGTERM, (
            r.returncode, r.stderr)
        r = run_script(SCRIPT.name, "--run", str(run), *args,
                       env={"UNBROKEN_TRACE": str(second)})
        assert r.returncode == 0, r.stderr
        result = compare(reference, [killed, read_trace(second)])
        assert result.first_divergence is None, (n, result.first_divergence)
        if stops:
            assert stops[0] >= after, (after, stops)  # at a boundary after the signal
            assert result.resumed_from == stops[0]
            stopped_at.append(stops[0])
    assert len(stopped_at) >= 8, stopped_at  # the signal landed during training
