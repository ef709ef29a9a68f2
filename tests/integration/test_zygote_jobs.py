"""The test zygote's jobs of many ranks (`conftest.zygote_job`, `_launch.forked`), which most
multi-rank tests launch through: each rank a process of its own with torchrun's variables and
torch threads, and a job whose rank fails ends at once, its other ranks ended as torchrun's
agent ends them, so that no test of a failing job can hang."""

from __future__ import annotations

import json
import time

from _launch import free_port
from conftest import zygote_job, zygote_ranks

RANK = """
import json, os, sys, time, torch
rank = int(os.environ["RANK"])
print(json.dumps({"rank": rank, "pid": os.getpid(), "threads": torch.get_num_threads(),
                  "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                         "LOCAL_WORLD_SIZE", "MASTER_PORT")},
                  "path0": sys.path[0]}), flush=True)
if sys.argv[1:] == ["fail"]:
    if rank == 1:
        sys.exit(3)
    time.sleep(120)  # (ended by the job: SIGTERM when rank 1 failed)
"""


def test_each_rank_is_a_process_of_its_own_with_torchruns_variables(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    code, ranks = zygote_ranks(3, str(script), [], {"MASTER_PORT": port})
    assert code == 0 and [r.returncode for r in ranks] == [0, 0, 0]
    docs = [json.loads(r.stdout) for r in ranks]
    assert [d["rank"] for d in docs] == [0, 1, 2] and len({d["pid"] for d in docs}) == 3
    assert all(d["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                            "LOCAL_WORLD_SIZE": "3", "MASTER_PORT": port}
               for r, d in enumerate(docs)), docs
    assert all(d["threads"] == 1 for d in docs)  # (torchrun's OMP_NUM_THREADS for many ranks)
    assert all(d["path0"] == str(tmp_path) for d in docs)  # (as `python rank.py` has it)
    two = zygote_job(2, str(script), [], {"OMP_NUM_THREADS": "2"})
    assert [json.loads(x)["threads"] for x in two.stdout.splitlines()] == [2, 2]


def test_a_failing_rank_ends_the_job_at_once(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    t = time.monotonic()
    code, ranks = zygote_ranks(2, str(script), ["fail"], {}, timeout=60)
    assert time.monotonic() - t < 30  # (rank 0 would sleep 120 s)
    assert code == 3 and ranks[1].returncode == 3
    assert ranks[0].returncode == -15  # SIGTERM, as torchrun's agent sends it
