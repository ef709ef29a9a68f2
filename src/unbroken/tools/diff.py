"""``unbroken diff A B``: what differs between two generations, part by part (DESIGN.md,
tools). Reads only verified bytes (every artifact re-hashed against its manifest, the state
decoded and its stamps checked, as `unbroken verify` does), compares the decoded state trees
leaf by leaf and never loads anything into a model.

Equality is bitwise: two generations saved from the same state must diff as equal, so a NaN
equals a NaN in the same position, and ``0.0`` differs from ``-0.0`` (reported with a max abs
difference of 0). Both generations are held in memory (they are checkpoints the user can
load); tensors are compared one at a time, in slices, and only the differing elements of a
slice are widened to float64, so the scratch memory stays bounded whatever the model.

Sharded tensors (FSDP2's DTensors, whose chunks ``shards.json`` indexes in every saving
rank's shard file) are compared as the others, by name: chunk against chunk when both
generations chunk a tensor alike, else each reassembled whole (one tensor of each side at a
time), so a generation saved by 2 ranks diffs against one saved by 4, or by one process."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._runview import UsageError, open_run, split_generation
from .._table import table
from ..dist._shard_index import SHARDS_FILE
from ..errors import RunUnreadable, UnbrokenError
from ..picking import rank_parts
from ..state._digest import digest_tree
from ..state.generation import check_sizes, check_stamps, decode_generation
from ..state.parts import RNG
from ..state.rng import rng_digests
from ..store.generations import GenerationStore
from ..store.verifying import GenerationInfo, not_loadable
from ._diff_shards import Sharded, place_shards

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements compared at once: ~150 MB of scratch at most
_RNG_STREAMS = ("python", "numpy", "torch_cpu", "cuda", "generators")  # in rng_digests

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxtuple = _short.maxdict = 6
_short.maxlevel = 3


# -- choosing the two generations ---------------------------------------------------------------


@dataclass
class Side:
    """One side of the diff: a verified generation and its decoded state."""

    store: GenerationStore
    info: GenerationInfo
    tree: dict[str, Any]
    sharded: bool
    # newer generations passed over because they did not verify: "generation N: why"
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        m = self.info.manifest
        assert m is not None
        return {"run": self.store.root, "generation": self.info.generation, "step": m.step,
                "run_id": m.run_id, "path": self.info.path}


def _load(store: GenerationStore, info: GenerationInfo) -> Side:
    """Read every artifact of ``info`` (hash-checked), decode it and check its stamps;
    `UnbrokenError` (CorruptCheckpoint) when any of that fails."""
    m = info.manifest
    if not info.ok or m is None:
        raise not_loadable(info)
    check_sizes(m, info.path)
    files = store.read_verified(info)
    tree, meta = decode_generation(files, info.path)
    # a job of many ranks: each rank's own parts (random streams, extras held per rank),
    # compared rank by rank (rank 0's stand for the parts when the stamps are checked)
    owns = [rank_parts(files, info.path, meta, r, set(m.parts) - set(tree))
            for r in range(m.world_size)] if m.world_size > 1 else []
    check_stamps(m, info.path, {**tree, **owns[0]} if owns else tree, meta)
    for rank, own in enumerate(owns):
        for part, value in own.items():
            tree[f"{part}[rank {rank}]"] = value
    if SHARDS_FILE in files:
        place_shards(tree, files, info.path, m)
    return Side(store, info, tree, SHARDS_FILE in files)


def resolve(label: str, spec: str, generation: int | None, older_than: int | None = None
            ) -> Side:
    """The generation ``spec`` names (a ``gen-*`` path, or ``generation`` of run ``spec``),
    or the newest one of run ``spec`` that verifies (and is older than ``older_than``)."""
    run, named = split_generation(spec)
    option = f"--{label.lower()}-generation"
    if named is not None and generation is not None and named != generation:
        raise UsageError(f"{spec}: names generation {named}, and {option} {generation} "
                         "another; give one of them")
    wanted = named if named is not None else generation
    try:
        store = open_run(run)
    except UsageError as e:
        raise UsageError(f"{spec}: {e}" if run != spec else str(e)) from None
    scanned = store.scan()
    found = [g.generation for g in scanned]
    if not scanned:
        raise UsageError(f"{spec}: no gen-NNNNNNNNN generation in {store.root}; expected a "
                         "run folder or URL, or a generation folder inside one")
    if wanted is not None:
        info = next((g for g in scanned if g.generation == wanted), None)
        if info is None:
            raise UsageError(f"{spec}: {store.root} has no generation {wanted} (found "
                             f"{found}); name one of those")
        try:
            return _load(store, info)
        except RunUnreadable:  # (this machine's: not a verdict on the generation)
            raise
        except UnbrokenError as e:
            raise UsageError(f"{spec}: generation {wanted} does not verify ({e}); name "
                             "another one, or none for the newest that verifies") from None
    problems: list[str] = []
    for info in reversed(scanned):
        if older_than is not None and info.generation >= older_than:
            continue
        try:
            side = _load(store, info)
        except RunUnreadable:  # (never a reason to compare an older one in its place)
            raise
        except UnbrokenError as e:
            problems.append(f"generation {info.generation}: {e}")
            continue
        side.skipped = problems
        return side
    older = f" older than generation {older_than}" if older_than is not None else ""
    raise UsageError(f"{spec}: no generation{older} verifies (found {found}"
                     + (f"; {'; '.join(problems)}" if problems else "") + f"); name {label} "
                     f"explicitly ({option} N, or a gen-NNNNNNNNN path)")


# -- comparing state trees ----------------------------------------------------------------------


def _is_node(value: Any) -> bool:
    """Whether ``leaves`` descends into ``value``: mappings, and sequences holding anything
    but plain values (a list of dicts or tensors). Sequences of numbers or strings (betas,
    base_lrs, a list of indices) are one leaf, shown truncated."""
    if isinstance(value, Mapping):
        return bool(value)
    return (isinstance(value, (list, tuple)) and any(
        isinstance(v, (Mapping, list, tuple, torch.Tensor, np.ndarray, Sharded))
        for v in value))


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, leaf) of a decoded part: ``state/0.weight/exp_avg``, ``param_groups[0]/lr``;
    a key that is not a string shows as ``[repr]``."""
    if not _is_node(tree):
        yield path, tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            sub = (f"{path}/{k}" if path else k) if isinstance(k, str) else f"{path}[{k!r}]"
            yield from leaves(v, sub)
    else:
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")


def part_leaves(part: str, tree: Any) -> dict[str, Any]:
    """The leaves of one part; random streams are compared by digest (a state is 5 KB of
    words that says nothing read side by side), one leaf per stream."""
    if (part == RNG or part.startswith(f"{RNG}[")) and isinstance(tree, Mapping):
        try:
            streams = {f"stream {k}": f"digest {v}" for k, v in rng_digests(tree).items()}
        except (TypeError, ValueError, AttributeError):  # hand-made state: compare it whole
            streams = {}
        if streams:
            rest = {k: v for k, v in tree.items() if k not in _RNG_STREAMS}
            return {**streams, **(dict(leaves(rest)) if rest else {})}
    return {key or ".": value for key, value in leaves(tree)}  # ".": the part is one leaf


def _as_tensor(value: Any) -> torch.Tensor | Sharded | None:
    if isinstance(value, (torch.Tensor, Sharded)):
        return value
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(np.ascontiguousarray(value))
        except TypeError:  # a dtype torch lacks (strings): compared as a plain value
            return None
    return None


def describe(t: torch.Tensor | Sharded) -> Any:
    """A tensor in a report: its value when it has one element (the Adam step), else
    ``float32[3, 4]``."""
    if math.prod(t.shape) == 1 and not t.dtype.is_complex:
        return (t.whole() if isinstance(t, Sharded) else t).reshape(-1)[0].item()
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def shown(value: Any) -> Any:
    """A plain leaf in a report: numbers, booleans, None and short strings as they are;
    anything else (and a long string) as a truncated repr."""
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 64 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, str) and len(value) <= 60:
        return value
    return _short.repr(value)


def tensor_diff(a: torch.Tensor | Sharded, b: torch.Tensor | Sharded) -> dict[str, Any] | None:
    """None when bitwise equal; else the change (shape, dtype, or values: how many elements
    differ, max abs and max rel difference, rel = abs / max(|a|, tiny)). A `Sharded` tensor
    is compared chunk against chunk with another chunked alike, else reassembled."""
    out: dict[str, Any] = {"kind": "tensor", "a": describe(a), "b": describe(b)}
    if a.dtype != b.dtype:
        return {**out, "change": "dtype"}
    if tuple(a.shape) != tuple(b.shape):
        return {**out, "change": "shape"}
    if (isinstance(a, Sharded) and isinstance(b, Sharded)
            and a.reader.layout(a.key) == b.reader.layout(b.key)):
        theirs = {tuple(c["offsets"]): t for c, t in b.reader.chunks(b.key)}
        pairs: Iterable[tuple[torch.Tensor, torch.Tensor]] = (
            (t, theirs[tuple(c["offsets"])]) for c, t in a.reader.chunks(a.key))
    else:  # (one of a kind, or chunked otherwise: each whole, one tensor a side at a time)
        pairs = [(a.whole() if isinstance(a, Sharded) else a,
                  b.whole() if isinstance(b, Sharded) else b)]
    count, max_abs, max_rel = 0, 0.0, 0.0
    for ta, tb in pairs:
        x = ta.detach().cpu().contiguous().reshape(-1)
        y = tb.detach().cpu().contiguous().reshape(-1)
        for at in range(0, x.numel(), _CHUNK):  # bounded scratch memory, whatever the tensor
            found = _chunk_diff(x[at:at + _CHUNK], y[at:at + _CHUNK])
            if found is not None:
                count += found[0]
                max_abs, max_rel = max(max_abs, found[1]), max(max_rel, found[2])
    if count == 0:
        return None
    return {**out, "change": "values", "differing": count, "elements": math.prod(a.shape),
            "max_abs": max_abs, "max_rel": max_rel}


def _chunk_diff(x: torch.Tensor, y: torch.Tensor) -> tuple[int, float, float] | None:
    """(differing elements, max abs, max rel) of two flat slices of one dtype; None when
    bitwise equal."""
    size = x.element_size()
    if size in _INT_VIEW:  # bitwise: NaN == NaN, -0.0 != 0.0
        differs = x.view(_INT_VIEW[size]) != y.view(_INT_VIEW[size])
    else:  # complex128: 16-byte elements
        differs = (x.view(torch.uint8).reshape(-1, size)
                   != y.view(torch.uint8).reshape(-1, size)).any(dim=1)
    count = int(differs.sum())
    if count == 0:
        return None
    wide = torch.complex128 if x.is_complex() else torch.float64
    xa, yb = x[differs].to(wide), y[differs].to(wide)  # only the differing elements widened
    same = (xa == yb) | (xa.isnan() & yb.isnan())  # -0.0 vs 0.0; NaNs of other payloads
    absolute = torch.where(same, 0.0, (xa - yb).abs())
    absolute = torch.where(absolute.isnan(), torch.inf, absolute)  # NaN against a number
    tiny = torch.finfo(x.dtype).tiny if x.is_floating_point() or x.is_complex() else 1.0
    relative = absolute / xa.abs().clamp_min(tiny)
    relative = torch.where(absolute == 0, 0.0, relative)
    relative = torch.where(relative.isnan(), torch.inf, relative)
    return count, float(absolute.max()), float(relative.max())


def _same(a: Any, b: Any) -> bool:
    """Plain leaves, by content digest: type-tagged and bitwise (1 != 1.0, NaN == NaN)."""
    try:
        return digest_tree(a) == digest_tree(b)
    except TypeError:  # a type the digest does not know
        return type(a) is type(b) and repr(a) == repr(b)


def leaf_diff(a: Any, b: Any) -> dict[str, Any] | None:
    """None when ``a`` and ``b`` are equal; else what changed."""
    ta, tb = _as_tensor(a), _as_tensor(b)
    if ta is not None and tb is not None:
        return tensor_diff(ta, tb)
    if ta is not None or tb is not None:
        return {"kind": "tensor" if ta is not None else "value", "change": "type",
                "a": describe(ta) if ta is not None else shown(a),
                "b": describe(tb) if tb is not None else shown(b)}
    if _same(a, b):
        return None
    return {"kind": "value", "change": "value" if type(a) is type(b) else "type",
            "a": shown(a), "b": shown(b)}


def _only(key: str, value: Any, side: str) -> dict[str, Any]:
    t = _as_tensor(value)
    return {"key": key, "kind": "tensor" if t is not None else "value",
            "change": f"only in {side}", side.lower(): describe(t) if t is not None
            else shown(value)}


def compare_part(la: Mapping[str, Any], lb: Mapping[str, Any]) -> dict[str, Any]:
    """The leaves of one part in A and B (`part_leaves`): the entries that differ and the
    keys that do not."""
    entries: list[dict[str, Any]] = []
    equal: list[str] = []
    for key in [*la, *(k for k in lb if k not in la)]:
        if key not in lb:
            entries.append(_only(key, la[key], "A"))
        elif key not in la:
            entries.append(_only(key, lb[key], "B"))
        else:
            found = leaf_diff(la[key], lb[key])
            if found is None:
                equal.append(key)
            else:
                entries.append({"key": key, **found})
    return {"status": "different" if entries else "equal", "compared": len(equal) + len(entries),
            "differing": len(entries), "entries": entries, "equal": equal}


def _identity_leaves(identity: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's identity as leaves: a config by its keys (``config/lr``) while its values
    are recorded, and each field by its kind and content hash (two configs may show equal
    values and still differ, e.g. in a value too large to record)."""
    out: dict[str, Any] = {}
    for name, entry in identity.items():
        if not isinstance(entry, Mapping):
            out[name] = entry
            continue
        value = entry.get("value")
        if isinstance(value, Mapping) and value:
            out.update(leaves(value, name))
        out[f"{name} (content)"] = (f"{entry.get('summary') or entry.get('kind')} "
                                     f"(xxh3 {entry.get('hash')})")
    return out


def diff_sides(a: Side, b: Side) -> dict[str, Any]:
    """The diff of two loaded generations, per part (parts in A's order, then B's own), and
    of the identity each is bound to (config, tokenizer, data): a generation bound to another
    config cannot continue this run's, however equal its tensors."""
    parts: dict[str, Any] = {}
    for part in [*a.tree, *(p for p in b.tree if p not in a.tree)]:
        found = compare_part(part_leaves(part, a.tree[part]) if part in a.tree else {},
                             part_leaves(part, b.tree[part]) if part in b.tree else {})
        if part not in a.tree or part not in b.tree:  # every leaf listed as only in A (B)
            found["status"] = f"only in {'A' if part in a.tree else 'B'}"
        parts[part] = found
    notes = [f"{label}: skipped {why}" for label, side in (("A", a), ("B", b))
             for why in side.skipped]
    assert a.info.manifest is not None and b.info.manifest is not None  # (verified: `_load`)
    identity = compare_part(_identity_leaves(a.info.manifest.identity),
                            _identity_leaves(b.info.manifest.identity))
    equal = identity["status"] == "equal" and all(p["status"] == "equal"
                                                  for p in parts.values())
    return {"a": a.summary(), "b": b.summary(), "equal": equal, "ok": equal, "parts": parts,
            "identity": identity, "notes": notes}


# -- the command --------------------------------------------------------------------------------


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _text(payload: dict[str, Any]) -> str:
    def head(label: str, s: dict[str, Any]) -> str:
        return (f"{label}  {s['run']} gen-{s['generation']:09d} (step {s['step']}, run "
                f"{s['run_id']})")

    lines = [head("A", payload["a"]), head("B", payload["b"]), ""]
    rows = []
    for part, p in [*payload["parts"].items(), ("identity", payload["identity"])]:
        for e in p["entries"]:
            count = f"{e['differing']}/{e['elements']}" if "differing" in e else None
            rows.append([part, e["key"], e["change"], _number(e.get("a")),
                         _number(e.get("b")), _number(e.get("max_abs")),
                         _number(e.get("max_rel")), count])
    if rows:
        lines += [table(["part", "entry", "change", "A", "B", "max abs", "max rel",
                         "differing"], [[_cut(c) for c in r] for r in rows],
                        right=(5, 6, 7)), ""]
    equal = [k for k, p in payload["parts"].items() if p["status"] == "equal"]
    lines.append(f"equal parts: {', '.join(equal) or 'none'}")
    lines += [f"note: {n}" for n in payload["notes"]]
    differ = [f"{k} ({p['status']})" if p["status"].startswith("only in") else
              f"{k} ({p['differing']} of {p['compared']} entries)"
              for k, p in payload["parts"].items() if p["status"] != "equal"]
    if payload["identity"]["status"] != "equal":
        fields = sorted({e["key"].split("/")[0].split(" ")[0]
                         for e in payload["identity"]["entries"]})
        differ.append(f"identity ({', '.join(fields)})")
    lines.append("verdict: equal (every part bitwise identical)" if payload["equal"] else
                 f"verdict: different: {', '.join(differ)}")
    return "\n".join(lines)


def _cut(cell: Any, width: int = 48) -> Any:
    text = "-" if cell is None else str(cell)
    return text if len(text) <= width else text[:width - 1] + "…"
