"""Checkpointers over subgroups of one world (``process_group=``): ranks 0-1 and 2-3 of a
4-rank gloo world are two jobs, each saving to its own run folder, as pipeline stages or the
replica groups of a hybrid-sharded job do. Every collective of a save (the background ones
too) must stay inside its subgroup: a leader named by its rank in the subgroup, a group of the
saves' own made by the subgroup's ranks alone."""

from __future__ import annotations

import json

import pytest
from _launch import free_port
from conftest import SCRIPTS, zygote_job

SCRIPT = str(SCRIPTS / "subgroups.py")


@pytest.mark.parametrize("mode", ["default", "process"])
def test_two_jobs_on_subgroups_of_one_world_save_and_restore_their_own(tmp_path, mode):
    """The default save (its read-back over a group of the saves' own, made by the
    subgroup's ranks alone), and the saves of persisting processes; the 4 ranks forked from
    the test zygote (as 8 fresh processes, the process mode took 22 s)."""
    r = zygote_job(4, SCRIPT, ["--folder", str(tmp_path), "--mode", mode],
                   {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(o["rank"], o["job"], o["restored"], o["same"]) for o in outs] == [
        (0, 0, 3, True), (1, 0, 3, True), (2, 1, 3, True), (3, 1, 3, True)]
    assert all("is not one of its ranks" in o["outside"] for o in outs), outs
    for job in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"job{job}").iterdir()
                      if p.name.startswith("gen-")) == ["gen-000000003"]  # retention ran
