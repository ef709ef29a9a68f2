"""`unbroken check` at an epoch's last update, where a per-epoch scheduler stepped after the
inner loop is lost by a save made before it (found by an outside attack: the check added its own
save at ``step_done`` there and killed right after it, so a script that saves after the
scheduler step, as the README advises, was reported diverged, though no save of its own ever
left that state). The kill now follows the script's own first save there, when it makes one."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import SCRIPTS, zygote_process

from unbroken.cli import main
from unbroken.proof import harness
from unbroken.proof.checkplan import Kill

SCRIPT = [sys.executable, str(SCRIPTS / "epoch_scheduler.py")]


@pytest.mark.parametrize("args,verdict", [
    ((), "diverged"),  # the scheduler step lost: no save after it
    (("--save-after",), "equivalent"),  # the README's remedy
    (("--save-after", "--every", "6"), "diverged"),  # its own save at 12 comes first
])
def test_the_epoch_edge_kill_follows_the_scripts_own_save(capsys, tmp_path, monkeypatch, args,
                                                           verdict):
    monkeypatch.setattr(harness, "run_process", zygote_process)
    code = main(["check", "--json", "--at", "12", "--phase", "after-commit", "--workdir",
                 str(tmp_path), "--", *SCRIPT, *args])
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == verdict, out
    assert code == (0 if verdict == "equivalent" else 1)
    case = out["cases"][0]
    assert case["kills"][0]["resumed_from"] == 12, case
    if verdict == "diverged":
        assert case["first_divergence"]["state_part"] == "scheduler", case


def test_an_after_commit_kill_adds_a_save_only_where_the_script_makes_none():
    assert Kill(12, "after-commit").env() == {"UNBROKEN_SAVE_AT": "12",
                                               "UNBROKEN_KILL_AT": "after-rename@12"}
    assert Kill(12, "after-commit").env([10, 12]) == {"UNBROKEN_KILL_AT": "after-rename@12"}
    assert Kill(12, "mid-save").env([12])["UNBROKEN_SAVE_AT"] == "11,12"  # (inside either)
