"""Setup checks of the Transformers Trainer adapter (`unbroken.integrations.transformers`)
that need nothing of the adapter itself: the sampling strategy, the Trainer's own
just-in-time checkpointing, and collators that draw from random generators of their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import Trainer, TrainingArguments

from ..data._private_rng import private_rng
from ..errors import UnsupportedSetup


def _sampling(args: TrainingArguments) -> str:
    return str(getattr(args, "train_sampling_strategy", "random"))


def _refuse_jit_checkpoint(trainer: Trainer) -> None:
    """The Trainer's just-in-time checkpointing (``enable_jit_checkpoint=True``) handles
    SIGTERM itself: it stops the loop with ``should_training_stop`` (what ends a run by its
    own logic, so the generation saved there would mark the run finished) and writes a pickled
    ``checkpoint-N`` folder this run never resumes from."""
    callbacks = [type(cb).__name__ if not isinstance(cb, type) else cb.__name__
                 for cb in trainer.callback_handler.callbacks]
    if getattr(trainer.args, "enable_jit_checkpoint", False) or \
            "JITCheckpointCallback" in callbacks:
        raise UnsupportedSetup(
            "enable_jit_checkpoint=True (a JITCheckpointCallback) stops training on SIGTERM "
            "as if the run had ended, and writes the Trainer's own pickled checkpoint-N "
            "folder: the unbroken generation saved there would mark the run finished, so a "
            "requeued job would train nothing more; set enable_jit_checkpoint=False and pass "
            "attach(trainer, root, signals=[signal.SIGTERM]) (the generation is saved at the "
            "update SIGTERM lands in, and the run continues from it)")


def _refuse_private_rng(collator: Callable[..., Any] | Any) -> None:
    """A collator drawing from a generator of its own (DataCollatorForLanguageModeling's
    ``seed=``, a ``torch.Generator`` a collate function closes over, a ``numpy`` or
    ``random.Random`` generator an attribute holds, at any depth of wrapping) continues that
    stream in each process and worker from where it was made: neither saved nor positioned
    by the data cursor, so a resumed run collates differently. The global streams (saved,
    and seeded per batch by the loader) are fine. The walk is the data layer's
    (`unbroken.data._private_rng`, which `ResumableLoader` runs on its ``collate_fn`` too);
    this check runs first, on the user's collator, so the refusal names ``data_collator``."""
    found = private_rng(collator, "data_collator")
    if found is not None:
        raise UnsupportedSetup(
            f"data_collator {type(collator).__name__} draws from a random generator of its "
            f"own ({found}): its stream is neither saved nor positioned by the data cursor, "
            "so a resumed run would collate differently; build the collator without it (no "
            "seed=, no generator of its own: draw from torch's, NumPy's or Python's global "
            "RNG): its draws from the global RNGs are seeded per batch from (seed, epoch, "
            "position), the same with any number of workers")
