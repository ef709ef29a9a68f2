"""Incremental generations: a tensor unchanged since the previous generation is not written
again. A part's tensors are split into files by how they change: its main file
(``model.safetensors``) holds what changed, and *stable* files (``model.g<N>.safetensors``,
written at generation N) hold tensors that did not change, or that are frozen
(``requires_grad=False``). A later generation whose stable file would be byte for byte the
same links that file (a hard link) instead of writing it.

Every generation stays whole and self-contained: each file it lists is in its own folder,
listed with its size and content hash, and verified like any other. The link count keeps
shared data alive however retention deletes older generations, and corruption of shared data
fails every generation that links it (each is verified on its own), so a restore falls back
past all of them. Where links are impossible (another filesystem, no hard links), the stable
file is written again. Which tensors are unchanged is decided by content: the xxh3-128 of
each tensor's dtype, shape and bytes, stamped into the file that holds it (so a restored run
knows them without hashing) and compared with the live tensor at the next save."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import xxhash

from ..errors import CorruptCheckpoint
from ..store.sources import Linked
from .jsontext import dumps_json, loads_json
from .tensorfile import Room, encode_safetensors, tensor_bytes

DIGESTS_KEY = "unbroken.digests"  # in a stable file's metadata: {key: xxh3-128 of the tensor}
MIN_STABLE_BYTES = 1 << 20  # a split into a stable file costs a file: not for a few scalars


def tensor_digest(t: torch.Tensor) -> str:
    """The content digest of a CPU tensor as it is written: dtype, shape and bytes."""
    h = xxhash.xxh3_128(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(tensor_bytes(t.contiguous()))
    return h.hexdigest()


def stable_name(prefix: str, part: str, generation: int) -> str:
    return f"{prefix}{part}.g{generation}.safetensors"


@dataclass(frozen=True)
class HeldFile:
    """A file of one part in the newest generation: where it is, what it holds (digests by
    key), its origin (the generation that wrote it, stamped into it) and its identity in the
    store when last verified (a link is made only while that still holds)."""

    part: str
    name: str
    path: str
    size: int
    xxh3_128: str
    generation: int
    incarnation: int
    digests: dict[str, str]
    ident: tuple[object, ...] = ()  # the backend's `ident` when verified (empty: unknown)
    linkable: bool = True  # stable files only: a main file always holds what changed
    identify: Callable[[str], tuple[object, ...]] | None = field(default=None, compare=False)

    def unchanged_on_disk(self) -> bool:
        if self.identify is None or not self.ident:
            return False
        try:
            return self.identify(self.path) == self.ident
        except OSError:
            return False


# (name, origin generation, origin incarnation, digests by key, stable) of a part's file
FileRow = tuple[str, int, int, dict[str, str], bool]




@dataclass
class Plan:
    """What the save of one generation knows of the previous one: the files held by part,
    and the model's frozen tensors (written apart from the first save on)."""

    generation: int
    held: Mapping[str, list[HeldFile]] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()
    # filled while encoding: the files of each part as this generation will list them
    layout: dict[str, list[FileRow]] = field(default_factory=dict)


def split_part(plan: Plan, part: str, tensors: Mapping[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[HeldFile],
                          dict[str, str]]:
    """(main, stable, linked files, digests of every tensor) for one part's tensors."""
    digests = {k: tensor_digest(t) for k, t in tensors.items()}
    held = plan.held.get(part, [])
    before = {k: d for f in held for k, d in f.digests.items()}
    unchanged = {k for k, d in digests.items() if before.get(k) == d}
    linked = [f for f in held if f.linkable and f.digests and set(f.digests) <= unchanged
              and f.unchanged_on_disk()]
    covered = {k for f in linked for k in f.digests}
    frozen = plan.frozen if part == "model" else frozenset()
    stable = {k: t for k, t in tensors.items()
              if k not in covered and (k in unchanged or k in frozen)}
    if sum(t.numel() * t.element_size() for t in stable.values()) < MIN_STABLE_BYTES:
        stable = {}
    main = {k: t for k, t in tensors.items() if k not in covered and k not in stable}
    return main, stable, linked, digests


def stable_entry(name: str, generation: int, incarnation: int) -> dict[str, str]:
    """How ``state.json`` names a part's extra file and the stamps it carries."""
    return {"file": name, "generation": str(generation), "incarnation": str(incarnation)}


def digests_meta(digests: Mapping[str, str], keys: Mapping[str, object]) -> str:
    return dumps_json({k: digests[k] for k in sorted(keys)}).decode()


def read_digests(meta: Mapping[str, str], where: str) -> dict[str, str]:
    """The digests stamped into a file (empty when it has none: written without incremental
    saves); malformed ones are corruption."""
    raw = meta.get(DIGESTS_KEY)
    if raw is None:
        return {}
    found = loads_json(raw.encode(), where, len(raw) + 1)
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              and len(v) == 32 for k, v in found.items()):
        raise CorruptCheckpoint(f"{where}: metadata {DIGESTS_KEY!r} is not a map of tensor "
                                "names to xxh3-128 digests")
    return found


def encode_part(plan: Plan, prefix: str, part: str, tensors: Mapping[str, torch.Tensor],
                meta: Mapping[str, str], room: Room | None = None
                ) -> tuple[dict[str, object], list[dict[str, str]]]:
    """The files of one part (name -> chunks, or `Linked`) and the extra files ``state.json``
    names for it (`stable_entry`); records the layout in ``plan``. ``room``: where the files
    written now build their gathered small tensors (`encode_safetensors`; not a `Linked`
    file's rewrite, which runs later)."""
    main, stable, linked, digests = split_part(plan, part, tensors)
    incarnation = int(meta["unbroken.incarnation"])
    layout = plan.layout.setdefault(part, [])
    out: dict[str, object] = {}
    extra: list[dict[str, str]] = []

    def stamped(generation: int, inc: int, keys: Mapping[str, object]) -> dict[str, str]:
        return {**meta, "unbroken.generation": str(generation),
                "unbroken.incarnation": str(inc), "unbroken.part": part,
                DIGESTS_KEY: digests_meta(digests, keys)}

    if main:
        name = f"{prefix}{part}.safetensors"
        out[name] = encode_safetensors(main, stamped(plan.generation, incarnation, main),
                                       room=room)
        layout.append((name, plan.generation, incarnation, {k: digests[k] for k in main}, False))
    if stable:
        # unique among the part's files: a save of the same step again may link a stable
        # file this generation number already wrote
        taken = {f.name for f in linked}
        name, n = stable_name(prefix, part, plan.generation), 1
        while name in taken:
            name = stable_name(prefix, part, plan.generation).replace(
                ".safetensors", f".{n}.safetensors")
            n += 1
        out[name] = encode_safetensors(stable, stamped(plan.generation, incarnation, stable),
                                       room=room)
        extra.append(stable_entry(name, plan.generation, incarnation))
        layout.append((name, plan.generation, incarnation, {k: digests[k] for k in stable},
                       True))
    for f in linked:
        # written anew exactly as its origin wrote it, should the link fail
        def rewrite(f: HeldFile = f) -> list[memoryview]:
            return encode_safetensors({k: tensors[k] for k in f.digests},
                                      stamped(f.generation, f.incarnation, f.digests))
        out[f.name] = Linked(f.path, f.size, f.xxh3_128, rewrite, ident=f.ident)
        extra.append(stable_entry(f.name, f.generation, f.incarnation))
        layout.append((f.name, f.generation, f.incarnation, dict(f.digests), True))
    return out, extra


def held_files(layout: Mapping[str, list[FileRow]],
               folder: str, artifacts: Mapping[str, tuple[int, str]],
               identify: Callable[[str], tuple[object, ...]], verified: bool = True
               ) -> dict[str, list[HeldFile]]:
    """The files each part holds in a committed, verified generation (``artifacts``: name ->
    (size, xxh3-128) from its manifest), for the next save to compare with. ``identify``:
    the store backend's ``ident`` (a local file's inode, size and time; an object's size and
    version). ``verified=False``: its bytes were checked, but not as the store holds them
    (read from a local cache): no file is linked or copied until a save verified its own."""
    held: dict[str, list[HeldFile]] = {}
    for part, files in layout.items():
        for name, generation, inc, digests, linkable in files:
            path = os.path.join(folder, name)
            size, digest = artifacts[name]
            try:
                ident = identify(path) if verified else ()
            except OSError:
                ident = ()
            held.setdefault(part, []).append(HeldFile(part, name, path, size, digest,
                                                      generation, inc, digests, ident,
                                                      linkable, identify))
    return held
