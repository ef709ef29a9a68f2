"""The README's loop over a map-style dataset with DataLoader workers, accumulation and
per-sample noise, for tests/integration/test_review_data_position_kill.py.

``python review_data_position.py --run DIR --log FILE [--workers W] [--persistent]
[--batch B] [--accumulation N] [--epochs E] [--every K] [--sleep S] [--iterable]``

Restores from DIR, trains to the end of epoch E, saving every K updates. Appends to FILE one
JSON line ``{"restored": step}`` after the restore, then one line per completed update with
the step, the epoch its data came from, the sample ids and noise *read from the batches
themselves* (not from the library's bookkeeping) and the loss as the float's hex. ``--sleep``
slows each micro-batch so that a test can SIGKILL it mid-epoch while the workers prefetch.
With ``--iterable`` the data is a resumable IterableDataset instead (items in a NumPy order
of its own)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import unbroken

N = 50


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(int(i)), torch.rand(2, dtype=torch.float64)


class Stream(torch.utils.data.IterableDataset):
    splits_by_worker = True

    def __init__(self) -> None:
        self.epoch = self.consumed = 0
        self.batch_size = 1

    def state_dict(self):
        return {"n": N, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state) -> None:
        assert state["n"] == N
        self.epoch, self.consumed = state["epoch"], state["consumed"]
        self.batch_size = state.get("batch_size", 1)

    def __iter__(self):
        order = np.random.RandomState([5, self.epoch]).permutation(N).tolist()
        info = torch.utils.data.get_worker_info()
        for p in range(self.consumed, N):
            if info is not None and (p - self.consumed) // self.batch_size % info.num_workers \
                    != info.id:
                continue
            g = torch.Generator().manual_seed(1000 * self.epoch + order[p])
            yield torch.tensor(order[p]), torch.rand(2, dtype=torch.float64, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--iterable", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    common = dict(num_workers=args.workers, accumulation=args.accumulation,
                  persistent_workers=args.persistent and args.workers > 0)
    if args.iterable:
        loader = unbroken.ResumableLoader(Stream(), batch_size=args.batch, **common)
    else:
        sampler = unbroken.ResumableSampler(N, batch_size=args.batch, seed=1)
        loader = unbroken.ResumableLoader(unbroken.seeded(Ids(), seed=2), sampler, **common)
    ckpt = unbroken.Checkpointer(args.run, model=model, optimizer=opt, data=loader,
                                 identity=unbroken.Identity(config={"lr": 1e-2}, data="points-v1"),
                                 every=args.every)
    step = ckpt.restore()
    with open(args.log, "a", buffering=1) as log:
        log.write(json.dumps({"restored": step}) + "\n")
        ids: list[int] = []
        noise: list[float] = []
        while loader.epoch < args.epochs:
            epoch = start = loader.epoch
            for index, x in loader:
                if args.sleep:
                    time.sleep(args.sleep)
                ids += [int(i) for i in index]
                noise += [float(v) for v in x.reshape(-1)]
                loss = model(x.float()).pow(2).mean()
                (loss / loader.window_size).backward()
                if not loader.at_boundary:
                    continue
                opt.step()
                opt.zero_grad()
                step += 1
                # logged before step_done saves it: a kill between the two never leaves a
                # saved step that no life logged
                log.write(json.dumps({"step": step, "epoch": epoch, "ids": ids, "noise": noise,
                                      "loss": loss.item().hex()}) + "\n")
                ckpt.step_done(step, loss=loss)
                ids, noise = [], []
                epoch = loader.epoch
            if loader.epoch != start + 1:  # a pass that ran out must have ended its epoch
                raise SystemExit(f"pass of epoch {start} ended at epoch {loader.epoch}")
    ckpt.save()
    ckpt.close()


if __name__ == "__main__":
    main()
