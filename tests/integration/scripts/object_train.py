"""The README's loop on a run named by URL (an object store): two DataLoader workers, dropout,
per-sample noise, warmup then decay, a save every 3 updates, the last 2 kept.

``python object_train.py URL UNTIL [--digest FILE]``: train from the newest generation up to
update UNTIL and write, with ``--digest``, the digests of the final model and optimizer state.
The store's endpoint and credentials come from the environment (``FSSPEC_S3_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...), as a user's would."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _points import Points

import unbroken
from unbroken.state._digest import digest_tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("until", type=int)
    ap.add_argument("--digest")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97 ** s)
    sampler = unbroken.ResumableSampler(96, batch_size=8, seed=0)
    data = Points(96, 6, seed=7, with_index=False)
    loader = unbroken.ResumableLoader(unbroken.seeded(data, seed=0), sampler,
                                      num_workers=2)
    ckpt = unbroken.Checkpointer(args.url, model=model, optimizer=opt, scheduler=sched,
                                 data=loader, every=3, keep=unbroken.Keep(last=2))
    step = ckpt.restore()
    while step < args.until:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            ckpt.step_done(step, loss=loss)
            if step == args.until:
                break
    ckpt.close()
    if args.digest:
        with open(args.digest, "w") as f:
            json.dump({"model": digest_tree(model.state_dict()),
                       "optimizer": digest_tree(opt.state_dict())}, f)


if __name__ == "__main__":
    main()
