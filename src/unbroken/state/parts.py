"""Named state parts -> one state tree per generation, and back.

A part is anything with ``state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol);
the model and optimizer get special handling so that optimizer state is keyed by parameter
*name* (torch maps it by position, which silently mis-maps a reordered model). Loading is split
into ``validate_*`` (reads only) and ``apply`` so that nothing live changes until the whole
generation has been checked."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import CorruptCheckpoint, MissingState, StateMismatch, UnbrokenError, UnsupportedValue
from .codec import (
    decode_safetensors,
    decode_tree,
    dumps_json,
    encode_safetensors,
    encode_tree,
    loads_json,
)

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


def check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that trains tensors outside the model: their moments would be
    saved but their values not, and a resume would silently start them from scratch."""
    names = param_names(model)
    outside = [f"group {gi} param {pi} {tuple(p.shape)}"
               for gi, g in enumerate(optimizer.param_groups)
               for pi, p in enumerate(g["params"]) if id(p) not in names]
    if outside:
        raise UnsupportedValue(
            f"the optimizer updates tensors that are not parameters of the model "
            f"({', '.join(outside[:3])}); register them on the model (e.g. as an "
            "nn.Parameter attribute) so their values are saved with it")


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict with integer parameter ids replaced by parameter names."""
    sd = optimizer.state_dict()
    group_names = _live_group_names(model, optimizer)
    by_index: dict[int, str] = {}
    for saved_group, names in zip(sd["param_groups"], group_names):
        by_index.update(zip(saved_group["params"], names))
    return {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
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
        if not isinstance(state, Mapping) or not all(isinstance(e, Mapping)
                                                     for e in state.values()):
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise CorruptCheckpoint(
            f"{where}: optimizer state lacks 'param_groups' or 'state'") from None
    live_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved.get("class", live_class) != live_class:
        raise StateMismatch(f"{where}: saved by {saved['class']}, the live optimizer is "
                            f"{live_class}; build the optimizer of the saved run, or warm_start")
    for gi, (saved_group, live_group) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(saved_group, Mapping) or set(saved_group) != set(live_group):
            got = set(saved_group) if isinstance(saved_group, Mapping) else saved_group
            raise StateMismatch(f"{where}: param group {gi} has settings {sorted(got)}, the "
                                f"live optimizer's has {sorted(live_group)}")
        for key, live in live_group.items():
            if key != "params" and not _same_kind(saved_group[key], live):
                raise CorruptCheckpoint(
                    f"{where}: param group {gi} {key!r} is {saved_group[key]!r:.40}, where the "
                    f"live optimizer holds a {type(live).__name__} ({live!r:.40})")
    live_names = _live_group_names(model, optimizer)
    if saved_names != live_names:
        raise StateMismatch(
            f"{where}: optimizer parameter groups differ from the live optimizer: saved "
            f"{_first_diff(saved_names, live_names)}. Parameters were renamed, reordered or "
            "regrouped; build the model and optimizer as in the saved run, or warm_start")
    # Per-parameter state shapes are the optimizer's business (Adafactor keeps factored
    # rows, LBFGS flat vectors); the names map onto parameters whose shapes validate_model
    # has checked against the saved model.
    index: dict[str, int] = {}
    n = 0  # torch numbers parameters in group order, each distinct parameter once
    for names in live_names:
        for name in names:
            if name not in index:
                index[name] = n
                n += 1
    unknown = set(state) - set(index)
    if unknown:
        raise StateMismatch(f"{where}: optimizer state for parameters {sorted(unknown)[:5]} "
                            "that the live optimizer does not hold")
    return {"state": {index[k]: v for k, v in state.items()},
            "param_groups": [{**g, "params": [index[x] for x in g["params"]]} for g in groups]}


# Param-group fields a learning-rate scheduler moves at every step: their live value in a
# freshly built run is the schedule's start, not a choice of the user. The base values the
# scheduler keeps (initial_lr, max_lr, base_momentum, ...) are compared instead.
_SCHEDULED = frozenset({"lr", "momentum", "betas"})


def _same_kind(saved: Any, live: Any) -> bool:
    """Whether a saved hyperparameter has the kind of value the live optimizer holds there
    (torch's load_state_dict takes anything: a None learning rate fails only at the step)."""
    if isinstance(live, bool) or live is None:
        return saved is None or isinstance(saved, bool)
    if isinstance(live, (int, float, torch.Tensor)):
        return (isinstance(saved, (int, float, torch.Tensor)) and not isinstance(saved, bool)
                and (not isinstance(saved, torch.Tensor) or saved.numel() == 1))
    if isinstance(live, (tuple, list)):
        return (isinstance(saved, (tuple, list)) and len(saved) == len(live)
                and all(_same_kind(a, b) for a, b in zip(saved, live)))
    if isinstance(live, str):
        return isinstance(saved, str)
    return True


def param_group_changes(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                        scheduled: bool = False) -> list[str]:
    """Each hyperparameter (param-group field) whose live value differs from the saved one:
    a continuation silently restores the saved value, so the change must at least be said.
    ``scheduled``: a scheduler drives the rates (see ``_SCHEDULED``)."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    skip = {"params", *(_SCHEDULED if scheduled else ())}
    out = []
    for gi, (old, live) in enumerate(zip(groups or [], optimizer.param_groups)):
        if not isinstance(old, Mapping):
            continue
        for key in sorted(k for k in live if k not in skip and k in old):
            a, b = old[key], live[key]
            same = (torch.equal(a, b) if isinstance(a, torch.Tensor) and
                    isinstance(b, torch.Tensor) else _plain(a) == _plain(b))
            if not same:
                out.append(f"optimizer param group {gi} {key!r}: saved {_plain(a)!r:.40}, "
                           f"live {_plain(b)!r:.40}")
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return list(value) if isinstance(value, tuple) else value


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


def validate_model(saved: Mapping[str, Any], model: torch.nn.Module, where: str,
                   dtypes: bool = True) -> None:
    """Keys, shapes and (for a continuation) dtypes of a saved model state against the live
    model. A warm start may change precision (fp32 weights into a bf16 model): load_state_dict
    converts."""
    if not isinstance(saved, Mapping):
        raise CorruptCheckpoint(f"{where}: the model state is not a mapping of tensors")
    live = model.state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatch(f"{where}: model keys differ: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}; the checkpoint was written by another model "
                            "definition")
    for k, t in live.items():
        s = saved[k]
        if (not isinstance(s, torch.Tensor) or s.shape != t.shape
                or dtypes and s.dtype != t.dtype):
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

    @staticmethod
    def validate_state_dict(saved: Mapping[str, Any], where: str) -> None:
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
                   where: str, intent: str = "continue") -> dict[str, Any]:
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
            validate_model(saved[name], obj, f"{where} [{name}]", dtypes=intent == "continue")
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
    """Load validated state into the live objects, all or nothing.

    The small parts (extras, scheduler, scaler, data, RNG, counters) go first: their
    ``load_state_dict`` can still refuse in ways no validation foresees, and if one does, those
    already loaded are put back from a copy. The optimizer and the model, fully validated and
    too large to copy, go last."""
    big = (OPTIMIZER, MODEL)
    order = sorted((p for p in parts if p not in big),
                   key=lambda p: not p.startswith(EXTRA_PREFIX)) + [p for p in big if p in parts]
    backup = {n: copy.deepcopy(parts[n].state_dict()) for n in order
              if n not in big and isinstance(parts[n], Stateful)}
    done: list[str] = []
    for name in order:
        obj = parts[name]
        if not isinstance(obj, Stateful):
            continue
        try:
            obj.load_state_dict(ready[name])
        except Exception as e:
            for prev in reversed([*done, name]):
                if prev in backup:
                    try:
                        parts[prev].load_state_dict(backup[prev])
                    except Exception:  # noqa: BLE001 - best effort; the error below says why
                        pass
            raise StateMismatch(f"part {name!r}: {type(obj).__name__}.load_state_dict refused "
                                f"the saved state ({e}); nothing was changed") from e
        done.append(name)


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
        try:
            skeleton, tensors = encode_tree(value, "")
            skeletons[part] = skeleton
            if tensors:
                files[part] = f"{part}.safetensors"
                artifacts[files[part]] = encode_safetensors(
                    tensors, {**meta, "unbroken.part": part})
        except UnsupportedValue as e:
            raise UnsupportedValue(f"part {part!r}: {e}") from None
    doc = {"schema": STATE_SCHEMA, "meta": dict(meta), "parts": skeletons, "tensor_files": files}
    text = dumps_json(doc, sort_keys=False)
    if len(text) > MAX_STATE_BYTES:  # what decode_generation refuses is never written
        sizes = sorted(((len(dumps_json(v, sort_keys=False)), k) for k, v in skeletons.items()),
                       reverse=True)
        raise UnsupportedValue(
            f"{STATE_FILE} would be {len(text)} bytes, over the {MAX_STATE_BYTES}-byte limit "
            "that restore applies; largest parts: " +
            ", ".join(f"{k!r} {n} bytes" for n, k in sizes[:3]) +
            ". Return bulk data from state_dict() as tensors or NumPy arrays (they go to "
            "safetensors), not as lists, strings or dicts")
    artifacts[STATE_FILE] = [memoryview(text)]
    return artifacts


def check_sizes(manifest: Any, folder: str) -> None:
    """Refuse, before reading a byte, a generation whose manifest lists a ``state.json``
    larger than restore parses: reading it first would cost its whole size in memory."""
    a = manifest.artifact(STATE_FILE)
    if a is not None and a.size > MAX_STATE_BYTES:
        raise CorruptCheckpoint(f"{folder}/{STATE_FILE}: {a.size} bytes, over the "
                                f"{MAX_STATE_BYTES}-byte limit; refusing to read it")


def decode_generation(files: Mapping[str, bytes | memoryview], folder: str,
                      parts: set[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Inverse of ``encode_generation`` over verified file contents; returns (tree, meta).
    ``parts`` limits decoding to some parts (a warm start reads only the model)."""
    try:
        return _decode_generation(files, folder, parts)
    except UnbrokenError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure on untrusted input is corruption
        raise CorruptCheckpoint(f"{folder}: cannot be decoded ({type(e).__name__}: "
                                f"{e!s:.200})") from None


def _decode_generation(files: Mapping[str, bytes | memoryview], folder: str,
                       parts: set[str] | None
                       ) -> tuple[dict[str, Any], dict[str, str]]:
    where = f"{folder}/{STATE_FILE}"
    if STATE_FILE not in files:
        raise CorruptCheckpoint(f"{where}: missing from the generation")
    doc = loads_json(files[STATE_FILE], where, MAX_STATE_BYTES)
    try:
        if doc["schema"] != STATE_SCHEMA:
            raise CorruptCheckpoint(f"{where}: schema {doc['schema']!r}, expected {STATE_SCHEMA!r}")
        meta, skeletons, tensor_files = doc["meta"], doc["parts"], doc["tensor_files"]
        if not all(isinstance(x, dict) for x in (meta, skeletons, tensor_files)):
            raise TypeError
        if not all(isinstance(v, str) for v in (*meta.values(), *tensor_files.values())):
            raise TypeError
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


def check_stamps(manifest: Any, folder: str, tree: Mapping[str, Any], meta: Mapping[str, Any],
                 all_parts: bool = True) -> None:
    """What decoding alone cannot know: state.json (and, through its stamps, every tensor
    file) belongs to the generation ``manifest`` describes. A file or a whole generation
    copied into another folder, or a manifest whose step was edited, is refused like any other
    corruption. ``all_parts=False`` when only some parts were decoded (a warm start)."""
    where = f"{folder}/{STATE_FILE}"
    expected = {"unbroken.run_id": manifest.run_id,
                "unbroken.generation": str(manifest.generation),
                "unbroken.incarnation": str(manifest.incarnation)}
    found = {k: meta.get(k) for k in expected}
    if found != expected:
        raise CorruptCheckpoint(f"{where}: stamped {found}, the manifest says {expected}: the "
                                "state belongs to another generation")
    if all_parts and sorted(tree) != sorted(manifest.parts):
        raise CorruptCheckpoint(f"{where}: holds parts {sorted(tree)}, the manifest lists "
                                f"{sorted(manifest.parts)}")
    counters = tree.get(COUNTERS)
    if COUNTERS in tree and not isinstance(counters, Mapping):
        raise CorruptCheckpoint(f"{where}: no counters part (a mapping of 'step' and 'epoch')")
    if isinstance(counters, Mapping):
        Counters.validate_state_dict(counters, f"{where} [{COUNTERS}]")  # ints, then compare
        if counters["step"] != manifest.step:
            raise CorruptCheckpoint(f"{where}: counters say step {counters['step']}, the "
                                    f"manifest says step {manifest.step}")
