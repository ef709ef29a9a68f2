"""One committed generation per job: the two-phase commit of many ranks, and the replica
check that comes before it.

1. The leader (rank 0, the writer-lock holder) prepares: the first-save rule, a leftover in
   the way, the staging folder. Its outcome is broadcast, so every rank refuses together.
2. Every rank writes its own artifacts into that staging folder and fsyncs and hashes them;
   the (name, size, hash) lists are gathered on the leader.
3. The leader writes the manifest naming every rank's files, last, and renames; the outcome
   is broadcast. A rank that fails or dies leaves nothing committed: the leader discards the
   staging folder and every surviving rank raises `SaveFailed` (a dead rank is seen by the
   next collective, within the process group's timeout).
4. Every rank re-hashes its own files; a generation any rank cannot read back is moved aside.

A rank's failure travels as ``{"type": ..., "message": ...}`` and is raised again, with the
same `UnbrokenError` type, on every rank. With ``async_save="process"``, step 1 runs in the
training processes and steps 2-4 in their persisting processes, whose collectives go through
files (`dist.filegroup`)."""

from __future__ import annotations

import errno
import re
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict
from typing import Any

import xxhash

from .. import errors
from .._progress import Progress
from ..errors import (
    CorruptCheckpoint,
    RunUnreadable,
    SaveFailed,
    SharedFileFailed,
    StateMismatch,
    UnbrokenError,
    UnbrokenWarning,
    UpdateBoundaryError,
)
from ..store.generations import GenerationInfo, GenerationStore, generation_name
from ..store.lock import errno_text
from ..store.manifest import Artifact, Manifest
from ..store.sources import Source
from .group import Group, RankFailed

_RANK_FILE = re.compile(r"rank[0-9]{5}\.", re.ASCII)
_TYPES = {name: cls for name, cls in vars(errors).items()
          if isinstance(cls, type) and issubclass(cls, UnbrokenError)}


def rank_prefix(rank: int) -> str:
    """The prefix of one rank's own files in a generation of many ranks."""
    return f"rank{rank:05d}."


def describe(e: BaseException) -> dict[str, str]:
    """An exception as it travels between ranks."""
    if isinstance(e, OSError) and not isinstance(e, UnbrokenError):
        return {"type": "SaveFailed", "message": f"{errno_text(e)} ({e.filename or 'run folder'})"}
    name = type(e).__name__ if type(e).__name__ in _TYPES else "UnbrokenError"
    # (an interrupt has no message: its type is what the other ranks must be told)
    return {"type": name, "message": str(e) or type(e).__name__}


def rebuild(failure: Mapping[str, str], rank: int | None = None) -> UnbrokenError:
    """The exception a rank's ``failure`` becomes on this rank."""
    where = "" if rank is None else f"rank {rank}: "
    return _TYPES.get(failure["type"], UnbrokenError)(where + failure["message"])


def check_replicas(group: Group, step: int, named: Iterable[tuple[str, Any]],
                   buffers_of: Callable[[], Collection[str]] = tuple) -> None:
    """Refuse a save that the ranks make at different steps (naming each rank's), or of
    replicas (DDP) that differ across ranks, naming the first differing parameter: ``named``
    yields (name, tensor or state) in the same order on every rank. A model buffer (one of
    ``buffers_of()``, asked once, only when a model tensor differs) is not refused: DDP
    copies rank 0's to every rank at the start of each forward (``broadcast_buffers``, its
    default), so rank 0's is what the next update starts from; it is warned about, once."""
    if not group.active:
        return
    from ..state._digest import digest_tree  # (torch: not in the persisting process)

    digests = [(name, digest_tree(value)) for name, value in named]
    # (the names too, by one digest: ranks holding other parameters or parts would pair
    # their digests up wrongly)
    names = xxhash.xxh3_64_hexdigest("\0".join(name for name, _ in digests).encode())
    everyone = group.all_gather([step, names, *(d for _, d in digests)], "comparing replicas")
    steps = [theirs.pop(0) for theirs in everyone]
    if len(set(steps)) > 1:
        raise UpdateBoundaryError(
            f"the ranks save different steps: {_by_step(steps)}; every rank saves at the "
            "same update (call save() and step_done() alike on every rank); nothing was "
            "saved")
    held = [theirs.pop(0) for theirs in everyone]
    ranks = [r for r, theirs in enumerate(held) if theirs != held[0]]
    if ranks:
        raise StateMismatch(
            f"the ranks hold different state: the names of rank(s) {ranks}'s parameters, "
            "buffers, optimizer state or parts differ from rank 0's (a model built otherwise "
            "on a rank, or a part given to some ranks only); every rank of a data-parallel "
            "job holds a replica of the same state; nothing was saved")
    buffers: list[str] = []
    model_buffers: Collection[str] | None = None
    for i, (name, mine) in enumerate(digests):
        ranks = [r for r, theirs in enumerate(everyone) if theirs[i] != everyone[0][i]]
        if ranks and name.startswith("model "):
            if model_buffers is None:
                model_buffers = set(buffers_of())
            if name[len("model "):] in model_buffers:
                buffers.append(name[len("model "):])
                continue
        if ranks:
            # (the model and its optimizer state diverge as replicas; any other part is
            # state a rank keeps on its own, which a generation holds once for all ranks)
            why = ("a DDP replica divergence: a rank stepped alone, or a buffer is not "
                   "synchronised" if name.startswith(("model ", "optimizer ")) else
                   "this part holds state of each rank's own, such as metrics logged without "
                   "synchronising them, and a generation holds one copy of it for all ranks "
                   "unless it is given as extras={name: unbroken.PerRank(obj)}, each rank's "
                   "then kept in its own files")
            raise StateMismatch(
                f"replicas differ across ranks: {name!r} on rank(s) {ranks} differs from rank "
                f"0 ({why}); refusing to save one copy for all")
    if buffers:  # (the same text at every save: shown once)
        warnings.warn(
            f"model buffers {buffers[:4]}{' ...' if len(buffers) > 4 else ''} differ across "
            "ranks (BatchNorm's running statistics, each rank's own after its forward): rank "
            "0's are saved, which DDP with broadcast_buffers=True (its default) copies to "
            "every rank at the start of the next forward, so the continuation is exact; with "
            "broadcast_buffers=False the other ranks' own are not kept", UnbrokenWarning,
            stacklevel=2)


def _by_step(steps: list[int]) -> str:
    """``[10, 7, 10, 10]`` -> "step 10 on ranks [0, 2, 3], step 7 on rank [1]"."""
    ranks: dict[int, list[int]] = {}
    for rank, step in enumerate(steps):
        ranks.setdefault(step, []).append(rank)
    return ", ".join(f"step {step} on rank{'s' * (len(r) > 1)} {r}" for step, r in ranks.items())


def stage_job(group: Group, stage: Callable[[], str]) -> str:
    """Step 1 of the module doc: the leader prepares and creates the staging folder
    (``stage``); its path on every rank, or its error raised on every rank."""
    plan: Any = None
    if group.leader:
        try:
            plan = {"staging": stage()}
        except (UnbrokenError, OSError) as e:
            plan = {"error": describe(e)}
    plan = group.broadcast(plan, "preparing the save")
    if "error" in plan:
        raise rebuild(plan["error"])
    return str(plan["staging"])


def commit_job(group: Group, store: GenerationStore, generation: int,
               prepare: Callable[[], None], mine: Mapping[str, Source],
               make_manifest: Callable[[list[Artifact]], Manifest], supersede: bool
               ) -> GenerationInfo:
    """Steps 1-3 of the module doc; returns the committed generation on every rank."""
    def stage() -> str:
        prepare()
        return store.stage(generation, supersede)

    return commit_staged(group, store, generation, stage_job(group, stage), mine,
                         make_manifest, supersede)


def commit_staged(group: Group, store: GenerationStore, generation: int, staging: str,
                  mine: Mapping[str, Source],
                  make_manifest: Callable[[list[Artifact]], Manifest], supersede: bool
                  ) -> GenerationInfo:
    """Steps 2-3 of the module doc, into the ``staging`` folder of step 1 (`stage_job`);
    returns the committed generation on every rank. (The persisting processes of a job run
    them too, over `dist.filegroup`.)"""
    report: dict[str, Any] = {"artifacts": [], "error": None}
    try:
        report["artifacts"] = [asdict(a) for a in store.write_artifacts(staging, mine,
                                                                       generation)]
    except (UnbrokenError, OSError) as e:
        report["error"] = describe(e)
    outcome: Any = None
    try:
        reports = group.all_gather(report, "writing the generation")
    except RankFailed as e:
        if group.leader:
            store.discard(staging)
        raise SaveFailed(f"{e}; generation {generation} was not committed, older ones are "
                         "untouched") from None
    if group.leader:
        failed = [(r, x["error"]) for r, x in enumerate(reports) if x["error"]]
        try:
            if failed:
                store.discard(staging)
                r, failure = failed[0]
                outcome = {"error": failure, "rank": r}
            else:
                written = [Artifact(**a) for x in reports for a in x["artifacts"]]
                info = store.publish(staging, generation, make_manifest(written), supersede)
                outcome = {"ok": True, "superseded": info.superseded}
        except (UnbrokenError, OSError) as e:
            outcome = {"error": describe(e), "rank": 0}
    outcome = group.broadcast(outcome, "committing the generation")
    if "error" in outcome:
        raise rebuild(outcome["error"], outcome["rank"])
    info = store.scan_one(generation)
    info.superseded = outcome["superseded"]
    return info


# What to do before the next save, by the error a write failed on.
_REMEDY = {errno.ENOSPC: "free space on the disk", errno.EDQUOT: "free space within the quota, or "
           "raise it", errno.EFBIG: "raise the file-size limit (ulimit -f), or save to a "
           "filesystem that takes files this large", errno.EROFS: "make the filesystem writable, "
           "or save to another folder", errno.EACCES: "let this user write to the run folder",
           errno.EPERM: "let this user write to the run folder (an immutable file or folder? "
           "lsattr shows it)"}


def save_failed(root: str, step: int, e: OSError) -> SaveFailed:
    """The error of a save whose writing failed on ``e``."""
    remedy = _REMEDY.get(e.errno or 0, "fix the disk")
    return SaveFailed(f"{root}: saving generation {step} failed: {errno_text(e)} "
                      f"({e.filename or 'run folder'}); older generations are untouched and "
                      f"training may continue; {remedy} before the next save")




def read_back(group: Group, store: GenerationStore, info: GenerationInfo,
              progress: Progress, linked: Collection[str] = ()) -> None:
    """Re-hash what was just committed (every rank its own files); a generation that does
    not read back as written is moved aside, and the save fails (on every rank). Files an
    incremental save linked from an earlier generation (``linked``: their names) are read
    back too: a shared file that changed on disk since it was verified (rot that keeps its
    size and time) must fail the first generation that links it, not be counted in every
    later one; then the error is a `SharedFileFailed`."""
    assert info.manifest is not None
    failed: list[str] = []
    unread: list[str] = []
    try:
        before = store.file_identity(info) if group.leader else None
        if group.active:
            problems, unread = verify_own(group, store, info,
                                          own_names(info.manifest, group.rank))
            if not problems and not unread and group.leader:
                store.verified_elsewhere(info, before)
        else:
            try:
                store.verify(info, advance=progress.advance, failed=failed)
                problems = []
            except CorruptCheckpoint as e:
                problems = [str(e)]
            except RunUnreadable as e:
                problems, unread = [], [str(e)]
    finally:
        progress.close()
    if unread and not problems:  # (not judged: left in place, never moved aside)
        error = SaveFailed(f"generation {info.generation} is committed, but reading it back "
                           f"failed for a reason of this machine ({'; '.join(unread)}): it "
                           "is left in place unverified (a restore verifies it before any "
                           "use); a save of this step again writes it anew")
        error.in_place = True  # type: ignore[attr-defined]
        raise error
    if not problems:
        return
    why = "; ".join(problems)
    if group.leader:
        try:
            store.move_aside(info, "corrupt")
        except OSError as moving:
            raise SaveFailed(f"generation {info.generation} did not read back as written "
                             f"({why}) and could not be moved aside ({moving}); restore "
                             "refuses it, and older generations are untouched") from None
        if info.superseded is not None:  # the same step saved before: it is the newest again
            try:
                store.put_back(info.superseded, info.generation)
            except (OSError, CorruptCheckpoint) as e:
                raise SaveFailed(
                    f"generation {info.generation} did not read back as written ({why}); it "
                    f"was moved aside, and the generation of the same step it superseded "
                    f"could not be put back from {info.superseded} ({e}): move it back "
                    f"to {generation_name(info.generation)} by hand") from None
    shared = [n for n in failed if n in linked]
    if shared:
        raise SharedFileFailed(
            f"generation {info.generation} did not read back as written ({why}); it was "
            f"moved aside. This save did not write {shared[0]}: it linked it (or had the "
            "store copy it) from an earlier generation, whose file may be damaged too (a "
            "hard link is the same file); a save writes every file anew from the state")
    raise SaveFailed(f"generation {info.generation} did not read back as written ({why}); "
                     "it was moved aside and older generations are untouched")


def verify_own(group: Group, store: GenerationStore, info: GenerationInfo,
               names: set[str], advance: Callable[[int], None] | None = None
               ) -> tuple[list[str], list[str]]:
    """Step 4: every rank re-hashes its own files; the problems of every rank, and what a
    rank could not read for a reason of its machine (`RunUnreadable`: not judged), agreed
    by all (a rank that left on it would leave the others waiting, or agreeing alone)."""
    problem: dict[str, str] | None = None
    try:
        store.verify(info, advance=advance, names=names)
    except CorruptCheckpoint as e:
        problem = {"corrupt": str(e)}
    except RunUnreadable as e:
        problem = {"unreadable": str(e)}
    everyone = group.all_gather(problem, "reading the generation back")
    return ([f"rank {r}: {p['corrupt']}" for r, p in enumerate(everyone) if p and "corrupt" in p],
            [f"rank {r}: {p['unreadable']}" for r, p in enumerate(everyone)
             if p and "unreadable" in p])


def own_names(manifest: Manifest, rank: int) -> set[str]:
    """The files of a generation one rank reads: the shared ones and its own."""
    mine = rank_prefix(rank)
    return {a.name for a in manifest.artifacts
            if not _RANK_FILE.match(a.name) or a.name.startswith(mine)}
