"""Setup checks of the Transformers Trainer adapter (`unbroken.integrations.transformers`)
that need nothing of the adapter itself: the sampling strategy, the Trainer's own
just-in-time checkpointing, and collators that draw from random generators of their own."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import random
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainingArguments

from ..errors import UnsupportedSetup

# How far `_refuse_private_rng` looks into what a collator holds: deep enough for a user
# collator wrapping the Trainer's wrapping a Hugging Face collator, bounded so that a
# collator holding a tokenizer or a model is searched in a fraction of a second.
_MAX_DEPTH = 8
_MAX_OBJECTS = 20_000
_PRIVATE = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_NAMES = ("torch.Generator", "numpy.random.Generator", "numpy.random.RandomState",
          "random.Random")
# Leaves: nothing a random generator could hide in (or too big to walk: a tensor's storage).
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor,
           np.ndarray, types.ModuleType, type, torch.dtype, torch.device)
# Not searched: what a collate function reaching a global Trainer, model or dataset would
# drag in is not the collator's own randomness (the sampler's, the model's, the dataset's
# streams are other parts' business), and searching it would name them falsely; nor the
# process-wide logging registry a logger reaches (any library's sampling filter).
_OPAQUE = (Trainer, TrainingArguments, torch.nn.Module, torch.optim.Optimizer,
           torch.utils.data.Dataset, torch.utils.data.DataLoader, logging.Logger,
           logging.LoggerAdapter, logging.Manager, logging.Handler, logging.Filterer)
_SKIPPED = _LEAVES + _OPAQUE
_MAX_ITEMS = 1_000  # of one container: a generator is not hidden past a big list's start


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


def _global_streams() -> tuple[object, ...]:
    # The process-wide streams the generation saves (and the loader seeds per batch): a
    # collator reaching them (random.random's instance, np.random's, torch's default) is fine.
    return (random._inst, np.random.mtrand._rand, torch.default_generator)  # type: ignore[attr-defined]


def _seeded_hf(obj: Any) -> bool:
    """A Hugging Face collator built with ``seed=`` (DataCollatorForLanguageModeling...):
    its generator is created lazily, in each process and worker, from that seed."""
    values = getattr(obj, "__dict__", None)
    return (isinstance(values, dict) and values.get("seed") is not None
            and "generator" in values)


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, object) for what ``obj`` holds: attributes, items, a function's closure
    cells, defaults and the globals its code names, a partial's function and arguments, a
    bound method's instance, a callable object's ``__call__``."""
    if isinstance(obj, Mapping):
        for key, value in list(itertools.islice(obj.items(), _MAX_ITEMS)):
            yield f"[{key!r}]", value
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(list(itertools.islice(obj, _MAX_ITEMS))):
            yield f"[{i}]", value
        return
    if isinstance(obj, functools.partial):
        yield ".func", obj.func
        for i, value in enumerate(obj.args):
            yield f".args[{i}]", value
        for key, value in obj.keywords.items():
            yield f".keywords[{key!r}]", value
        return
    if isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
        return
    if isinstance(obj, types.BuiltinMethodType):  # rng.random of a private random.Random
        yield ".__self__", obj.__self__
        return
    if isinstance(obj, types.FunctionType):
        try:
            found = inspect.getclosurevars(obj)
        except (TypeError, ValueError):  # a cell not yet filled
            found = None
        if found is not None:
            for name, value in found.nonlocals.items():
                yield f" (closure {name})", value
            for name, value in found.globals.items():
                yield f" (global {name})", value
        for i, value in enumerate(obj.__defaults__ or ()):
            yield f" (default #{i})", value
        for name, value in (obj.__kwdefaults__ or {}).items():
            yield f" (default {name})", value
        return
    values = getattr(obj, "__dict__", None)
    if isinstance(values, dict):
        for key, value in list(values.items()):
            yield f".{key}", value
    call = getattr(type(obj), "__call__", None)
    if isinstance(call, types.FunctionType):  # a collator class's own code (its globals)
        yield f" ({type(obj).__name__}.__call__)", call


def _private_rng(root: Any, name: str) -> str | None:
    """The path to a random generator of its own that ``root`` reaches, or None."""
    shared = {id(s) for s in _global_streams()}
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, root, 0)]
    while stack and len(seen) < _MAX_OBJECTS:
        path, obj, depth = stack.pop()
        if id(obj) in seen or id(obj) in shared or isinstance(obj, _SKIPPED) \
                or type(obj).__module__.startswith("unbroken."):
            continue
        seen.add(id(obj))
        if isinstance(obj, _PRIVATE):
            kind = next(n for k, n in zip(_PRIVATE, _NAMES, strict=True) if isinstance(obj, k))
            return f"{path}: a {kind}"
        if _seeded_hf(obj):
            return f"{path}: {type(obj).__name__}(seed={obj.seed!r})"
        if depth < _MAX_DEPTH:
            stack.extend((path + suffix, child, depth + 1)
                         for suffix, child in reversed(list(_children(obj))))
    return None


def _refuse_private_rng(collator: Callable[..., Any] | Any) -> None:
    """A collator drawing from a generator of its own (DataCollatorForLanguageModeling's
    ``seed=``, a ``torch.Generator`` a collate function closes over, a ``numpy`` or
    ``random.Random`` generator an attribute holds, at any depth of wrapping) continues that
    stream in each process and worker from where it was made: neither saved nor positioned
    by the data cursor, so a resumed run collates differently. The global streams (saved,
    and seeded per batch by the loader) are fine."""
    found = _private_rng(collator, "data_collator")
    if found is not None:
        raise UnsupportedSetup(
            f"data_collator {type(collator).__name__} draws from a random generator of its "
            f"own ({found}): its stream is neither saved nor positioned by the data cursor, "
            "so a resumed run would collate differently; build the collator without it (no "
            "seed=, no generator of its own: draw from torch's, NumPy's or Python's global "
            "RNG): its draws from the global RNGs are seeded per batch from (seed, epoch, "
            "position), the same with any number of workers")
