"""A generation's files: the state tree of every part -> ``<part>.safetensors`` files and
``state.json`` (the skeletons), and back from verified file contents, with the checks that a
generation's files belong together (sizes before reading, stamps after decoding)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint, UnbrokenError, UnsupportedValue
from .codec import Encoded, ShardedLeaf, encode_tree_for_file
from .decoding import decode_tree
from .incremental import DIGESTS_KEY, Plan, encode_part, read_digests
from .jsontext import dumps_json, json_pieces, loads_json
from .parts import (
    COUNTERS,
    MAX_STATE_BYTES,
    MORE_FILES,
    STATE_FILE,
    STATE_SCHEMA,
    Counters,
)
from .tensorfile import PlanUnfit, Room, encode_safetensors, rewinding
from .tensorread import decode_safetensors


def check_part_tree(name: str, tree: Any) -> None:
    """A part's state must be a mapping: restore validates every part as one (so a list or a
    tensor from an extra's state_dict() would save, and never restore)."""
    if not isinstance(tree, Mapping):
        raise UnsupportedValue(f"state_dict() of part {name!r} returned a "
                               f"{type(tree).__name__}; it must return a dict")


def _encoded(name: str, part: str, value: Any, meta: Mapping[str, str],
             plans: dict[str, Any] | None, layout: dict[str, Any] | None, room: Room | None,
             owned: bool, to_file: bool, artifacts: dict[str, Any]) -> Encoded:
    """Part ``part`` encoded (`codec.encode_tree_for_file`) and, with ``to_file`` (not an
    incremental save), its tensor file ``name`` built into ``artifacts``: a plan's tensors
    are checked as the file is built (``defer``; not an owner's buffers, which a plan keeps
    for the next save only once checked), and one that no longer fits its plan has the part
    encoded again, one tensor at a time."""
    for defer in (to_file and not owned, False):
        encoded = encode_tree_for_file(value, plans, owned, defer)
        if not encoded.tensors or not to_file:
            break
        rewind = rewinding(room) if encoded.unchecked else None
        try:
            artifacts[name] = encode_safetensors(
                encoded.tensors, {**meta, "unbroken.part": part}, prepared=True,
                layout=layout, kinds=encoded.kinds, ptrs=encoded.ptrs, room=room,
                unchecked=encoded.unchecked)
            break
        except PlanUnfit:
            assert plans is not None  # (only a plan's tensors go unchecked)
            plans.clear()
            if rewind is not None:  # (the room's gifts to the refused file, given again)
                rewind()
    return encoded


def encode_generation(tree: Mapping[str, Any], meta: Mapping[str, str], prefix: str = "",
                      plan: Plan | None = None, layouts: dict[str, Any] | None = None,
                      room: Room | None = None, owned: bool = False) -> dict[str, Any]:
    """Artifacts of one generation: ``<part>.safetensors`` per part holding tensors and
    ``state.json`` with every part's skeleton. ``meta`` (run id, generation, incarnation) is
    stamped into every tensor file so a file moved between generations is recognised.
    ``prefix`` names one rank's own files (``rank00001.state.json``, ...). With ``plan``
    (incremental saves, see `incremental`), a part's unchanged tensors go to stable files,
    and a stable file of the previous generation is a `Linked` artifact. ``layouts``: kept
    from one save to the next, each tensor file's layout (`encode_safetensors`) and the
    encoding plans of its part (`encode_tree_for_file`). ``room``: where gathered small
    tensors are built (`encode_safetensors`). ``owned``: the tree's tensors are an async
    snapshot's buffers (`codec.encode_tree_for_file`)."""
    skeletons: dict[str, Any] = {}
    files: dict[str, str] = {}
    more: dict[str, list[dict[str, str]]] = {}
    artifacts: dict[str, Any] = {}
    texts: dict[str, str] = {}  # (the planned mappings' JSON text, see `codec.Encoded`)
    for part, value in tree.items():
        try:
            check_part_tree(part, value)
            name = f"{prefix}{part}.safetensors"
            layout = None if layouts is None else layouts.setdefault(name, {})
            plans = None if layout is None else layout.setdefault("plans", {})
            try:
                encoded = _encoded(name, part, value, meta, plans, layout, room, owned,
                                   plan is None, artifacts)
            except BaseException:
                # (a save refused after a plan took the part: the next one plans it anew,
                # never on what this one took and did not check)
                if plans:
                    plans.clear()
                raise
            if name in artifacts:
                files[part] = name
            skeleton, tensors = encoded.skeleton, encoded.tensors
            skeletons[part] = skeleton
            texts.update(encoded.texts)
            if tensors and plan is not None:
                out, extra = encode_part(plan, prefix, part, tensors, meta, room)
                if f"{prefix}{part}.safetensors" in out:
                    files[part] = f"{prefix}{part}.safetensors"
                if extra:
                    more[part] = extra
                artifacts.update(out)
        except ShardedLeaf as e:  # (of its own type: the caller may take it out and retry)
            raise ShardedLeaf(f"part {part!r}: {e}") from None
        except UnsupportedValue as e:
            raise UnsupportedValue(f"part {part!r}: {e}") from None
    doc = {"schema": STATE_SCHEMA, "meta": dict(meta), "parts": skeletons, "tensor_files": files}
    if more:
        doc[MORE_FILES] = more
    pieces = json_pieces(doc, texts)
    size = sum(map(len, pieces))
    if size > MAX_STATE_BYTES:  # what decode_generation refuses is never written
        sizes = sorted(((len(dumps_json(v, sort_keys=False, texts=texts)), k)
                        for k, v in skeletons.items()),
                       reverse=True)
        raise UnsupportedValue(
            f"{STATE_FILE} would be {size} bytes, over the {MAX_STATE_BYTES}-byte limit "
            "that restore applies; largest parts: " +
            ", ".join(f"{k!r} {n} bytes" for n, k in sizes[:3]) +
            ". Return bulk data from state_dict() as tensors or NumPy arrays (they go to "
            "safetensors), not as lists, strings or dicts")
    artifacts[prefix + STATE_FILE] = [memoryview(piece) for piece in pieces]
    return artifacts


def check_sizes(manifest: Any, folder: str) -> None:
    """Refuse, before reading a byte, a generation whose manifest lists a ``state.json``
    larger than restore parses: reading it first would cost its whole size in memory."""
    for a in manifest.artifacts:  # state.json, and each rank's rankNNNNN.state.json
        if a.name.endswith(STATE_FILE) and a.size > MAX_STATE_BYTES:
            raise CorruptCheckpoint(f"{folder}/{a.name}: {a.size} bytes, over the "
                                    f"{MAX_STATE_BYTES}-byte limit; refusing to read it")


def decode_generation(files: Mapping[str, bytes | memoryview], folder: str,
                      parts: set[str] | None = None, prefix: str = "",
                      layout: dict[str, list[Any]] | None = None
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """Inverse of ``encode_generation`` over verified file contents; returns (tree, meta).
    ``parts`` limits decoding to some parts (a warm start reads only the model). ``layout``
    collects each part's files (name, origin generation and incarnation, digests, stable)
    for the next incremental save."""
    try:
        return _decode_generation(files, folder, parts, prefix, layout)
    except UnbrokenError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure on untrusted input is corruption
        raise CorruptCheckpoint(f"{folder}: cannot be decoded ({type(e).__name__}: "
                                f"{e!s:.200})") from None


def _decode_generation(files: Mapping[str, bytes | memoryview], folder: str,
                       parts: set[str] | None, prefix: str,
                       layout: dict[str, list[Any]] | None
                       ) -> tuple[dict[str, Any], dict[str, str]]:
    where = f"{folder}/{prefix}{STATE_FILE}"
    if prefix + STATE_FILE not in files:
        raise CorruptCheckpoint(f"{where}: missing from the generation")
    doc = loads_json(files[prefix + STATE_FILE], where, MAX_STATE_BYTES, unique=False)
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
    more = doc.get(MORE_FILES, {})
    if not isinstance(more, dict):
        raise CorruptCheckpoint(f"{where}: {MORE_FILES!r} is not an object")
    tree = {}
    for part, skeleton in skeletons.items():
        if parts is not None and part not in parts:
            continue
        tensors: dict[str, torch.Tensor] = {}
        own = [(tensor_files[part], {**meta, "unbroken.part": part}, False)
               ] if part in tensor_files else []
        extra = more.get(part, [])
        if not isinstance(extra, list):
            raise CorruptCheckpoint(f"{where}: {MORE_FILES!r} of part {part!r} is not a list")
        for name, stamps, stable in [*own, *(_extra_file(e, meta, part, where) for e in extra)]:
            if name not in files:
                raise CorruptCheckpoint(f"{folder}/{name}: listed for part {part!r} but missing")
            found, file_meta = decode_safetensors(files[name], f"{folder}/{name}")
            digests = read_digests(file_meta, f"{folder}/{name}")
            if DIGESTS_KEY in file_meta and set(digests) != set(found):
                raise CorruptCheckpoint(f"{folder}/{name}: its {DIGESTS_KEY!r} name other "
                                        "tensors than the file holds")
            file_meta.pop(DIGESTS_KEY, None)
            if file_meta != stamps:
                raise CorruptCheckpoint(
                    f"{folder}/{name}: stamped {file_meta}, expected {stamps}: the file "
                    "belongs to another generation or part")
            if not tensors:  # (the usual part has one file: its tensors as they are)
                tensors = found
            elif found.keys() & tensors.keys():
                raise CorruptCheckpoint(f"{folder}/{name}: holds tensors of part {part!r} "
                                        "that another of its files holds too")
            else:
                tensors.update(found)
            if layout is not None:
                layout.setdefault(part, []).append(
                    (name, int(stamps["unbroken.generation"]),
                     int(stamps["unbroken.incarnation"]), digests, stable))
        tree[part] = decode_tree(skeleton, tensors, f"{where} [{part}]")
    return tree, meta


def _extra_file(entry: Any, meta: Mapping[str, str], part: str, where: str
                ) -> tuple[str, dict[str, str], bool]:
    """A part's file as ``state.json`` names it, and the stamps it must carry: its origin's,
    a generation no newer than this one, of the same run."""
    try:
        name, generation, inc = entry["file"], entry["generation"], entry["incarnation"]
        ok = (isinstance(name, str) and isinstance(generation, str) and isinstance(inc, str)
              and generation.isdecimal() and inc.isdecimal() and generation.isascii()
              and inc.isascii() and len(generation) < 20 and len(inc) < 20
              and int(generation) <= int(meta.get("unbroken.generation", "-1")))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CorruptCheckpoint(f"{where}: part {part!r} names a file as {entry!r:.120}, "
                                "expected a file of this or an older generation of this run")
    return name, {**meta, "unbroken.generation": generation, "unbroken.incarnation": inc,
                  "unbroken.part": part}, True


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
