"""A Lightning ``Trainer.fit`` made resumable with unbroken.

An MLP with dropout classifies 256 id-carrying points with random augmentation in
``__getitem__`` (noise from torch, NumPy and Python RNGs), AdamW, a warmup + cosine schedule
stepped per update, gradient clipping, two DataLoader workers and a validation pass at each
epoch's end. Kill it at any moment (even mid-epoch) and run it again: ``fit`` continues at the
next batch, bit for bit. SIGTERM (what SLURM sends) saves at the next update and stops.
Under torchrun it trains as a DDP job of as many processes (gloo on CPU), each rank logging
its own training loss.

    python examples/lightning_train.py --run runs/lightning
    unbroken check -- python examples/lightning_train.py --run runs/lightning
    torchrun --nproc-per-node 2 examples/lightning_train.py --run runs/lightning-ddp
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

import unbroken
from unbroken.integrations.lightning import UnbrokenCallback


class Points(torch.utils.data.Dataset):
    """Points in 16 dimensions, 4 classes; each sample is augmented on every read."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
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


class Classifier(L.LightningModule):
    def __init__(self, lr: float, total: int) -> None:
        super().__init__()
        self.lr, self.total = lr, total
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = F.cross_entropy(self(x), y)
        # (each rank's own value; the epoch mean syncs across ranks when it is computed)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = max(1, self.total // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(
            (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / self.total)))))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> None:
    """Train (or continue) the run; ``callbacks``: more Lightning callbacks (their
    ``state_dict``, e.g. EarlyStopping's, is saved with each generation)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/lightning")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    L.seed_everything(0, verbose=False)  # seeds Python, NumPy and torch; harmless to resumes
    # Under torchrun: this process's rank (the Trainer sets up the process group later); the
    # batch is the global one, each rank taking its contiguous share.
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dataset = Points(args.samples)
    sampler = unbroken.ResumableSampler(len(dataset), batch_size=args.batch_size, seed=0,
                                        rank=rank, world_size=world)
    loader = unbroken.ResumableLoader(unbroken.seeded(dataset, seed=0), sampler,
                                      num_workers=args.workers, accumulation=args.accumulation)
    # Validation may read through a plain DataLoader: the callback resumes the training data.
    val = torch.utils.data.DataLoader(Points(64, seed=99), batch_size=32)
    total = args.epochs * math.ceil(len(loader) / args.accumulation)
    model = Classifier(args.lr, total)
    # Loader knobs (workers) are not identity: a run may resume with another worker count.
    config = {k: v for k, v in vars(args).items() if k not in ("run", "workers", "every")}
    callback = UnbrokenCallback(args.run, identity=unbroken.Identity(config=config),
                                every=args.every, signals=[signal.SIGTERM])
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=args.epochs,
                        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
                        use_distributed_sampler=False,
                        max_steps=args.max_steps,
                        accumulate_grad_batches=args.accumulation, gradient_clip_val=1.0,
                        deterministic=True, callbacks=[callback, *callbacks], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader, val)
    print(f"finished: {callback.step} updates (resumed from {callback.restored_step}), "
          f"epoch {trainer.current_epoch}")


if __name__ == "__main__":
    main()
