"""The demo's training script: a tiny character-level transformer language model.

Everything that makes resuming hard is in it: dropout; random token masking in the dataset's
``__getitem__`` (augmentation) read by 2 DataLoader workers; gradient accumulation over 2
micro-batches; AdamW; warmup + cosine schedule; gradient clipping; an AMP GradScaler whose
scale moves (it starts near overflow with a short growth interval, so some updates are skipped
and the scale halves and doubles); LayerDrop decided by Python's RNG and a random context crop
drawn from NumPy's, in the training loop itself. The corpus is generated, nothing downloads.

    python -m unbroken.proof.tinylm --run runs/tinylm
    unbroken check --random 5 --seed 1 -- python -m unbroken.proof.tinylm --run runs/tinylm
"""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
import torch
import torch.nn.functional as F

from .. import Checkpointer, Identity, ResumableLoader, ResumableSampler, seeded

CONTEXT = 32
WORDS = ("the model saves its state and the run goes on as if it had never stopped "
         "a checkpoint is a promise that every random stream and every sample comes back "
         "optimizer moments learning rate data position loss scale").split()


def corpus(n_chars: int = 40_000) -> str:
    """Deterministic pseudo-sentences (no download)."""
    rng = random.Random(2026)
    out: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class Windows(torch.utils.data.Dataset):
    """Fixed windows of the corpus; 10% of input tokens are masked at random on each read."""

    def __init__(self, text: str, samples: int) -> None:
        chars = sorted(set(text))
        self.vocab = len(chars) + 1  # + the mask token
        self.mask = len(chars)
        ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
        stride = (len(ids) - CONTEXT - 1) // samples
        self.rows = torch.stack([ids[i * stride:i * stride + CONTEXT + 1] for i in range(samples)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i]
        x, y = row[:-1].clone(), row[1:]
        x[torch.rand(CONTEXT) < 0.1] = self.mask  # augmentation: random token masking
        return x, y


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(CONTEXT, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True,
                                             norm_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(n))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
        for i, block in enumerate(self.blocks):
            if i != skip:  # LayerDrop
                h = block(h, src_mask=mask, is_causal=True)
        return self.head(h)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unbroken.proof.tinylm")
    ap.add_argument("--run", default="runs/tinylm")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=768)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    torch.set_num_threads(1)  # bitwise results depend on the thread count: pin it
    data = Windows(corpus(), args.samples)
    model = TinyLM(data.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = ResumableLoader(seeded(data, seed=0),
                             ResumableSampler(len(data), batch_size=16, seed=0),
                             num_workers=args.workers, accumulation=2)
    total = args.epochs * math.ceil(len(loader) / 2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(
        (s + 1) / 6, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**125, growth_interval=3)
    ckpt = Checkpointer(args.run, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                        data=loader, every=args.every, identity=Identity(
                            config={"d": 64, "layers": 2, "context": CONTEXT, "lr": 3e-3,
                                    "samples": args.samples, "epochs": args.epochs}))
    step = ckpt.restore()
    new_window = True
    while loader.epoch < args.epochs:
        for x, y in loader:
            if new_window:  # randomness drawn by the training loop itself, once per update
                skip = 1 if random.random() < 0.2 else None  # LayerDrop (Python's RNG)
                crop = int(np.random.randint(24, CONTEXT + 1))  # context crop (NumPy's RNG)
                new_window = False
            logits = model(x[:, :crop], skip)
            loss = F.cross_entropy(logits.reshape(-1, data.vocab), y[:, :crop].reshape(-1))
            scaler.scale(loss / loader.window_size).backward()
            if not loader.at_boundary:
                continue
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)  # skipped when the scaled gradients overflowed
            scaler.update()
            sched.step()
            opt.zero_grad()
            step += 1
            new_window = True
            ckpt.step_done(step, loss=loss, grad_norm=grad_norm, batch=(x, y))
    ckpt.close()
    print(f"finished {step} updates; loss scale {scaler.get_scale():.3g}")


if __name__ == "__main__":
    main()
