"""The Lightning adapter with the real library on CPU: `unbroken check` kills the example's
``Trainer.fit`` with SIGKILL mid-epoch (two DataLoader workers, dropout, random augmentation,
warmup + cosine) and resumes it in fresh processes: every update bitwise equal to the
uninterrupted run, every sample of each epoch seen once; a torn newest generation is refused
and the previous one used; setups that cannot resume exactly are refused by name.

Importing Lightning takes ~9 s on two cores, so every process here is forked from one server
(tests/integration/_zygote.py's protocol) that imported it once: each is still a new process
that never trained and restores only from disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import unbroken.proof.harness as harness
from unbroken.cli import main
from unbroken.proof.equivalence import compare, stitch
from unbroken.trace import read_trace

HERE = Path(__file__).parent
EXAMPLE = str(Path(__file__).parents[2] / "examples" / "lightning_train.py")
SAMPLES, BATCH = 256, 16  # the example's defaults: 16 updates per epoch, 2 epochs
PER_EPOCH = SAMPLES // BATCH
# Lightning imported before the fork server's loop starts (it then runs as __main__).
PRELOAD = ("import sys, runpy, lightning, unbroken.integrations.lightning; "
           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


class Forks:
    """Client of a fork server that imported Lightning."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PRELOAD, str(HERE / "_zygote.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, script: str, argv: list[str], env: dict[str, str],
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            assert self.proc.stdin and self.proc.stdout
            self.proc.stdin.write(json.dumps({"script": script, "argv": argv, "env": env,
                                              "out": out, "err": err,
                                              "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
            return subprocess.CompletedProcess([script, *argv], reply["returncode"],
                                               Path(out).read_text(), Path(err).read_text())

    def run_process(self, cmd: list[str], env: dict[str, str], log: str, timeout: float) -> int:
        """`harness.run_process` through the server (``cmd`` is [python, script, *argv])."""
        assert cmd[0] == sys.executable and cmd[1].endswith(".py"), cmd
        r = self.run(cmd[1], cmd[2:], harness._clean_env(env), timeout)
        with open(log, "a") as f:
            f.write(r.stdout + r.stderr)
        return r.returncode

    def example(self, *argv: str, trace: Path) -> subprocess.CompletedProcess[str]:
        env = {**harness._clean_env({}), "UNBROKEN_TRACE": str(trace)}
        r = self.run(EXAMPLE, list(argv), env)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.kill()  # (every child has ended; Lightning's interpreter exit takes ~1 s)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def forks():
    server = Forks()
    yield server
    server.close()


def test_check_kills_mid_epoch_and_resumes_bitwise(capsys, tmp_path, forks, monkeypatch):
    """The acceptance: the default places of `unbroken check` (inside a save and after it,
    inside the first update after a resume, mid-epoch; the last update of an epoch; the first
    and the final update) on the example, each a SIGKILL of the whole process group."""
    monkeypatch.setattr(harness, "run_process", forks.run_process)
    code = main(["check", "--json", "--workdir", str(tmp_path), "--", sys.executable, EXAMPLE,
                 "--run", str(tmp_path / "unused")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "equivalent", out
    assert out["steps"] == 2 * PER_EPOCH
    kills = [k for case in out["cases"] for k in case["kills"]]
    assert all(k["reached"] for k in kills), kills
    assert {k["phase"] for k in kills} >= {"after-update", "mid-save", "after-commit",
                                           "mid-update"}
    mid_epoch = [k for k in kills if k["at"] % PER_EPOCH and k["at"] > 1]
    assert {k["phase"] for k in mid_epoch} >= {"mid-save", "mid-update"}, kills
    assert any(k["at"] == PER_EPOCH and k["resumed_from"] == PER_EPOCH for k in kills), kills

    lives = sorted((tmp_path / "case-01").glob("life-*.jsonl"))
    segments = [read_trace(p) for p in lives]
    restored = [r["step"] for seg in segments for r in seg if r["event"] == "restore"]
    assert any(0 < s % PER_EPOCH for s in restored), restored  # resumed inside an epoch
    updates, _ = stitch(segments)
    assert sorted(updates) == list(range(1, 2 * PER_EPOCH + 1))
    for epoch in range(2):
        steps = range(epoch * PER_EPOCH + 1, (epoch + 1) * PER_EPOCH + 1)
        assert {updates[s]["epoch"] for s in steps} == {epoch}
        seen = Counter(i for s in steps for i in updates[s]["ids"])
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch


def test_check_with_accumulation_and_a_shorter_last_window(capsys, tmp_path, forks,
                                                          monkeypatch):
    """accumulate_grad_batches=4 over 15 batches an epoch (windows of 4, 4, 4 and 3): Lightning
    steps where the loader's windows close, and saves land on those boundaries."""
    monkeypatch.setattr(harness, "run_process", forks.run_process)
    code = main(["check", "--json", "--workdir", str(tmp_path), "--", sys.executable, EXAMPLE,
                 "--run", str(tmp_path / "unused"), "--samples", "240", "--accumulation", "4",
                 "--workers", "0", "--every", "3"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "equivalent", out
    assert out["steps"] == 8
    kills = [k for case in out["cases"] for k in case["kills"]]
    assert all(k["reached"] for k in kills) and any(k["at"] == 3 for k in kills), kills
    updates, _ = stitch(read_trace(p) for p in sorted((tmp_path / "case-01").glob("life-*")))
    assert [len(updates[s]["ids"]) for s in range(1, 5)] == [64, 64, 64, 48]


SMALL = ["--samples", "96", "--workers", "0", "--every", "5"]  # 6 updates an epoch, 12 in all


@pytest.fixture(scope="module")
def finished(tmp_path_factory, forks) -> tuple[Path, list[dict[str, Any]]]:
    """A finished run of the example saved at updates 5 and 10 (both mid-epoch) and at its
    end, and its trace."""
    tmp = tmp_path_factory.mktemp("finished")
    forks.example("--run", str(tmp / "run"), *SMALL, trace=tmp / "trace.jsonl")
    assert sorted(p.name for p in (tmp / "run").glob("gen-*")) == [
        "gen-000000005", "gen-000000010", "gen-000000012"]
    return tmp / "run", read_trace(tmp / "trace.jsonl")


@pytest.mark.parametrize("tear", ["manifest", "truncated"])
def test_torn_newest_generation_is_refused_and_the_previous_used(tmp_path, forks, finished,
                                                                  tear):
    source, reference = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    newest = run / "gen-000000012"
    if tear == "manifest":  # killed before the commit's last write
        (newest / "MANIFEST.json").unlink()
    else:  # a file cut short
        model = newest / "model.safetensors"
        os.truncate(model, model.stat().st_size // 2)
    r = forks.example("--run", str(run), *SMALL, trace=tmp_path / "trace.jsonl")
    assert "finished: 12 updates (resumed from 10)" in r.stdout, r.stdout
    resumed = read_trace(tmp_path / "trace.jsonl")
    restore = resumed[0]
    assert restore["event"] == "restore" and restore["step"] == 10, restore
    assert any("gen-000000012" in name for name in restore["rejected"]), restore
    label = {"manifest": "torn", "truncated": "corrupt"}[tear]
    assert [p.name.split("-2")[0] for p in (run / "aside").iterdir()] == [
        f"gen-000000012-{label}"]
    result = compare(reference, [reference, resumed])
    assert result.resumed_from == 10 and result.restore_differs == []
    assert result.verdict == "equivalent", result.first_divergence
    assert [u["step"] for u in resumed if u["event"] == "update"] == [11, 12]


def test_a_finished_run_run_again_or_killed_after_its_final_commit_trains_nothing(
        capsys, tmp_path, forks, finished, monkeypatch):
    """``fit`` ends with a generation of its final state (max_epochs reached; its last epoch's
    batch count is still in the loops, the loader already at the next epoch's start): run
    again, the script restores it and trains nothing; SIGKILLed right after that generation's
    commit, the resumed process does the same."""
    source, _ = finished
    shutil.copytree(source, tmp_path / "run")
    r = forks.example("--run", str(tmp_path / "run"), *SMALL, trace=tmp_path / "again.jsonl")
    assert "finished: 12 updates (resumed from 12), epoch 2" in r.stdout, r.stdout
    assert [e for e in read_trace(tmp_path / "again.jsonl") if e["event"] == "update"] == []
    assert sorted(p.name for p in (tmp_path / "run").glob("gen-*")) == sorted(
        p.name for p in source.glob("gen-*"))  # (the final state was saved: nothing new)

    monkeypatch.setattr(harness, "run_process", forks.run_process)
    code = main(["check", "--json", "--workdir", str(tmp_path / "check"), "--at", "12",
                 "--phase", "after-commit", "--", sys.executable, EXAMPLE, "--run",
                 str(tmp_path / "unused"), *SMALL])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "equivalent", out
    kills = [k for case in out["cases"] for k in case["kills"]]
    assert [(k["reached"], k["resumed_from"]) for k in kills] == [(True, 12)], kills


def test_max_steps_stops_identically_after_a_resume(tmp_path, forks):
    """A run ending by max_steps inside an epoch, killed inside an update after a save and
    resumed, stops at the same update as the uninterrupted run; run again, it trains nothing."""
    args = ["--samples", "96", "--workers", "0", "--every", "100", "--max-steps", "9"]
    whole = forks.example("--run", str(tmp_path / "whole"), *args, trace=tmp_path / "whole.jsonl")
    assert "finished: 9 updates (resumed from 0), epoch 2" in whole.stdout, whole.stdout
    env = {**harness._clean_env({}), "UNBROKEN_SAVE_AT": "4",
           "UNBROKEN_KILL_AT": "update-end@6", "UNBROKEN_TRACE": str(tmp_path / "a.jsonl")}
    killed = forks.run(EXAMPLE, ["--run", str(tmp_path / "run"), *args], env)
    assert killed.returncode == -9, killed.stderr[-3000:]
    lives = [read_trace(tmp_path / "a.jsonl")]
    for life, resumed_from in (("b", 4), ("c", 9)):
        r = forks.example("--run", str(tmp_path / "run"), *args, trace=tmp_path / f"{life}.jsonl")
        assert f"finished: 9 updates (resumed from {resumed_from}), epoch 2" in r.stdout, r.stdout
        lives.append(read_trace(tmp_path / f"{life}.jsonl"))
    assert [r["step"] for r in lives[2] if r["event"] == "update"] == []
    result = compare(read_trace(tmp_path / "whole.jsonl"), lives)
    assert result.verdict == "equivalent" and result.resumes == [4, 9], result.first_divergence


def test_early_stopping_state_and_its_stop_survive_a_resume(capsys, tmp_path, forks,
                                                            monkeypatch):
    """EarlyStopping (patience 1, no val_loss ever improves by 10) ends the run after epoch 1:
    killed mid-epoch 1 its patience count and best score come back (else it stops an epoch
    later); killed after the final update's commit, the stop it requested comes back (else
    the resumed run trains on)."""
    monkeypatch.setattr(harness, "run_process", forks.run_process)
    code = main(["check", "--json", "--workdir", str(tmp_path), "--at", "9", "--at",
                 str(2 * 6), "--phase", "after-commit", "--", sys.executable, __file__,
                 "--early-stopping", "--run", str(tmp_path / "unused"), *SMALL,
                 "--epochs", "4"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "equivalent", out
    assert out["steps"] == 2 * 6
    kills = [k for case in out["cases"] for k in case["kills"]]
    assert [(k["reached"], k["resumed_from"]) for k in kills] == [(True, 9), (True, 12)], kills


def test_a_sigterm_mid_epoch_leaves_fit_cleanly_without_epoch_end_hooks(capsys, tmp_path, forks,
                                                                       monkeypatch):
    """SIGTERM inside epoch 0: the update is saved and ``fit`` returns (exit 0) without running
    the epoch-end hooks on the cut epoch (EarlyStopping would fail there: no validation has
    produced its metric yet), and the resumed run is equivalent."""
    monkeypatch.setattr(harness, "run_process", forks.run_process)
    code = main(["check", "--json", "--workdir", str(tmp_path), "--at", "4", "--phase",
                 "sigterm", "--", sys.executable, __file__, "--early-stopping", "--run",
                 str(tmp_path / "unused"), *SMALL, "--epochs", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "equivalent", out
    kills = [k for case in out["cases"] for k in case["kills"]]
    assert [(k["reached"], k["resumed_from"]) for k in kills] == [(True, 4)], kills


def test_setups_that_cannot_resume_exactly_are_refused(tmp_path, forks):
    r = forks.run(__file__, ["--refusals", str(tmp_path)], harness._clean_env({}))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for case, (kind, words) in {
        "plain DataLoader": ("UnsupportedSetup", "DataLoader"),
        "two loaders": ("UnsupportedSetup", "exactly one"),
        "manual optimization": ("UnsupportedSetup", "manual optimization"),
        "accumulation": ("UnsupportedSetup", "accumulate_grad_batches=2"),
        "limit_train_batches": ("UnsupportedSetup", "limit_train_batches=0.5"),
        "optimizer given": ("UnsupportedSetup", "takes the model, optimizer"),
        "ckpt_path": ("UnsupportedSetup", "fit(ckpt_path="),
        "max_steps raised in the last epoch": ("StateMismatch", "the epoch ended early"),
        "GradientAccumulationScheduler": ("UnsupportedSetup", "GradientAccumulationScheduler("),
        "metric not storable": ("UnsupportedSetup", "trainer.callback_metrics['note'] is a "),
        # change the model or optimizer during fit: a later generation fits no rebuilt run
        "StochasticWeightAveraging": ("UnsupportedSetup", "StochasticWeightAveraging changes"),
        "BackboneFinetuning": ("UnsupportedSetup", "BackboneFinetuning changes"),
        "ModelPruning": ("UnsupportedSetup", "ModelPruning changes"),
        # keep state in Lightning's checkpoint dict, which generations do not hold
        "EMAWeightAveraging": ("UnsupportedSetup", "EMAWeightAveraging defines "
                                                   "on_save_checkpoint and on_load_checkpoint"),
        "a callback's checkpoint hook": ("UnsupportedSetup", "Counter defines "
                                                             "on_save_checkpoint:"),
    }.items():
        assert got[case][0] == kind and words in got[case][1], (case, got[case])
    for case in ("StochasticWeightAveraging", "BackboneFinetuning", "ModelPruning",
                 "EMAWeightAveraging", "a callback's checkpoint hook"):
        assert got["saved"][case] == [], case  # refused before anything was trained
    assert got["module hook"] == [4, ["HookedModule defines on_save_checkpoint: the "
                                      "UnbrokenCallback calls neither"]], got["module hook"]
    assert got["from train_dataloader()"] == 4  # the module's hook may return the loader
    assert got["scheduled accumulation saved"] == []  # refused before anything was trained
    # A GradScaler of the precision plugin is a part of every generation, and comes back.
    assert got["scaler"] == [["scaler"], 2, 4], got["scaler"]


def _refusals(tmp: str) -> dict[str, Any]:
    """(In a process of the fork server.) What each setup raises, as [type, message]; and for
    a 16-bit mixed-precision run with a GradScaler, [which of its parts are the scaler's, the
    step resumed from, the step reached]."""
    import warnings

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import (
        BackboneFinetuning,
        EMAWeightAveraging,
        GradientAccumulationScheduler,
        ModelPruning,
        StochasticWeightAveraging,
    )
    from lightning.pytorch.plugins import MixedPrecision

    import unbroken
    from unbroken.integrations.lightning import UnbrokenCallback

    class Net(L.LightningModule):
        def __init__(self, manual: bool = False) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
            self.automatic_optimization = not manual  # (two optimizers need manual)

        def training_step(self, batch, batch_idx):
            return self.b(self.a(batch[0])).pow(2).mean()

        def configure_optimizers(self):
            if not self.automatic_optimization:
                return [torch.optim.SGD(self.a.parameters(), 0.1),
                        torch.optim.SGD(self.b.parameters(), 0.1)]
            return torch.optim.SGD(self.parameters(), 0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(32, 4))

    def loader(accumulation: int = 1) -> unbroken.ResumableLoader:
        return unbroken.ResumableLoader(ds, unbroken.ResumableSampler(32, 8),
                                        accumulation=accumulation)

    def trainer(*callbacks: Any, **kwargs: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks), **kwargs)

    def fit(name: str, data: Any, net: Any = None, ckpt_path: str | None = None,
            more: tuple[L.Callback, ...] = (), **kwargs: Any) -> UnbrokenCallback:
        cb = UnbrokenCallback(os.path.join(tmp, name), every=2)
        trainer(cb, *more, **kwargs).fit(net or Net(), data, ckpt_path=ckpt_path)
        return cb

    def lightning_checkpoint() -> str:
        t = trainer(max_steps=1)
        t.fit(Net(), torch.utils.data.DataLoader(ds, batch_size=8))
        t.save_checkpoint(os.path.join(tmp, "l.ckpt"))
        return os.path.join(tmp, "l.ckpt")

    class Hooked(Net):
        def train_dataloader(self):
            return loader()

    class Note(L.Callback):  # a callback metric the state codec cannot store without pickle
        def on_train_batch_end(self, trainer, *args):
            trainer.callback_metrics["note"] = object()

    class Counter(L.Callback):  # state kept in Lightning's checkpoint dict
        seen = 0

        def on_train_batch_end(self, *args):
            self.seen += 1

        def on_save_checkpoint(self, trainer, module, checkpoint):
            checkpoint["seen"] = self.seen

    class Backbone(Net):  # (BackboneFinetuning needs a `backbone`)
        def __init__(self) -> None:
            super().__init__()
            self.backbone = self.a

    class HookedModule(Net):  # metadata for an export: warned, trained as usual
        def on_save_checkpoint(self, checkpoint):
            checkpoint["exported_by"] = "me"

    cases = {
        "plain DataLoader": lambda: fit("a", torch.utils.data.DataLoader(ds, batch_size=8)),
        "two loaders": lambda: fit("b", [loader(), loader()]),
        "manual optimization": lambda: fit("c", loader(), Net(manual=True)),
        "accumulation": lambda: fit("d", loader(), accumulate_grad_batches=2),
        "limit_train_batches": lambda: fit("e", loader(), limit_train_batches=0.5),
        "optimizer given": lambda: UnbrokenCallback(tmp, optimizer=None),
        "ckpt_path": lambda: fit("f", loader(), ckpt_path=lightning_checkpoint()),
        # stopped by max_steps in the last epoch, continued with a larger one (no identity
        # holds max_steps): the restored loops are done before any batch is fetched
        "max_steps raised in the last epoch": lambda: (fit("h", loader(), max_steps=2),
                                                       fit("h", loader(), max_steps=4)),
        # it changes accumulate_grad_batches by epoch; the loader's windows are fixed
        "GradientAccumulationScheduler": lambda: fit(
            "i", loader(), more=(GradientAccumulationScheduler({0: 1, 1: 2}),)),
        "metric not storable": lambda: fit("j", loader(), more=(Note(),)),
        "StochasticWeightAveraging": lambda: fit(
            "swa", loader(), more=(StochasticWeightAveraging(swa_lrs=0.01),)),
        "BackboneFinetuning": lambda: fit("bb", loader(), Backbone(),
                                          more=(BackboneFinetuning(unfreeze_backbone_at_epoch=1),)),
        "ModelPruning": lambda: fit("prune", loader(), more=(ModelPruning("l1_unstructured"),)),
        "EMAWeightAveraging": lambda: fit("ema", loader(), more=(EMAWeightAveraging(),)),
        "a callback's checkpoint hook": lambda: fit("count", loader(), more=(Counter(),)),
    }
    out: dict[str, Any] = {}
    for case, call in cases.items():
        try:
            call()
            out[case] = ["nothing", ""]
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[case] = [type(e).__name__, str(e)]
    out["saved"] = {case: sorted(p.name for p in Path(tmp, name).glob("gen-*"))
                    for case, name in [("StochasticWeightAveraging", "swa"),
                                       ("BackboneFinetuning", "bb"), ("ModelPruning", "prune"),
                                       ("EMAWeightAveraging", "ema"),
                                       ("a callback's checkpoint hook", "count")]}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        step = fit("hooked", loader(), HookedModule()).step
    out["module hook"] = [step, [str(w.message)[:len("HookedModule defines on_save_checkpoint: "
                                                     "the UnbrokenCallback calls neither")]
                                 for w in said if "HookedModule" in str(w.message)]]
    out["from train_dataloader()"] = fit("g", None, Hooked()).step
    out["scheduled accumulation saved"] = sorted(p.name for p in Path(tmp, "i").glob("gen-*"))
    amp = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    fit("amp", loader(), **amp)
    parts = json.loads(Path(tmp, "amp", "gen-000000004", "MANIFEST.json").read_text())
    shutil.rmtree(Path(tmp, "amp", "gen-000000004"))  # resume from 2
    cb = fit("amp", loader(), **amp)
    out["scaler"] = [[p for p in parts["parts"] if p == "scaler"], cb.restored_step, cb.step]
    return out


def _early_stopping(argv: list[str]) -> None:
    """(In a process of the fork server.) The example with an EarlyStopping callback."""
    import runpy

    from lightning.pytorch.callbacks import EarlyStopping

    example = runpy.run_path(EXAMPLE)
    example["main"](argv, [EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)])


if __name__ == "__main__" and sys.argv[1:2] == ["--refusals"]:
    print(json.dumps(_refusals(sys.argv[2])))
elif __name__ == "__main__" and sys.argv[1:2] == ["--early-stopping"]:
    _early_stopping(sys.argv[2:])
