"""A 2-rank job (gloo on CPU) for tests/integration/test_job_saves_s27.py. Run with RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT set and ``CASE``:

- ``noop``: each rank passes its own loss to ``step_done`` (as the README loop does), which
  saves step 4 (``every=4``); ``save()`` again at step 4, nothing changed, is a no-op (the
  manifest holds the leader's loss: the other rank's differs);
- ``hang``: rank 1 stops answering (sleeps) before the save of step 2; rank 0's save, with
  the default read-back (beside the loop), fails within the process group's timeout (3 s),
  not ``async_timeout`` (600 s), as a `SaveFailed`;
- ``dies``: rank 1 exits before the save of step 2; rank 0's save is a `SaveFailed`.

Writes ``<out>/result.rank<r>.json``: what the second save raised and how long it took."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

import unbroken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    case = os.environ["CASE"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ck = unbroken.Checkpointer(args.folder, model=ddp, optimizer=opt, every=4)
    ck.restore()
    torch.manual_seed(rank)
    result: dict[str, object] = {"raised": None}
    last = 4 if case == "noop" else 2
    for step in range(1, last + 1):
        loss = ddp(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == last and rank == 1 and case == "hang":
            time.sleep(60)  # (the test kills it long before)
        if step == last and rank == 1 and case == "dies":
            os._exit(3)
        started = time.monotonic()
        try:
            ck.step_done(step, loss=loss)  # (its own loss on each rank)
            if case == "noop":
                ck.wait()
                result["before"] = sorted(os.listdir(args.folder))
                ck.save()  # at step 4 again, nothing changed
                ck.wait()
                result["after"] = sorted(os.listdir(args.folder))
            elif step == last:
                ck.save()
                ck.wait()
        except unbroken.UnbrokenError as e:
            result["raised"] = {"type": type(e).__name__, "message": str(e),
                                "is_save_failed": isinstance(e, unbroken.SaveFailed)}
        result["seconds"] = time.monotonic() - started
    with open(os.path.join(args.out, f"result.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if case != "noop":
        os._exit(0)  # (the other rank is gone or stuck: no collective at close)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
