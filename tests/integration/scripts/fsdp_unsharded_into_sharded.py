"""A generation saved unsharded, restored into the same model sharded with FSDP2 (one gloo
rank): refused as a StateMismatch naming the tensor, before any live object changed. Prints
one JSON line: the error's class and message, and the live optimizer's and scheduler's
state after it."""

import datetime
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist

import unbroken


def build(shard: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    folder = os.path.join(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(), "run")
    model, opt, sched = build(False)
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched) as ck:
        for step in (1, 2, 3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step(), opt.zero_grad(), sched.step()
            ck.step_done(step)
        ck.save()
    model, opt, sched = build(True)
    error = None
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched) as ck:
        try:
            ck.restore()
        except unbroken.UnbrokenError as e:
            error = e
    print(json.dumps({"error": type(error).__name__, "message": str(error),
                      "optimizer_states": len(opt.state), "last_epoch": sched.last_epoch,
                      "lr": opt.param_groups[0]["lr"]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
