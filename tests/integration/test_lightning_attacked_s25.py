"""The Lightning adapter against what validation leaves behind for training: `unbroken check`
SIGKILLs ``Trainer.fit`` after a mid-epoch validation (``val_check_interval``) or after the
first validation of a ``persistent_workers=True`` validation loader, resumes it in a fresh
process and compares every update bitwise with the uninterrupted run.

* An epoch-end ``ReduceLROnPlateau`` and ``EarlyStopping(check_on_train_epoch_end=True)`` read
  ``trainer.callback_metrics["val_loss"]`` logged by a validation before the save: the
  generation holds the callback metrics (else the resumed run fails, or skips the LR
  reduction and diverges silently).
* Persistent validation workers draw their base seed from the torch RNG on their first pass,
  which a resumed process makes at another update: validation leaves training's streams as it
  found them, and each starts its own workers (else every later dropout mask differs).

The processes are forks of test_integration_lightning's server (Lightning imported once)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a process of the fork server: this folder is not on its path
    sys.path.insert(0, str(Path(__file__).parent))

import pytest
from test_integration_lightning import forks  # noqa: F401  (the fork server fixture)

import unbroken.proof.harness as harness
from unbroken.cli import main
from unbroken.proof.equivalence import stitch
from unbroken.trace import read_trace

PER_EPOCH = 16  # 64 samples in batches of 4; validation after batches 5, 10 and 15


def _check(capsys: Any, tmp_path: Path, at: int, *argv: str) -> dict[str, Any]:
    """`unbroken check` killing the child (this file) once, after the commit of generation
    ``at``: the report, asserted equivalent with that one kill reached and resumed from."""
    code = main(["check", "--json", "--workdir", str(tmp_path), "--at", str(at), "--phase",
                 "after-commit", "--", sys.executable, __file__, "--child", "--run",
                 str(tmp_path / "unused"), *argv])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "equivalent", out
    kills = [k for case in out["cases"] for k in case["kills"]]
    assert [(k["reached"], k["resumed_from"]) for k in kills] == [(True, at)], kills
    return out


@pytest.mark.parametrize("watcher", ["plateau", "early-stopping"])
def test_a_metric_of_a_mid_epoch_validation_survives_a_resume(capsys, tmp_path, forks,  # noqa: F811
                                                               monkeypatch, watcher):
    """Killed after generation 15 (the epoch's last validation ran at batch 15, none runs at its
    end): the resumed process's epoch-end plateau step (strict=False: without the metric it
    would skip the reduction silently) or EarlyStopping check reads that validation's val_loss,
    and every update, the learning rate and the stop are the uninterrupted run's."""
    monkeypatch.setattr(harness, "run_process", forks.run_process)
    out = _check(capsys, tmp_path, 15, f"--{watcher}", "--val-interval", "5")
    updates, _ = stitch(read_trace(p) for p in sorted((tmp_path / "case-01").glob("life-*")))
    lrs = [updates[s]["lr"] for s in sorted(updates)]
    if watcher == "plateau":  # the LR was reduced at the end of epoch 0 and of epoch 1
        assert out["steps"] == 3 * PER_EPOCH
        assert len({tuple(lr) for lr in lrs}) == 3, lrs
    else:  # no val_loss improves by 10: patience 1 stops the run after epoch 1 of 3
        assert out["steps"] == 2 * PER_EPOCH


def test_persistent_validation_workers_leave_training_streams_alone(capsys, tmp_path,
                                                                   forks,  # noqa: F811
                                                                   monkeypatch):
    """Two persistent validation workers with a random augmentation, a plateau scheduler on
    their val_loss and dropout in training; killed after generation 20 (epoch 1, after the
    first validation): the resumed process starts its validation workers at the next
    validation only, yet every update is bitwise the uninterrupted run's."""
    monkeypatch.setattr(harness, "run_process", forks.run_process)
    out = _check(capsys, tmp_path, 20, "--val-workers", "2", "--plateau")
    assert out["steps"] == 3 * PER_EPOCH


def _child(argv: list[str]) -> None:
    """(In a process of the fork server.) A small classifier with dropout trained 3 epochs of
    16 updates, saved every 5, validated through a plain DataLoader."""
    import argparse

    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import EarlyStopping

    import unbroken
    from unbroken.integrations.lightning import UnbrokenCallback

    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--plateau", action="store_true")
    ap.add_argument("--early-stopping", action="store_true")
    ap.add_argument("--val-interval", type=int, default=None)
    ap.add_argument("--val-workers", type=int, default=0)
    args = ap.parse_args(argv)

    class Points(torch.utils.data.Dataset):
        def __init__(self, n: int, augment: bool) -> None:
            g = torch.Generator().manual_seed(n)
            self.x, self.augment = torch.randn(n, 4, generator=g), augment
            self.y = (self.x.sum(1) > 0).long()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            noise = 0.3 * torch.randn(4) if self.augment else 0.0  # the worker's torch stream
            return self.x[i] + noise, self.y[i]

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5),
                                           torch.nn.Linear(16, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            if not args.plateau:
                return opt
            # (threshold 10: no epoch improves, so each epoch end after the first reduces)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5,
                                                                 threshold=10.0)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": plateau, "interval": "epoch", "monitor": "val_loss",
                "strict": False}}

    L.seed_everything(0, verbose=False)
    train = Points(64, augment=False)
    loader = unbroken.ResumableLoader(train, unbroken.ResumableSampler(64, 4, seed=0))
    workers = {"num_workers": args.val_workers, "persistent_workers": args.val_workers > 0}
    val = torch.utils.data.DataLoader(Points(32, augment=args.val_workers > 0), batch_size=16,
                                      **workers)
    callbacks: list[Any] = [UnbrokenCallback(args.run, every=5)]
    if args.early_stopping:
        callbacks.append(EarlyStopping("val_loss", patience=1, min_delta=10.0,
                                       check_on_train_epoch_end=True))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False,
                        val_check_interval=args.val_interval, num_sanity_val_steps=0,
                        callbacks=callbacks, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), loader, val)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2:])
