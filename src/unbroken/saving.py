"""What one process writes of a generation, and checks around it: its share (everything
alone; in a job, the shared parts from the leader and each rank's RNG streams and the extras
held per rank, `state.parts.PerRank`, in its own ``rankNNNNN.*`` files), the state every
rank of a data-parallel job must hold alike, the
read-back after the commit, and whether a repeated save of a step changed anything."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import xxhash

from .dist.commit import describe, rank_prefix, rebuild
from .dist.group import Group
from .dist.sharded import encode_shards, split
from .errors import CorruptCheckpoint, RunUnreadable, UnbrokenError
from .inputs import same_number
from .state import generation as G
from .state import parts as S
from .state.codec import ShardedLeaf, encode_tree
from .state.incremental import Plan, tensor_digest
from .state.jsontext import dumps_json, loads_json
from .state.optimrest import EXTRA, OTHER_STATE
from .state.tensorfile import Room, rewinding
from .store.generations import GenerationInfo, GenerationStore
from .store.sources import Linked

# In a Checkpointer's ``layouts``: a save of it met a DTensor (each save then splits first).
_SHARDED = "unbroken.sharded"


def stamps(generation: int, incarnation: int, run_id: str) -> dict[str, str]:
    """The stamps every file of a generation carries (a file moved between generations or
    runs is recognised)."""
    return {"unbroken.run_id": run_id, "unbroken.generation": str(generation),
            "unbroken.incarnation": str(incarnation)}


def encode_share(group: Group, tree: dict[str, Any], meta: dict[str, str],
                 plan: Plan | None = None, layouts: dict[str, Any] | None = None,
                 room: Room | None = None, owned: bool = False,
                 per_rank: frozenset[str] = frozenset()) -> dict[str, Any]:
    """This process's files of a generation (see module doc); sharded tensors (DTensors)
    go through DCP, each rank writing its own chunks (`dist.sharded`). With ``plan``, the
    shared parts are saved incrementally (`state.incremental`). ``layouts``: the
    Checkpointer's tensor-file layouts, kept from one save to the next (`encode_generation`).
    ``room``: where gathered small tensors are built (`state.tensorfile.encode_safetensors`).
    ``owned``: the tree's tensors are an async snapshot's buffers (`encode_generation`).
    ``per_rank``: the parts each rank of a job stores in its own files (with its RNG)."""
    if (not group.active and plan is None and layouts is not None
            and not layouts.get(_SHARDED)):
        # No save of this Checkpointer met a DTensor: the tree is encoded whole, not looked
        # through for one first (~0.6 ms for 10,000 tensors); the encoder refuses one it meets
        # (`ShardedLeaf`), and the tree is then split and encoded again, as every later one.
        # (Not an incremental save: its plan records each part as it is encoded.)
        again = rewinding(room)
        try:
            return G.encode_generation(tree, meta, plan=plan, layouts=layouts, room=room,
                                       owned=owned)
        except ShardedLeaf:
            layouts[_SHARDED] = True
            if again is not None:
                again()
    tree, shards = split(tree)
    if not group.active:
        out = G.encode_generation(tree, meta, plan=plan, layouts=layouts, room=room,
                                  owned=owned)
        if shards:
            out.update(encode_shards(group, shards, meta))
        return out
    # The shared parts are encoded by the leader alone, so only it may refuse one: every rank
    # still takes part in the collectives below and all raise its error together (else the
    # others would wait in them for a leader that left).
    out, failure = {}, None
    try:
        own = {k: v for k, v in tree.items() if k == S.RNG or k in per_rank}
        shared = {k: v for k, v in tree.items() if k not in own}
        out = G.encode_generation(shared, meta, plan=plan, layouts=layouts, room=room,
                                  owned=owned) if group.leader else {}
        out.update(G.encode_generation(own,
                                       {**meta, "unbroken.rank": str(group.rank)},
                                       prefix=rank_prefix(group.rank), layouts=layouts,
                                       room=room, owned=owned))
    except UnbrokenError as e:
        failure = describe(e)
    out.update(encode_shards(group, shards, meta))
    for rank, failed in enumerate(group.all_gather(failure, "encoding the generation")):
        if failed:
            raise rebuild(failed, rank)
    return out


def replicated(tree: dict[str, Any], per_rank: frozenset[str] = frozenset()
               ) -> Iterable[tuple[str, Any]]:
    """What every rank of a data-parallel job holds alike, by name: the model's tensors,
    each parameter's optimizer state, and every other shared part (not what is sharded:
    every rank holds its own chunk of it; nor the parts of ``per_rank``)."""
    tree = split(tree)[0]
    for name, value in tree[S.MODEL].items():
        yield f"model {name}", value
    if S.OPTIMIZER in tree:
        opt = tree[S.OPTIMIZER]
        for name, value in opt["state"].items():
            yield f"optimizer state of {name}", value
        for key in (OTHER_STATE, EXTRA):  # (what else its state_dict holds: `optimrest`)
            if key in opt:
                yield f"optimizer {key}", opt[key]
    for part in sorted(tree):
        if part not in (S.MODEL, S.OPTIMIZER, S.RNG) and part not in per_rank:
            yield part, tree[part]


def saved_unchanged(store: GenerationStore, group: Group, step: int, tree: dict[str, Any],
                    values: dict[str, float], plan: Plan | None = None,
                    per_rank: frozenset[str] = frozenset()) -> bool:
    """Whether generation ``step`` already holds ``tree`` (and the metric ``values``): its
    files (in a job, every rank its own), encoded again with that generation's own stamps,
    hash the same. A save of the same step after the state changed (an end-of-epoch
    scheduler step, weights averaged) supersedes it instead of being dropped."""
    info = store.scan_one(step)
    m = info.manifest
    # (the manifest holds the leader's metric values: each rank passes its own loss)
    same = info.ok and m is not None and (not group.leader or all(
        same_number(m.metrics.get(k), v) for k, v in values.items()))
    # A generation that no longer verifies (rot since its save) is written again: the state
    # it should hold is still live. (The leader's verdict is the job's: see below.)
    try:
        same = same and (not group.leader or store.verified(info) is None)
    except RunUnreadable:  # (not judged, so not known to hold the state: written again)
        same = False
    if group.active:  # every rank or none goes on to the encoding below: it is collective
        same = all(group.all_gather(same, "comparing with the saved generation"))
    if same and plan is not None:  # its layout came from the generation before it
        same = not group.active and _same_state(store, info, tree, plan)
    elif same:
        assert m is not None
        listed = {a.name: (a.size, a.xxh3_128) for a in m.artifacts}
        encoded = encode_share(group, tree, stamps(m.generation, m.incarnation, m.run_id),
                               per_rank=per_rank)
        same = (group.active or set(encoded) == set(listed)) and all(
            listed.get(name) == _size_and_hash(chunks) for name, chunks in encoded.items())
    return all(group.all_gather(same, "comparing with the saved generation"))


def _same_state(store: GenerationStore, info: GenerationInfo, tree: dict[str, Any],
                plan: Plan) -> bool:
    """(Incremental saves.) Whether ``tree`` is what generation ``info`` holds, as ``plan``
    describes it (the files of that very generation): every part's skeleton as its
    ``state.json`` has it, and every tensor's digest as its file stamps it."""
    tree, shards = split(tree)
    if shards or not all(os.path.dirname(f.path) == info.path
                         for files in plan.held.values() for f in files):
        return False
    where = os.path.join(info.path, S.STATE_FILE)
    try:
        saved = loads_json(store.fs.read_file(where, S.MAX_STATE_BYTES), where,
                           S.MAX_STATE_BYTES, unique=False)["parts"]
    except (OSError, CorruptCheckpoint, KeyError, TypeError):
        return False
    if not isinstance(saved, dict) or set(saved) != set(tree):
        return False
    for part, value in tree.items():
        skeleton, tensors = encode_tree(value, "")
        if dumps_json(skeleton, sort_keys=False) != dumps_json(saved[part], sort_keys=False):
            return False
        held = {k: d for f in plan.held.get(part, []) for k, d in f.digests.items()}
        if held != {k: tensor_digest(t) for k, t in tensors.items()}:
            return False
    return True


def _size_and_hash(chunks: Any) -> tuple[int, str]:
    if isinstance(chunks, Linked):
        return chunks.size, chunks.xxh3_128
    h, size = xxhash.xxh3_128(), 0
    for c in chunks:
        h.update(c)
        size += memoryview(c).nbytes
    return size, h.hexdigest()
