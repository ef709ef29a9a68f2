"""The README's loop under DDP: every rank builds its Checkpointer on the same run folder.

Run with ``torchrun --nproc-per-node 2`` or with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set by hand. ``KILL_RANK`` and ``KILL_AT`` arm ``$UNBROKEN_KILL_AT`` on one rank
only (a rank that dies alone); ``DIVERGE`` perturbs rank 1's weights (a replica divergence)."""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :3].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.05 * torch.randn(8), self.y[i], i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="runs/ddp")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    if os.environ.get("KILL_RANK") == str(rank):
        os.environ["UNBROKEN_KILL_AT"] = os.environ["KILL_AT"]
    torch.manual_seed(0), np.random.seed(rank), random.seed(rank)
    data = Points()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = unbroken.ResumableSampler(len(data), batch_size=16, seed=0)  # rank from dist
    loader = unbroken.ResumableLoader(unbroken.seeded(data, seed=0), sampler,
                                      num_workers=args.workers)
    ckpt = unbroken.Checkpointer(args.folder, model=ddp, optimizer=opt, scheduler=sched,
                                 data=loader, every=args.every)
    step = ckpt.restore()
    torch.manual_seed(100 + rank) if step == 0 else None  # dropout differs per rank, saved
    if os.environ.get("DIVERGE") and rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1e-3)
    while loader.epoch < args.epochs:
        for x, y, _ in loader:
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            ckpt.step_done(step, loss=loss)
    ckpt.close()
    dist.destroy_process_group()
    # Past this point everything is saved; with 4 gloo ranks on 2 cores, interpreter teardown
    # aborts now and then ("terminate called without an active exception", in gloo's
    # threads), so leave without it.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
