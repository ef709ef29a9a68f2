"""The README's loop on many ranks with DistributedDataParallel.

Every rank builds a Checkpointer on the same run folder and they act as one job: rank 0 holds
the writer lock and publishes each generation's manifest, each rank writes its own files, and
the model, optimizer, scheduler and data cursor are written once. Kill the job at any moment
(or send SIGTERM to any one rank) and run the same command again: every rank continues from
the newest committed generation; another number of ranks continues it too.

    torchrun --nproc-per-node 2 examples/train_ddp.py --folder runs/ddp

gloo on CPU; with CUDA, one GPU per LOCAL_RANK and NCCL for the model's tensors (unbroken's
own collectives are small CPU tensors, which go through gloo).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="runs/ddp")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1024, 16, generator=g)
    ds = torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4)).to(device)
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    torch.manual_seed(1 + rank)  # each rank its own dropout draws (saved per rank)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    # batch_size is the global batch: each rank takes its contiguous 64 / world_size of it.
    sampler = unbroken.ResumableSampler(len(ds), batch_size=64, seed=0)
    loader = unbroken.ResumableLoader(unbroken.seeded(ds, seed=0), sampler, num_workers=2)
    ckpt = unbroken.Checkpointer(args.folder, model=net, optimizer=opt, scheduler=sched,
                                 data=loader, every=args.every, keep=unbroken.Keep(last=3),
                                 signals=[signal.SIGTERM])
    step = ckpt.restore()  # agreed by every rank: the same generation, or all raise
    print(f"rank {rank} of {world}: " + (f"restored step {step}" if step else "fresh start"),
          flush=True)
    while loader.epoch < args.epochs and not ckpt.should_stop:
        for xb, yb in loader:
            loss = F.cross_entropy(net(xb.to(device)), yb.to(device))
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients across ranks here
            opt.step()
            sched.step()
            step += 1
            ckpt.step_done(step, loss=loss)  # every rank calls it; saves are collective
            if ckpt.should_stop:  # SIGTERM reached some rank: every rank saved this update
                print(f"rank {rank}: stopped after update {step}", flush=True)
                break
    ckpt.save()  # a no-op when this step is already saved
    ckpt.close()
    if rank == 0 and not ckpt.should_stop:
        print(f"finished: {step} updates, {loader.epoch} epochs", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
