"""The checks behind ``unbroken verify --deep``: what a hash cannot see.

Plain verification proves that every file holds the bytes its manifest names and that the
state decodes. A generation can pass that and still never train: a NaN or an inf in a weight
(the silent corruption large runs report), an optimizer moment whose shape no parameter has
(a resealed ``exp_avg`` of shape [2**40, 0] decodes, loads, and fails at the first step), an
impossible hyperparameter, or a scheduler or GradScaler state torch's own classes could not
hold. `deep_problems` reads the decoded state tree (`unbroken.state.generation.decode_generation`)
and names each such problem; it changes nothing and imports no user code. The sharded
tensors of an FSDP2 generation, which the tree lacks, are read from their shard files one
file at a time and checked chunk by chunk (`_sharded_values`).

It is tolerant of what legitimately varies: parts that are absent, an optimizer without
state yet, extras of any shape, third-party optimizers (whose state layouts are their own
business: only finiteness, names and ``step`` are checked there), and an inf in a model
tensor no optimizer trains (a persistent attention mask holds -inf by design)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dist._shard_index import SHARDS_FILE  # (not `dist.sharded`: no torch.distributed)
from ..dist._shard_read import Read, ShardReader, generation_stamps, key_path
from ..errors import CorruptCheckpoint, shown
from ..state.parts import MODEL, OPTIMIZER, RNG, SCALER, SCHEDULER, STATE_FILE
from ..state.rng import rng_form_problems
from ..state.wellformed import (
    MAX_DEPTH,
    group_problems,
    judges,
    number,
    optimizer_state_problems,
    scaler_problems,
    scheduler_problems,
    show,
)
from ..store.manifest import Manifest

__all__ = ["deep_problems"]


# Elements per pass of a finiteness scan: the temporaries (16 MiB masks, a 64 MiB float32 copy
# of a float8 chunk) stay bounded whatever the size of the tensor, which is a mapped file.
_CHUNK = 1 << 24
_NATIVE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                     torch.complex64, torch.complex128})  # isfinite/isnan/isinf run on these


def deep_problems(tree: Mapping[str, Any], manifest: Manifest, where: str,
                  shards: Mapping[str, Any] | None = None, read: Read | None = None
                  ) -> list[str]:
    """Every problem of a decoded, hash-verified generation that would keep it from loading
    or training correctly, one message each (file, key, what was expected, what was found);
    an empty list when there is none.

    ``tree`` is what ``decode_generation`` returns for the generation's shared files,
    ``manifest`` its manifest (file names), ``where`` its folder. ``shards`` is its
    validated ``shards.json`` (`unbroken.dist.sharded.read_index`) when it has one: the
    global shapes of sharded tensors, which the tree does not hold, and where their chunks
    are, whose values are checked as the tree's tensors are (`_sharded_values`), read one
    shard file at a time by ``read(name)`` (its hash-verified bytes). Without ``shards``,
    names, shapes and values of a sharded generation's sharded tensors are not checked (the
    tree lacks them); without ``read``, their values are not."""
    out: list[str] = []
    names = {a.name for a in manifest.artifacts}
    state_json = f"{where}/{STATE_FILE}"
    sharded = _sharded_shapes(shards)
    shapes: dict[str, Any] | None = None  # the model's tensors; None: unknown
    model = tree.get(MODEL)
    if MODEL in tree and not isinstance(model, Mapping):
        out.append(f"{state_json}: the model part is a {type(model).__name__}; expected a "
                   "mapping of tensor names to tensors")
    elif isinstance(model, Mapping) and (SHARDS_FILE not in names or shards is not None):
        shapes = {k: tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
        # (a sharded parameter's global shape is its own, not a saved layout: exact)
        shapes.update({p[1]: torch.empty(s, device="meta") for p, s in sharded.items()
                       if len(p) == 2 and p[0] == MODEL})
    trained: set[str] = set()  # the parameters the optimizer's groups list
    groups = None
    later: list[str] = []  # the optimizer's problems, reported after the model's
    if OPTIMIZER in tree:
        # (a sharded generation read without its shards.json: what each parameter holds is
        # not all in the tree)
        complete = SHARDS_FILE not in names or shards is not None
        groups = _optimizer(tree[OPTIMIZER], shapes, sharded,
                            _Files(where, names, OPTIMIZER, read), state_json, trained, later,
                            complete)
    if isinstance(model, Mapping):
        file = _Files(where, names, MODEL, read)
        for key, t in model.items():
            if isinstance(t, torch.Tensor):
                # inf only where no optimizer trains it: a persistent attention mask holds
                # -inf by design, a trained weight never does; NaN is never legitimate
                out.extend(_finite(t, f"model tensor {key!r}", file,
                                   allow_inf=key not in trained))
    in_model, in_optimizer = (_sharded_values(shards, manifest, where, trained, read)
                              if shards is not None and read is not None else ([], []))
    out.extend(in_model)
    out.extend(later)
    out.extend(in_optimizer)
    if SCHEDULER in tree:
        scheduler_problems(tree[SCHEDULER], "scheduler", groups, state_json, out)
    if SCALER in tree:
        scaler_problems(tree[SCALER], state_json, out)
    if isinstance(tree.get(RNG), Mapping):
        out.extend(rng_form_problems(tree[RNG], f"{where}/{RNG}"))
    return out


# -- the optimizer ------------------------------------------------------------------------------


def _optimizer(opt: Any, shapes: Mapping[str, Any] | None,
               sharded: Mapping[tuple[Any, ...], tuple[int, ...]], files: _Files, state_json: str,
               trained: set[str], out: list[str], complete: bool) -> int | None:
    """Check the optimizer part (name-keyed, see `unbroken.state.optim`); fill ``trained``
    with the parameter names its groups list; return the number of groups (None: unknown).
    ``complete``: the tree (with ``sharded``) holds every tensor of the state."""
    groups = opt.get("param_groups") if isinstance(opt, Mapping) else None
    state = opt.get("state") if isinstance(opt, Mapping) else None
    if (not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups)
            or not isinstance(state, Mapping)):
        out.append(f"{state_json}: the optimizer part needs 'param_groups' (a list of "
                   f"mappings) and 'state' (a mapping); found {shown(_kinds(opt), 80)}")
        return None
    cls = opt.get("class")
    judged = judges(cls)
    # (a sharded parameter's state is not in the tree: DCP holds it, `shards.json` its shape,
    # which a tensor on the meta device stands for)
    held = dict(state)
    for at, shape in sharded.items():
        if len(at) == 4 and at[:2] == (OPTIMIZER, "state"):
            entry = held.get(at[2], {})
            if isinstance(entry, Mapping):
                held[at[2]] = {**entry, at[3]: torch.empty(shape, device="meta")}
    file = files.name
    # (the shapes the model's tensors were saved in: `saved_layout`; sharded ones exact)
    out.extend(optimizer_state_problems(cls, held, groups, shapes, file, state_json,
                                        complete, saved_layout=True))
    for gi, g in enumerate(groups):
        params = g.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            out.append(f"{state_json}: optimizer param group {gi} 'params' is "
                       f"{shown(params)}; expected a list of parameter names")
            continue
        trained.update(params)
        if shapes is not None:
            out.extend(f"{state_json}: optimizer param group {gi} lists parameter {p!r}, "
                       "which the model does not have" for p in params if p not in shapes)
        group_problems(cls, g, gi, file, state_json, out)
    for name, entry in state.items():
        label = f"optimizer state[{name!r}]"
        if not isinstance(entry, Mapping):
            out.append(f"{state_json}: {label} is a {type(entry).__name__}; expected a "
                       "mapping")
            continue
        if name not in trained:
            out.append(f"{state_json}: {label}: no param group lists {name!r}; the state of "
                       "a parameter the optimizer does not train could never load")
        if shapes is not None and name not in shapes:
            out.append(f"{state_json}: {label}: the model has no parameter {name!r}")
        # (a step that is no number at all: optimizer_state_problems said so)
        if "step" in entry and not (judged and number(entry["step"]) is None
                                    and not isinstance(entry["step"], torch.Tensor)):
            step = number(entry["step"])
            if step is None or not math.isfinite(step) or step < 0:
                holder = _at(entry["step"], files, state_json)
                out.append(f"{holder}: {label}['step'] is "
                           f"{show(entry['step'])}; expected a finite scalar >= 0")
        for path, t in _tensors(entry, label):
            if not path.endswith("['step']"):  # (reported above, with its own bound)
                out.extend(_finite(t, path, files))
    return len(groups)


# -- sharded tensors ----------------------------------------------------------------------------


@dataclass
class _Found:
    """What the chunks of one sharded tensor scanned so far hold that is refused."""

    nans: int = 0
    infs: int = 0
    first: tuple[int, ...] | None = None  # global index of the first refused value
    file: str = ""  # the shard file holding it


def _sharded_values(index: Mapping[str, Any], manifest: Manifest, where: str,
                    trained: set[str], read: Read) -> tuple[list[str], list[str]]:
    """(the model's, the optimizer's) problems of the sharded tensors ``index`` lists: a
    shard file that does not decode or belongs to another generation, a chunk it lacks or
    holds with another dtype or shape than the index says, and NaN or inf values, as
    `_finite` finds them in an unsharded tensor (inf allowed in a model tensor no optimizer
    trains), reported once per tensor with the global index of its first such value.

    The shard files are read one at a time and dropped before the next (each chunk of a
    file scanned in place), so memory stays bounded by one file: an FSDP tensor has a chunk
    in every rank's file, and reassembling tensors one by one would read each file again
    for each tensor."""
    reader = ShardReader(index, read, where,
                         generation_stamps(manifest), keep=False)
    found: dict[str, _Found] = {}
    broken: list[str] = []  # the files' and chunks' own problems
    for file, chunks in reader.files():
        try:
            tensors = reader.decode(file)
        except CorruptCheckpoint as e:  # (then every chunk of it is unread: said once)
            broken.append(str(e))
            continue
        for key, c in chunks:
            try:
                t = reader.chunk(key, c, tensors)
            except CorruptCheckpoint as e:
                broken.append(str(e))
                continue
            path = key_path(key)
            if path[0] not in (MODEL, OPTIMIZER):
                continue  # extras: their layouts are the user's (as unsharded, module doc)
            hit = _scan(t, allow_inf=path[0] == MODEL and path[1] not in trained)
            if hit is None:
                continue
            # A chunk is a box of the tensor: its own row-major order is the tensor's, so
            # its first refused value is the first among its own in the whole tensor.
            at = tuple(o + i for o, i in zip(c["offsets"], _unravel(hit[2], c["sizes"])))
            f = found.setdefault(key, _Found())
            f.nans, f.infs = f.nans + hit[0], f.infs + hit[1]
            if f.first is None or at < f.first:
                f.first, f.file = at, file
        del tensors  # (the file's bytes go with its last view)
    model: list[str] = []
    optimizer: list[str] = []
    for key in (k for k in reader.entries if k in found):  # (the index's order)
        f, path = found[key], key_path(key)
        assert f.first is not None
        count = len(reader.entries[key]["chunks"])
        message = _non_finite(
            f"{where}/{f.file}", _sharded_label(path), reader.dtype(key), reader.size(key),
            f.nans, f.infs, f.first, allow_inf=path[0] == MODEL and path[1] not in trained,
            how=f", sharded in {count} chunk{'s' if count != 1 else ''}")
        (model if path[0] == MODEL else optimizer).append(message)
    return model + broken, optimizer


def _sharded_label(path: list[Any]) -> str:
    """A sharded tensor as the messages of an unsharded one name it: ``model tensor
    '0.weight'``, ``optimizer state['0.weight']['exp_avg']``."""
    if path[0] == OPTIMIZER and len(path) >= 3 and path[1] == "state":
        return f"optimizer state[{path[2]!r}]" + "".join(f"[{k!r}]" for k in path[3:])
    return f"{path[0]} tensor {path[1]!r}" + "".join(f"[{k!r}]" for k in path[2:])


# -- tensors and values -------------------------------------------------------------------------


def _finite(t: torch.Tensor, label: str, file: _Files, allow_inf: bool = False) -> list[str]:
    """One message if ``t`` (floating or complex) holds NaN (or, unless ``allow_inf``, inf):
    how many of each, and the index of the first. Scanned in chunks of `_CHUNK` elements."""
    found = _scan(t, allow_inf)
    if found is None:
        return []
    nans, infs, first = found
    return [_non_finite(file.of(t), label, t.dtype, tuple(t.shape), nans, infs,
                        _unravel(first, t.shape), allow_inf)]


def _scan(t: torch.Tensor, allow_inf: bool) -> tuple[int, int, int] | None:
    """(NaNs, infs, flat index of the first) of ``t`` when it holds NaN (or, unless
    ``allow_inf``, inf); None when it holds none, or is neither floating nor complex.
    Scanned in flat slices of `_CHUNK` elements; NaNs and infs are counted only in slices
    that hold something refused."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    flat = t.reshape(-1)
    nans = infs = 0
    first = -1
    for lo in range(0, flat.numel(), _CHUNK):
        c = flat[lo:lo + _CHUNK]
        if c.dtype not in _NATIVE:  # float8 and friends: no isinf/isfinite kernels
            try:
                c = c.to(torch.complex64 if c.is_complex() else torch.float32)
            except (RuntimeError, TypeError):
                return None  # a packed dtype (float4) that no kernel reads: nothing to check
        # aminmax propagates NaN and is one pass, 10-20x faster than an isfinite mask: the
        # masks below run only on a chunk that holds something non-finite
        low, high = torch.aminmax(torch.view_as_real(c) if c.is_complex() else c)
        if math.isfinite(float(low)) and math.isfinite(float(high)):
            continue
        bad = torch.isnan(c) if allow_inf else ~torch.isfinite(c)
        if not bool(bad.any()):
            continue
        if first < 0:
            first = lo + int(bad.to(torch.uint8).argmax())  # argmax: the first maximum
        nans += int(torch.isnan(c).sum())
        infs += int(torch.isinf(c).sum())
    return None if first < 0 else (nans, infs, first)


def _non_finite(file: str, label: str, dtype: torch.dtype, shape: tuple[int, ...], nans: int,
                infs: int, first: tuple[int, ...], allow_inf: bool, how: str = "") -> str:
    """The message of a tensor holding ``nans`` NaN and ``infs`` inf, the first at index
    ``first`` (``how``: how it is stored, when not whole in ``file``)."""
    kinds = f"{nans} NaN" if allow_inf else f"{nans} NaN and {infs} inf"
    return (f"{file}: {label} ({str(dtype).removeprefix('torch.')} {list(shape)}{how}) holds "
            f"{kinds} of {math.prod(shape)} values, the first at index {list(first)}; "
            f"expected {'no NaN' if allow_inf else 'finite values'}")


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        index, r = divmod(index, n)
        out.append(r)
    return tuple(reversed(out))


def _tensors(node: Any, label: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``node`` (nested mappings, lists and tuples), with its path."""
    if isinstance(node, torch.Tensor):
        yield label, node
    elif depth < MAX_DEPTH and isinstance(node, Mapping):
        for k, v in node.items():
            yield from _tensors(v, f"{label}[{k!r}]", depth + 1)
    elif depth < MAX_DEPTH and isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _tensors(v, f"{label}[{i}]", depth + 1)


def _kinds(opt: Any) -> Any:
    """What an optimizer part holds, for a message: its keys and their types."""
    if not isinstance(opt, Mapping):
        return type(opt).__name__
    return {k: type(v).__name__ for k, v in opt.items()}


def _at(value: Any, files: _Files, state_json: str) -> str:
    """Where a value lives: tensors in the part's safetensors files, the rest in state.json."""
    return files.of(value) if isinstance(value, torch.Tensor) else state_json


class _Files:
    """A part's tensor files: an incremental generation spreads a part over its own file and
    stable files of earlier generations, so a message names the one whose bytes a tensor
    views (found by address among the verified files ``read`` gives), and the part's files
    (``name``) where that cannot be told (a tensor copied at decode, an empty one)."""

    def __init__(self, where: str, names: set[str], part: str, read: Read | None) -> None:
        self.own = sorted(n for n in names
                          if n.startswith(part + ".") and n.endswith(".safetensors"))
        self.where, self.read = where, read
        self.name = (f"{where}/{self.own[0]}" if len(self.own) == 1
                     else f"{where}/{part}.*.safetensors")
        self._spans: list[tuple[int, int, str]] | None = None

    def of(self, t: torch.Tensor) -> str:
        """The file whose bytes ``t`` views, else `name`."""
        if len(self.own) < 2 or self.read is None or not t.numel() or t.device.type != "cpu":
            return self.name
        if self._spans is None:
            self._spans = []
            for n in self.own:
                data = self.read(n)
                view = memoryview(data)
                if view.nbytes:
                    at = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
                    self._spans.append((at, at + view.nbytes, n))
        ptr = t.data_ptr()
        found = next((n for start, end, n in self._spans if start <= ptr < end), None)
        return self.name if found is None else f"{self.where}/{found}"


def _sharded_shapes(index: Mapping[str, Any] | None) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """{path in the state tree: global shape} of the sharded tensors ``shards.json`` lists."""
    out: dict[tuple[Any, ...], tuple[int, ...]] = {}
    tensors = index.get("tensors") if isinstance(index, Mapping) else None
    for key, entry in (tensors or {}).items():
        try:
            path, size = json.loads(key), entry["size"]
        except (ValueError, TypeError, KeyError):
            continue  # read_index validated it; anything else is not ours to judge here
        if isinstance(path, list) and isinstance(size, list):
            out[tuple(path)] = tuple(int(d) for d in size)
    return out
