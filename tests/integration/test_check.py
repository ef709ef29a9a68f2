"""`unbroken check` on real scripts: it proves a correct resume equivalent in all three kill
phases, and it fails, naming the right state part, when any part is left unrestored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import zygote_process

import unbroken.proof.harness as harness
from unbroken.cli import main

ROOT = Path(__file__).parents[2]
TINY_LM = [sys.executable, str(ROOT / "examples" / "tiny_lm.py")]
# A shorter run of the same script for the many defect cases.
SHORT = [*TINY_LM, "--samples", "192", "--epochs", "2", "--every", "100"]


def check(capsys, *args: str) -> tuple[int, dict]:
    code = main(["check", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_acceptance_default_places_and_random_five_equivalent(capsys, tmp_path, monkeypatch):
    # Each life a fresh process forked from a server that imported torch (as the defect cases
    # below); test_check_cli.py runs the same CLI on processes started from scratch.
    monkeypatch.setattr(harness, "run_process", zygote_process)
    code, out = check(capsys, "--random", "5", "--seed", "1", "--workdir", str(tmp_path),
                      "--plot", str(tmp_path / "check.png"), "--", *TINY_LM)
    assert code == 0, out
    assert out["verdict"] == "equivalent"
    kills = out["cases"][0]["kills"]
    assert {k["phase"] for k in kills} >= {"after-update", "mid-save", "after-commit",
                                           "mid-update"}
    assert sum(k["place"] == "random" for k in kills) >= 3
    for k in kills:
        if not k["reached"]:
            assert k["note"].startswith("skipped"), k
            continue
        # The resume really started where that interruption left the run.
        if k["phase"] == "after-commit":
            assert k["resumed_from"] == k["at"], k
        elif k["phase"] in ("mid-save", "mid-update"):
            assert k["resumed_from"] == k["at"] - 1, k
        else:
            assert k["at"] - 1 <= k["resumed_from"] <= k["at"], k
    covered = " | ".join(out["covered"])
    assert "the first update after a resume" in covered and "the final update" in covered
    assert (tmp_path / "check.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """One uninterrupted run of SHORT, reused by every defect case."""
    tmp = tmp_path_factory.mktemp("ref")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "run_process", zygote_process)
        assert main(["check", "--json", "--at", "9", "--phase", "after-commit", "--workdir",
                     str(tmp), "--", *SHORT]) == 0
    return str(tmp / "reference" / "trace.jsonl")


@pytest.fixture
def forked(monkeypatch):
    """The defect cases' processes forked from the test zygote (see conftest.zygote_process):
    what they test is the attribution, and eight checks of fresh interpreters cost a minute."""
    monkeypatch.setattr(harness, "run_process", zygote_process)


@pytest.mark.parametrize("drop,part", [
    ("optimizer", "optimizer"), ("scheduler", "scheduler"), ("scaler", "scaler"),
    ("data", "data position"), ("rng.python", "rng (python)"), ("rng.numpy", "rng (numpy)"),
    ("rng.torch_cpu", "rng (torch_cpu)"),
])
def test_checker_names_each_missing_part(capsys, tmp_path, reference, forked, drop, part):
    code, out = check(capsys, "--at", "7", "--phase", "after-update", "--drop", drop,
                      "--reference", reference, "--workdir", str(tmp_path), "--", *SHORT)
    assert code == 1, out
    case = out["cases"][0]
    assert case["verdict"] == "diverged" and case["resumed_from"] == 6
    d = case["first_divergence"]
    assert d["state_part"] == part, d
    assert d["step"] == 7 and d["kind"] == "jump"


def test_unknown_part_is_a_usage_error(capsys, tmp_path):
    code = main(["check", "--at", "7", "--drop", "nothing", "--workdir", str(tmp_path), "--",
                 *SHORT])
    assert code == 2
    assert "--drop 'nothing'" in capsys.readouterr().err


NOISY = [sys.executable, str(Path(__file__).parent / "scripts" / "noisy_after_resume.py")]


def test_tolerance_mode_tells_drift_from_a_jump(capsys, tmp_path, monkeypatch):
    """Tiny per-update noise growing after the resume (keyed to a value the process keeps:
    state the Checkpointer does not capture) is reported at the exact level, the update
    before it matched bitwise, so not as a drift from tiny values; it is accepted within a
    tolerance, where a missing optimizer is still a jump."""
    monkeypatch.setenv("NOISE", "1e-7")
    monkeypatch.setattr(harness, "run_process", zygote_process)
    common = ["--at", "12", "--phase", "after-update", "--"]
    code, out = check(capsys, "--workdir", str(tmp_path / "exact"), *common, *NOISY)
    d = out["cases"][0]["first_divergence"]
    assert code == 1 and d["kind"] == "jump" and d["step"] == 13, d
    assert d["state_part"].startswith("state the Checkpointer does not capture"), d
    ref = str(tmp_path / "exact" / "reference" / "trace.jsonl")
    code, out = check(capsys, "--rtol", "1e-4", "--reference", ref, "--workdir",
                      str(tmp_path / "tol"), *common, *NOISY)
    assert code == 0 and out["verdict"] == "equivalent", out
    code, out = check(capsys, "--rtol", "1e-4", "--drop", "optimizer", "--reference", ref,
                      "--workdir", str(tmp_path / "drop"), *common, *NOISY)
    d = out["cases"][0]["first_divergence"]
    assert code == 1 and d["kind"] == "jump" and d["state_part"] == "optimizer", d
