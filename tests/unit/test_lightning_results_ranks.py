"""The Lightning adapter's running epoch aggregates across a change of the job's size
(`integrations._lightning_results`): a rank restoring another rank's loop state (one the saving
job did not have, or any rank but 0 after a save in one process) starts its share of the
aggregates empty, as taking the other's would count its batches twice in a synced epoch value;
and a restored entry takes ``sync_dist`` from the next ``self.log``, since Lightning asks for
a reduction only in a job of several processes (``sync_dist and is_distributed``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")

from unbroken.integrations._lightning_results import (  # noqa: E402
    load_results,
    save_results,
    training_results,
)


@pytest.fixture()
def trainer() -> Any:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _log(trainer: Any, name: str, value: float, **kwargs: Any) -> None:
    """What ``LightningModule.log`` hands the training results (in one process)."""
    training_results(trainer).log(
        "training_step", name, torch.tensor(value), batch_size=4,
        sync_dist_fn=trainer.strategy.reduce, **{"on_step": False, "on_epoch": True, **kwargs})


@pytest.mark.parametrize("reduce_fx,empty", [("mean", 0.0), ("sum", 0.0), ("max", -float("inf")),
                                             ("min", float("inf"))])
def test_another_ranks_running_aggregates_start_empty_here(trainer, reduce_fx, empty):
    for value in (2.0, 4.0):
        _log(trainer, "loss", value, reduce_fx=reduce_fx)
        _log(trainer, "step_loss", value, on_step=True, on_epoch=False)
    saved = save_results(trainer)
    results = training_results(trainer)

    load_results(trainer, saved, own=True)
    kept = results["training_step.loss"]
    assert kept.value.item() == {"mean": 24.0, "sum": 6.0, "max": 4.0, "min": 2.0}[reduce_fx]
    assert kept._update_count == 2 and not kept.has_reset

    load_results(trainer, saved, own=False)
    fresh = results["training_step.loss"]
    assert fresh.value.item() == empty
    if reduce_fx == "mean":
        assert fresh.cumulated_batch_size.item() == 0
    # (a value logged per step only is no aggregate: kept as saved)
    assert results["training_step.step_loss"].value.item() == 4.0
    _log(trainer, "loss", 8.0, reduce_fx=reduce_fx)  # accumulates from empty
    assert fresh.compute().item() == 8.0


def test_a_restored_entry_takes_sync_dist_from_the_next_log(trainer):
    _log(trainer, "loss", 2.0)  # (saved in one process: no reduction asked for)
    saved = save_results(trainer)
    assert saved[0]["sync_dist"] is False
    load_results(trainer, saved)
    entry = training_results(trainer)["training_step.loss"]
    _log(trainer, "loss", 4.0, sync_dist=True)  # (resumed in a job: the reduction asked for)
    assert entry.meta.sync.should and entry.compute().item() == 3.0
