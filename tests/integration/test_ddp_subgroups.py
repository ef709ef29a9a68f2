"""Checkpointers over subgroups of one world (``process_group=``): ranks 0-1 and 2-3 of a
4-rank gloo world are two jobs, each saving to its own run folder, as pipeline stages or the
replica groups of a hybrid-sharded job do. Every collective of a save (the background ones
too) must stay inside its subgroup: a leader named by its rank in the subgroup, a group of the
saves' own made by the subgroup's ranks alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _launch import free_port
from conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "subgroups.py")


def test_two_jobs_on_subgroups_of_one_world_save_and_restore_their_own(tmp_path):
    """The default save (its read-back over a group of the saves' own, made by the
    subgroup's ranks alone). (The script takes ``--mode process`` too: it passed, in 22 s of
    8 processes, too long for the suite.)"""
    port = str(free_port())
    procs = []
    for r in range(4):
        procs.append(subprocess.Popen(
            [sys.executable, SCRIPT, "--folder", str(tmp_path)],
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [(o["rank"], o["job"], o["restored"], o["same"]) for o in outs] == [
        (0, 0, 3, True), (1, 0, 3, True), (2, 1, 3, True), (3, 1, 3, True)]
    assert all("is not one of its ranks" in o["outside"] for o in outs), outs
    for job in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"job{job}").iterdir()
                      if p.name.startswith("gen-")) == ["gen-000000003"]  # retention ran
