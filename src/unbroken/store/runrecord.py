"""RUN.json: which run a run folder holds, so that a generation copied in from another run is
recognised and never continued silently.

The record names the folder's run id and its *lineage*: the ids of other runs whose
generations this run deliberately continued from (``restore(adopt=True)``). A generation
whose run id is neither is foreign. The record is written once, before the first generation
of the folder is committed (and again when a run is adopted), atomically: a temporary file,
fsync, rename over the old record, fsync of the folder. It is sealed with the same checksum
as a manifest, so an edit reads as corruption, never as another run id.

A folder written before this record existed has none; its run is then the run that wrote
most of its complete generations (refused as ambiguous on a tie), and the record is written at
the next save."""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import CorruptCheckpoint, SaveFailed
from ..state.jsontext import loads_json
from .backends.local import LocalFS
from .manifest import check_seal, seal
from .verifying import unreadable

RUN_FILE = "RUN.json"
RUN_SCHEMA = "unbroken.run/1"
MAX_RUN_BYTES = 1024 * 1024
_TMP_PREFIX = ".staging-run-"  # debris a writer's lock() removes, like a staging folder


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass
class RunRecord:
    """The run a folder holds, and the runs it adopted generations from."""

    run_id: str
    lineage: list[str] = field(default_factory=list)
    created: str = ""

    def accepts(self, run_id: str) -> bool:
        """Whether a generation written by ``run_id`` belongs to this run."""
        return run_id == self.run_id or run_id in self.lineage

    def to_bytes(self) -> bytes:
        return seal({"schema": RUN_SCHEMA, "run_id": self.run_id,
                     "lineage": list(self.lineage), "created": self.created})


def parse_run_record(data: bytes, where: str) -> RunRecord:
    raw = loads_json(data, where, MAX_RUN_BYTES)
    if not isinstance(raw, dict):
        raise CorruptCheckpoint(f"{where}: expected a JSON object, found {type(raw).__name__}")
    check_seal(raw, where, RUN_SCHEMA, "run record")
    run_id, lineage, created = raw.get("run_id"), raw.get("lineage"), raw.get("created")
    if raw.get("schema") != RUN_SCHEMA:
        raise CorruptCheckpoint(f"{where}: schema {raw.get('schema')!r:.40}, this version of "
                                f"unbroken reads {RUN_SCHEMA!r}")
    if (not isinstance(run_id, str) or not isinstance(lineage, list)
            or not all(isinstance(r, str) for r in lineage) or not isinstance(created, str)):
        raise CorruptCheckpoint(f"{where}: needs a string 'run_id', a list 'lineage' of run "
                                "ids and a string 'created'")
    return RunRecord(run_id, lineage, created)


def _not_a_file(where: str) -> str:
    """The problem with a RUN.json that is a folder, a link or a device, if it is one."""
    try:
        mode = os.lstat(where).st_mode
    except OSError:
        return ""
    if stat.S_ISREG(mode):
        return ""
    return (f"{where}: not a regular file (mode {oct(mode)}); the run record must be a regular "
            "file: remove it (the run is then taken from the folder's generations)")


def read_run_record(root: str, fs: LocalFS) -> RunRecord | None:
    """The folder's record, ``None`` when it has none; ``CorruptCheckpoint`` when unreadable
    (`RunUnreadable` when for a reason of this machine: a record taken for damaged would be
    written anew without its lineage, and the generations it adopted set aside as foreign)."""
    where = os.path.join(root, RUN_FILE)
    if not fs.exists(where):
        return None
    if _not_a_file(where):
        raise CorruptCheckpoint(_not_a_file(where))
    try:
        data = fs.read_file(where, MAX_RUN_BYTES)
    except OSError as e:
        raise unreadable(where, e) from None
    return parse_run_record(data, where)


@dataclass
class FolderRun:
    """The run a folder holds, as far as it can be told (see `folder_run`)."""

    record: RunRecord | None  # None: a folder without RUN.json and without any generation
    on_disk: bool  # the record is RUN.json as it stands
    problem: str | None = None  # why RUN.json could not be used (damaged), if it exists
    ambiguous: str | None = None  # no RUN.json to tell, and the generations name two runs


def folder_run(root: str, fs: LocalFS, complete_run_ids: Iterable[str]) -> FolderRun:
    """The run a folder holds: its RUN.json. Without a readable one (a folder of an older
    version, or a damaged record: ``problem`` says which), the run that wrote most of the
    complete generations (``complete_run_ids``, oldest first); when two runs wrote equally
    many, nothing can tell which one the folder holds: ``ambiguous`` says so, and the record
    is the newest generation's run, only ever used when the user adopts it."""
    problem = None
    try:
        record = read_run_record(root, fs)
    except CorruptCheckpoint as e:
        record, problem = None, str(e)
    if record is not None:
        return FolderRun(record, True)
    ids = list(complete_run_ids)
    if not ids:
        return FolderRun(None, False, problem)
    counts = Counter(ids)
    (first, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        tied = sorted(r for r, c in counts.items() if c == n)
        ambiguous = (f"{os.path.join(root, RUN_FILE)}: "
                     f"{'damaged' if problem else 'missing'}, and the generations name "
                     f"{len(counts)} runs ({', '.join(f'{r} ({counts[r]})' for r in tied)}): "
                     "which one this folder continues cannot be told. restore(adopt=True) "
                     "continues from the newest generation and records the other runs in the "
                     "lineage; or move the other run's generations out of the folder")
        return FolderRun(RunRecord(ids[-1]), False, problem, ambiguous)
    return FolderRun(RunRecord(first), False, problem)


def write_run_record(root: str, fs: LocalFS, record: RunRecord) -> None:
    """Replace the folder's record atomically (the caller holds the writer lock)."""
    if not record.created:
        record.created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    where = os.path.join(root, RUN_FILE)
    if _not_a_file(where):  # replacing a folder would fail with a bare EISDIR
        raise SaveFailed(_not_a_file(where))
    tmp = os.path.join(root, f"{_TMP_PREFIX}{uuid.uuid4().hex[:12]}")
    try:
        fs.write_file(tmp, [record.to_bytes()])
        fs.replace(tmp, os.path.join(root, RUN_FILE))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fs.fsync_dir(root)
