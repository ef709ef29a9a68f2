"""The README's loop under DDP or FSDP2: every rank builds its Checkpointer on the same run
folder.

Run with ``torchrun --nproc-per-node 2`` or with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set by hand. ``KILL_RANK`` and ``KILL_AT`` arm ``$UNBROKEN_KILL_AT`` on one rank
only (a rank that dies alone); ``SIGNAL_RANK`` and ``SIGNAL_AT`` send SIGTERM to one rank
inside an update (a preemption notice that rank alone receives); ``DIVERGE`` perturbs rank
1's weights (a replica divergence); ``HASH_LOG`` lists the files rank 0 re-hashes.
``--async-save`` saves in the background (``--process-save``: through a persisting process;
``--read-back-sync``: the read-back in save());
``--fsdp`` shards the model with ``fully_shard``
(DTensors) instead of DDP; ``--dump FILE`` writes, from rank 0, digests of the *full* model
and optimizer state (gathered from every rank) at update ``--dump-at`` (right after its save,
or right after a restore to it), and the global sample ids of the next update."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _points import Points

import unbroken
from unbroken.state._digest import digest_tree


def dataset() -> Points:
    """The job's data: 256 noisy points of 8 features, each returned with its id."""
    return Points(256, 8, seed=1234, with_index=True)


def full(value):
    """A DTensor gathered whole (collective); anything else as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_state(model, opt) -> dict[str, str]:
    """Digests of every model tensor and every optimizer state entry, whole, by name."""
    out = {f"model {k}": digest_tree(full(v)) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entry in opt.state.items():
        for key, value in sorted(entry.items()):
            out[f"optimizer {names[id(p)]} {key}"] = digest_tree(full(value))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="runs/ddp")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--process-save", action="store_true")  # async_save="process"
    ap.add_argument("--read-back-sync", action="store_true")
    ap.add_argument("--stop-check-every", type=int, default=1)
    ap.add_argument("--dump")
    ap.add_argument("--dump-at", type=int, default=-1)
    args = ap.parse_args()
    # a rank stuck past this shows every thread's stack in the test's failure, then exits
    faulthandler.dump_traceback_later(150, exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    if os.environ.get("KILL_RANK") == str(rank):
        os.environ["UNBROKEN_KILL_AT"] = os.environ["KILL_AT"]
    if os.environ.get("SIGNAL_RANK") == str(rank):  # SIGTERM lands inside update SIGNAL_AT
        os.environ["UNBROKEN_SIGNAL_AT"] = os.environ["SIGNAL_AT"]
    torch.manual_seed(0), np.random.seed(rank), random.seed(rank)
    data = dataset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 3))
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = unbroken.ResumableSampler(len(data), batch_size=16, seed=0)  # rank from dist
    loader = unbroken.ResumableLoader(unbroken.seeded(data, seed=0), sampler,
                                      num_workers=args.workers)
    groups = len(dist.distributed_c10d._world.pg_map)  # (the job's, before the Checkpointer's)
    ckpt = unbroken.Checkpointer(args.folder, model=net, optimizer=opt, scheduler=sched,
                                 data=loader, every=args.every,
                                 signals=[signal.SIGTERM],
                                 async_save="process" if args.process_save else args.async_save,
                                 read_back="sync" if args.read_back_sync else "background",
                                 async_timeout=60,  # a background collective never hangs CI
                                 stop_check_every=args.stop_check_every)
    if os.environ.get("HASH_LOG") and rank == 0:  # which files rank 0 re-hashes, and when
        hash_file = ckpt.store.fs.hash_file

        def logged(path, *a, **k):
            with open(os.environ["HASH_LOG"], "a") as f:
                f.write(os.path.basename(path) + "\n")
            return hash_file(path, *a, **k)

        ckpt.store.fs.hash_file = logged
    if os.environ.get("READ_LOG"):  # which files each rank reads (READ_LOG.<rank>)
        read_verified = ckpt.store.read_verified

        def logged_read(info, *a, **k):
            out = read_verified(info, *a, **k)
            with open(f"{os.environ['READ_LOG']}.{rank}", "a") as f:
                f.write("".join(f"{info.name}/{name}\n" for name in out))
            return out

        ckpt.store.read_verified = logged_read
    step = ckpt.restore()
    torch.manual_seed(100 + rank) if step == 0 else None  # dropout differs per rank, saved
    if os.environ.get("DIVERGE") and rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1e-3)
    dump: dict = {}
    if step == args.dump_at:
        dump["state"] = full_state(net, opt)
    while loader.epoch < args.epochs and not ckpt.should_stop:
        for x, y, ids in loader:
            if "state" in dump and "ids" not in dump:
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, ids.tolist())
                dump["ids"] = sum(everyone, [])
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            ckpt.step_done(step, loss=loss)
            if step == args.dump_at:
                dump["state"] = full_state(net, opt)
            if ckpt.should_stop:
                print(f"rank {rank} stopped after update {step}", flush=True)
                break
    if args.dump and rank == 0:
        with open(args.dump, "w") as f:
            json.dump(dump, f)
    ckpt.close()
    # an async save's own group is torn down by close(), not left to the interpreter's exit
    assert len(dist.distributed_c10d._world.pg_map) == groups, dist.distributed_c10d._world.pg_map
    dist.destroy_process_group()
    # Past this point everything is saved; with 4 gloo ranks on 2 cores, interpreter teardown
    # aborts now and then ("terminate called without an active exception", in gloo's
    # threads), so leave without it.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
