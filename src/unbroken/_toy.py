"""Seed 000's toy experiment through unbroken's real API: one weight, momentum, a
step-dependent learning rate, a shuffled dataset and random input perturbations drawn from
Python, NumPy and torch. Each event appends a JSON line of exact state digests to --log, so an
interrupted run can be compared with the uninterrupted one bit for bit. ``--defect`` resumes
deliberately wrongly (weights only; momentum cleared) to show what that changes.

Run as ``python -m unbroken._toy --run DIR --log FILE``; used by ``unbroken demo`` and tests."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from typing import Any

import numpy as np
import torch
import xxhash

from . import Checkpointer, Identity, Keep
from .state.rng import capture_rng, rng_digests

N, BATCH = 16, 4


def _hash(tensors) -> str:
    return xxhash.xxh3_64(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()


def digests(model, opt, sched, gens) -> dict:
    """Exact digests of the state that decides the next update."""
    opt_tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"weight": model.weight.item().hex(), "model": _hash(model.state_dict().values()),
            "optimizer": _hash(opt_tensors), "lr": sched.get_last_lr()[0].hex(),
            "rng": rng_digests(capture_rng(gens))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unbroken._toy")
    ap.add_argument("--run", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--stop-after", type=int, default=None, help="exit cleanly after this step")
    ap.add_argument("--every", type=int, default=None)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--data-revision", default="toy-v1")
    ap.add_argument("--log", required=True)
    ap.add_argument("--async-save", choices=["off", "thread", "process"], default="off")
    ap.add_argument("--defect", choices=["none", "weights_only", "clear_momentum"], default="none")
    args = ap.parse_args(argv)

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    xs = torch.linspace(-1, 1, N)
    ys = 3.0 * xs + 0.5
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))
    noise = torch.Generator().manual_seed(7)
    gens = {"noise": noise}
    ident = Identity(config={"lr": 0.1, "momentum": 0.9}, data=args.data_revision)

    def log(event: str, step: int) -> None:
        with open(args.log, "a") as f:
            f.write(json.dumps({"event": event, "step": step,
                                **digests(model, opt, sched, gens)}) + "\n")

    if args.defect == "weights_only":
        # A warm start: weights from the interrupted run, everything else new.
        fresh = args.run + "-warm"
        shutil.rmtree(fresh, ignore_errors=True)
        ckpt: Any = Checkpointer(fresh, model=model, optimizer=opt, scheduler=sched,
                                     generators=gens, identity=ident, every=args.every)
        ckpt.restore(intent="warm_start", source=args.run)
        ckpt.close()
        ckpt = None
        start = 5  # continue the step count as a naive weights-only resume would
    else:
        ckpt = Checkpointer(args.run, model=model, optimizer=opt, scheduler=sched,
                                     generators=gens, identity=ident, every=args.every,
                                     keep=Keep(last=args.keep_last),
                                     async_save={"off": False, "thread": True}.get(
                                         args.async_save, args.async_save))
        start = ckpt.restore()
        if args.defect == "clear_momentum":
            for s in opt.state.values():
                s["momentum_buffer"].zero_()
    log("restored", start)
    for step in range(start + 1, args.steps + 1):
        epoch, offset = divmod((step - 1) * BATCH, N)
        order = torch.randperm(N, generator=torch.Generator().manual_seed(1000 + epoch))
        idx = order[offset:offset + BATCH]
        x = xs[idx] + 0.01 * torch.randn(BATCH, generator=noise) + 0.001 * torch.randn(BATCH)
        x = x + float(np.random.normal(0, 1e-3)) + random.gauss(0, 1e-3)
        loss = ((model(x[:, None]).squeeze(1) - ys[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if ckpt is not None:
            ckpt.step_done(step, loss=loss)
        log("step", step)
        if ckpt is not None and args.stop_after == step:
            ckpt.save(step)
            break
    if ckpt is not None:
        ckpt.close()


if __name__ == "__main__":
    main()
