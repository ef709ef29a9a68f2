"""Two jobs in one world of 4 ranks (gloo): ranks 0-1 and ranks 2-3 each train their own
model and save it with a Checkpointer over their own subgroup (``process_group=``), as the
stages of a pipeline or the replicas of a hybrid-sharded job do. Run with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set; ``--mode`` is the Checkpointer's save mode. Each rank resumes
in a second Checkpointer and prints one JSON line: the step it restored, whether its state
equals the one it saved, and what a Checkpointer on the other job's subgroup said."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os

import torch
import torch.distributed as dist

import unbroken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--mode", choices=["default", "sync", "thread", "process"],
                    default="default")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows its stacks, then ends
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    # every rank makes every subgroup, in the same order (as torch asks of new_group)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, job = groups[rank // 2], rank // 2
    options = {"default": {}, "sync": {"read_back": "sync"}, "thread": {"async_save": True},
               "process": {"async_save": "process"}}[args.mode]
    torch.manual_seed(job)  # each job's replicas agree; the jobs differ
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    folder = os.path.join(args.folder, f"job{job}")
    try:  # the other job's subgroup: this rank is not in it
        unbroken.Checkpointer(folder, model=model, process_group=groups[1 - job])
        outside = "accepted"
    except ValueError as e:
        outside = str(e)
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, process_group=mine,
                               keep=unbroken.Keep(last=1), async_timeout=30,
                               **options) as ckpt:
        ckpt.restore()
        for step in range(1, 4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * job + step))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            ckpt.step_done(step)
            ckpt.save()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(99)
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with unbroken.Checkpointer(folder, model=fresh, optimizer=fresh_opt, process_group=mine,
                               async_timeout=30, **options) as again:
        step = again.restore()
    same = all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    print(json.dumps({"rank": rank, "job": job, "restored": step, "same": same,
                      "outside": outside}), flush=True)
    # Rank 0 holds the world's store, which the other job's ranks may still be using (their
    # subgroups are made through it): every rank ends together (within the 30 s timeout).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
