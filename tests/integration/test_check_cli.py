"""What a user meets on the way through `unbroken check`: errors found before minutes of
training, the script's own error when it fails, JSON on errors, a crashed resume reported as an
error (not a divergence), and no working folder left behind unless asked."""

from __future__ import annotations

import glob
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import zygote_process

import unbroken.proof.harness as harness
from unbroken.cli import main

CRASHES_ON_RESUME = textwrap.dedent("""
    import random, sys, numpy, torch, unbroken
    random.seed(0); numpy.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer("run", model=model, optimizer=opt, every=2)
    step = ckpt.restore()
    if step:
        raise RuntimeError("cannot open the shard index after a resume")
    for step in range(step + 1, 7):
        model(torch.ones(2)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step)
    ckpt.close()
    """)


@pytest.fixture
def forked_lives(monkeypatch):
    """The check's lives forked from the test zygote (`conftest.zygote_process`): new
    processes that restore from disk alone, without ~2 s of imports each."""
    monkeypatch.setattr(harness, "run_process", zygote_process)


def write(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(code)
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plot_without_matplotlib_fails_before_any_training(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    work = tmp_path / "work"
    code, out, err = run(capsys, "check", "--plot", str(tmp_path / "x.png"), "--workdir",
                         str(work), "--", sys.executable, "-c", "raise SystemExit(9)")
    assert code == 2 and "--plot needs matplotlib" in err
    assert not work.exists()  # nothing ran


def test_a_failing_reference_run_shows_the_scripts_own_error_and_json(capsys, tmp_path):
    script = write(tmp_path, "bad.py", "import sys\nprint('loading data/train.bin')\n"
                   "raise FileNotFoundError('data/train.bin: no such file')\n")
    code, out, err = run(capsys, "check", "--", sys.executable, script)
    assert code == 1  # (a run of the script that fails: found from outside, it exited 2)
    assert "FileNotFoundError: data/train.bin: no such file" in out
    code, out, err = run(capsys, "check", "--json", "--", sys.executable, script)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["verdict"] == "error"
    assert "data/train.bin: no such file" in doc["error"]


def test_a_crashed_resume_is_an_error_not_a_divergence(capsys, tmp_path, monkeypatch,
                                                       forked_lives):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, "train.py", CRASHES_ON_RESUME)
    code, out, err = run(capsys, "check", "--json", "--keep", "--at", "3", "--phase",
                         "after-update", "--", sys.executable, script)  # (one case is enough)
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "error"
    assert "cannot open the shard index after a resume" in doc["cases"][0]["note"]
    assert doc["cases"][0]["first_divergence"] is None
    assert Path(doc["workdir"]).is_dir()  # --keep


def test_the_working_folder_is_removed_unless_kept(capsys, tmp_path, monkeypatch, forked_lives):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = write(tmp_path, "train.py", CRASHES_ON_RESUME.replace(
        "    raise RuntimeError", "    pass  # RuntimeError"))
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "check", "--json", "--at", "3", "--phase", "after-update",
                         "--", sys.executable, script)
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "equivalent" and doc["workdir"] is None
    assert not glob.glob(str(tmp_path / "unbroken-check-*"))


@pytest.mark.parametrize("argv", [["inspect", "{missing}/run"], ["verify", "{missing}"]])
def test_every_command_prints_json_on_errors(capsys, tmp_path, argv):
    # (a folder under tmp_path: a fixed path such as /nonexistent may exist on a machine)
    argv = [a.format(missing=tmp_path / "missing") for a in argv]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 2 and json.loads(out)["ok"] is False and "no such run folder" in err


def test_an_unwritable_plot_path_fails_before_any_training(capsys, tmp_path):
    work = tmp_path / "work"
    code, out, err = run(capsys, "check", "--plot", str(tmp_path / "no" / "dir" / "x.png"),
                         "--workdir", str(work), "--", sys.executable, "-c", "pass")
    assert code == 2 and "cannot be written" in err and not work.exists()


@pytest.mark.parametrize("bad", [["--random", "-1"], ["--rtol", "-1"], ["--rtol", "nan"],
                                 ["--atol", "inf"], ["--at", "0"], ["--timeout", "0"],
                                 ["--exact-steps", "-2"], ["--reference", "/nonexistent"],
                                 ["--exact-steps", "3"]])  # (without a tolerance)
def test_invalid_check_options_are_usage_errors(capsys, tmp_path, bad):
    work = tmp_path / "work"
    code, out, err = run(capsys, "check", *bad, "--workdir", str(work), "--", sys.executable,
                         "-c", "pass")
    assert code == 2 and not work.exists(), err


def test_a_failing_check_removes_its_temporary_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = write(tmp_path, "bad.py", "raise SystemExit('no data')\n")
    code, out, err = run(capsys, "check", "--", sys.executable, script)
    assert code == 1 and "no data" in out and "rerun with --keep" in out
    assert not glob.glob(str(tmp_path / "unbroken-check-*"))


def test_a_drop_of_a_part_the_script_lacks_is_a_usage_error_after_the_reference(
        capsys, tmp_path, forked_lives):
    """(Session 34's attack: every life ran, then each failed at its restore: exit 1.)"""
    script = write(tmp_path, "plain.py", CRASHES_ON_RESUME.replace(
        'raise RuntimeError("cannot open the shard index after a resume")', "pass"))
    work = tmp_path / "work"
    for drop in ("scaler", "extra.ema", "optimizer,scheduler@1"):
        code, out, err = run(capsys, "check", "--drop", drop, "--workdir", str(work),
                             "--json", "--", sys.executable, script)
        doc = json.loads(out)
        assert code == 2 and "the script registers no" in doc["error"], (drop, doc)
        assert not list(work.glob("case-*")), drop  # (nothing was interrupted)


def test_a_failed_case_gives_its_reason_as_the_reports_error(capsys, tmp_path, forked_lives):
    script = write(tmp_path, "crash.py", CRASHES_ON_RESUME)
    # (one case: the three phases' cases each failed alike, in a process started from scratch)
    code, out, err = run(capsys, "check", "--at", "3", "--phase", "after-commit", "--json",
                         "--workdir", str(tmp_path / "w"), "--", sys.executable, script)
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "error"
    assert doc["error"] and "cannot open the shard index" in doc["error"], doc["error"]
