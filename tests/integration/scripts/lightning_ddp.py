"""One rank of a 2-rank Lightning DDP job (gloo, CPU, launched by torchrun) that logs training
metrics each rank holds its own value of (tests/integration/test_lightning_ddp.py): the loss
per step (Lightning's default), its running epoch mean without ``sync_dist`` and its epoch
mean with ``sync_dist=True``, which a ``ReduceLROnPlateau`` monitors (every rank then takes
the same decision). A small classifier with dropout (each rank's own draws) and SGD with
momentum, 4 epochs of 6 updates per rank. Every collective runs under a 30 s process-group
timeout.

Writes, per rank, every logged record (``<out>.rank<r>.log``, floats as float.hex: bitwise)
and at the end digests of the final state (``<out>.rank<r>.final``); prints "resumed from S,
reached N"."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _points import Points
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy

import unbroken
from unbroken.integrations.lightning import UnbrokenCallback

ap = argparse.ArgumentParser()
ap.add_argument("--folder", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--async-save", default="")
args = ap.parse_args()
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)  # (on_step only: each rank's own value)
        self.log("rank_mean", loss, on_step=False, on_epoch=True)  # each rank's own aggregate
        self.log("synced", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        # (an epoch whose synced mean is not 0.05 below the best so far halves the rate)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, patience=0, factor=0.5, threshold=0.05, threshold_mode="abs")
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": plateau, "interval": "epoch", "monitor": "synced"}}


class Record(Logger):
    """Every logged record of this rank, floats as float.hex, appended as it is logged."""

    name, version = "record", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        with open(f"{args.out}.rank{RANK}.log", "a") as f:
            f.write(json.dumps({"step": step, "metrics": {
                k: float(v).hex() for k, v in sorted(metrics.items())}}) + "\n")

    def log_hyperparams(self, params: Any, *a: Any, **k: Any) -> None:
        pass


L.seed_everything(0, verbose=False)
loader = unbroken.ResumableLoader(
    Points(48, 4, seed=48, with_index=False),
    unbroken.ResumableSampler(48, 4, seed=0, rank=RANK, world_size=WORLD))
options: dict[str, Any] = {"every": 100}
if args.async_save:
    options["async_save"] = "process" if args.async_save == "process" else True
cb = UnbrokenCallback(args.folder, **options)
net = Net()
trainer = L.Trainer(
    accelerator="cpu", devices=WORLD, num_nodes=1, max_epochs=4, logger=Record(),
    strategy=DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=30)),
    log_every_n_steps=1, callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, use_distributed_sampler=False)
trainer.fit(net, loader)


def digest(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1).contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


opt = trainer.optimizers[0]
sched = trainer.lr_scheduler_configs[0].scheduler
final = {"model": {k: digest(v) for k, v in net.state_dict().items()},
         "optimizer": {f"{i}.{k}": digest(v) for i, s in opt.state_dict()["state"].items()
                       for k, v in s.items() if isinstance(v, torch.Tensor)},
         "scheduler": {k: repr(v) for k, v in sched.state_dict().items()},
         "lr": float(opt.param_groups[0]["lr"]).hex(),
         "dropout": digest(torch.get_rng_state())}
Path(f"{args.out}.rank{RANK}.final").write_text(json.dumps(final, sort_keys=True))
print(f"rank {RANK}: resumed from {cb.restored_step}, reached {cb.step}", flush=True)
