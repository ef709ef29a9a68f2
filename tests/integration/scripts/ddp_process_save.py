"""A 2-rank DDP loop whose saves persist in processes of their own (``async_save="process"``),
for test_ddp_process_save.py. Run with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.

After every save (every ``--every`` updates) each rank writes its model and optimizer tensors
to ``<out>/state.<step>.rank<r>.safetensors`` and the marker ``<out>/saved.<step>.rank<r>``.
``KILL_RANK`` and ``KILL_AT``: that rank SIGKILLs itself right after the save of update
``KILL_AT`` returned; ``DIE_RANK`` and ``DIE_AT``: inside it, once the generation's staging
folder is agreed, before it hands its share over. At the end each rank lists the libraries
its persisting process loaded in ``<out>/persister.rank<r>.json``. ``FAIL_RANK`` and
``FAIL_AT``: that rank's persisting process cannot write its first file of generation
``FAIL_AT`` (a folder is in its way); every rank then waits for that save and writes what it
raised to ``<out>/failed.rank<r>.json``. ``PERSISTER_KILL_RANK`` and
``PERSISTER_KILL_AT``: that rank's persisting process is SIGKILLed right after its rename
committed generation ``PERSISTER_KILL_AT``, before it replied; a ``step_done`` that raises
`SaveFailed` (the last save's failure: its own save not made) is written to
``<out>/raised.<step>.rank<r>.json`` and its save made again. ``NO_RESTORE``: a fresh run
that does not call ``restore()``."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _points import Points
from safetensors.torch import save_file

import unbroken


def dump(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entry in opt.state.items():
        for key, value in entry.items():
            tensors[f"optimizer.{names[id(p)]}.{key}"] = value.detach().clone()
    save_file(tensors, path)


def fail_first_file(persister, staging_of_step: int) -> None:
    """Put a folder where the persisting process writes its first file of that save."""
    submit = persister.submit

    def failing(request, artifacts):
        if request["step"] == staging_of_step:
            os.mkdir(os.path.join(request["job"]["staging"], next(iter(artifacts))))
        submit(request, artifacts)

    persister.submit = failing


def die_before_handing_over(persister, step: int) -> None:
    """SIGKILL this rank inside the save of ``step``, where it would hand its share over."""
    submit = persister.submit

    def dying(request, artifacts):
        if request["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        submit(request, artifacts)

    persister.submit = dying


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(100, exit=True)  # a stuck rank shows its stacks, ends
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0), np.random.seed(rank), random.seed(rank)
    data = Points(256, 8, seed=1234, with_index=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 3))
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sampler = unbroken.ResumableSampler(len(data), batch_size=16, seed=0)
    loader = unbroken.ResumableLoader(unbroken.seeded(data, seed=0), sampler, num_workers=0)
    env = os.environ
    if env.get("PERSISTER_KILL_RANK") == str(rank):  # (before the Checkpointer starts it)
        env["UNBROKEN_KILL_SELF_AT"] = f"after-rename@{env['PERSISTER_KILL_AT']}"
    ckpt = unbroken.Checkpointer(args.folder, model=net, optimizer=opt, data=loader,
                                 every=args.every, keep=unbroken.Keep(last=2),
                                 async_save="process", async_timeout=20)
    if env.get("FAIL_RANK") == str(rank):
        fail_first_file(ckpt._persister, int(env["FAIL_AT"]))
    if env.get("DIE_RANK") == str(rank):
        die_before_handing_over(ckpt._persister, int(env["DIE_AT"]))
    step = 0 if env.get("NO_RESTORE") else ckpt.restore()  # (a fresh run may skip it)
    print(f"rank {rank} restored {step}", flush=True)
    torch.manual_seed(100 + rank) if step == 0 else None  # dropout differs per rank, saved
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            try:
                saved = ckpt.step_done(step, loss=loss)
            except unbroken.SaveFailed as e:  # (the last save's failure: this one not made)
                with open(os.path.join(args.out, f"raised.{step}.rank{rank}.json"), "w") as f:
                    json.dump({"message": str(e)}, f)
                ckpt.save(step)
                saved = True
            if saved:  # the save handed over: save() returned
                dump(os.path.join(args.out, f"state.{step}.rank{rank}.safetensors"), model, opt)
                open(os.path.join(args.out, f"saved.{step}.rank{rank}"), "w").close()
                if env.get("KILL_RANK") == str(rank) and step == int(env["KILL_AT"]):
                    os.kill(os.getpid(), signal.SIGKILL)
            if env.get("FAIL_AT") == str(step):
                started = time.monotonic()
                try:
                    ckpt.wait()
                    failed = None
                except unbroken.UnbrokenError as e:
                    failed = {"type": type(e).__name__, "message": str(e)}
                with open(os.path.join(args.out, f"failed.rank{rank}.json"), "w") as f:
                    json.dump({"raised": failed, "seconds": time.monotonic() - started,
                               "folder": sorted(os.listdir(args.folder))}, f)
            if step == args.steps:
                break
    persister = ckpt._persister._proc  # (its maps: which libraries it loaded)
    if persister is not None and persister.poll() is None:
        with open(f"/proc/{persister.pid}/maps") as f:
            libs = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in f if ".so" in line})
        with open(os.path.join(args.out, f"persister.rank{rank}.json"), "w") as f:
            json.dump({"libraries": libs}, f)
    ckpt.close()
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # (as ddp_train.py: no gloo teardown at interpreter exit)


if __name__ == "__main__":
    main()
