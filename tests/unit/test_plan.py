"""``unbroken plan``: the save-interval arithmetic, through the API and the command line."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.cli import main
from unbroken.tools.plan import daly, duration, observed_period, plan, young


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def sig3(a: float, b: float) -> bool:
    """Equal to 3 significant digits."""
    return f"{a:.3g}" == f"{b:.3g}"


# -- the seed's example -------------------------------------------------------------------------


def test_thirty_second_save_every_ten_minutes_is_4_76_percent(capsys):
    code, out, err = run_cli(capsys, "--save-seconds", "30", "--interval-minutes", "10")
    assert code == 0, err
    assert "4.76%" in out
    assert "10.0 min" in out and "30.0 s" in out


def test_thirty_second_save_every_ten_minutes_json(capsys):
    code, out, _ = run_cli(capsys, "--save-seconds", "30", "--interval-minutes", "10", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] is True
    [given] = doc["intervals"]
    assert given["label"] == "given"
    assert given["save_overhead"] == pytest.approx(30 / 630)
    assert given["period_seconds"] == 630
    assert given["lost_per_failure_seconds"] == pytest.approx(315)  # half a period, no restart
    assert given["total_overhead"] is None  # no MTBF: failures unknown
    assert doc["young_seconds"] is None and doc["recommended"] is None


# -- Young and Daly against the formulas --------------------------------------------------------


@pytest.mark.parametrize("c, mtbf_h", [(30, 24), (5, 1), (120, 8), (600, 0.5), (2, 1000)])
def test_young_and_daly_match_the_formulas(capsys, c, mtbf_h):
    m = mtbf_h * 3600.0
    expect_young = (2 * c * m) ** 0.5
    expect_daly = (2 * c * m) ** 0.5 * (1 + (1 / 3) * (c / (2 * m)) ** 0.5 + c / (18 * m)) - c
    code, out, _ = run_cli(capsys, "--save-seconds", str(c), "--mtbf-hours", str(mtbf_h),
                           "--json")
    assert code == 0
    doc = json.loads(out)
    assert sig3(doc["young_seconds"], expect_young)
    assert sig3(doc["daly_seconds"], expect_daly)
    assert doc["recommended"] == "Daly" and doc["recommended_seconds"] == doc["daly_seconds"]
    assert young(c, m) == pytest.approx(expect_young)
    assert daly(c, m) == pytest.approx(expect_daly)


def test_daly_is_the_mtbf_when_a_save_costs_twice_the_mtbf():
    result = plan(save_seconds=7200, mtbf_hours=1)
    assert result["daly_seconds"] == 3600 and result["daly_bounded"] is True


def test_the_human_report_names_both_intervals_and_the_recommended_one(capsys):
    code, out, _ = run_cli(capsys, "--save-seconds", "30", "--mtbf-hours", "24")
    assert code == 0
    assert f"Young sqrt(2CM): {duration((2 * 30 * 86400) ** 0.5)}" in out
    assert "Daly (recommended)" in out


# -- failures: lost work and total overhead ----------------------------------------------------


def test_lost_work_and_total_overhead():
    c, r, m = 30.0, 120.0, 24 * 3600.0
    result = plan(c, mtbf_hours=24, restart_seconds=r, interval_minutes=10, hours=720)
    given = result["intervals"][0]
    lost = (600 + c) / 2 + r
    assert given["lost_per_failure_seconds"] == pytest.approx(lost)
    assert result["expected_failures"] == pytest.approx(720 * 3600 / m)  # 30 failures
    assert given["expected_lost_seconds"] == pytest.approx(30 * lost)
    assert given["total_overhead"] == pytest.approx(c / (600 + c) + lost / m)
    # Daly's interval costs less in total than saving every 10 minutes with a 1-day MTBF
    daly_row = next(i for i in result["intervals"] if i["label"] == "Daly")
    assert daly_row["total_overhead"] < given["total_overhead"]


def test_duration_and_failures_in_the_text(capsys):
    code, out, _ = run_cli(capsys, "--save-seconds", "30", "--mtbf-hours", "24",
                           "--restart-seconds", "120", "--hours", "720")
    assert code == 0
    assert "lost over 720 h" in out and "30.0 expected failures" in out


# -- usage errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    ((), "no save cost"),
    (("--mtbf-hours", "24"), "no save cost"),
    (("--save-seconds", "30"), "nothing to compute"),
    (("--save-seconds", "0", "--mtbf-hours", "24"), "> 0"),
    (("--save-seconds", "-3", "--mtbf-hours", "24"), "> 0"),
    (("--save-seconds", "30", "--mtbf-hours", "0"), "> 0"),
    (("--save-seconds", "30", "--mtbf-hours", "nan"), "finite"),
    (("--save-seconds", "30", "--interval-minutes", "-1"), "> 0"),
    (("--save-seconds", "30", "--mtbf-hours", "1", "--restart-seconds", "-1"), ">= 0"),
    (("--save-seconds", "30", "--mtbf-hours", "1", "--bandwidth", "100"), "pass RUN"),
])
def test_usage_errors_exit_2(capsys, argv, says):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert says in err
    assert "Traceback" not in err


def test_usage_error_with_json_is_a_json_document(capsys):
    code, out, _ = run_cli(capsys, "--save-seconds", "30", "--json")
    assert code == 2
    doc = json.loads(out)
    assert doc["ok"] is False and "nothing to compute" in doc["error"]


@pytest.mark.parametrize("kwargs", [
    {"save_seconds": 0, "mtbf_hours": 1}, {"save_seconds": 1, "mtbf_hours": -1},
    {"save_seconds": 1, "mtbf_hours": 1, "restart_seconds": -1},
    {"save_seconds": math.inf, "mtbf_hours": 1}, {"save_seconds": 1}])
def test_the_api_refuses_bad_numbers(kwargs):
    with pytest.raises(ValueError):
        plan(**kwargs)


# -- RUN: what a run records --------------------------------------------------------------------


@pytest.fixture
def run(tmp_path):
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        for step in range(1, 4):
            opt.zero_grad()
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            ckpt.save(step)
    return tmp_path / "run"


def test_a_run_measures_its_save_cost_from_its_manifests(capsys, run):
    from unbroken._runview import open_run
    from unbroken.store.manifest import TO_COMMIT

    timings = [g.manifest.timings[TO_COMMIT] for g in open_run(str(run)).scan()]
    assert len(timings) == 3 and all(t > 0 for t in timings)
    code, out, _ = run_cli(capsys, str(run), "--mtbf-hours", "24", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["save_seconds"] == pytest.approx(sorted(timings)[1])
    code, out, _ = run_cli(capsys, str(run), "--mtbf-hours", "24")
    assert code == 0 and "measured: median of 3 saves" in out


def test_run_without_a_save_cost_says_what_is_missing(capsys, run):
    """Manifests written before unbroken recorded timings: the cost must be given."""
    from unbroken.store.manifest import seal

    for manifest in run.glob("gen-*/MANIFEST.json"):
        fields = json.loads(manifest.read_text())
        del fields["timings"]
        manifest.write_bytes(seal(fields))
    code, _, err = run_cli(capsys, str(run), "--mtbf-hours", "24")
    assert code == 2
    assert "records no save duration" in err
    assert "--save-seconds" in err and "--bandwidth" in err


def test_run_with_a_bandwidth_estimates_from_the_checkpoint_size(capsys, run):
    code, out, err = run_cli(capsys, str(run), "--mtbf-hours", "24", "--bandwidth", "100",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    size = doc["run"]["checkpoint_bytes"]
    # weights and bias plus two AdamW moments of each, float32, plus JSON parts
    assert size > 3 * (32 * 32 + 32) * 4
    assert doc["run"]["generations"] == 3 and doc["run"]["newest_step"] == 3
    assert doc["save_seconds"] == pytest.approx(size / 100e6)
    assert doc["save_source"].startswith("estimated") and "not measured" in doc["save_source"]
    code, out, _ = run_cli(capsys, str(run), "--mtbf-hours", "24", "--bandwidth", "100")
    assert code == 0 and "save cost: estimated" in out and "3 complete generations" in out


def test_run_with_a_given_save_cost(capsys, run):
    code, out, _ = run_cli(capsys, str(run), "--save-seconds", "30", "--interval-minutes",
                           "10", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["save_source"].startswith("given")
    assert doc["intervals"][0]["save_overhead"] == pytest.approx(30 / 630)


def test_run_that_is_not_there_or_empty(capsys, tmp_path):
    code, _, err = run_cli(capsys, str(tmp_path / "nothing"), "--save-seconds", "3",
                           "--mtbf-hours", "1")
    assert code == 2 and "no such run folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, str(tmp_path / "empty"), "--bandwidth", "10",
                           "--mtbf-hours", "1")
    assert code == 2 and "no complete generation" in err


def test_observed_period_from_manifest_times():
    saves = [("r1", 1, 100, "2024-05-01T12:00:00+0000"),
             ("r1", 1, 200, "2024-05-01T12:10:30+0000"),
             ("r1", 1, 300, "2024-05-01T12:21:00+0000"),
             ("r1", 1, 500, "2024-05-01T12:42:00+0000"),  # retention removed step 400
             ("r1", 2, 600, "2024-05-01T15:00:00+0000"),  # a restart: no period across it
             ("r1", 2, 700, "not a time")]
    seen = observed_period(saves)
    assert seen == {"period_seconds": 630.0, "steps": 100, "pairs": 2}
    # saves within the same second cannot be told apart
    assert observed_period([("r", 1, 1, "2024-05-01T12:00:00+0000"),
                            ("r", 1, 2, "2024-05-01T12:00:00+0000")]) is None
    assert observed_period([]) is None


# -- the plot -----------------------------------------------------------------------------------


def test_plot_is_a_png(capsys, tmp_path):
    target = tmp_path / "plan.png"
    code, out, err = run_cli(capsys, "--save-seconds", "30", "--mtbf-hours", "24",
                             "--interval-minutes", "10", "--plot", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {target}" in out


def test_plot_without_matplotlib_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run_cli(capsys, "--save-seconds", "30", "--interval-minutes", "10",
                           "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "pip install 'unbroken[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def test_run_evaluates_the_interval_it_used(capsys, run, monkeypatch):
    # The saves of the fixture are milliseconds apart, below the manifests' one-second
    # timestamps: stand in a period of 10.5 minutes as if observed over two pairs.
    from unbroken.tools import plan as module

    real = module.measure_run

    def measured(path: str):
        found = real(path)
        found["observed"] = {"period_seconds": 630.0, "steps": 1, "pairs": 2}
        return found

    monkeypatch.setattr(module, "measure_run", measured)
    code, out, err = run_cli(capsys, str(run), "--save-seconds", "30")
    assert code == 0, err
    assert "interval: observed, 10.5 min between saves" in out
    assert "observed" in out and "4.76%" in out
    code, out, _ = run_cli(capsys, str(run), "--save-seconds", "30", "--json")
    doc = json.loads(out)
    assert doc["interval_source"] == "observed"
    assert doc["intervals"][0]["label"] == "observed"
    assert doc["intervals"][0]["seconds"] == pytest.approx(600)


# -- extreme inputs -------------------------------------------------------------------------------

_ANY = st.floats(min_value=5e-324, max_value=1.7e308, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(c=_ANY, m=st.none() | _ANY, t=st.none() | _ANY, d=st.none() | _ANY,
       r=st.just(0.0) | _ANY)
def test_any_positive_inputs_give_finite_figures_or_a_value_error(c, m, t, d, r):
    """Extreme but valid numbers never come out as inf or nan, nor raise from the arithmetic
    (a ZeroDivisionError, an OverflowError): figures a user can read, or a ValueError that
    names the inputs (the command line's usage error)."""
    if m is None and t is None:
        return
    try:
        out = plan(c, m, r, t, d)
    except ValueError as e:
        assert "save_seconds=" in str(e)
        return
    numbers = [v for v in out.values() if isinstance(v, float)]
    numbers += [v for i in out["intervals"] for v in i.values() if isinstance(v, float)]
    assert all(math.isfinite(v) for v in numbers)
    assert all(i["seconds"] > 0 for i in out["intervals"])


@pytest.mark.parametrize("argv", [
    ["--save-seconds", "1e308", "--mtbf-hours", "1e308"],
    ["--save-seconds", "1e-320", "--mtbf-hours", "1e-300", "--hours", "1e300"]])
def test_extreme_inputs_are_a_usage_error_not_inf_or_a_crash(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert "overflow or vanish" in err and "unexpected" not in err
    assert "inf" not in out and "nan" not in out
