"""What a save blocks a job for, by save mode: the default (committed and durable when it
returns, read back beside the loop), async in a thread, and async in a persisting process
(``async_save="process"``, which survives the rank being killed), on DDP-style replicas of a
model + AdamW in a gloo job on CPU. Every rank saves at the same step; rank 0 prints a table
and a JSON document.

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/job_modes.py            # ~252 MB, 5 saves
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/job_modes.py --layers 5 --saves 3

blocked: from ``save()`` until it returned; durable: until ``wait()`` returned (written,
committed, read back by every rank, retention applied). The first save of each mode is a
warm-up (buffers, the persisting processes' start) and is not counted."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import save_load as sl  # noqa: E402  (helpers: the scratch folder)

import unbroken  # noqa: E402

MODES: dict[str, dict[str, Any]] = {"default": {}, "async thread": {"async_save": True},
                                    "async process": {"async_save": "process"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="Linear(1024, 1024) layers "
                    "(default 20: 252 MB with AdamW)")
    ap.add_argument("--saves", type=int, default=5, help="timed saves a mode (default 5)")
    ap.add_argument("--dir", help="parent of the scratch folder (as save_load.py)")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    mb = sum(t.nbytes for t in sl.state_tensors(model, opt)) / sl.MB
    root = sl.pick_root(args.dir) if rank == 0 else None
    shared = [root]
    dist.broadcast_object_list(shared, 0)
    root = shared[0]
    results: dict[str, dict[str, float]] = {}
    try:
        for mode, options in MODES.items():
            ckpt = unbroken.Checkpointer(os.path.join(root, mode.replace(" ", "-")), model=model,
                                         optimizer=opt, keep=unbroken.Keep(last=1),
                                         async_timeout=120, **options)
            ckpt.restore()
            blocked, durable = [], []
            for step in range(1, args.saves + 2):
                with torch.no_grad():  # an update: every save writes new values
                    for p in model.parameters():
                        p.add_(1e-3)
                dist.barrier()
                t = time.perf_counter()
                ckpt.save(step)
                b = time.perf_counter() - t
                ckpt.wait()
                if step > 1:
                    blocked.append(b)
                    durable.append(time.perf_counter() - t)
            ckpt.close()
            results[mode] = {"blocked_s": statistics.median(blocked), "blocked_min_s":
                             min(blocked), "blocked_max_s": max(blocked),
                             "durable_s": statistics.median(durable)}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, {mb:.0f} MB of model + AdamW a rank "
              f"(replicas), {args.saves} saves a mode (medians, min-max)")
        print("| mode | blocked s | durable s |\n|---|---|---|")
        for mode, r in results.items():
            print(f"| {mode} | {r['blocked_s']:.3f} ({r['blocked_min_s']:.3f}-"
                  f"{r['blocked_max_s']:.3f}) | {r['durable_s']:.3f} |")
        print(json.dumps({"world_size": dist.get_world_size(), "state_mb": mb,
                          "saves": args.saves, "modes": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
