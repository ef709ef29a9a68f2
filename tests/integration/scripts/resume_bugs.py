"""A realistic training script with one resume bug injected by name (``--bug``), for testing
that `unbroken check` catches each with its default kill points and names the part to fix.

Correct (``--bug none``): an MLP with dropout, id-carrying data augmented in ``__getitem__``,
noise from a registered torch and NumPy generator in the loop, AdamW, warmup + cosine per
update, clipping, an AMP GradScaler whose scale overflows now and then (skipped steps), and an
EMA of the weights registered as an extra whose validation loss goes to ``step_done``."""

from __future__ import annotations

import argparse
import math
import random
import signal

import numpy as np
import torch
import torch.nn.functional as F

import unbroken

BUGS = {
    "none": "correct",
    "scheduler-unregistered": "the scheduler is not passed to the Checkpointer",
    "scheduler-stepped-twice": "sched.step() once more after restore()",
    "scheduler-recreated": "a new scheduler built after restore() drives the rates",
    "per-epoch-scheduler": "sched.step() after the inner loop, after step_done saved",
    "scaler-unregistered": "the GradScaler is not passed to the Checkpointer",
    "reseed-after-restore": "torch.manual_seed() after restore()",
    "generator-reseeded": "the registered noise generator is reseeded after restore()",
    "optimizer-recreated": "a new AdamW built after restore()",
    "weight-decay-changed": "weight_decay changed after restore()",
    "eval-left-on": "model.eval() after restore(), never model.train()",
    "python-global": "a Python counter in the loss restarts at 0",
    "generator-unregistered": "the loop's torch.Generator is not registered",
    "ema-unregistered": "the EMA of the weights is not registered",
    "data-unregistered": "the loader is not passed to the Checkpointer",
    "extra-overwritten": "the registered EMA is re-initialised after restore()",
    "epoch-skipped": "the sampler moved on to the next epoch after restore() (a resume in "
                     "the last epoch then ends the run at once)",
}


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, :3].argmax(1)).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.05 * torch.randn(8)
        if random.random() < 0.5:
            x = x * float(np.random.uniform(0.9, 1.1))
        return x, self.y[i], i


class Rotary(torch.nn.Module):
    """A rotary-style table cached in a non-persistent buffer, grown lazily to the longest
    length seen so far: never saved, rebuilt after a resume, same values where used."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.detach().abs().sum().item() * 10) % 7 + 1
        if self.cache.numel() < n:
            self.cache = torch.cos(torch.arange(n, dtype=torch.float32))
        return x + 0.01 * self.cache[:n].mean()


class EMA:
    """An exponential moving average of the weights (a Stateful extra)."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)

    def state_dict(self):
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state) -> None:
        self.decay = state["decay"]
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/bugs")
    ap.add_argument("--bug", default="none", choices=sorted(BUGS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--signals", action="store_true", help="stop cleanly on SIGTERM")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--rotary", action="store_true", help="a lazily grown rotary cache")
    args = ap.parse_args()
    bug = args.bug

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    data = Points()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                *([Rotary()] if args.rotary else []), torch.nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sampler = unbroken.ResumableSampler(len(data), batch_size=8, seed=0)
    loader = unbroken.ResumableLoader(unbroken.seeded(data, seed=0), sampler,
                                      accumulation=args.accumulation)
    total = args.epochs * math.ceil(len(loader) / args.accumulation)

    def schedule(s: int) -> float:
        return min((s + 1) / 4, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    if bug == "per-epoch-scheduler":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 122, growth_interval=2)
    ema = EMA(model)
    noise = torch.Generator().manual_seed(1)
    jitter = np.random.default_rng(2)
    generators = {"jitter": jitter}
    if bug != "generator-unregistered":
        generators["noise"] = noise
    ckpt = unbroken.Checkpointer(
        args.run, model=model, optimizer=opt,
        scheduler=None if bug == "scheduler-unregistered" else sched,
        scaler=None if bug == "scaler-unregistered" else scaler,
        data=None if bug == "data-unregistered" else loader,
        extras=None if bug == "ema-unregistered" else {"ema": ema},
        generators=generators, every=args.every,
        signals=(signal.SIGTERM,) if args.signals else ())
    step = ckpt.restore()
    if bug == "data-unregistered":
        loader.load_state_dict({**loader.state_dict(), "epoch": step * 8 // len(data),
                                "consumed": 0})  # a script that only keeps the epoch
    resumed = step > 0
    if resumed and bug == "epoch-skipped":
        sampler.set_epoch(loader.epoch + 1)
    if resumed and bug == "scheduler-stepped-twice":
        sched.step()
    if resumed and bug == "scheduler-recreated":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if resumed and bug == "reseed-after-restore":
        torch.manual_seed(0)
    if resumed and bug == "generator-reseeded":
        noise.manual_seed(1)
    if resumed and bug == "optimizer-recreated":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule, last_epoch=-1)
    if resumed and bug == "weight-decay-changed":
        for g in opt.param_groups:
            g["weight_decay"] = 0.05
    if resumed and bug == "extra-overwritten":
        ema.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    if resumed and bug == "eval-left-on":
        model.eval()
    counter = 0 if bug == "python-global" else step
    val_x, val_y = data.x[:32], data.y[:32]
    while loader.epoch < args.epochs:
        for batch in loader:
            x, y, _ = batch
            x = x + 0.01 * torch.randn(x.shape, generator=noise)
            x = x * float(jitter.uniform(0.95, 1.05))
            loss = F.cross_entropy(model(x), y) + 1e-4 * counter
            # * 64: large enough to overflow now and then
            scaler.scale(loss * 64 / loader.window_size).backward()
            if not loader.at_boundary:
                continue
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)  # skipped when the scaled gradients overflowed
            scaler.update()
            if bug != "per-epoch-scheduler":
                sched.step()
            opt.zero_grad()
            ema.update(model)
            training = model.training
            model.eval()
            with torch.no_grad():
                ema_val = F.cross_entropy(torch.func.functional_call(model, ema.shadow, (val_x,)),
                                          val_y)
            model.train(training)
            step += 1
            counter += 1
            ckpt.step_done(step, loss=loss, grad_norm=grad_norm, batch=batch, ema_val=ema_val)
            if ckpt.should_stop:
                break
        if ckpt.should_stop:
            break
        if bug == "per-epoch-scheduler":
            sched.step()  # after step_done saved the epoch's last update: lost on resume
    ckpt.close()


if __name__ == "__main__":
    main()
