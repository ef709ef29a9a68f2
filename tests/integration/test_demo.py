"""`unbroken demo`, the main job: a tiny LM killed with SIGKILL mid-epoch and resumed
bitwise, then each defective resume caught and attributed to its state part. (Its own file so
that the test runner can run it beside test_check.py's cases.)"""

from __future__ import annotations

import json

from conftest import zygote_process

from unbroken.cli import main
from unbroken.proof import demo


def test_demo_proves_resume_and_attributes_every_defect(capsys, tmp_path, monkeypatch):
    # Its eight lives are forked from the test zygote, which has imported torch: each a new
    # process that restores only from disk and is SIGKILLed as a whole group, without the
    # ~3 s of an interpreter's start (the CLI on interpreters started from scratch is tested
    # by test_check_cli.py, and `unbroken demo` itself is the README's first command).
    monkeypatch.setattr(demo, "run_process", zygote_process)
    assert main(["demo", "--json", "--dir", str(tmp_path / "demo")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["killed_by_sigkill"]
    assert out["seconds"] < 90
    assert out["resume"]["verdict"] == "equivalent" and out["resume"]["resumed_from"] == 30
    d = out["defects"]
    assert d["weights_only"]["state_part"] == "optimizer"
    assert d["no_scheduler"]["state_part"] == "scheduler"
    assert d["no_rng"]["state_part"].startswith("rng")
    assert d["no_data_position"]["state_part"] == "data position"
    assert all(v["verdict"] == "diverged" for k, v in d.items() if k != "torn_latest")
    torn = d["torn_latest"]
    assert torn["verdict"] == "equivalent" and torn["refused"] == ["gen-000000030"]
    assert torn["resumed_from"] == 20
