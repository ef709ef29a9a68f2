"""One rank of a gloo job (tests/integration/test_per_rank_extra.py) whose Checkpointer holds an
extra each rank has its own state of (`unbroken.PerRank`: a count and a tensor of the rank's
own values) beside a plain extra every rank holds alike, and a model with BatchNorm fed each
rank's own data. Every collective runs under a 30 s
process-group timeout.

``--mode save``: 3 updates of a DDP model, each rank setting its own values, then a save of
step 3. ``--mode restore``: restores and prints, as one JSON line, what this rank got back."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist

import unbroken

ap = argparse.ArgumentParser()
ap.add_argument("--folder", required=True)
ap.add_argument("--mode", required=True, choices=("save", "restore"))
args = ap.parse_args()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank() if dist.is_initialized() else 0


class Mine:
    """This rank's own state: how many updates it counted and a tensor of its values."""

    def __init__(self) -> None:
        self.count, self.values = 0, torch.zeros(3)

    def state_dict(self) -> dict:
        return {"count": self.count, "values": self.values.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.values = state["count"], state["values"].clone()


class Shared:
    def __init__(self) -> None:
        self.decay = 0.5

    def state_dict(self) -> dict:
        return {"decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]


torch.manual_seed(0)
# (BatchNorm: each rank's running statistics its own after its forward, which DDP replaces by
# rank 0's at the start of the next; a save keeps rank 0's and warns, never refuses)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
mine, shared = Mine(), Shared()


def report(**fields) -> None:
    """One JSON line, in one write (the ranks share the launcher's output)."""
    os.write(1, (json.dumps({"rank": rank, **fields}) + "\n").encode())


ck = unbroken.Checkpointer(args.folder, model=model, optimizer=opt,
                           extras={"mine": unbroken.PerRank(mine), "shared": shared})
try:
    if args.mode == "save":
        for step in range(1, 4):
            ddp(torch.randn(8, 4) + rank).sum().backward()
            opt.step()
            opt.zero_grad()
            mine.count += rank + 1
            mine.values += torch.tensor([rank, 10.0 * rank, step])
            shared.decay *= 0.9
        ck.save(3)
        ck.wait()
        report(saved=3)
    else:
        step = ck.restore()
        report(step=step, count=mine.count, values=mine.values.tolist(), decay=shared.decay)
finally:
    ck.close()
    if dist.is_initialized():
        dist.destroy_process_group()
