"""The Hugging Face Trainer made resumable with unbroken (``unbroken[transformers]``).

A small classifier with dropout trains on 232 id-carrying samples with random augmentation in
``__getitem__`` (torch, NumPy and Python RNGs) and a random feature mask in the collator,
through ``transformers.Trainer`` on the CPU: AdamW, warmup + cosine from TrainingArguments,
gradient accumulation over an epoch whose last batch and last update window are short, and
two DataLoader workers. Kill it at any moment and run it again: ``trainer.train()`` continues
at the first sample no completed update consumed, bit for bit.

    python examples/transformers_train.py --run runs/hf
    unbroken check -- python examples/transformers_train.py --run runs/hf
    unbroken check --at 5 --phase sigterm -- python examples/transformers_train.py --run runs/hf
"""

from __future__ import annotations

import argparse
import random
import signal

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from unbroken.integrations.transformers import attach


class Points(torch.utils.data.Dataset):
    """Points in 16 dimensions, 4 classes; each sample is augmented on every read."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x[:, :4].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(16)  # augmentation: torch RNG ...
        x = x * float(np.random.uniform(0.9, 1.1))  # ... NumPy's ...
        if random.random() < 0.5:  # ... and Python's
            x = x.flip(0)
        return {"x": x, "labels": self.y[i]}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack, and mask 10% of the features at random (as a masked-LM collator would)."""
    batch = transformers.default_data_collator(samples)
    batch["x"] = batch["x"] * (torch.rand(batch["x"].shape) > 0.1)
    return batch


class Classifier(torch.nn.Module):
    """An MLP with dropout returning ``{"loss", "logits"}``, as Trainer models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/hf")
    ap.add_argument("--samples", type=int, default=232)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=3)
    # under torchrun: how long a rank waits for the others in a collective (the Trainer's
    # default is 30 minutes)
    ap.add_argument("--ddp-timeout", type=int, default=1800)
    args = ap.parse_args(argv)

    transformers.set_seed(0)  # seeds Python, NumPy and torch before the model is built
    training = transformers.TrainingArguments(
        output_dir=f"{args.run}.trainer", use_cpu=True, report_to=[], disable_tqdm=True,
        save_strategy="no", seed=0, num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, learning_rate=3e-3, weight_decay=0.01,
        lr_scheduler_type="cosine", warmup_steps=3, max_grad_norm=1.0, logging_steps=4,
        dataloader_num_workers=args.workers, ddp_timeout=args.ddp_timeout)
    trainer = transformers.Trainer(model=Classifier(), args=training,
                                   train_dataset=Points(args.samples), data_collator=collate)
    # The run folder, saved every N updates; SIGTERM (a scheduler's notice) saves and stops.
    unbroken = attach(trainer, args.run, every=args.every, signals=[signal.SIGTERM])
    out = trainer.train(resume_from_checkpoint=True)  # continues from the newest generation
    if unbroken.checkpointer is not None and unbroken.checkpointer.should_stop:
        print(f"stopped by SIGTERM after {out.global_step} updates (saved); run it again")
    else:
        print(f"finished: {out.global_step} updates, epoch {trainer.state.epoch}")


if __name__ == "__main__":
    main()
