"""Finding a random generator of its own that a collate function or a dataset reaches.

A collate function (or a Hugging Face data collator) that draws from a generator it holds —
a ``torch.Generator``, a ``numpy.random.Generator``/``RandomState``, a ``random.Random``,
reached through attributes, containers, closures, globals, defaults or a ``functools.partial``,
at any depth of wrapping — continues that stream from where it was made in each process and
worker: the stream is neither saved with a generation nor positioned by the data cursor, so a
resumed run collates differently. Only the process-wide streams are exact: a generation saves
them, and the loader seeds them for each batch's collate from (seed, epoch, position).

`private_rng` walks what an object reaches and returns the path to the first such generator;
`refuse_private_collate` is `ResumableLoader`'s refusal of such a ``collate_fn``, and the
Transformers adapter refuses such a ``data_collator`` in its own words: each names the path.
`warn_private_dataset` warns of a map-style dataset holding one (its ``__getitem__`` may draw
from it, which `seeded` does not key; one kept for other ends, a split made once, is not
refused for it).
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import itertools
import logging
import random
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ..errors import UnbrokenWarning, UnsupportedSetup

# How far `private_rng` looks into what a collator holds: deep enough for a user collator
# wrapping the Trainer's wrapping a Hugging Face collator, bounded so that a collator holding a
# tokenizer or a model is searched in a fraction of a second.
_MAX_DEPTH = 8
_MAX_OBJECTS = 20_000
_MAX_ITEMS = 1_000  # of one container: a generator is not hidden past a big list's start
_PRIVATE = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random,
            np.random.BitGenerator)
_NAMES = ("torch.Generator", "numpy.random.Generator", "numpy.random.RandomState",
          "random.Random", "numpy.random bit generator")
# Leaves: nothing a random generator could hide in (or too big to walk: a tensor's storage).
# (A module is looked at for generators it holds itself, not walked: `_children`.)
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor,
           np.ndarray, type, torch.dtype, torch.device)
# Not searched: what a collate function reaching a global model, optimizer or dataset would
# drag in is not the collator's own randomness (the sampler's, the model's, the dataset's
# streams are other parts' business), and searching it would name them falsely; nor the
# process-wide logging registry a logger reaches (any library's sampling filter).
_OPAQUE = (torch.nn.Module, torch.optim.Optimizer, torch.utils.data.Dataset,
           torch.utils.data.DataLoader, logging.Logger, logging.LoggerAdapter,
           logging.Manager, logging.Handler, logging.Filterer)
# Framework trainers are opaque for the same reason (a Trainer holds the model, optimizer,
# accelerator and callbacks), named by (module, class) so that the data layer imports no
# framework: a class whose module was never imported has no instance to meet.
_TRAINERS = (("transformers.trainer", "Trainer"),
             ("transformers.training_args", "TrainingArguments"),
             ("lightning.pytorch.trainer.trainer", "Trainer"),
             ("pytorch_lightning.trainer.trainer", "Trainer"))


def _skipped() -> tuple[type, ...]:
    """The types the walk does not enter: leaves, the opaque ones, and the trainer classes
    of the frameworks imported so far."""
    found = [getattr(sys.modules.get(module), name, None) for module, name in _TRAINERS]
    return _LEAVES + _OPAQUE + tuple(t for t in found if isinstance(t, type))


def _global_streams() -> tuple[object, ...]:
    # The process-wide streams the generation saves (and the loader seeds per batch): a
    # collator reaching them (random.random's instance, np.random's, torch's default) is fine.
    return (random._inst, np.random.mtrand._rand, torch.default_generator)  # type: ignore[attr-defined]


def _seeded_hf(obj: Any) -> bool:
    """A Hugging Face collator built with ``seed=`` (DataCollatorForLanguageModeling...):
    its generator is created lazily, in each process and worker, from that seed."""
    values = getattr(obj, "__dict__", None)
    return (isinstance(values, dict) and values.get("seed") is not None
            and "generator" in values
            and (values["generator"] is None or isinstance(values["generator"], _PRIVATE)))


def _globals_loaded(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it load."""
    return {i.argval for c in _codes(code) for i in dis.get_instructions(c)
            if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}


def _named_on_self(func: Any, kind: type) -> set[str]:
    """The attribute names a method's code (and the code of the methods of ``kind`` it names,
    in turn) holds: what it may read of its object."""
    names: set[str] = set()
    todo, done = [func], set[types.CodeType]()
    while todo and len(done) < 64:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or code in done:
            continue
        done.add(code)
        found: set[str] = set()
        for c in _codes(code):
            found.update(c.co_names)
        names |= found
        todo.extend(m for n in found if isinstance(m := inspect.getattr_static(kind, n, None),
                                                    types.FunctionType))
    return names


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code nested in it (comprehensions, lambdas, inner functions)."""
    todo = [code]
    while todo:
        c = todo.pop()
        yield c
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, object) for what ``obj`` holds: attributes, items, a function's closure
    cells, defaults and the globals its code names, a partial's function and arguments, a
    bound method's instance, a callable object's ``__call__``."""
    if isinstance(obj, Mapping):
        for key, value in list(itertools.islice(obj.items(), _MAX_ITEMS)):
            yield f"[{key!r}]", value
        return
    if isinstance(obj, list | tuple | set | frozenset | collections.deque):
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
        # (A method of an object that does more than collate, a LightningDataModule's: only
        # what it and the methods it calls name on their object are looked into, not a
        # generator the object keeps for its own ends, its split's.)
        yield ".__func__", obj.__func__
        held = getattr(obj.__self__, "__dict__", None)
        if isinstance(held, dict):
            for name in sorted(_named_on_self(obj.__func__, type(obj.__self__)) & held.keys()):
                yield f".__self__.{name}", held[name]
        return
    if isinstance(obj, types.BuiltinMethodType):  # rng.random of a private random.Random
        yield ".__self__", obj.__self__
        return
    if isinstance(obj, types.FunctionType):
        # (what its code loads as globals, its nested code's too: a comprehension's, a
        # lambda's; not ``getclosurevars``, whose "globals" are every name the code holds,
        # an attribute's among them: ``self.generator`` named the module's ``generator``)
        for name in sorted(_globals_loaded(obj.__code__)):
            if name in obj.__globals__:
                yield f" (global {name})", obj.__globals__[name]
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f" (closure {name})", cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
        for i, value in enumerate(obj.__defaults__ or ()):
            yield f" (default #{i})", value
        for name, value in (obj.__kwdefaults__ or {}).items():
            yield f" (default {name})", value
        return
    if isinstance(obj, types.ModuleType):  # (a module's own generator: helpers.RNG; not
        for key, value in list(vars(obj).items()):  # the OS's entropy, secrets._sysrand)
            if isinstance(value, _PRIVATE) and not isinstance(value, random.SystemRandom):
                yield f".{key}", value
        return
    values = getattr(obj, "__dict__", None)
    if isinstance(values, dict):
        for key, value in list(itertools.islice(values.items(), _MAX_ITEMS)):
            yield f".{key}", value
    kind: Any = type(obj)  # (its class's own generators: ``rng = ...`` in the class)
    yield from _class_generators(kind)
    for kind in type(obj).__mro__:  # (a class with __slots__ holds no __dict__ for them)
        slots = kind.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                yield f".{slot}", getattr(obj, slot)
    call = getattr(type(obj), "__call__", None)
    if isinstance(call, types.FunctionType):  # a collator class's own code (its globals)
        yield f" ({type(obj).__name__}.__call__)", call


@functools.lru_cache(maxsize=1024)
def _class_generators(kind: Any) -> tuple[tuple[str, Any], ...]:
    """The random generators ``kind`` and its bases hold as class attributes (looked up
    once per class: a tokenizer's class has hundreds of attributes)."""
    return tuple((f" ({k.__name__}.{key})", value) for k in kind.__mro__[:-1]
                 for key, value in list(vars(k).items()) if isinstance(value, _PRIVATE))


def private_rng(root: Any, name: str, datasets: bool = False) -> str | None:
    """The path to a random generator of its own that ``root`` reaches, or None.

    The path starts with ``name`` (what the caller calls ``root``: ``collate_fn``,
    ``data_collator``) and ends with what was found: ``"collate_fn.rng: a torch.Generator"``.
    The global streams (saved, and seeded per batch by the loader) are not reported, however
    reached; nor what unbroken's own objects hold (their streams are saved or keyed).
    ``datasets``: the datasets ``root`` reaches are searched too (a dataset's own search).
    """
    shared = {id(s) for s in _global_streams()}
    skipped = _skipped()
    if datasets:  # (a dataset's search: the datasets it wraps are its own)
        skipped = tuple(t for t in skipped if t is not torch.utils.data.Dataset)
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, root, 0)]
    while stack and len(seen) < _MAX_OBJECTS:
        path, obj, depth = stack.pop()
        if id(obj) in seen or id(obj) in shared:
            continue
        seen.add(id(obj))
        try:
            if (depth and isinstance(obj, skipped)  # (the root itself is looked into)
                    or str(type(obj).__module__).startswith("unbroken.")):
                continue
            if isinstance(obj, _PRIVATE):
                kind = next(n for k, n in zip(_PRIVATE, _NAMES, strict=True)
                            if isinstance(obj, k))
                return f"{path}: a {kind}"
            if _seeded_hf(obj):
                return f"{path}: {type(obj).__name__}(seed={obj.seed!r})"
            if depth < _MAX_DEPTH:
                stack.extend((path + suffix, child, depth + 1)
                             for suffix, child in reversed(list(_children(obj))))
        except Exception:  # noqa: BLE001 -- an object that will not be looked into (a proxy
            continue  # whose attributes raise, a mapping that raises on a read): passed by
    return None


def _named(fn: Any) -> str:
    """How an error names a collate function: its qualified name, a partial's function, or
    the class of a callable object (``Masking(...)``)."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_named(fn.func)})"
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(fn).__qualname__}(...)"


def refuse_private_collate(collate_fn: Callable[[list[Any]], Any]) -> None:
    """Refuse a collate_fn drawing from a generator of its own: it continues that stream from
    where it was made (in the main process, or from a worker's copy of it each pass), which no
    generation saves and the cursor does not position, so a resume collates differently.
    What collate draws from the global streams is exact: `_SeededCollate` (map-style) and the
    iterable pass seed them for each batch."""
    found = private_rng(collate_fn, "collate_fn")
    if found is not None:
        raise UnsupportedSetup(
            f"ResumableLoader: collate_fn={_named(collate_fn)} draws from a random generator "
            f"of its own ({found}): its stream is neither saved with a generation nor "
            "positioned by the data cursor, so a resumed run would collate differently; draw "
            "from the global RNGs instead (torch's default CPU generator: torch.rand, "
            "torch.randint...; NumPy's np.random.*; Python's random.*): ResumableLoader seeds "
            "those three for each batch's collate_fn call from (its seed, the epoch, the "
            "position of the batch's first sample), the same with any number of workers")


def warn_private_dataset(dataset: Any) -> None:
    """Warn when a map-style dataset (inside `seeded`'s wrapper too) holds a random generator
    of its own: draws from it in ``__getitem__`` continue its stream from where it was made,
    in each process and worker, which no generation saves and `seeded` does not key, so a
    resumed run's items differ."""
    inner = getattr(dataset, "dataset", None) if str(type(dataset).__module__).startswith(
        "unbroken.") else dataset
    found = private_rng(inner, "dataset", datasets=True) if inner is not None else None
    if found is not None:
        warnings.warn(
            f"ResumableLoader: the dataset holds a random generator of its own ({found}): "
            "draws from it in __getitem__ continue its stream from where it was made, in each "
            "process and worker, which no generation saves, so a resumed run's items differ; "
            "draw from the global RNGs (torch.rand, np.random.*, random.*), which seeded() "
            "keys by sample, or make a generator from the sample's key", UnbrokenWarning,
            stacklevel=4)
