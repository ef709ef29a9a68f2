"""Variable-length documents packed into fixed-length rows, resumable mid-document.

A tiny next-token model trains on rows cut from a stream of synthetic token documents
(`unbroken.Packer`). The packer's state (epoch, documents consumed, offset into the current
document) goes into every checkpoint, so after a kill the resumed run rebuilds the partial
row exactly and sees the same tokens in the same rows.

    python examples/train_packed_lm.py --run runs/packed
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.nn.functional as F

import unbroken

VOCAB, SEQ = 64, 33


def documents(n: int = 200) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    lengths = torch.randint(5, 60, (n,), generator=g)
    return [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/packed")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)

    torch.manual_seed(0), np.random.seed(0), random.seed(0)  # seed every stream
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, VOCAB))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    packer = unbroken.Packer(documents(), SEQ, batch_size=4, seed=0, eos_id=0)
    ckpt = unbroken.Checkpointer(args.run, model=model, optimizer=opt, data=packer,
                                 identity=unbroken.Identity(config={"vocab": VOCAB, "seq": SEQ}),
                                 every=args.every)
    step = ckpt.restore()
    for rows in packer:
        if step == args.steps:
            break
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        ckpt.step_done(step, loss=loss, batch=rows)
    ckpt.close()


if __name__ == "__main__":
    main()
