"""SIGKILL at numbered points inside save, commit and retention (real processes): a fresh
process then restores a complete verified generation whose state equals, bit for bit, what
the uninterrupted run had at that step, and finishes the run identically."""

from __future__ import annotations

import signal

import pytest
from conftest import read_log, run_script

TOY = "unbroken._toy"

STEPS, EVERY = 10, 2


def _steps(log: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in log if e["event"] == "step"}


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("ref")
    r = run_script(TOY, "--run", str(tmp / "run"), "--log", str(tmp / "log"),
                   "--steps", str(STEPS), "--every", str(EVERY), "--keep-last", "2")
    assert r.returncode == 0, r.stderr
    return _steps(read_log(tmp / "log"))


# (kill point, generation it is armed for, generation the restore must find)
CASES = [
    ("artifact-1-written", 6, 4),   # after the first artifact of generation 6
    ("artifact-3-written", 6, 4),   # after some more
    ("manifest-written", 6, 4),     # manifest in staging, not yet renamed
    ("before-rename", 6, 4),
    ("after-rename", 6, 6),         # committed, killed before read-back and retention
    ("retention-unlinked", 2, 6),   # generation 2's manifest deleted, folder not yet removed
]


# With async_save="process" the protocol's kill points fall in the persisting process, and
# kill the training process with it (a lost machine); a kill of the training process alone
# just after save() returned ("step-done") leaves the persisting process to commit it.
IN_PROCESS = [("artifact-1-written", 6, 4), ("retention-unlinked", 2, 6), ("step-done", 6, 6)]


@pytest.mark.parametrize("point,armed,expect,mode", [
    *((*c, "off") for c in CASES), *((*c, "process") for c in IN_PROCESS)],
    ids=[c[0] for c in CASES] + [f"process-{c[0]}" for c in IN_PROCESS])
def test_kill_inside_save(tmp_path, ref, point, armed, expect, mode):
    run, log = str(tmp_path / "run"), tmp_path / "log"
    args = ("--run", run, "--log", str(log), "--steps", str(STEPS), "--every", str(EVERY),
            "--keep-last", "2", "--async-save", mode)
    killed = run_script(TOY, *args,
                        env={"UNBROKEN_KILL_AT": f"{point}@{armed}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_script(TOY, *args)
    assert resumed.returncode == 0, resumed.stderr
    events = read_log(log)
    restored = [e for e in events if e["event"] == "restored"]
    assert [e["step"] for e in restored] == [0, expect]
    same = {k: v for k, v in restored[1].items() if k != "event"}
    assert same == {k: v for k, v in ref[expect].items() if k != "event"}
    final = _steps(events)
    assert final[STEPS] == ref[STEPS]
    # No staging debris and no torn generation survive the finished run.
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["LOCK", "RUN.json", "gen-000000008", "gen-000000010"], names
