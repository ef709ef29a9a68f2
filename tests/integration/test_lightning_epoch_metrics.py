"""The Lightning adapter and the running epoch aggregates of ``self.log(..., on_epoch=True)``
training metrics: ``Trainer.fit`` SIGKILLed in the middle of an epoch and resumed in a fresh
process logs the same epoch values (mean, max and sum over *all* the epoch's batches, not
only those after the resume), and a ``ReduceLROnPlateau`` monitoring ``train_loss_epoch``
reduces the learning rate at the same epochs, so every update, the final parameters,
optimizer and scheduler state and every logged value are bitwise the uninterrupted run's.

Before the generation held these aggregates, the resumed epoch's mean covered only the
batches after the resume: another logged value, another plateau decision (and ``best``).
A ``torchmetrics.Metric`` logged with ``on_epoch=True``, whose aggregate cannot be saved, is
refused by name at the first batch that logs it (before any generation is saved).

The processes are forks of test_integration_lightning's server (Lightning imported once)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a process of the fork server: this folder is not on its path
    sys.path.insert(0, str(Path(__file__).parent))

import pytest
from test_integration_lightning import forks  # noqa: F401  (the fork server fixture)

import unbroken.proof.harness as harness
from unbroken.proof.equivalence import compare, stitch
from unbroken.trace import read_trace

PER_EPOCH, EPOCHS = 12, 4  # 48 samples in batches of 4


def _run(forks: Any, tmp: Path, name: str, life: str, **env: str) -> Any:  # noqa: F811
    """One process of the child on run folder ``name``; its trace, logged metrics and final
    state go to files named after ``life``."""
    full = {**harness._clean_env({}), "UNBROKEN_TRACE": str(tmp / f"{life}.trace"), **env}
    return forks.run(__file__, ["--child", "--run", str(tmp / name), "--out",
                                str(tmp / life)], full)


def _logged(tmp: Path, lives: list[str]) -> tuple[dict[int, Any], dict[int, Any]]:
    """The values the lives logged, by step and by epoch (epoch-end records): a later life's
    record replaces an earlier one's (the killed life logged steps the resumed one redid)."""
    steps: dict[int, Any] = {}
    epochs: dict[int, Any] = {}
    for life in lives:
        for line in (tmp / f"{life}.log").read_text().splitlines():
            rec = json.loads(line)
            metrics = rec["metrics"]
            if "train_loss_epoch" in metrics:
                epochs[int(float.fromhex(metrics["epoch"]))] = metrics
            else:
                steps[rec["step"]] = metrics
    return steps, epochs


@pytest.mark.parametrize("saved,shown", [(17, False), (12, False), (17, True)])
def test_epoch_aggregates_and_a_plateau_on_them_survive_a_mid_epoch_kill(tmp_path,
                                                                        forks,  # noqa: F811
                                                                        saved, shown):
    """Saved at update 17 (after batch 5 of epoch 1: the running sums hold 5 batches) or 12
    (the boundary into epoch 1: they hold only what ``on_train_epoch_start`` logged, and the
    first batch after the resume is the epoch's first), SIGKILLed inside update 20, resumed
    in a fresh process: everything bitwise the uninterrupted run's. ``shown``: the resumed
    script no longer shows the loss on the progress bar (``prog_bar`` is display only:
    before, Lightning's "logged twice with different arguments" ended the resumed fit)."""
    whole = _run(forks, tmp_path, "whole", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _run(forks, tmp_path, "run", "a", UNBROKEN_SAVE_AT=str(saved),
                  UNBROKEN_KILL_AT="update-end@20")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _run(forks, tmp_path, "run", "b", **({"NO_PROG_BAR": "1"} if shown else {}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved}, reached {EPOCHS * PER_EPOCH}" in resumed.stdout, (
        resumed.stdout)

    ref = read_trace(tmp_path / "whole.trace")
    result = compare(ref, [read_trace(tmp_path / "a.trace"), read_trace(tmp_path / "b.trace")])
    assert result.resumes == [saved], result.resumes
    if shown:  # (the loop state holds how each metric is shown: that differs, as asked)
        assert result.first_divergence.field == "state.extra.lightning", result
    else:
        assert result.verdict == "equivalent", result.first_divergence

    # The plateau did reduce the learning rate, and not at every epoch end: its decisions
    # depend on the epoch means (a partial mean would decide otherwise).
    updates, _ = stitch([ref])
    lrs = [updates[e * PER_EPOCH + 1]["lr"] for e in range(EPOCHS)]
    assert 2 <= len({tuple(lr) for lr in lrs}) < EPOCHS, lrs
    final = json.loads((tmp_path / "whole.final").read_text())
    assert json.loads((tmp_path / "b.final").read_text()) == final

    steps, epochs = _logged(tmp_path, ["whole"])
    got_steps, got_epochs = _logged(tmp_path, ["a", "b"])
    assert sorted(epochs) == list(range(EPOCHS)) and len(steps) == EPOCHS * PER_EPOCH
    assert got_epochs == epochs  # (floats as float.hex: bitwise)
    assert got_steps == steps


def test_a_restored_metric_logged_otherwise_is_refused_naming_the_argument(
        tmp_path, forks):  # noqa: F811
    """The resumed script logs the loss with another reduction than the run that saved its
    running mean: a StateMismatch naming the argument, saved and given (before: Lightning's
    "logged twice with different arguments" from inside the training step)."""
    killed = _run(forks, tmp_path, "run", "a", UNBROKEN_SAVE_AT="17",
                  UNBROKEN_KILL_AT="update-end@20")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _run(forks, tmp_path, "run", "b", REDUCE_MAX="1")
    assert resumed.returncode != 0
    assert "StateMismatch" in resumed.stderr, resumed.stderr[-3000:]
    assert "self.log('train_loss', ...) in training_step" in resumed.stderr
    assert "reduce_fx='mean' saved, 'max' given" in resumed.stderr, resumed.stderr[-3000:]


def test_a_torchmetrics_metric_logged_on_epoch_is_refused_at_its_first_batch(
        tmp_path, forks):  # noqa: F811
    """Its running state lives in the metric object (not saved): refused, naming the key,
    before the first generation (every=5) could silently drop it."""
    r = forks.run(__file__, ["--child", "--run", str(tmp_path / "run"), "--out",
                             str(tmp_path / "m"), "--torchmetric"], harness._clean_env({}))
    assert r.returncode == 0, r.stderr[-3000:]
    kind, message = json.loads(r.stdout.strip().splitlines()[-1])["refused"]
    assert kind == "UnsupportedSetup", (kind, message)
    assert "training_step.train_mae" in message and "torchmetrics" in message, message
    assert not list((tmp_path / "run").glob("gen-*"))  # refused before any generation


def test_older_states_are_read_and_damaged_results_refused(tmp_path, forks):  # noqa: F811
    """A version-3 state (no running aggregates) still passes the checks; a version-4 one
    whose results are damaged or missing is refused by name before anything is loaded."""
    r = forks.run(__file__, ["--child", "--run", str(tmp_path / "run"), "--out",
                             str(tmp_path / "s"), "--states"], harness._clean_env({}))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["saved"] == ["on_train_epoch_start.epoch_lr", "training_step.train_loss",
                            "training_step.train_max", "training_step.train_sum",
                            "training_step.train_acc"], got
    assert got["version 3"] == ["nothing", ""], got
    # (values no save writes: corrupt, so a restore uses the previous generation)
    kind, message = got["damaged"]
    assert kind == "CorruptCheckpoint" and "entry 1 ('training_step.train_loss')" in message, got
    assert "'median'" in message, got
    kind, message = got["missing"]
    assert kind == "CorruptCheckpoint" and "not a list" in message, got


def _child(argv: list[str]) -> None:
    """(In a process of the fork server.) A small classifier with dropout, SGD with momentum
    and a plateau scheduler on ``train_loss_epoch``, trained 4 epochs of 12 updates; logs the
    loss per step and per epoch (mean), its epoch max and sum, the learning rate at each
    epoch start (min) and a torchmetrics accuracy per step; writes every logged record and,
    at the end, digests of the final state. ``--torchmetric``: also a Metric logged on_epoch
    (reports the refusal); ``--states``: reports the loop state's checks (`Probe`)."""
    import argparse
    import hashlib

    import lightning as L
    import torch
    import torch.nn.functional as F
    import torchmetrics
    from lightning.pytorch.loggers import Logger

    import unbroken
    from unbroken.integrations.lightning import UnbrokenCallback

    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--torchmetric", action="store_true")
    ap.add_argument("--states", action="store_true")
    args = ap.parse_args(argv)

    class Points(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(n)
            self.x = torch.randn(n, 4, generator=g)
            self.y = (self.x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.x[i], self.y[i]

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5),
                                           torch.nn.Linear(16, 2))
            # Logged per step only: rebuilt around this object after a resume.
            self.acc = torchmetrics.classification.BinaryAccuracy()
            if args.torchmetric:
                self.mae = torchmetrics.MeanAbsoluteError()

        def on_train_epoch_start(self) -> None:
            # (Logged before the epoch's first batch: its entry is running at a save there.)
            self.log("epoch_lr", self.trainer.optimizers[0].param_groups[0]["lr"],
                     reduce_fx="min")

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            loss = F.cross_entropy(out, y)
            self.log("train_loss", loss, on_step=True, on_epoch=True,
                     prog_bar=not os.environ.get("NO_PROG_BAR"),
                     reduce_fx="max" if os.environ.get("REDUCE_MAX") else "mean")
            self.log("train_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
            self.log("train_sum", loss, on_step=False, on_epoch=True, reduce_fx="sum")
            self.acc(out.argmax(1), y)
            self.log("train_acc", self.acc)
            if args.torchmetric:
                self.mae(out[:, 1], y.float())
                self.log("train_mae", self.mae, on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            # Patience 0 and an absolute threshold of 0.125: an epoch whose mean loss is not
            # 0.125 below the best so far halves the learning rate (some epochs do, some not).
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                opt, patience=0, factor=0.5, threshold=0.125, threshold_mode="abs")
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": plateau, "interval": "epoch", "monitor": "train_loss_epoch"}}

    class Record(Logger):
        """Every logged record, floats as float.hex (bitwise), appended as it is logged."""

        name, version = "record", 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            with open(args.out + ".log", "a") as f:
                f.write(json.dumps({"step": step, "metrics": {
                    k: float(v).hex() for k, v in sorted(metrics.items())}}) + "\n")

        def log_hyperparams(self, params: Any, *a: Any, **k: Any) -> None:
            pass

    L.seed_everything(0, verbose=False)
    loader = unbroken.ResumableLoader(Points(48), unbroken.ResumableSampler(48, 4, seed=0))
    cb = UnbrokenCallback(args.run, every=5 if args.torchmetric else 100)
    net = Net()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, logger=Record(),
                        log_every_n_steps=1, callbacks=[cb], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    if args.states:
        class Probe(L.Callback):
            """At update 3, the loop state's checks on a version-3 state and damaged ones."""

            out: dict[str, Any] = {}

            def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
                if trainer.global_step != 3:
                    return
                loops: Any = cb._loops
                state = loops.state_dict()
                self.out["saved"] = [e["key"] for e in state["results"]]
                old = {**{k: v for k, v in state.items() if k != "results"}, "version": 3}
                damaged = {**state, "results": [state["results"][0],
                                                {**state["results"][1], "reduce_fx": "median"}]}
                for case, st in (("version 3", old), ("damaged", damaged),
                                 ("missing", {**state, "results": None})):
                    try:
                        loops.validate_state_dict(st, "probe")
                        self.out[case] = ["nothing", ""]
                    except Exception as e:  # noqa: BLE001 - reported to the test
                        self.out[case] = [type(e).__name__, str(e)]

        probe = Probe()
        trainer.callbacks.append(probe)
        trainer.fit(net, loader)
        print(json.dumps(probe.out))
        return
    if args.torchmetric:
        try:
            trainer.fit(net, loader)
            print(json.dumps({"refused": ["nothing", ""]}))
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(json.dumps({"refused": [type(e).__name__, str(e)]}))
        return
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
             "lr": float(opt.param_groups[0]["lr"]).hex()}
    Path(args.out + ".final").write_text(json.dumps(final, sort_keys=True))
    print(f"resumed from {cb.restored_step}, reached {cb.step}")


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2:])
