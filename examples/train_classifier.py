"""A plain PyTorch training loop made resumable with unbroken.

An MLP with dropout classifies 512 id-carrying samples with random augmentation in
``__getitem__`` (noise from torch, NumPy and Python RNGs), AdamW, a warmup + cosine schedule,
gradient clipping, gradient accumulation and DataLoader workers. Kill it at any moment and run
it again: it continues at the first sample no completed update consumed, bit for bit.

    python examples/train_classifier.py --run runs/clf --workers 2 --accumulation 4
    unbroken check --random 3 -- python examples/train_classifier.py --run runs/clf
"""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
import torch
import torch.nn.functional as F

import unbroken


class Points(torch.utils.data.Dataset):
    """512 points in 16 dimensions, 4 classes; each sample is augmented on every read."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :4].argmax(1)).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(16)  # augmentation: torch RNG ...
        x = x * float(np.random.uniform(0.9, 1.1))  # ... NumPy's ...
        if random.random() < 0.5:  # ... and Python's
            x = x.flip(0)
        return x, self.y[i], i


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/classifier")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    torch.manual_seed(0), np.random.seed(0), random.seed(0)  # seed every stream a run uses
    dataset = Points()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = unbroken.ResumableSampler(len(dataset), batch_size=args.batch_size, seed=0)
    loader = unbroken.ResumableLoader(unbroken.seeded(dataset, seed=0), sampler,
                                      num_workers=args.workers, accumulation=args.accumulation)
    updates_per_epoch = math.ceil(len(loader) / args.accumulation)
    total = args.epochs * updates_per_epoch
    warmup = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    # Loader knobs (workers) are not identity: a run may resume with another worker count.
    config = {k: v for k, v in vars(args).items() if k not in ("run", "workers", "every")}
    ckpt = unbroken.Checkpointer(args.run, model=model, optimizer=opt, scheduler=sched,
                                 data=loader, identity=unbroken.Identity(config=config),
                                 every=args.every)
    step = ckpt.restore()
    while loader.epoch < args.epochs:
        for x, y, _ in loader:
            loss = F.cross_entropy(model(x), y) / loader.window_size
            loss.backward()
            if loader.at_boundary:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                ckpt.step_done(step, loss=loss, grad_norm=grad_norm, batch=(x, y))
    ckpt.close()
    print(f"finished: {step} updates, {loader.epoch} epochs")


if __name__ == "__main__":
    main()
