"""The Transformers Trainer's own continuation state as an unbroken part, and the default
identity of a Trainer run (`unbroken.integrations.transformers`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..checkpointer import Checkpointer
from ..errors import CorruptCheckpoint, IdentityMismatch, StateMismatch, UnbrokenWarning
from ..state.identity import Identity

# TrainingArguments fields that shape the trajectory: the default identity config, so a
# continuation with another learning rate, schedule, batch or seed is refused by name.
# The default identity of an older adapter (generations it saved still continue).
_LEGACY_ARGS = (
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
    "optim_args", "max_grad_norm", "num_train_epochs", "max_steps", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "per_device_train_batch_size",
    "gradient_accumulation_steps", "seed", "data_seed", "fp16", "bf16",
    "label_smoothing_factor", "dataloader_drop_last", "average_tokens_across_devices")
# Added since: when evaluation runs and what it reports decide a reduce_lr_on_plateau step
# and EarlyStopping; NEFTune adds noise to the embeddings; the sample order; which modules
# a GaLore-style optimizer targets; kernels and precision that change the numerics (TF32,
# torch.compile, Liger kernels, deterministic algorithms). Logging, output and evaluation
# batching only are left out: they do not change the weights.
_ADDED_ARGS = (
    "eval_strategy", "eval_steps", "eval_delay", "metric_for_best_model", "greater_is_better",
    "neftune_noise_alpha", "train_sampling_strategy", "optim_target_modules", "tf32",
    "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel",
    "liger_kernel_config", "full_determinism")
_TRAJECTORY_ARGS = _LEGACY_ARGS + _ADDED_ARGS
# TrainerState fields that continue from one update to the next (the rest is recomputed
# from the arguments by the Trainer at every train()).
_STATE_FIELDS = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history",
                 "best_metric", "best_global_step", "best_model_checkpoint")
_LOGGING_FIELDS = ("tr_loss", "globalstep_last_logged", "current_flos")


def trainer_config(args: TrainingArguments) -> dict[str, Any]:
    """The `TrainingArguments` values that shape the training trajectory (learning rate,
    schedule, batch, accumulation, seeds, precision): the default identity config of
    `attach`. Extend it for an `Identity` of your own: ``Identity(config={**trainer_config(
    args), "model": ...}, data="train-v3")``."""
    values = args.to_dict()
    return {k: values[k] for k in _TRAJECTORY_ARGS if k in values}


class _LegacyIdentity(Identity):
    """``base`` with the config an older adapter recorded by default (`_LEGACY_ARGS`)."""

    def __init__(self, base: Identity, args: TrainingArguments) -> None:
        values = args.to_dict()
        super().__init__(config={k: values[k] for k in _LEGACY_ARGS if k in values})
        self._base = base

    def fingerprint(self) -> dict[str, Any]:
        return {**self._base.fingerprint(), "config": super().fingerprint()["config"]}


def _config_keys(info: Any) -> set[str] | None:
    """The config keys a generation's manifest recorded, or None (unknown)."""
    entry = (info.manifest.identity or {}).get("config")
    if not isinstance(entry, Mapping):
        return None
    if isinstance(entry.get("value"), Mapping):
        return set(entry["value"])
    if isinstance(entry.get("keys"), Mapping):  # "config.<key>..." digests
        return {path.split(".")[1].split("[")[0] for path in entry["keys"] if "." in path}
    return None


def _older_saved(ckpt: Checkpointer) -> bool:
    """Whether a generation of the run was saved with an older adapter's default identity
    (its config recorded none of `_ADDED_ARGS`): any of them, as the restore may fall back
    past newer ones that do not verify."""
    for info in ckpt.store.scan():
        keys = _config_keys(info) if info.manifest is not None else None
        if keys is not None and not keys & set(_ADDED_ARGS):
            return True
    return False


def restore_compatible(ckpt: Checkpointer, args: TrainingArguments,
                       identity: Identity | None) -> int:
    """``ckpt.restore()``; a generation an older adapter saved with its default identity
    (fewer TrainingArguments: `_LEGACY_ARGS`) continues when those match, with a warning
    that the arguments added since cannot be checked for this resume; the next save records
    them all. Refusing it would strand every run saved before they were added."""
    try:
        return ckpt.restore()
    except IdentityMismatch:
        current = ckpt.identity
        default = Identity(config=trainer_config(args)).fingerprint()["config"]
        if current.fingerprint().get("config") != default or not _older_saved(ckpt):
            raise  # an identity of the user's own, or every generation has the added ones
    ckpt.identity = _LegacyIdentity(current, args)
    try:
        step = ckpt.restore()  # a mismatch now names the older arguments that changed
    finally:
        ckpt.identity = current
    warnings.warn(
        f"{ckpt.store.root}: generation {step} was saved by an older unbroken whose default "
        "Trainer identity did not record "
        f"{[k for k in _ADDED_ARGS if k in trainer_config(args)]}; the arguments it did "
        "record match, but a change of those cannot be detected for this resume (the next "
        "save records them)", UnbrokenWarning, stacklevel=3)
    return step


def _wall_clock(key: str) -> bool:
    # speed_metrics(): "<split>_runtime", "<split>_samples_per_second", ... measure the
    # process, not the training; they differ on every run, so they are not state.
    return key.endswith(("_runtime", "_per_second"))


class TrainerProgress:
    """The Trainer's own continuation state as an unbroken part (``extras["trainer"]``):
    the TrainerState counters (global step, epoch, tokens seen, FLOs, log history without
    wall-clock timings, best metric), the logging accumulators (loss summed since the last
    log, the step of that log, FLOs not yet stored), the attributes of every stateful
    callback (`ExportableState`, e.g. EarlyStoppingCallback's patience counter) and whether
    the run had stopped there (``control.should_training_stop``: max_steps, early stopping)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        # The loop resets its logging accumulators after the restore; put back at train begin.
        self.pending_logging: dict[str, Any] | None = None
        # The restored generation was saved when the run stopped (max_steps, a callback's
        # should_training_stop): the uninterrupted run trained no further.
        self.stopped = False
        # The loop is being left for a signal (set by the callback): the run goes on in the
        # next process, so should_training_stop does not mark the run's end.
        self.interrupted = False

    def _stateful(self) -> list[tuple[str, Any]]:
        return [(type(cb).__name__, cb) for cb in self._trainer.callback_handler.callbacks
                if isinstance(cb, ExportableState)]

    def state_dict(self) -> dict[str, Any]:
        """Copies of the values (a save may write them while training goes on)."""
        t = self._trainer
        state: dict[str, Any] = {name: getattr(t.state, name) for name in _STATE_FIELDS}
        state["log_history"] = [{k: v for k, v in entry.items() if not _wall_clock(k)}
                                for entry in t.state.log_history or []]
        if self.pending_logging is not None:  # restored, not yet given to the loop
            logging = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                       for k, v in self.pending_logging.items()}
            stopped = self.stopped
        else:
            tr_loss = getattr(t, "_tr_loss", None)  # created by the loop: absent before it
            logging = {"tr_loss": (tr_loss.detach().clone() if isinstance(tr_loss, torch.Tensor)
                                   else torch.zeros(())),
                       "globalstep_last_logged": int(getattr(t, "_globalstep_last_logged", 0)),
                       "current_flos": getattr(t, "current_flos", 0)}
            control = getattr(t, "control", None)
            stopped = bool(getattr(control, "should_training_stop", False)) \
                and not self.interrupted
        return {
            "state": state,
            "logging": logging,
            "callbacks": [[name, dict(cb.state().get("attributes", {}))]
                          for name, cb in self._stateful()],
            "stopped": stopped,
        }

    def validate_state_dict(self, saved: Mapping[str, Any], where: str) -> None:
        """Refuse a saved state that does not fit this Trainer, before anything changes."""
        state, logging = saved.get("state"), saved.get("logging")
        if (not isinstance(state, Mapping) or set(state) != set(_STATE_FIELDS)
                or not isinstance(logging, Mapping) or set(logging) != set(_LOGGING_FIELDS)
                or type(state["global_step"]) is not int or state["global_step"] < 0
                or not isinstance(state["log_history"], list)
                or not isinstance(logging["tr_loss"], torch.Tensor)
                or logging["tr_loss"].dim() != 0
                or not isinstance(saved.get("stopped", False), bool)):
            raise CorruptCheckpoint(f"{where}: not the Trainer state this adapter writes "
                                    f"(expected state {list(_STATE_FIELDS)} and logging "
                                    f"{list(_LOGGING_FIELDS)})")
        names = [name for name, _ in saved.get("callbacks", [])]
        live = [name for name, _ in self._stateful()]
        if names != live:
            raise StateMismatch(f"{where}: the run was saved with the stateful callbacks "
                                f"{names}, this Trainer has {live}; add the same callbacks "
                                "(in the same order) to continue it")

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Set the TrainerState counters and callbacks now; the logging accumulators when the
        loop has initialized its own (`UnbrokenCallback.on_train_begin`)."""
        t = self._trainer
        for name in _STATE_FIELDS:
            setattr(t.state, name, saved["state"][name])
        t.state.log_history = [dict(entry) for entry in saved["state"]["log_history"]]
        t.current_flos = saved["logging"]["current_flos"]
        self.pending_logging = dict(saved["logging"])
        self.stopped = saved.get("stopped", False)  # absent: saved before this field existed
        for (_, cb), (_, attributes) in zip(self._stateful(), saved["callbacks"], strict=True):
            for key, value in attributes.items():
                setattr(cb, key, value)
