"""A data-bound loop with loader workers started by fork (``python ctrl_c_workers.py RUN
torch|resumable``), ``signals=[SIGINT]``: the test sends Ctrl-C to its whole process group,
workers included. The workers must outlive the parent's stop save: 16 micro-batches an
update, one prefetched each, so the parent needs the workers to reach its boundary."""

from __future__ import annotations

import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import unbroken


class _Slow(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.full((8,), float(i))


def main(root: str, kind: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, signals=[signal.SIGINT])
    if kind == "torch":
        loader = DataLoader(_Slow(), batch_size=4, num_workers=2, prefetch_factor=1,
                            multiprocessing_context="fork")
    else:
        loader = unbroken.ResumableLoader(unbroken.seeded(_Slow(), seed=0),
                                          unbroken.ResumableSampler(100_000, 4),
                                          num_workers=2, prefetch_factor=1,
                                          multiprocessing_context="fork")
    batches = iter(loader)
    print("ready", flush=True)
    for update in range(1, 10_000):
        for _ in range(16):
            model(next(batches)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(update)
        if ckpt.should_stop:
            print(f"stopped at {update}", flush=True)
            break
    ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
