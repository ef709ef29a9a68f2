"""Setup checks of the Transformers Trainer adapter (`unbroken.integrations.transformers`)
that need nothing of the adapter itself: the sampling strategy and collators with random
generators of their own."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from transformers import TrainingArguments

from ..errors import UnsupportedSetup


def _sampling(args: TrainingArguments) -> str:
    return str(getattr(args, "train_sampling_strategy", "random"))


def _refuse_private_rng(collator: Any) -> None:
    """A collator drawing from a generator of its own (DataCollatorForLanguageModeling's
    ``seed=``) continues that stream in each process and worker from its seed: neither saved
    nor positioned by the data cursor, so a resumed run masks differently."""
    inner = getattr(collator, "data_collator", None)  # the Trainer's RemoveColumnsCollator
    if inner is not None and inner is not collator:
        _refuse_private_rng(inner)
    values = getattr(collator, "__dict__", {})
    found = [k for k, v in values.items()
             if isinstance(v, torch.Generator | np.random.Generator | np.random.RandomState
                           | random.Random)]
    if values.get("seed") is not None and "generator" in values:
        found = [f"seed={values['seed']!r}"] + [k for k in found if k != "generator"]
    if found:
        raise UnsupportedSetup(
            f"data_collator {type(collator).__name__} draws from a random generator of its "
            f"own ({', '.join(found)}): its stream is neither saved nor positioned by the data "
            "cursor, so a resumed run would collate differently; build the collator without "
            "it (no seed=): its draws from the global RNGs are seeded per batch from (seed, "
            "epoch, position), the same with any number of workers")
