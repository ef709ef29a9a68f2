"""Which generation a restore loads: the newest candidate that verifies, decodes, belongs to
this run and fits the live objects, with its state validated and ready to apply before any
live object changes.

A torn, corrupt or foreign candidate is *refused* (recorded with its reason and a label for
``aside/``) and the next older one is tried; a mismatch with the live run (identity, keys,
shapes, a missing part) is not the checkpoint's fault and raises at once."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._progress import Progress
from .dist.commit import describe, own_names, rank_prefix, rebuild
from .dist.group import Group
from .dist.sharded import SHARDS_FILE, load_shards, read_index, shard_file
from .errors import (
    CorruptCheckpoint,
    ForeignGeneration,
    MissingState,
    NoCheckpoint,
    UnbrokenError,
)
from .state import generation as G
from .state import parts as S
from .state.environment import environment
from .state.identity import Identity, check_environment, check_identity
from .state.livemodel import LiveModel
from .state.settings import param_group_changes, scheduler_changes
from .store.backends._mapped import MappedFiles
from .store.generations import GenerationInfo, GenerationStore
from .store.manifest import Artifact
from .store.runrecord import RunRecord
from .store.verifying import not_loadable

log = logging.getLogger("unbroken")
_MAP_MIN = 32 << 20


@dataclass
class Pick:
    """The outcome of a restore's search: what loads, and what was refused on the way."""

    info: GenerationInfo | None = None
    ready: dict[str, Any] = field(default_factory=dict)  # validated, ready for `applying.apply`
    tree: dict[str, Any] = field(default_factory=dict)  # the decoded state, as saved
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    labels: dict[str, str] = field(default_factory=dict)  # path -> corrupt | torn | foreign
    layout: dict[str, list[Any]] = field(default_factory=dict)  # files by part (decode_generation)
    mapped: MappedFiles = field(default_factory=MappedFiles)  # release after `applying.apply`
    walked: LiveModel | None = None  # the live model's walk, validated against (`applying.apply`)


def pick_generation(store: GenerationStore, scanned: list[GenerationInfo],
                    generation: int | None, intent: str, allow: Iterable[str], adopt: bool, *,
                    parts: Mapping[str, Any], model: torch.nn.Module, identity: Identity,
                    run: RunRecord, pick: Pick, group: Group | None = None,
                    fresh: tuple[str, ...] = (), defer: bool = False) -> Pick:
    """Fill ``pick`` with the newest loadable candidate among ``scanned`` (or generation
    ``generation``); raise `CorruptCheckpoint` listing every refusal when none loads.
    ``pick`` is filled in place, so the refusals are known even when this raises.

    In a job (``group``) the leader names the candidates, every rank loads its share of each,
    and the verdict is agreed: a candidate any rank refuses is refused by all, and a mismatch
    with the live run on any rank raises on every rank, so no rank continues from another step
    than the others. ``fresh``: a warm start's model names left as they are
    (`modelcheck.keep_fresh`). ``defer``: the files copied into live tensors are hashed as
    they are copied, by ``pick.mapped`` (`MappedFiles`; one process only): the caller then
    falls back on its own when `MappedFiles.verify_rest` finds one corrupt."""
    group = group or Group()
    candidates = [g.generation for g in reversed(scanned)
                  if generation is None or g.generation == generation]
    candidates = group.broadcast(candidates, "choosing the generation to restore")
    if not candidates:
        raise NoCheckpoint(f"{store.root}: no generation {generation}; found "
                           f"{[g.generation for g in scanned]}")
    by_number = {g.generation: g for g in scanned}
    for number in candidates:
        info = by_number.get(number) or store.scan_one(number)
        mine: dict[str, Any] = {"refused": None, "foreign": False, "fatal": None}
        pick.layout, pick.mapped = {}, MappedFiles(defer=defer and not group.active)
        try:
            pick.ready, pick.tree = _load(store, info, intent, allow, adopt, parts, model,
                                          identity, run, group, pick, fresh)
        except CorruptCheckpoint as e:
            mine.update(refused=str(e), foreign=isinstance(e, ForeignGeneration))
        except UnbrokenError as e:
            mine["fatal"] = describe(e)
            try:  # (decoded from bytes not hashed yet, a header: were they the file's?)
                pick.mapped.verify_unhashed(drop=True)
            except CorruptCheckpoint as bad:
                mine.update(refused=str(bad), fatal=None)
            except UnbrokenError:
                pass
        everyone = group.all_gather(mine, "agreeing on the generation to restore")
        for r, x in enumerate(everyone):
            if x["fatal"]:
                pick.mapped.close()
                raise rebuild(x["fatal"], r if group.active else None)
        refused = [(r, x) for r, x in enumerate(everyone) if x["refused"]]
        if refused:
            why = "; ".join(f"rank {r}: {x['refused']}" if group.active else x["refused"]
                            for r, x in refused)
            pick.rejected.append((info.path, why))
            pick.labels[info.path] = ("foreign" if any(x["foreign"] for _, x in refused) else
                                      "torn" if info.status == "torn" else "corrupt")
            log.warning("rejected %s: %s", info.path, why)
            pick.mapped.close()
            continue
        pick.info = info
        if pick.rejected:
            log.warning("using %s after rejecting %d newer generation(s)", info.path,
                        len(pick.rejected))
        return pick
    raise none_verifies(store.root, pick)


def none_verifies(root: str, pick: Pick) -> CorruptCheckpoint:
    """The error of a restore that found no generation to load: each refusal of ``pick``."""
    foreign = "foreign" in pick.labels.values()
    return CorruptCheckpoint(
        f"{root}: no generation verifies; refusing to start from scratch:\n" +
        "\n".join(f"  {path}: {why}" for path, why in pick.rejected) +
        ("\nrestore(adopt=True) continues from a generation of another run deliberately"
         if foreign else "") +
        "\nInspect with `unbroken inspect`; move the folder away to start a new run")


def _load(store: GenerationStore, info: GenerationInfo, intent: str, allow: Iterable[str],
          adopt: bool, parts: Mapping[str, Any], model: torch.nn.Module, identity: Identity,
          run: RunRecord, group: Group, pick: Pick, fresh: tuple[str, ...] = ()
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify, decode and validate one candidate; `CorruptCheckpoint` refuses it."""
    if not info.ok or info.manifest is None:  # (one not judged, unreadable: raised at once)
        raise not_loadable(info)
    manifest = info.manifest
    if intent == "continue" and not adopt and not run.accepts(manifest.run_id):
        raise ForeignGeneration(
            f"{info.path}: written by run {manifest.run_id!r}, but this folder holds run "
            f"{run.run_id!r} (RUN.json) and its lineage {run.lineage or 'is empty'}: a "
            "generation copied from another run is never continued silently; "
            "restore(adopt=True) continues from it deliberately")
    G.check_sizes(manifest, info.path)  # before reading a byte
    sharded = intent == "continue" and manifest.world_size > 1
    names: Iterable[str] | None = (
        own_names(manifest, group.rank) if sharded else
        None if intent == "continue" else
        [a.name for a in manifest.artifacts  # the model's files (its main and stable ones)
         if a.name in (S.STATE_FILE, SHARDS_FILE) or a.name.startswith(f"{S.MODEL}.")])
    progress = Progress(f"loading {info.name}", manifest.total_bytes)
    copied = _copied_parts(parts if intent == "continue" else {})
    try:  # the model's and optimizer's files are copied from into live tensors (`apply`)
        files = store.read_verified(info, names, advance=progress.advance, mapped=pick.mapped,
                                    map_if=lambda a: _copied_from(a, copied))
    finally:
        if pick.mapped.defers:  # (its files are read as they are copied from)
            pick.mapped.progress = progress
        else:
            progress.close()
    tree, meta = G.decode_generation(files, info.path,
                                     None if intent == "continue" else {S.MODEL},
                                     layout=pick.layout)
    if sharded:
        tree.update(_rank_parts(store, info, files, meta, group, parts,
                                set(manifest.parts) - set(tree)))
    elif intent == "continue" and group.size > 1:
        log.warning("%s was saved by one process: every rank of this job restores the same "
                    "random streams (equal data order and weights; dropout draws alike on "
                    "every rank)", info.path)
    G.check_stamps(manifest, info.path, tree, meta, all_parts=intent == "continue")
    where = store.manifest_path(info)
    live = parts if intent == "continue" else {S.MODEL: model}
    try:
        if SHARDS_FILE in files:
            _load_shards(store, info, files, tree, meta, live, model)
        check_identity(manifest.identity, identity.fingerprint(), intent=intent, allow=allow,
                       where=where)
        check_environment(manifest.environment, environment(), where=where)
        pick.walked = LiveModel(model)
        ready = S.validate_parts(tree, live, model, info.path, intent, pick.walked, fresh)
        for name, obj in live.items():
            check = getattr(obj, "validate_state_dict", None)
            if check is not None:
                check(tree[name], f"{info.path} [{name}]")
    except UnbrokenError:
        raise
    except Exception as e:  # noqa: BLE001 -- verified bytes that decode to nonsense
        raise CorruptCheckpoint(f"{info.path}: saved state does not validate "
                                f"({type(e).__name__}: {e!s:.200})") from None
    return ready, tree


def _copied_parts(parts: Mapping[str, Any]) -> tuple[str, ...]:
    """The parts whose saved tensors a restore copies into live tensors: the model's, and the
    optimizer's unless it holds no state tensor yet (a resumed job's fresh optimizer), whose
    saved tensors then become its state as they are read (views of the file read whole, as
    a small file's are): copying them would fault in fresh memory after the read, instead of
    while the disk reads."""
    optimizer = parts.get(S.OPTIMIZER)
    state = getattr(optimizer, "state", None)
    fresh = isinstance(state, Mapping) and not any(
        isinstance(v, torch.Tensor) for values in state.values()
        if isinstance(values, Mapping) for v in values.values())
    return (S.MODEL,) if fresh else (S.MODEL, S.OPTIMIZER)


def _copied_from(a: Artifact, parts: tuple[str, ...]) -> bool:
    """The files a restore maps and copies from (rather than reads whole): tensors of 32 MiB
    or more of ``parts`` (`_copied_parts`; the optimizer state is copied into the live state
    tensors, see `optim.load_optimizer_state`). Smaller ones are read whole and decoded as
    views, which is faster for many small tensors; the two parts' small files together stay
    under the 64 MiB a restore may add beyond its largest tensor."""
    return (a.size >= _MAP_MIN and a.name.endswith(".safetensors")
            and a.name.split(".", 1)[0] in parts)


def _load_shards(store: GenerationStore, info: GenerationInfo, files: dict[str, Any],
                 tree: dict[str, Any], meta: Mapping[str, str], live: Mapping[str, Any],
                 model: torch.nn.Module) -> None:
    """The sharded tensors of the parts being loaded, resharded to this job (`dist.sharded`);
    each shard file is hash-verified as it is first read."""
    index = read_index(files[SHARDS_FILE], f"{info.path}/{SHARDS_FILE}")
    index["tensors"] = {k: v for k, v in index["tensors"].items()
                        if json.loads(k)[0] in live}  # a warm start reads the model only

    def read(name: str) -> Any:
        if name not in files:
            files.update(store.read_verified(info, [name]))
        if name not in files:
            raise CorruptCheckpoint(f"{info.path}/{name}: named in {SHARDS_FILE}, missing "
                                    "from the manifest")
        return files[name]

    load_shards(tree, index, S.capture(live, model), model, read, info.path,
                {k: meta[k] for k in ("unbroken.run_id", "unbroken.generation",
                                      "unbroken.incarnation")})


def _rank_parts(store: GenerationStore, info: GenerationInfo, files: dict[str, Any],
                meta: Mapping[str, str], group: Group, parts: Mapping[str, Any],
                expected: set[str]) -> dict[str, Any]:
    """This rank's own parts (its RNG streams, the extras held per rank: ``expected``) from
    its own files of a generation of many ranks. A rank the saving job did not have keeps
    its live streams and takes rank 0's extras (said: the same data order and weights, other
    dropout draws); the parts of ranks this job lacks are dropped (said)."""
    assert info.manifest is not None  # (verified by the caller)
    saved_ranks = info.manifest.world_size
    if group.rank < saved_ranks:
        if group.leader and group.size < saved_ranks:
            log.warning("%s: saved by %d ranks, restored on %d: the random streams of ranks "
                        "%d..%d are dropped, and their extras held per rank if any (equal data "
                        "order and weights, other random draws)", info.path, saved_ranks,
                        group.size, group.size, saved_ranks - 1)
        return rank_parts(files, info.path, meta, group.rank, expected)
    log.warning("%s: saved by %d ranks, this is rank %d of %d: its random streams start afresh "
                "(equal data order and weights, other random draws than a run of %d ranks)"
                "; extras held per rank, if any, are rank 0's", info.path, saved_ranks,
                group.rank, group.size, saved_ranks)
    live = {S.RNG: parts[S.RNG].state_dict()}
    if not expected - {S.RNG}:  # (no extra held per rank)
        return live
    # rank 0's own state (not its chunks of sharded tensors, which `_load_shards` reads)
    first = rank_prefix(0)
    files.update(store.read_verified(info, [
        a.name for a in info.manifest.artifacts
        if a.name.startswith(first) and a.name != shard_file(0) and a.name not in files]))
    return {**rank_parts(files, info.path, meta, 0, expected), **live}


def rank_parts(files: Mapping[str, Any], folder: str, meta: Mapping[str, str], rank: int,
               expected: set[str]) -> dict[str, Any]:
    """The parts ``rank`` of a generation of many ranks holds its own of: its RNG streams and
    its extras held per rank (`state.parts.PerRank`), from its ``rankNNNNN.state.json``,
    checked to be stamped with this generation and that rank, and to be the ``expected``
    ones (the manifest's parts that ``state.json`` lacks: every rank holds the same)."""
    prefix = rank_prefix(rank)
    if prefix + S.STATE_FILE not in files:
        raise CorruptCheckpoint(f"{folder}/{prefix}{S.STATE_FILE}: missing; every rank of the "
                                "saving job writes its own random streams there")
    own, own_meta = G.decode_generation(files, folder, prefix=prefix)
    stamped = {**meta, "unbroken.rank": str(rank)}
    if own_meta != stamped or S.RNG not in own:
        raise CorruptCheckpoint(f"{folder}/{prefix}{S.STATE_FILE}: stamped {own_meta}, expected "
                                f"{stamped}: the file belongs to another rank or generation")
    odd = sorted(p for p in own if p != S.RNG and not p.startswith(S.EXTRA_PREFIX))
    if odd or set(own) != expected:
        # (a rank's file never holds the model, the optimizer or a part of state.json: a
        # restore would take that rank's copy)
        raise CorruptCheckpoint(
            f"{folder}/{prefix}{S.STATE_FILE}: holds parts {sorted(own)}, expected "
            f"{sorted(expected)} (the manifest's parts besides those of {S.STATE_FILE}); a "
            "rank's own file holds its random streams and its extras held per rank only")
    return own


def check_continuable(pick: Pick, root: str, optimizer: Any, parts: Mapping[str, Any]
                      ) -> list[str]:
    """Refuse an imported generation (of the run folder ``root``); the warnings of a
    continuation from it: each hyperparameter and scheduler setting it sets back."""
    info, ready, tree = pick.info, pick.ready, pick.tree
    assert info is not None and info.manifest is not None
    manifest = info.manifest
    origin = manifest.origin or {}
    # (the import's own generation, the first of its run: later ones, which an older
    # unbroken let a continuation write, hold trained state and inherit the origin)
    if origin.get("operation") == "import" and manifest.parent is None:
        raise MissingState(
            f"{info.path}: imported weights (from {origin.get('source')!r}, by "
            "unbroken import), not a run to continue: the training state beside them "
            "(counters, RNG streams) is the import's, not the source's. Start a run from "
            f"them with restore(intent=\"warm_start\", source={root!r}) in a "
            "new run folder")
    said = []
    if optimizer is not None:
        said += [f"{info.path}: {change}; a continuation restores the saved value (to change a "
                 "hyperparameter, set it after restore(), or warm_start a new run)"
                 for change in param_group_changes(tree[S.OPTIMIZER], optimizer,
                                                   scheduled=S.SCHEDULER in parts)]
    if S.SCHEDULER in parts and S.SCHEDULER in ready:
        said += [f"{info.path}: {change}; a continuation restores the saved schedule (to "
                 "change it, set it on the scheduler after restore(), or warm_start a new run)"
                 for change in scheduler_changes(ready[S.SCHEDULER], parts[S.SCHEDULER])]
    return said


def partly(refused: Pick) -> str:
    """What a restore left in the live objects after a file failed its hash as it was copied."""
    assert refused.info is not None
    return (f"The live model and optimizer hold bytes of {refused.info.path} now (its files are "
            "hashed as they are copied into them, and the corruption was found after): build "
            "them anew before training or restoring again")
