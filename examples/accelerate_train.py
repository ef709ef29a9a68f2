"""An Accelerate training loop made resumable with unbroken.

An MLP with dropout classifies 224 id-carrying samples with random augmentation in
``__getitem__`` (noise from torch, NumPy and Python RNGs), AdamW, warmup + cosine, gradient
clipping, 2 DataLoader workers and Accelerate's gradient accumulation (``accumulate``,
``sync_gradients``; 14 micro-batches an epoch in windows of 3, so each epoch ends with a
window of 2). Kill it at any moment and run it again: it continues at the first sample no
completed update consumed, bit for bit. SIGTERM (a preemption notice) saves at the next update
boundary and stops.

    python examples/accelerate_train.py --run runs/acc
    unbroken check -- python examples/accelerate_train.py --run runs/acc
    torchrun --nproc-per-node 2 examples/accelerate_train.py   # a DDP job (runs/accelerate)
"""

from __future__ import annotations

import argparse
import math
import random
import signal

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration

import unbroken
from unbroken.integrations import accelerate as ua


class Points(torch.utils.data.Dataset):
    """Points in 16 dimensions, 4 classes; each sample is augmented on every read."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x[:, :4].argmax(1)

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
    ap.add_argument("--run", default="runs/accelerate")
    ap.add_argument("--samples", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accumulation", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    torch.manual_seed(0), np.random.seed(0), random.seed(0)  # seed every stream a run uses
    # split_batches: under torchrun, each rank takes its share of the sampler's global batch.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    dataset = Points(args.samples)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = unbroken.ResumableSampler(len(dataset), batch_size=args.batch_size, seed=0)
    loader = unbroken.ResumableLoader(unbroken.seeded(dataset, seed=0), sampler,
                                      num_workers=args.workers, accumulation=args.accumulation)
    total = args.epochs * math.ceil(len(loader) / args.accumulation)  # optimizer updates
    warmup = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    # accelerator.prepare, except that the ResumableLoader keeps its exact data position.
    model, opt, loader, sched = ua.prepare(accelerator, model, opt, loader, sched)
    # Loader knobs (workers) are not identity: a run may resume with another worker count.
    config = {k: v for k, v in vars(args).items() if k not in ("run", "workers", "every")}
    ckpt = ua.checkpointer(accelerator, args.run, model=model, optimizer=opt, scheduler=sched,
                           data=loader, identity=unbroken.Identity(config=config),
                           every=args.every, signals=[signal.SIGTERM])
    step = ckpt.restore()
    while loader.epoch < args.epochs and not ckpt.should_stop:
        for x, y, _ in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)  # divides by the accumulation steps
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()  # Accelerate steps these only when the window is complete
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:  # an update completed: trace it, save when due
                step += 1
                ckpt.step_done(step, loss=loss, grad_norm=grad_norm, batch=(x, y))
                if ckpt.should_stop:  # SIGTERM arrived: the generation is saved, leave now
                    break
    ckpt.close()
    print(f"finished: {step} updates, {loader.epoch} epochs")


if __name__ == "__main__":
    main()
