"""Reading a run folder for the CLI: generation records, identity summaries, debris and
verification, without taking the lock, and hashing only when asked (verify)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from ._table import human_size, table
from .errors import UnbrokenError
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .store import ASIDE, STAGING_PREFIX, TRASH_PREFIX, GenerationInfo, GenerationStore

_DEBRIS = {STAGING_PREFIX: "in-progress or interrupted save, ignored",
           TRASH_PREFIX: "interrupted deletion, ignored"}


class UsageError(Exception):
    """Bad input found after argument parsing (no such folder, unknown generation): exit 2."""


# -- reading a run folder (no lock, no hashing unless asked) ------------------------------------


def open_run(path: str) -> GenerationStore:
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
        where = os.path.join(info.path, MANIFEST)  # never a symlink, FIFO or device
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


def record(store: GenerationStore, info: GenerationInfo) -> dict[str, Any]:
    """A generation as JSON: what scan found, plus what its manifest says (if it parses)."""
    m = _peek_manifest(store, info)
    return {
        "generation": info.generation, "path": info.path, "status": info.status,
        "reason": info.reason or None,
        "step": m.step if m else None,
        "bytes": info.manifest.total_bytes if info.manifest else _disk_bytes(info.path),
        "run_id": m.run_id if m else None, "incarnation": m.incarnation if m else None,
        "created": m.created if m else None, "parts": m.parts if m else [],
        "artifacts": [asdict(a) for a in m.artifacts] if m else [],
    }


def _relative(root: str, text: str | None) -> str:
    """Shorten absolute paths inside the run folder for the human-readable report."""
    return (text or "").replace(root + os.sep, "")


def rows(root: str, records: list[dict[str, Any]]) -> str:
    headers = ["generation", "step", "size", "status", "incarnation", "created", "parts",
               "reason"]
    rows = [[r["generation"], r["step"], human_size(r["bytes"]), r["status"], r["incarnation"],
             (r["created"] or "-")[:19].replace("T", " "), ",".join(r["parts"]) or "-",
             _relative(root, r["reason"])] for r in records]
    if not any(r["reason"] for r in records):
        headers, rows = headers[:-1], [r[:-1] for r in rows]
    return table(headers, rows, right=(0, 1, 2, 4), indent="  ")


# -- inspect ------------------------------------------------------------------------------------


def newest_summary(info: GenerationInfo) -> dict[str, Any]:
    m = info.manifest
    assert m is not None
    return {"generation": info.generation, "step": m.step, "path": info.path,
            "run_id": m.run_id, "incarnation": m.incarnation, "identity": m.identity,
            "parent": m.parent, "origin": m.origin, "environment": m.environment,
            "metrics": m.metrics, "retention": m.retention}


def newest_summary_lines(n: dict[str, Any]) -> list[str]:
    lines = [f"newest complete: gen-{n['generation']:09d} (step {n['step']})",
             f"  run          {n['run_id']} (incarnation {n['incarnation']})"]
    for field in ("config", "tokenizer", "data"):
        e = n["identity"].get(field)
        desc = "not recorded" if not isinstance(e, dict) else (
            f"{e.get('summary') or e.get('kind', '?')} [{str(e.get('hash', ''))[:12]}]")
        lines.append(f"  {field:<12} {desc}")
    p = n["parent"]
    if isinstance(p, dict):
        same = "this run" if p.get("run_id") == n["run_id"] else f"run {p.get('run_id')}"
        parent = f"gen {p.get('generation')} of {same}, incarnation {p.get('incarnation')}"
    else:
        parent = "none (first generation of the run)"
    lines.append(f"  parent       {parent}")
    o = n["origin"]
    origin = "fresh run" if not isinstance(o, dict) else (
        f"{o.get('operation', '?')} from {o.get('source', '?')} gen {o.get('generation')} "
        f"(run {o.get('run_id')})")
    lines.append(f"  origin       {origin}")
    env = n["environment"]
    cuda = ", ".join(map(str, env.get("cuda_devices") or [])) or "none"
    lines.append(f"  environment  torch {env.get('torch', '?')}, python {env.get('python', '?')}, "
                 f"{env.get('num_threads', '?')} threads, deterministic algorithms "
                 f"{'on' if env.get('deterministic_algorithms') else 'off'}, cuda {cuda}, "
                 f"world size {env.get('world_size', '?')}, "
                 f"filesystem {env.get('filesystem', '?')}")
    if n["metrics"]:
        lines.append("  metrics      " + ", ".join(f"{k}={v:g}" if isinstance(v, (int, float))
                                                  else f"{k}={v}" for k, v in n["metrics"].items()))
    return lines


def list_debris(root: str) -> list[dict[str, str]]:
    return [{"name": name, "note": note} for name in sorted(os.listdir(root))
            for prefix, note in _DEBRIS.items() if name.startswith(prefix)]


def aside_entries(root: str) -> list[str]:
    folder = os.path.join(root, ASIDE)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def verify_one(store: GenerationStore, info: GenerationInfo) -> dict[str, Any]:
    from .state import check_stamps, decode_generation  # torch-heavy; only verify needs it

    rec = record(store, info)
    if not info.ok:
        return rec
    try:
        files = store.read_verified(info)  # every byte re-hashed against the manifest
        tree, meta = decode_generation(files, info.path)  # headers, references, stamps
        assert info.manifest is not None
        check_stamps(info.manifest, info.path, tree, meta)
    except UnbrokenError as e:
        rec.update(status="corrupt", reason=str(e))
    except Exception as e:  # noqa: BLE001 -- a decoder bug must not hide the other generations' results
        rec.update(status="corrupt", reason=f"{info.path}: cannot be decoded "
                                            f"({type(e).__name__}: {e})")
    else:
        rec.update(status="ok", reason=None)
    return rec
