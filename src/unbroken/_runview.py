"""Reading a run folder for the CLI: generation records, identity summaries, debris and
verification, without taking the lock, and hashing only when asked (verify)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ._table import human_size, table
from .errors import CorruptCheckpoint, RunUnreadable, UnbrokenError
from .store.generations import STAGING_PREFIX, TRASH_PREFIX, GenerationInfo, GenerationStore
from .store.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .store.objects import ObjectStore
from .store.opening import is_url, open_store
from .store.retention import ranked
from .store.runrecord import RunRecord, folder_run
from .store.verifying import UNREADABLE, unreadable

# The status of a generation that a writer's retention deleted while `verify_one` read it.
GONE = "deleted while checked"
_GEN = re.compile(r"gen-([0-9]{9,})", re.ASCII)
_GEN_OF_ASIDE = re.compile(r"gen-([0-9]{9,})-", re.ASCII)

_DEBRIS = {STAGING_PREFIX: "in-progress or interrupted save, ignored",
           TRASH_PREFIX: "interrupted deletion, ignored"}


class UsageError(Exception):
    """Bad input found after argument parsing (no such folder, unknown generation): exit 2."""


# -- reading a run folder (no lock, no hashing unless asked) ------------------------------------


def split_generation(spec: str) -> tuple[str, int | None]:
    """``RUN/gen-000000400`` (a folder, or a URL) -> (``RUN``, 400); anything else -> (spec,
    None): a run."""
    if is_url(spec):
        head, _, last = spec.rstrip("/").rpartition("/")
    else:
        head, last = os.path.split(spec.rstrip("/" + os.sep))
    m = _GEN.fullmatch(last)
    if m is None or (is_url(spec) and head.endswith(":/")):  # memory://gen-... is a run
        return spec, None
    return head or ".", int(m.group(1))


def named_generation(spec: str, generation: int | None, command: str
                     ) -> tuple[str, int | None]:
    """(run, generation) for a command taking a run and ``--generation``: ``RUN/gen-N`` is
    RUN with generation N (a different ``--generation`` beside it is a `UsageError`, and so
    is a generation folder that is not there)."""
    root, named = split_generation(spec)
    if named is None:
        return spec, generation
    if generation not in (None, named):
        raise UsageError(f"{spec} is generation {named}, but --generation {generation} was "
                         "given: name one")
    if not is_url(spec) and not os.path.lexists(spec):
        raise UsageError(f"{spec}: no such generation folder ({command} takes a run folder, "
                         "or a generation folder in one)")
    return root, named


def holds_a_run(store: GenerationStore) -> bool:
    """Whether the run folder (or object-store prefix) of ``store`` holds anything a
    Checkpointer writes (its lock or lease, RUN.json, generations, staging, trash or aside/):
    a run, perhaps with no generation yet or left. (A misspelled bucket or prefix holds
    nothing: a check of it that passed would pass on a typo.)"""
    from .store.aside import ASIDE
    from .store.lock import LOCK
    from .store.runrecord import RUN_FILE

    if is_url(store.root):
        return bool(store.fs.listing(store.root))  # type: ignore[attr-defined]
    try:
        names = os.listdir(store.root)
    except OSError:
        return True  # (unreadable: the command says why when it reads it)
    return any(n in (LOCK, RUN_FILE, ASIDE) or n.startswith(("gen-", STAGING_PREFIX,
                                                              TRASH_PREFIX)) for n in names)


def open_run(path: str) -> GenerationStore:
    if is_url(path):
        try:
            return open_store(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such run folder")
    if not os.path.isdir(path):
        raise UsageError(f"{path}: not a folder; a run folder holds gen-* generation folders")
    return GenerationStore(path)


def _peek_manifest(store: GenerationStore, info: GenerationInfo) -> Manifest | None:
    """The manifest of a generation if it parses at all (a corrupt one may still name its
    step); ``None`` when missing or unreadable. Reads the manifest only."""
    if info.manifest is not None:
        return info.manifest
    try:
        where = store.manifest_path(info)  # (read as a regular file: never a symlink, FIFO)
        return parse_manifest(store.fs.read_file(where, MAX_MANIFEST_BYTES), where)
    except (UnbrokenError, OSError):
        return None


def _disk_bytes(folder: str) -> int | None:
    try:
        with os.scandir(folder) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries
                       if e.is_file(follow_symlinks=False))
    except OSError:
        return None


def folder_run_record(store: GenerationStore, scanned: list[GenerationInfo]
                      ) -> tuple[RunRecord | None, str | None]:
    """The run the folder holds (RUN.json, or the run that wrote most of its complete
    generations; None when that cannot be told: then no generation is called foreign), and
    why RUN.json could not be used when it exists but is damaged (the next writer rewrites it:
    a warning, not a problem of the checkpoints)."""
    found = folder_run(store.root, store.fs, (g.manifest.run_id for g in scanned
                                              if g.ok and g.manifest is not None))
    problem = (f"{found.problem}; the run is taken from its generations, and the next save "
               "rewrites the record") if found.problem else None
    return (None if found.ambiguous else found.record), problem


def record(store: GenerationStore, info: GenerationInfo, run: RunRecord | None = None
           ) -> dict[str, Any]:
    """A generation as JSON: what scan found, plus what its manifest says (if it parses).
    A complete generation of another run than ``run`` has status "foreign"."""
    m = _peek_manifest(store, info)
    status, reason = info.status, info.reason or None
    if info.ok and m is not None and run is not None and not run.accepts(m.run_id):
        status, reason = "foreign", (f"{info.path}: written by run {m.run_id!r}; this folder "
                                     f"holds run {run.run_id!r}: restore refuses it unless "
                                     "adopted (restore(adopt=True))")
    return {
        "generation": info.generation, "path": info.path, "status": status,
        "reason": reason,
        "step": m.step if m else None,
        "bytes": info.manifest.total_bytes if info.manifest else _disk_bytes(info.path),
        "run_id": m.run_id if m else None, "incarnation": m.incarnation if m else None,
        "created": m.created if m else None, "parts": m.parts if m else [],
        "artifacts": [asdict(a) for a in m.artifacts] if m else [],
        "shared_bytes": _shared_bytes(info.path, m),
        "metrics": m.metrics if m else {},
    }


def mark_best(records: list[dict[str, Any]], retention: Any) -> dict[str, Any] | None:
    """With a ``best`` retention rule (the newest complete generation's): each record's
    ``best`` (whether it ranks first among the complete ones, as retention ranks them), and
    the rule with that generation (None without such a rule)."""
    best = retention.get("best") if isinstance(retention, dict) else None
    if not (isinstance(best, list) and len(best) == 2 and all(isinstance(b, str) for b in best)):
        return None
    top = ranked([(r["generation"], r["metrics"]) for r in records
                  if r["status"] == "complete"], (best[0], best[1]))
    for r in records:
        r["best"] = bool(top) and r["generation"] == top[0]
    return {"metric": best[0], "mode": best[1], "generation": top[0] if top else None}


def _shared_bytes(folder: str, m: Manifest | None) -> int:
    """Bytes of the generation's files hard-linked with another generation (incremental
    saves: written once, listed and verified by every generation that links them)."""
    total = 0
    for a in m.artifacts if m else []:
        try:
            st = os.lstat(os.path.join(folder, a.name))
        except OSError:
            continue
        if st.st_nlink > 1:
            total += st.st_size
    return total


def _relative(root: str, text: str | None) -> str:
    """Shorten absolute paths inside the run folder for the human-readable report."""
    return (text or "").replace(root + os.sep, "")


def rows(root: str, records: list[dict[str, Any]]) -> str:
    headers = ["generation", "step", "size", "shared", "status", "incarnation", "created",
               "parts", "reason"]
    rows = [[r["generation"], r["step"], human_size(r["bytes"]),
             human_size(r["shared_bytes"]) if r["shared_bytes"] else "-",
             r["status"] + (" (best)" if r.get("best") else ""),
             r["incarnation"], (r["created"] or "-")[:19].replace("T", " "),
             ",".join(r["parts"]) or "-", _relative(root, r["reason"])] for r in records]
    shown = [i for i, h in enumerate(headers)  # shared: for incremental runs only
             if (h != "shared" or any(r["shared_bytes"] for r in records))
             and (h != "reason" or any(r["reason"] for r in records))]
    numeric = ("generation", "step", "size", "shared", "incarnation")
    return table([headers[i] for i in shown], [[row[i] for i in shown] for row in rows],
                 right=tuple(j for j, i in enumerate(shown) if headers[i] in numeric),
                 indent="  ")


# -- inspect ------------------------------------------------------------------------------------


def newest_summary(info: GenerationInfo) -> dict[str, Any]:
    m = info.manifest
    assert m is not None
    return {"generation": info.generation, "step": m.step, "path": info.path,
            "run_id": m.run_id, "incarnation": m.incarnation, "identity": m.identity,
            "parent": m.parent, "origin": m.origin, "environment": m.environment,
            "metrics": m.metrics, "retention": m.retention}


def _d(value: object) -> dict[str, Any]:
    """A manifest field that should be an object; a hand-edited one may be anything."""
    return value if isinstance(value, dict) else {}


def _s(value: object, width: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[:width - 1] + "…"


def _identity_line(entry: object) -> str:
    if not isinstance(entry, dict):
        return "not recorded"
    value = entry.get("value")
    shown = (", ".join(f"{k}={_s(v, 24)}" for k, v in value.items()) if isinstance(value, dict)
             else _s(entry.get("summary") or entry.get("kind", "?")))
    return f"{_s(shown, 100)} [{_s(entry.get('hash', ''))[:12]}]"


def newest_summary_lines(n: dict[str, Any]) -> list[str]:
    lines = [f"newest complete: gen-{n['generation']:09d} (step {n['step']})",
             f"  run          {n['run_id']} (incarnation {n['incarnation']})"]
    identity = _d(n["identity"])
    for field in ("config", "tokenizer", "data"):
        lines.append(f"  {field:<12} {_identity_line(identity.get(field))}")
    p = n["parent"]
    if isinstance(p, dict):
        same = "this run" if p.get("run_id") == n["run_id"] else f"run {_s(p.get('run_id'))}"
        parent = (f"gen {_s(p.get('generation'))} of {same}, incarnation "
                  f"{_s(p.get('incarnation'))}")
    else:
        parent = "none (first generation of the run)"
    lines.append(f"  parent       {parent}")
    o = n["origin"]
    origin = "fresh run" if not isinstance(o, dict) else (
        f"{_s(o.get('operation', '?'))} from {_s(o.get('source', '?'))}" + (
            f" ({_s(o.get('format'))})" if o.get("operation") == "import" else
            f" gen {_s(o.get('generation'))} (run {_s(o.get('run_id'))})") + (
            f", kept fresh: {', '.join(map(_s, o['fresh']))}"
            if isinstance(o.get("fresh"), list) else ""))
    lines.append(f"  origin       {origin}")
    env = _d(n["environment"])
    devices = env.get("cuda_devices")
    cuda = (", ".join(_s(d) for d in devices) if isinstance(devices, list) else
            _s(devices) if devices else "") or "none"
    deterministic = "on" if env.get("deterministic_algorithms") is True else "off"
    lines.append(f"  environment  torch {_s(env.get('torch', '?'))}, python "
                 f"{_s(env.get('python', '?'))}, {_s(env.get('num_threads', '?'))} threads, "
                 f"deterministic algorithms {deterministic}, "
                 f"cuda {cuda}, world size {_s(env.get('world_size', '?'))}, "
                 f"filesystem {_s(env.get('filesystem', '?'))}")
    if n["metrics"]:
        lines.append("  metrics      " + ", ".join(f"{k}={v:g}" for k, v in n["metrics"].items()))
    return lines


def list_debris(store: GenerationStore) -> list[dict[str, str]]:
    if isinstance(store, ObjectStore):
        return [{"name": name, "note": note} for name, note in store.debris()]
    return [{"name": name, "note": note} for name in sorted(os.listdir(store.root))
            for prefix, note in _DEBRIS.items() if name.startswith(prefix)]


def aside_entries(store: GenerationStore) -> list[dict[str, Any]]:
    """What ``aside/`` holds, oldest first: name, why it was moved there, when, and size."""
    out = []
    for e in store.aside():
        m = _GEN_OF_ASIDE.match(e.name)
        size = (sum(i.get("size", 0) for i in store.fs.listing(e.path).values())
                if isinstance(store, ObjectStore) else _disk_bytes(e.path))
        out.append({"name": e.name, "generation": int(m.group(1)) if m else None,
                    "reason": e.reason, "moved": e.moved or None, "bytes": size})
    return out


def aside_lines(entries: list[dict[str, Any]]) -> list[str]:
    if not entries:
        return []
    rows = [[e["name"], e["reason"], e["moved"] or "-", human_size(e["bytes"])] for e in entries]
    return ["aside/ (moved aside, never loaded; the oldest are removed beyond Keep(aside=N)):",
            table(["folder", "reason", "moved", "size"], rows, right=(3,), indent="  ")]


Problems = Callable[[dict[str, Any], Manifest, str, Any, Any], list[str]]


def _opened(store: Any, path: str, size: int, whole: bool) -> Any:
    """An artifact read again for decoding (``whole``: into memory, else mapped): an error
    of this machine or store there (a second download refused by a throttled store, no
    memory or descriptors left to map it) is `RunUnreadable`, as in the hash pass; an
    I/O error is the file's."""
    try:
        return store.fs.read_file(path, size) if whole else store.fs.map_file(path, size)
    except OSError as e:
        raise unreadable(path, e) from None


def verify_one(store: GenerationStore, info: GenerationInfo, run: RunRecord | None = None,
               deep: Problems | None = None) -> dict[str, Any]:
    """Re-hash every artifact (streaming), then decode the generation's structure (headers,
    references, stamps) from copy-on-write mappings: memory stays bounded by the headers
    and ``state.json``, whatever the size of the tensors. ``deep(tree, manifest, path,
    shards, read)`` (``read(name)``: an artifact's bytes, hashed here) lists what else is
    wrong with the decoded state (`tools.deep`): any problem makes the generation corrupt,
    all of them listed in ``problems``."""
    from .dist.sharded import SHARDS_FILE, read_index
    from .state.generation import check_sizes, check_stamps, decode_generation
    from .state.parts import STATE_FILE

    rec = record(store, info, run)
    if rec["status"] != "complete":
        return rec
    m = info.manifest
    assert m is not None
    try:
        check_sizes(m, info.path)  # before reading a byte
        store.verify(info)  # every byte re-hashed against the manifest, one buffer at a time
        files = {a.name: _opened(store, os.path.join(info.path, a.name), a.size,
                                 a.name in (STATE_FILE, SHARDS_FILE))
                 for a in m.artifacts}
        tree, meta = decode_generation(files, info.path)  # headers, references, stamps
        if m.world_size > 1:  # each rank's own parts, each checked (rank 0's: the parts)
            from .picking import rank_parts

            expected = set(m.parts) - set(tree)
            owns = [rank_parts(files, info.path, meta, r, expected)
                    for r in range(m.world_size)]
            tree = {**tree, **owns[0]}
        check_stamps(m, info.path, tree, meta)
        if deep is not None:
            index = (read_index(files[SHARDS_FILE], f"{info.path}/{SHARDS_FILE}")
                     if SHARDS_FILE in files else None)
            problems = deep(tree, m, info.path, index, files.__getitem__)  # (hashed above)
            if problems:
                rec["problems"] = problems
                more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
                raise CorruptCheckpoint("; ".join(problems[:5]) + more)
    except RunUnreadable as e:  # (this machine's: not judged)
        rec.update(status=UNREADABLE, reason=str(e))
    except UnbrokenError as e:
        rec.update(status="corrupt", reason=str(e))
    except Exception as e:  # noqa: BLE001 -- a decoder bug must not hide the other generations' results
        rec.update(status="corrupt", reason=f"{info.path}: cannot be decoded "
                                            f"({type(e).__name__}: {e})")
    else:
        rec.update(status="verified", reason=None)
    if rec["status"] == "corrupt" and not store.present(info):
        _gone(rec, info)  # (its files went with it: a live writer's retention)
    return rec


def _gone(rec: dict[str, Any], info: GenerationInfo) -> None:
    rec.update(status=GONE, reason=f"{info.path}: deleted while it was checked (by the "
                                   "retention of a writer saving into the run); not a failure")


def recheck_torn(store: GenerationStore, infos: list[GenerationInfo],
                 records: list[dict[str, Any]], pause: float = 0.2) -> None:
    """After `verify_one` or `record` of every generation: one listed torn or corrupt that is
    gone by now was being deleted by a live writer's retention (which removes the manifest
    first, then the folder), not torn. One torn still there gets ``pause`` seconds to go
    (once, for all of them)."""
    for info, rec in zip(infos, records):
        if rec["status"] == "corrupt" and not store.present(info):
            _gone(rec, info)
    torn = [(info, rec) for info, rec in zip(infos, records) if rec["status"] == "torn"]
    if torn and all(store.present(info) for info, _ in torn):
        time.sleep(pause)
    for info, rec in torn:
        if not store.present(info):
            _gone(rec, info)
