"""(``python fork_exit_loader.py``) A training process iterating a ResumableLoader with forked
workers forks a child that exits normally (``sys.exit``: its exit handlers run), and a
ResumableLoader whose construction fails; the parent must go on iterating, and exit cleanly."""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import Dataset

import unbroken


class _Items(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def main() -> None:
    try:
        unbroken.ResumableLoader(_Items())  # (a map-style dataset needs a sampler: refused)
    except TypeError:
        pass
    loader = unbroken.ResumableLoader(unbroken.seeded(_Items(), seed=0),
                                      unbroken.ResumableSampler(4096, 4), num_workers=2,
                                      multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # (the child's exit handlers run)
    os.waitpid(pid, 0)
    got = sum(1 for _ in range(200) if next(batches) is not None)
    print(f"parent got {got} batches after the child's exit", flush=True)


if __name__ == "__main__":
    main()
