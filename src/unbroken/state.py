"""Named state parts -> one state tree per generation, and back.

A part is anything with ``state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol);
the model and optimizer get special handling so that optimizer state is keyed by parameter
*name* (torch maps it by position, which silently mis-maps a reordered model). Loading is split
into ``validate_*`` (reads only) and ``apply`` so that nothing live changes until the whole
generation has been checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from .codec import (
    decode_safetensors,
    decode_tree,
    dumps_json,
    encode_safetensors,
    encode_tree,
    loads_json,
)
from .errors import CorruptCheckpoint, MissingState, StateMismatch, UnbrokenError

# State keys: the part names of a generation (and the stem of their tensor files).
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
DATA = "data"
RNG = "rng"
COUNTERS = "counters"
EXTRA_PREFIX = "extra."
STATE_FILE = "state.json"
STATE_SCHEMA = "unbroken.state/1"
MAX_STATE_BYTES = 256 * 1024 * 1024

INTENTS = ("continue", "warm_start")


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state can be captured and restored (torchdata's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# -- model and optimizer ----------------------------------------------------------------------


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in the model (tied parameters keep one name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _live_group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = param_names(model)
    return [[names.get(id(p), f"<not in model>.group{gi}.param{pi}")
             for pi, p in enumerate(g["params"])] for gi, g in enumerate(optimizer.param_groups)]


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict with integer parameter ids replaced by parameter names."""
    sd = optimizer.state_dict()
    group_names = _live_group_names(model, optimizer)
    by_index: dict[int, str] = {}
    for saved_group, names in zip(sd["param_groups"], group_names):
        by_index.update(zip(saved_group["params"], names))
    return {
        "state": {by_index[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": names}
                         for g, names in zip(sd["param_groups"], group_names)],
    }


def optimizer_state_to_torch(saved: Mapping[str, Any], model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, where: str) -> dict[str, Any]:
    """Map a name-keyed optimizer state onto the live optimizer, refusing any mismatch."""
    try:
        groups, state = saved["param_groups"], saved["state"]
        saved_names = [list(g["params"]) for g in groups]
    except (KeyError, TypeError):
        raise CorruptCheckpoint(
            f"{where}: optimizer state lacks 'param_groups' or 'state'") from None
    live_names = _live_group_names(model, optimizer)
    if saved_names != live_names:
        raise StateMismatch(
            f"{where}: optimizer parameter groups differ from the live optimizer: saved "
            f"{_first_diff(saved_names, live_names)}. Parameters were renamed, reordered or "
            "regrouped; build the model and optimizer as in the saved run, or warm_start")
    index: dict[str, int] = {}
    params: dict[str, torch.Tensor] = {}
    n = 0  # torch numbers parameters in group order, each distinct parameter once
    for names, group in zip(live_names, optimizer.param_groups):
        for name, p in zip(names, group["params"]):
            if name not in index:
                index[name], params[name] = n, p
                n += 1
    unknown = set(state) - set(index)
    if unknown:
        raise StateMismatch(f"{where}: optimizer state for parameters {sorted(unknown)[:5]} "
                            "that the live optimizer does not hold")
    for name, entry in state.items():
        for key, value in (entry.items() if isinstance(entry, Mapping) else ()):
            p = params[name]
            if (isinstance(value, torch.Tensor) and value.dim() == p.dim() and value.dim() > 0
                    and value.shape != p.shape):
                raise StateMismatch(f"{where}: optimizer state {name}.{key} has shape "
                                    f"{tuple(value.shape)}, parameter {name} has {tuple(p.shape)}")
    return {"state": {index[k]: v for k, v in state.items()},
            "param_groups": [{**g, "params": [index[x] for x in g["params"]]} for g in groups]}


def _first_diff(saved: list[list[str]], live: list[list[str]]) -> str:
    if len(saved) != len(live):
        return f"{len(saved)} groups, live {len(live)}"
    for gi, (a, b) in enumerate(zip(saved, live)):
        if a != b:
            for pi in range(max(len(a), len(b))):
                x = a[pi] if pi < len(a) else "<none>"
                y = b[pi] if pi < len(b) else "<none>"
                if x != y:
                    return f"group {gi} position {pi} is {x!r}, live is {y!r}"
    return "same names"


def validate_model(saved: Mapping[str, Any], model: torch.nn.Module, where: str) -> None:
    """Keys, shapes and dtypes of a saved model state against the live model."""
    live = model.state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatch(f"{where}: model keys differ: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}; the checkpoint was written by another model "
                            "definition")
    for k, t in live.items():
        s = saved[k]
        if not isinstance(s, torch.Tensor) or s.shape != t.shape or s.dtype != t.dtype:
            found = (f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor)
                     else type(s).__name__)
            raise StateMismatch(f"{where}: model tensor {k!r}: expected {tuple(t.shape)} "
                                f"{t.dtype} (live model), found {found}")


class Counters:
    """Completed updates and epoch. The epoch lives here only when no data part owns it."""

    def __init__(self, data: Any) -> None:
        self.step = 0
        self._epoch = 0
        self._data = data

    @property
    def epoch(self) -> int:
        return int(getattr(self._data, "epoch", self._epoch))

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self._data is not None and hasattr(self._data, "epoch"):
            raise UnbrokenError("the data part owns the epoch; do not set it on the Checkpointer")
        self._epoch = int(value)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch}

    def validate_state_dict(self, saved: Mapping[str, Any], where: str) -> None:
        if type(saved.get("step")) is not int or type(saved.get("epoch")) is not int:
            raise CorruptCheckpoint(f"{where}: counters need integer 'step' and 'epoch'")

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.step = saved["step"]
        if self._data is None or not hasattr(self._data, "epoch"):
            self._epoch = saved["epoch"]


# -- capture and restore of every part ---------------------------------------------------------


def capture(parts: Mapping[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """One tree per part. ``parts`` maps part names to live objects (or, for counters and
    rng, to already-captured trees)."""
    tree: dict[str, Any] = {}
    for name, obj in parts.items():
        if name == OPTIMIZER:
            tree[name] = optimizer_state(model, obj)
        elif isinstance(obj, Stateful):
            tree[name] = obj.state_dict()
        else:
            tree[name] = obj
    return tree


def validate_parts(saved: Mapping[str, Any], parts: Mapping[str, Any], model: torch.nn.Module,
                   where: str) -> dict[str, Any]:
    """Check every part the run has against the saved tree; return what ``apply`` needs
    (the optimizer state already mapped to torch's positional form). Reads only."""
    missing = [p for p in parts if p not in saved]
    if missing:
        raise MissingState(
            f"{where}: the checkpoint has no {', '.join(map(repr, missing))} state, which this "
            "run has; a continuation needs every part (use warm_start to begin a new run from "
            "the weights)")
    extra = [p for p in saved if p not in parts]
    if extra:
        raise StateMismatch(
            f"{where}: the checkpoint holds {', '.join(map(repr, extra))} state but this run "
            "has no such part; pass it to the Checkpointer so the run continues as saved")
    ready = dict(saved)
    for name, obj in parts.items():
        if name == MODEL:
            validate_model(saved[name], obj, f"{where} [{name}]")
        elif name == OPTIMIZER:
            ready[name] = optimizer_state_to_torch(saved[name], model, obj, f"{where} [{name}]")
        elif isinstance(obj, Stateful) and not isinstance(saved[name], Mapping):
            raise CorruptCheckpoint(f"{where}: part {name!r} is not a mapping")
        elif name in (SCHEDULER, SCALER):
            live, got = set(obj.state_dict()), set(saved[name])
            if live - got:
                raise MissingState(f"{where}: {name} state lacks {sorted(live - got)}; it was "
                                   f"written by a different {type(obj).__name__} configuration")
    return ready


def apply(ready: Mapping[str, Any], parts: Mapping[str, Any]) -> None:
    """Load validated state into the live objects: user extras first (they can still fail in
    ways we cannot validate), the model and optimizer after."""
    order = sorted(parts, key=lambda p: (not p.startswith(EXTRA_PREFIX), p == MODEL))
    for name in order:
        obj = parts[name]
        if not isinstance(obj, Stateful):
            continue
        try:
            obj.load_state_dict(ready[name])
        except Exception as e:
            raise StateMismatch(f"part {name!r}: {type(obj).__name__}.load_state_dict refused "
                                f"the saved state ({e})") from e


# -- a generation's files ---------------------------------------------------------------------


def encode_generation(tree: Mapping[str, Any], meta: Mapping[str, str]
                      ) -> dict[str, list[memoryview]]:
    """Artifacts of one generation: ``<part>.safetensors`` per part holding tensors and
    ``state.json`` with every part's skeleton. ``meta`` (run id, generation, incarnation) is
    stamped into every tensor file so a file moved between generations is recognised."""
    skeletons: dict[str, Any] = {}
    files: dict[str, str] = {}
    artifacts: dict[str, list[memoryview]] = {}
    for part, value in tree.items():
        skeleton, tensors = encode_tree(value, "")
        skeletons[part] = skeleton
        if tensors:
            files[part] = f"{part}.safetensors"
            artifacts[files[part]] = encode_safetensors(
                tensors, {**meta, "unbroken.part": part})
    doc = {"schema": STATE_SCHEMA, "meta": dict(meta), "parts": skeletons, "tensor_files": files}
    artifacts[STATE_FILE] = [memoryview(dumps_json(doc, sort_keys=False))]
    return artifacts


def decode_generation(files: Mapping[str, bytes], folder: str,
                      parts: set[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Inverse of ``encode_generation`` over verified file contents; returns (tree, meta).
    ``parts`` limits decoding to some parts (a warm start reads only the model)."""
    where = f"{folder}/{STATE_FILE}"
    if STATE_FILE not in files:
        raise CorruptCheckpoint(f"{where}: missing from the generation")
    doc = loads_json(files[STATE_FILE], where, MAX_STATE_BYTES)
    try:
        if doc["schema"] != STATE_SCHEMA:
            raise CorruptCheckpoint(f"{where}: schema {doc['schema']!r}, expected {STATE_SCHEMA!r}")
        meta, skeletons, tensor_files = doc["meta"], doc["parts"], doc["tensor_files"]
        dict(meta), dict(skeletons), dict(tensor_files)
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpoint(f"{where}: not an unbroken state document") from None
    tree = {}
    for part, skeleton in skeletons.items():
        if parts is not None and part not in parts:
            continue
        tensors: dict[str, torch.Tensor] = {}
        if part in tensor_files:
            name = tensor_files[part]
            if name not in files:
                raise CorruptCheckpoint(f"{folder}/{name}: listed for part {part!r} but missing")
            tensors, file_meta = decode_safetensors(files[name], f"{folder}/{name}")
            expected = {**meta, "unbroken.part": part}
            if file_meta != expected:
                raise CorruptCheckpoint(
                    f"{folder}/{name}: stamped {file_meta}, expected {expected}: the file "
                    "belongs to another generation or part")
        tree[part] = decode_tree(skeleton, tensors, f"{where} [{part}]")
    return tree, meta
