"""A small deterministic training run that, once it has been resumed, perturbs its weights by
a tiny relative amount after every update but the first: numerical nondeterminism on demand
(which, unlike missing state, does not start exactly at the resume), for testing the
checker's drift classification (``NOISE`` sets the size; 0 = none)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

import unbroken

torch.manual_seed(0), np.random.seed(0), random.seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = unbroken.Checkpointer("runs/noisy", model=model, optimizer=opt, every=5)
step = ckpt.restore()
resumed_at = step
noise = float(os.environ.get("NOISE", "0"))
g = torch.Generator().manual_seed(1)
xs, ys = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
while step < 20:
    i = (step * 8) % 64
    loss = torch.nn.functional.mse_loss(model(xs[i:i + 8]), ys[i:i + 8])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if resumed_at and noise and step > resumed_at:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + noise)
    step += 1
    ckpt.step_done(step, loss=loss)
ckpt.close()
