"""Stanford CS336 assignment 1 checkpointing contract, in unbroken's safe format.

``save_checkpoint(model, optimizer, iteration, out)`` / ``load_checkpoint(src, model,
optimizer) -> iteration``, where ``out``/``src`` is a path or a binary file object. The file is
one safetensors file: model tensors under ``model/``, optimizer tensors under ``optimizer/``,
and the non-tensor skeleton plus a content hash of the tensor bytes in its metadata. Optimizer
state is keyed by parameter name. Nothing is pickled.
"""

from __future__ import annotations

import os
from typing import IO

import torch
import xxhash

from ..errors import CorruptCheckpoint
from ..state.codec import encode_tree
from ..state.decoding import decode_tree
from ..state.jsontext import dumps_json, loads_json
from ..state.livemodel import with_versions
from ..state.modelcheck import validate_model
from ..state.optim import load_optimizer_state, optimizer_state, optimizer_state_to_torch
from ..state.tensorfile import encode_safetensors
from ..state.tensorread import decode_safetensors

_FORMAT = "unbroken.cs336/1"


def _hash(text: str) -> str:
    return xxhash.xxh3_128(text.encode()).hexdigest()


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int,
                    out: str | os.PathLike[str] | IO[bytes]) -> None:
    """Write model, optimizer and iteration to ``out`` (path or binary file object)."""
    skeleton, tensors = encode_tree({"model": model.state_dict(),
                                     "optimizer": optimizer_state(model, optimizer),
                                     "iteration": int(iteration)})
    text = dumps_json(skeleton).decode()
    chunks = encode_safetensors(tensors, {"unbroken.format": _FORMAT, "unbroken.skeleton": text,
                                          "unbroken.skeleton_xxh3_128": _hash(text)},
                                data_hash_key="unbroken.xxh3_128")
    if isinstance(out, (str, os.PathLike)):
        tmp = f"{os.fspath(out)}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)  # a reader never sees a half-written checkpoint
    else:
        for chunk in chunks:
            out.write(chunk)


def load_checkpoint(src: str | os.PathLike[str] | IO[bytes], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from ``src``; return the saved iteration. Everything is
    validated (hash, keys, shapes, parameter names) before either object changes."""
    where = os.fspath(src) if isinstance(src, (str, os.PathLike)) else getattr(src, "name",
                                                                               "<file object>")
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            data = f.read()
    else:
        data = src.read()
    tensors, meta = decode_safetensors(data, str(where))
    if meta.get("unbroken.format") != _FORMAT:
        raise CorruptCheckpoint(f"{where}: format {meta.get('unbroken.format')!r}, expected "
                                f"{_FORMAT!r} (written by unbroken.compat.cs336.save_checkpoint)")
    n = int.from_bytes(data[:8], "little")
    digest = xxhash.xxh3_128(memoryview(data)[8 + n:]).hexdigest()
    if digest != meta.get("unbroken.xxh3_128"):
        raise CorruptCheckpoint(f"{where}: tensor data hash {digest}, the header records "
                                f"{meta.get('unbroken.xxh3_128')} (the file is corrupt)")
    text = meta.get("unbroken.skeleton", "")
    if _hash(text) != meta.get("unbroken.skeleton_xxh3_128"):
        raise CorruptCheckpoint(f"{where}: the header's state skeleton does not match its hash "
                                "(the file is corrupt)")
    tree = decode_tree(loads_json(text.encode(), str(where), 1 << 30), tensors, str(where))
    if not (isinstance(tree, dict) and {"model", "optimizer", "iteration"} <= set(tree)
            and type(tree["iteration"]) is int):
        raise CorruptCheckpoint(f"{where}: expected model, optimizer and an integer iteration")
    validate_model(tree["model"], model, str(where))
    ready = optimizer_state_to_torch(tree["optimizer"], model, optimizer, str(where))
    model.load_state_dict(with_versions(model, tree["model"]))
    load_optimizer_state(optimizer, ready)  # (as a restore loads it: see optim)
    return int(tree["iteration"])
