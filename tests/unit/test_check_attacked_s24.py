"""`unbroken check` attacked from outside (twenty-fourth session): a difference long after a
resume, following updates that all matched bitwise, is state the Checkpointer does not capture
(a global counter), not a drift; the report names no log it removed, reads properly, calls a
crashed resumed process resumed; a failed reference run is a failed run (exit 1); random
points are distinct from the default ones; the plot's legend and lines say the same. The last
two tests run `unbroken check` on real processes (about 15 s; in this file, as a file of the
same name under tests/integration would clash with it on import)."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from unbroken.cli import main
from unbroken.proof import harness
from unbroken.proof.attribution import NOT_CAPTURED
from unbroken.proof.checkplan import Kill, default_plan
from unbroken.proof.equivalence import compare
from unbroken.proof.harness import CaseResult, CheckReport, KillResult, format_report

STEPS, RESUME = 12, 4


def records(switch_at: int | None = None, field: str = "params") -> list[dict[str, Any]]:
    """A run's trace; from update ``switch_at`` on, ``field`` differs (a loss weight switched
    by a global counter: bitwise equal before, different after)."""
    recs: list[dict[str, Any]] = [{"event": "restore", "step": 0, "params": "p0",
                                   "state": {"optimizer": "o0"}, "rng": {"torch_cpu": "r0"}}]
    for s in range(1, STEPS + 1):
        rec = {"event": "update", "step": s, "lr": [(0.1).hex()], "ids": [s], "batch": f"b{s}",
               "loss": (2.0 / s).hex(), "grad_norm": (1.0 / s).hex(), "params": f"p{s}",
               "state": {"optimizer": f"o{s}", "data": f"d{s}"}, "rng": {"torch_cpu": f"r{s}"}}
        if switch_at is not None and s >= switch_at:
            rec[field] = (2.5 / s).hex() if field == "loss" else rec[field] + "*"
        recs.append(rec)
    return recs


def resumed(recs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Killed after RESUME + 1, resumed from RESUME (its restore equal to the saved state)."""
    first = [r for r in recs if r["step"] <= RESUME + 1]
    at = next(r for r in recs if r["event"] == "update" and r["step"] == RESUME)
    return [first, [dict(at, event="restore"), *(r for r in recs if r["step"] > RESUME)]]


@pytest.mark.parametrize("field", ["params", "loss"])
def test_a_late_difference_after_bitwise_equal_updates_is_state_not_captured(field):
    """delayed.py: a global counting this process's updates doubles the loss weight at 8; the
    resumed run switches later. Was: 'numerics', a drift; every earlier update was bitwise
    equal, so nothing tiny was there to grow."""
    ref, got = records(), resumed(records(switch_at=9, field=field))
    d = compare(ref, got).first_divergence
    assert (d.step, d.field, d.kind) == (9, field, "jump"), d
    assert d.state_part == f"{NOT_CAPTURED} (first differs: {field})"
    # It says what else it could be, and how to tell: a run to the end before its only kill.
    assert "nondeterministic from update 9" in d.hint
    assert f"--at {STEPS} --phase after-commit" in d.hint


def test_late_nondeterminism_that_shows_before_the_kill_stays_irreproducible():
    d = compare(records(), [records(switch_at=3)]).first_divergence
    assert d.kind == "irreproducible" and d.hint == ""


def test_without_digests_or_under_a_tolerance_a_late_difference_is_still_a_drift():
    # No parameter digests (an older trace): nothing shows the state was equal.
    ref, bad = records(), records(switch_at=9, field="loss")
    for r in [*ref, *bad]:
        r.pop("params", None)
    d = compare(ref, resumed(bad)).first_divergence
    assert (d.kind, d.state_part, d.hint) == ("drift", "numerics", "")
    # A tolerance accepts numerical noise: a difference beyond it stays a drift, as before.
    noisy = records()
    for r in noisy:
        if r["step"] >= 9:
            r["loss"] = (float.fromhex(r["loss"]) * (1 + 1e-7)).hex()
            r["params"] += "~"
    d = compare(records(), resumed(noisy), rtol=1e-9).first_divergence
    assert (d.step, d.kind, d.state_part) == (9, "drift", "numerics")


def _case(kind: str, field: str, part: str, also: list[str]) -> CaseResult:
    ref, bad = records(), records(switch_at=9, field=field)
    comparison = compare(ref, resumed(bad))
    d = comparison.first_divergence
    assert d is not None
    d.kind, d.state_part, d.also = kind, part, also
    return CaseResult([KillResult(Kill(RESUME + 1, "after-update"), True, -9, RESUME)],
                      "diverged", comparison)


def test_the_fix_line_does_not_repeat_the_field_and_reads_properly():
    report = CheckReport(["python", "train.py"], STEPS, [
        _case("drift", "params", "numerics", ["params"]),
        _case("irreproducible", "loss", "the script (nondeterministic before any "
              "interruption)", ["loss", "params"])])
    text = format_report(report, None)
    assert "fix: numerics; a drift from tiny values (numerics)" in text
    assert "also differs: params; irreproducible: the runs differ before the interruption" \
        in text
    assert "an irreproducible" not in text and "also differs: loss" not in text


def _fail_reference(code: int | None) -> Any:
    def run(cmd, env, log, timeout):
        Path(log).write_text("Traceback (most recent call last):\nSyntaxError: bad\n")
        if code is None:
            raise harness.Timeout(f"{' '.join(cmd)} ran past 5 s; {harness._output_of(log)}")
        return code
    return run


@pytest.mark.parametrize("code", [1, None])
def test_a_failed_reference_run_is_a_failed_run_whose_log_is_named_only_when_kept(
        tmp_path, monkeypatch, code):
    """Was: an UnbrokenError (exit 2) naming reference/output.log, then 'the working folder
    was removed'. Now a report with the verdict error (exit 1) and the end of the output."""
    monkeypatch.setattr(harness, "run_process", _fail_reference(code))
    report = harness.run_check([sys.executable, "-c", "pass"], str(tmp_path / "w"))
    assert report.verdict == "error" and report.cases == []
    assert "SyntaxError: bad" in report.error and report.to_json()["error"] == report.error
    assert ("exited with 1" if code else "hung") in report.error
    removed = format_report(report, None)
    assert "output.log" not in removed and "SyntaxError: bad" in removed
    assert "working folder was removed" in removed
    kept = format_report(report, str(tmp_path / "w"))
    assert f"whole output: {tmp_path / 'w' / 'reference' / 'output.log'}" in kept


def test_a_missing_command_or_script_is_a_usage_error_before_any_run(tmp_path, monkeypatch):
    from unbroken._runview import UsageError

    monkeypatch.setattr(harness, "run_process", pytest.fail)  # nothing may run
    for cmd in ([sys.executable, str(tmp_path / "nonexist.py")],
                [sys.executable, "-u", "-X", "dev", "nonexist.py", "--lr", "1"],
                [str(tmp_path / "no-such-binary"), "train.py"]):
        with pytest.raises(UsageError, match="no such (script|command)"):
            harness.run_check(cmd, str(tmp_path / "w"))


def test_a_crash_right_after_the_restore_is_the_resumed_run_and_nothing_is_covered(
        tmp_path, monkeypatch):
    """b2.py crash_resume: was 'the interrupted run exited with 1 after update 1' and the
    row 'resumed from 1, covered yes'."""
    from unbroken.trace import TRACE_ENV

    lives = iter([(-9, [{"event": "restore", "step": 0}, {"event": "update", "step": 1}]),
                  (1, [{"event": "restore", "step": 1}])])

    def run(cmd, env, log, timeout):
        code, recs = next(lives)
        Path(env[TRACE_ENV]).write_text("".join(json.dumps(r) + "\n" for r in recs))
        Path(log).write_text("RuntimeError: boom on resume\n")
        return code

    monkeypatch.setattr(harness, "run_process", run)
    kills = [Kill(1, "after-update"), Kill(4, "mid-save")]
    case = harness._run_case(["python", "t.py"], kills, str(tmp_path / "case-01"),
                             {None: records()}, 0, 0, None, None, 60, None)
    assert case.verdict == "error" and "boom on resume" in case.note
    assert "the interrupted run" not in case.note
    assert case.note.startswith("the run resumed from update 1 after the interruption at "
                                "update 1 (to be interrupted at update 4) exited with 1 right "
                                "after its restore"), case.note
    first = case.kills[0]
    assert first.reached and first.resumed_from == 1 and not first.covered
    report = CheckReport(["python", "t.py"], STEPS, [case])
    assert report.covered == [] and "no (the resume failed)" in format_report(report, None)


@pytest.mark.parametrize("seed", range(40))
def test_random_points_are_distinct_and_none_is_a_default_place(seed):
    ref = [{"event": "update", "step": s, "epoch": (s - 1) // 6} for s in range(1, 13)]
    ref.append({"event": "save", "step": 4})
    defaults = {k.at for k in default_plan(ref)}
    chain = default_plan(ref, random_n=4, seed=seed)
    drawn = [k.at for k in chain if k.place == "random"]
    assert len(drawn) == len(set(drawn)) and not set(drawn) & defaults, chain
    many = [k.at for k in default_plan(ref, random_n=50, seed=seed) if k.place == "random"]
    assert len(many) == len(set(many)) and not set(many) & defaults  # as many as there are


def test_the_plot_says_killed_and_resumed_as_the_lines_do_and_marks_the_first_difference(
        tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from unbroken.proof.plot import plot_check

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    case = _case("jump", "params", NOT_CAPTURED, [])
    case.kills[0].kill = Kill(RESUME + 1, "after-update")
    report = CheckReport(["python", "t.py"], STEPS, [case],
                         reference_loss=[(s, 2.0 / s) for s in range(1, STEPS + 1)])
    plot_check(report, str(tmp_path / "p.png"))
    top = figures[0].axes[0]
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert f"killed at update {RESUME + 1}; resumed from step {RESUME} (vertical lines)" \
        in labels[1], labels
    assert labels[2] == "case 1: first differs at update 9 (params)", labels
    assert sorted({x for line in top.get_lines()[1:] for x in line.get_xdata()
                   if len(set(line.get_xdata())) == 1}) == [RESUME, 9]
    assert (tmp_path / "p.png").stat().st_size > 1000


# delayed.py of the outside tester: a loss weight doubled after 8 updates of this process.
GLOBAL_COUNTER = textwrap.dedent("""
    import random, numpy as np, torch, torch.nn.functional as F, unbroken
    torch.manual_seed(0); np.random.seed(0); random.seed(0); torch.set_num_threads(1)
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(1)); y = x.sum(1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ckpt = unbroken.Checkpointer("run", model=model, optimizer=opt)
    step = ckpt.restore()
    updates_this_process = 0
    while step < 10:
        i = (step * 4) % 48
        loss = F.mse_loss(model(x[i:i + 4]), y[i:i + 4])
        (loss * (2.0 if updates_this_process >= 5 else 1.0)).backward()
        opt.step(); opt.zero_grad()
        step += 1; updates_this_process += 1
        ckpt.step_done(step, loss=loss)
    ckpt.close()
    """)


def check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_global_counter_is_state_not_captured_not_numerics(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(GLOBAL_COUNTER)
    code, out, _ = check(capsys, "--json", "--at", "3", "--phase", "after-update", "--",
                         sys.executable, "train.py")
    d = json.loads(out)["cases"][0]["first_divergence"]
    # The uninterrupted run switches at update 6; the resumed one (from 2) at 8.
    assert code == 1 and (d["step"], d["kind"]) == (6, "jump"), d
    assert d["state_part"].startswith(NOT_CAPTURED) and "nondeterministic" in d["hint"]


def test_a_failed_script_exits_1_and_a_missing_one_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "syntax.py").write_text("print(\n")
    code, out, err = check(capsys, "--", sys.executable, "syntax.py")
    assert code == 1 and "SyntaxError" in out and "verdict: ERROR" in out, (out, err)
    assert "output.log" not in out + err and "working folder was removed" in out
    work = tmp_path / "work"
    code, out, _ = check(capsys, "--workdir", str(work), "--", sys.executable, "syntax.py")
    log = work / "reference" / "output.log"
    assert code == 1 and f"whole output: {log}" in out and "SyntaxError" in log.read_text()
    code, out, err = check(capsys, "--json", "--", sys.executable, "missing.py")
    assert code == 2 and json.loads(out)["exit_status"] == 2 and "no such script" in err
    assert not Path("missing.py").exists()


def test_a_nan_difference_is_drawn_above_the_others_not_at_the_identical_floor(
        tmp_path, monkeypatch):
    """Session 28: a loss gone NaN after the resume was drawn as 1e-12, labelled identical."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from unbroken.proof.plot import plot_check

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    case = _case("jump", "params", NOT_CAPTURED, [])
    c = case.comparison
    assert c is not None
    c.loss_diff = [(s, 0.0 if s <= RESUME else 1e-3 if s == RESUME + 1 else math.nan)
                   for s, _ in c.loss_diff]
    report = CheckReport(["python", "t.py"], STEPS, [case],
                         reference_loss=[(s, 2.0 / s) for s in range(1, STEPS + 1)])
    plot_check(report, str(tmp_path / "p.png"))
    bottom = figures[0].axes[1]
    ys = list(bottom.get_lines()[0].get_ydata())
    assert ys[:RESUME] == [1e-12] * RESUME and ys[RESUME] == 1e-3
    assert all(y > 1e-3 for y in ys[RESUME + 1:])  # NaN: above every finite difference
    labels = [t.get_text() for t in bottom.get_legend().get_texts()]
    assert labels == ["case 1: NaN or infinite difference"]
