"""Review of the default background read-back (``read_back="background"``): what finishes
after ``save()`` returned, seen from the framework adapters and the stop path."""

from __future__ import annotations

import json
import logging
import signal
import threading

import pytest
import torch

import unbroken
import unbroken.persisting
from unbroken.errors import SaveFailed
from unbroken.trace import read_trace


def _net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _failing_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(group, store, info, *args, **kwargs):
        raise SaveFailed(f"generation {info.generation} did not read back as written")

    monkeypatch.setattr(unbroken.persisting, "read_back", failing)


def test_lightning_on_exception_lets_the_training_error_through(tmp_path, monkeypatch, caplog):
    # Lightning's handler calls on_exception, then strategy.on_exception, the loggers'
    # finalize and trainer._teardown(), then re-raises the training's exception: a save error
    # raised by on_exception would replace that exception and skip the rest.
    lightning = pytest.importorskip("unbroken.integrations.lightning")
    callback = lightning.UnbrokenCallback(tmp_path / "run")
    model, opt = _net()
    callback.checkpointer = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt)
    _failing_read_back(monkeypatch)
    callback.checkpointer.save(1)  # committed; its read-back fails in the background
    with caplog.at_level(logging.ERROR, logger="unbroken"):
        callback.on_exception(None, None, RuntimeError("CUDA out of memory"))  # type: ignore
    assert callback.checkpointer is None
    assert any("read back" in r.getMessage() for r in caplog.records)  # said, not lost
    unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt).close()  # lock released


def test_the_stop_save_is_read_back_before_the_loop_is_told_to_stop(tmp_path, monkeypatch):
    real, started = unbroken.persisting.read_back, threading.Event()

    def slow(*args, **kwargs):
        started.set()
        threading.Event().wait(0.2)  # still reading back when step_done reaches its wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(unbroken.persisting, "read_back", slow)
    model, opt = _net()
    trace = tmp_path / "trace.jsonl"
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, trace=trace,
                               signals=[signal.SIGUSR1]) as ckpt:
        signal.raise_signal(signal.SIGUSR1)
        assert ckpt.step_done(1)
        assert started.is_set() and ckpt.should_stop and ckpt._in_flight is None
        events = [json.loads(line)["event"] for line in trace.read_text().splitlines()]
        assert events[-2:] == ["save", "stop"]  # verified, then told to stop


def test_transformers_train_raises_the_training_error_not_the_read_back(tmp_path, monkeypatch,
                                                                          caplog):
    # train() releases the run folder when training raised; a save error found there (already
    # logged) must not replace the training's exception.
    transformers = pytest.importorskip("transformers")
    from unbroken.integrations.transformers import attach

    model, _ = _net()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                          report_to=[], save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args)
    callback = attach(trainer, tmp_path / "run")
    _failing_read_back(monkeypatch)

    def training(*args, **kwargs):  # the loop saved, then an update raised
        callback.checkpointer = unbroken.Checkpointer(tmp_path / "run", model=model)
        callback._open = True
        callback.checkpointer.save(1)  # committed; its read-back fails in the background
        raise RuntimeError("CUDA out of memory")

    callback._orig["train"] = training
    with caplog.at_level(logging.ERROR, logger="unbroken"):
        with pytest.raises(RuntimeError, match="out of memory"):
            trainer.train()
    assert any("read back" in r.getMessage() for r in caplog.records)  # said, not lost
    unbroken.Checkpointer(tmp_path / "run", model=model).close()  # lock released


@pytest.mark.parametrize("options", [{}, {"read_back": "sync"}, {"async_save": True}])
def test_the_trace_records_each_save_once_when_it_is_verified_even_without_close(tmp_path,
                                                                                   options):
    # The save record used to be written at the next save, wait() or close(): a script
    # ending without close() never recorded its last generation.
    model, opt = _net()
    trace = tmp_path / "trace.jsonl"
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, trace=trace,
                                 **options)
    for step in (1, 2, 3):
        ckpt.step_done(step)
        ckpt.save()
    for _ in range(200):  # the last read-back ends beside the loop, not waited for
        saves = [r["step"] for r in read_trace(trace) if r["event"] == "save"]
        if saves == [1, 2, 3]:
            break
        threading.Event().wait(0.05)
    assert saves == [1, 2, 3]
    ckpt.close()  # nothing recorded twice
    assert [r["step"] for r in read_trace(trace) if r["event"] == "save"] == [1, 2, 3]
