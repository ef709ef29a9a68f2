"""The small real training run the tortures use: a model with everything a resume can get
wrong, one update, one life of training logged as exact state digests. The crash torture forks
it again and again; the corruption fuzz makes its base run with it and restores into it."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from ..checkpointer import Checkpointer
from ..errors import RunNotRestored
from ..state.codec import encode_tree
from ..state.identity import Identity
from ..store.backends.killpoints import io_count
from ..store.retention import Keep

STEPS = 24
KEEP_LAST = 2


@dataclass
class Job:
    """The live objects of one training process."""

    ckpt: Checkpointer
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    data: torch.Generator


def build(run: str, every: int | None, keep_last: int, async_save: bool | str = False,
          persist_share: float | None = None) -> Job:
    """A small model with everything a resume can get wrong: AdamW moments, a warm-up
    schedule, dropout (global torch RNG), a registered data generator, NumPy and Python
    randomness. Deterministic given the seeds set here. ``async_save``, ``persist_share``: the
    Checkpointer's."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    data = torch.Generator().manual_seed(1)
    ckpt = Checkpointer(run, model=model, optimizer=opt, scheduler=sched,
                        generators={"data": data},
                        identity=Identity(config={"torture": 1, "width": 16}),
                        every=every, keep=Keep(last=keep_last), async_save=async_save,
                        persist_share=persist_share)
    return Job(ckpt, model, opt, sched, data)


def state_digest(job: Job) -> str:
    """One digest of everything that decides the next update: parameters, optimizer and
    scheduler state, and every RNG stream (Python, NumPy, torch, the data generator). Taken
    from the live objects directly, independent of how unbroken captures them."""
    h = xxhash.xxh3_64()
    tree = {"model": job.model.state_dict(), "optimizer": job.opt.state_dict(),
            "scheduler": job.sched.state_dict(), "python": random.getstate(),
            "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "data": job.data.get_state(), "step": job.ckpt.step}
    skeleton, tensors = encode_tree(tree)
    h.update(json.dumps(skeleton, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def update(job: Job) -> torch.Tensor:
    """One training update (forward, backward, clip, optimizer and scheduler step)."""
    x = torch.randn(16, 8, generator=job.data)
    y = x.sum(1, keepdim=True) + float(np.random.normal(0, 1e-2)) + random.gauss(0, 1e-2)
    loss = (job.model(x) - y).pow(2).mean()
    job.opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1.0)
    job.opt.step()
    job.sched.step()
    return loss


def _emitter(log: str) -> tuple[int, Any]:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def emit(**record: Any) -> None:  # one write per line: a kill never tears a record
        os.write(fd, (json.dumps({**record, "t": time.monotonic()}) + "\n").encode())

    return fd, emit


def train(run: str, log: str, steps: int = STEPS, every: int = 2,
          keep_last: int = KEEP_LAST, reseed: int | None = None,
          async_save: bool | str = False, persist_share: float | None = None) -> None:
    """One life of the run: restore from disk, train to ``steps``, logging exact digests.
    ``reseed``: reseed every random stream after restoring (an independent run, whose states
    differ from the usual one's). With ``async_save``, a save is logged twice: "handed" when
    ``step_done`` returned (the snapshot taken, persisting in the background), and
    "committed" once `Checkpointer.wait` returned it, just before the next save (the point
    where the Checkpointer waits for it anyway) and at the end."""
    fd, emit = _emitter(log)
    emit(e="start", pid=os.getpid())
    job = build(run, every, keep_last, async_save, persist_share)
    start = job.ckpt.restore()
    emit(e="restored", step=start, digest=state_digest(job),
         rejected=[os.path.basename(p) for p, _ in job.ckpt.rejected])
    if reseed is not None:
        torch.manual_seed(reseed)
        random.seed(reseed)
        np.random.seed(reseed)
        job.data.manual_seed(reseed)
    for step in range(start + 1, steps + 1):
        loss = update(job)
        if async_save and step % every == 0:
            _confirm(job, emit)
        saved = job.ckpt.step_done(step, loss=loss)
        emit(e="step", step=step, saved=saved and not async_save,
             handed=bool(saved and async_save), digest=state_digest(job))
    if async_save:
        _confirm(job, emit)
    persister = job.ckpt._persister  # (async_save="process": its I/O counts as the run's)
    job.ckpt.close()
    emit(e="done", step=steps, digest=state_digest(job),
         ops=io_count() + (persister.io_ops if persister is not None else 0))
    os.close(fd)


def _confirm(job: Job, emit: Any) -> None:
    info = job.ckpt.wait()
    if info is not None:
        emit(e="committed", step=info.generation)


def start_without_restore(run: str, log: str, steps: int = STEPS, every: int = 2,
                          keep_last: int = KEEP_LAST, async_save: bool | str = False,
                          persist_share: float | None = None) -> None:
    """A script that forgot ``restore()``: it trains from step 0 in a used run folder until its
    first save, which must raise `RunNotRestored` before writing or deleting anything. Logs
    "refused" (with the error) or, if the save went through, "saved"."""
    fd, emit = _emitter(log)
    emit(e="start", pid=os.getpid())
    job = build(run, every, keep_last, async_save, persist_share)
    step = 0
    try:
        while step < steps:
            loss = update(job)
            step += 1
            if job.ckpt.step_done(step, loss=loss):
                break
        else:
            job.ckpt.save()
        emit(e="saved", step=step)
    except RunNotRestored as e:
        emit(e="refused", error=type(e).__name__, step=step, message=str(e)[:600])
    finally:
        job.ckpt.close()
        os.close(fd)


def prepare_parent() -> None:
    """Import what every life needs once, before any fork: building the first optimizer
    imports torch._dynamo (seconds); it runs no kernel, so no thread pool exists yet."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
